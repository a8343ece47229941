"""torch 2.13's ``_dedup_save_plans``: each replicated item kept in one
plan, balancing the bytes per rank (``default_planner.dedup_save_plans``)."""

from __future__ import annotations

from .default_planner import dedup_save_plans

__all__ = ["dedup_save_plans"]
