"""Overlap of two chunks of one tensor, as torch 2.13's ``resharding``
(private helpers that torch's older planners and user code call). shardstate's
own planner finds overlaps with ``geometry.OverlapIndex`` (C); these answer
the same question for one pair."""

from __future__ import annotations

from typing import Any

from .metadata import ChunkStorageMetadata as ChunkStorageMetadata  # as torch's module has it

__all__: list[str] = []


def _check_shard_metadata_pair_overlap(shard1: Any, shard2: Any) -> bool:
    """Whether two chunks (``offsets``/``sizes``) share any element."""
    for o1, s1, o2, s2 in zip(shard1.offsets, shard1.sizes, shard2.offsets, shard2.sizes):
        if o1 >= o2 + s2 or o2 >= o1 + s1:
            return False
    return True


def _shards_get_overlap_region_wrt_saved_tensor(
    saved_shard: Any, current_shard: Any
) -> list[tuple[int, int, int, int]]:
    """Per dimension: (dim, offset in the saved chunk, offset in the current
    chunk, length) of the two chunks' overlap."""
    narrows = []
    for dim, (so, co, ss, cs) in enumerate(zip(saved_shard.offsets, current_shard.offsets,
                                               saved_shard.sizes, current_shard.sizes)):
        length = min(so + ss, co + cs) - max(co, so)
        if so > co:
            narrows.append((dim, 0, so - co, length))
        else:
            narrows.append((dim, co - so, 0, length))
    return narrows
