"""Walking nested state dicts: torch 2.13's ``_traverse`` (same names and
signatures), on the rules below.

* a Mapping is always descended into (keys become ``str(k)``); an empty one
  contributes nothing;
* a list is descended into only when it (recursively) holds a tensor, a
  Mapping or a list that is itself descended into; otherwise it is one leaf;
* a tuple, or any other object, is always a leaf.

Checkpoints written before torch 2.4 used the older rule
(``traverse_state_dict_v_2_3``): a Mapping is a leaf as well when nothing in
it (recursively) is a tensor.

"Tensor" here means a ``torch.Tensor`` (when torch is loaded) or a
``numpy.ndarray``: shardstate saves NumPy arrays as tensors, so a list of
arrays is descended into like a list of tensors. The walk uses an explicit
stack: deep nesting cannot hit the recursion limit.

No torch import: tensors can only exist if torch is already loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TypeVar, cast

import numpy as np

__all__ = ["get_element", "print_tensor", "set_element", "traverse_state_dict"]

PATH_ITEM = str | int
OBJ_PATH = tuple[PATH_ITEM, ...]
STATE_DICT_ITEM = object
CONTAINER_TYPE = MutableMapping[PATH_ITEM, STATE_DICT_ITEM]
STATE_DICT_TYPE = dict[str, Any]
T = TypeVar("T")


def is_tensor_like(value: Any) -> bool:
    """A torch.Tensor (DTensor and ShardedTensor included) or an ndarray."""
    if isinstance(value, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _terminal(value: Any, keep_traversing: Callable[[Any], bool], mapping_leaf: bool) -> bool:
    """Whether ``value`` is visited as one leaf.

    ``mapping_leaf`` selects the pre-2.4 rule, where a Mapping is examined
    like a list instead of always being descended into.
    """
    if isinstance(value, Mapping):
        if not mapping_leaf:
            return False
        values: Any = value.values()
    elif isinstance(value, list):
        values = value
    else:
        return True
    for entry in values:
        if isinstance(entry, (Mapping, list)) and not _terminal(
            entry, keep_traversing, mapping_leaf
        ):
            return False
        if keep_traversing(entry):
            return False
    return True


def traverse_state_dict(
    state_dict: Mapping[Any, Any],
    visitor: Callable[[OBJ_PATH, Any], None],
    keep_traversing: Callable[[Any], bool] = is_tensor_like,
) -> None:
    """Call ``visitor(path, leaf)`` for every leaf, in dict order (torch >= 2.4 rule)."""
    stack: list[tuple[OBJ_PATH, Any]] = [((str(k),), v) for k, v in state_dict.items()]
    stack.reverse()
    while stack:  # explicit stack: deep nesting cannot hit the recursion limit
        path, value = stack.pop()
        if isinstance(value, Mapping):
            stack.extend(reversed([(path + (str(k),), v) for k, v in value.items()]))
        elif _terminal(value, keep_traversing, False):
            visitor(path, value)
        elif isinstance(value, list):
            stack.extend(reversed([(path + (i,), v) for i, v in enumerate(value)]))


def traverse_state_dict_v_2_3(
    state_dict: Mapping[Any, Any],
    visitor: Callable[[OBJ_PATH, Any], None],
    keep_traversing: Callable[[Any], bool] = is_tensor_like,
) -> None:
    """Like :func:`traverse_state_dict` with the pre-2.4 rule: a container
    holding no tensor (recursively) is a single leaf."""
    stack: list[tuple[OBJ_PATH, Any]] = [((str(k),), v) for k, v in state_dict.items()]
    stack.reverse()
    while stack:
        path, value = stack.pop()
        if _terminal(value, keep_traversing, True):
            visitor(path, value)
        elif isinstance(value, Mapping):
            stack.extend(reversed([(path + (str(k),), v) for k, v in value.items()]))
        elif isinstance(value, list):
            stack.extend(reversed([(path + (i,), v) for i, v in enumerate(value)]))


def set_element(root_dict: MutableMapping[Any, Any], path: OBJ_PATH, value: Any) -> None:
    """Set ``value`` at ``path`` in ``root_dict``, creating dicts for ``str`` keys
    and lists (padded with None) for ``int`` keys on the way."""
    cur: Any = root_dict
    for prev, key in zip(path, path[1:]):
        default: Any = {} if type(key) is str else []
        if isinstance(cur, Mapping):
            cur = cur.setdefault(prev, default)
        else:
            idx = cast(int, prev)
            if len(cur) <= idx:
                cur.extend([None] * (idx + 1 - len(cur)))
            if cur[idx] is None:
                cur[idx] = default
            cur = cur[idx]
    last = path[-1]
    if type(last) is int and len(cur) <= last:
        cur.extend([None] * (last + 1 - len(cur)))
    cur[last] = value


def get_element(
    root_dict: Mapping[Any, Any], path: OBJ_PATH, default_value: T | None = None
) -> Any:
    """The value at ``path`` in ``root_dict``, or ``default_value`` if there is none."""
    cur: Any = root_dict
    for part in path:
        if type(part) is int:
            if not isinstance(cur, list) or len(cur) <= part:
                return default_value
        elif not isinstance(cur, Mapping) or part not in cur:
            return default_value
        cur = cur[part]
    return cur




def _print_nested(value: Any, prefix: str = "", print_fun: Callable[[str], None] = print) -> None:
    torch = sys.modules.get("torch")
    kind = type(value).__name__
    if torch is not None and kind == "ShardedTensor":
        print_fun(f"{prefix} ShardedTensor size: {value.size()}")
        for shard in value.local_shards():
            _print_nested(shard.tensor, f"{shard.metadata.shard_offsets} ", print_fun=print_fun)
    elif torch is not None and kind == "DTensor":
        print_fun(f"{prefix} DistributedTensor size: {value.size()}")
        _print_nested(value._local_tensor, print_fun=print_fun)
    elif torch is not None and isinstance(value, torch.Tensor):
        print_fun(f"{prefix} Tensor size: {value.size()}")
    elif isinstance(value, np.ndarray):
        print_fun(f"{prefix} ndarray shape: {value.shape}")
    else:
        print_fun(f"{prefix} Type: {type(value)}")


def print_tensor(path: OBJ_PATH, value: Any, print_fun: Callable[[str], None] = print) -> None:
    """A ``traverse_state_dict`` visitor that prints each leaf's kind and size
    (through ``print_fun``, ``print`` by default)."""
    _print_nested(value, prefix=str(path), print_fun=print_fun)
