"""torch 2.13's ``_dedup_tensors``: the older dedup rule, each replicated
item kept in the first plan that has it."""

from __future__ import annotations

import dataclasses
import logging

from .metadata import MetadataIndex
from .planner import SavePlan

__all__ = ["dedup_tensors"]

logger = logging.getLogger(__name__)


def dedup_tensors(all_plans: list[SavePlan]) -> list[SavePlan]:
    """The plans with every item that an earlier plan also has removed."""
    all_plans = list(all_plans)
    seen: set[MetadataIndex] = set()
    removed: dict[int, list[MetadataIndex]] = {}
    for plan_idx, plan in enumerate(all_plans):
        keep = []
        for item in plan.items:
            if item.index in seen:
                removed.setdefault(plan_idx, []).append(item.index)
            else:
                seen.add(item.index)
                keep.append(item)
        if plan_idx in removed:
            all_plans[plan_idx] = dataclasses.replace(plan, items=keep)
    if removed:
        logger.info("Duplicate keys to remove: %s", removed)
    return all_plans
