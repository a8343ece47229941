"""Flattening nested state dicts into dotted keys, and back.

The same rules as torch 2.13's ``_nested_dict.py`` / ``_traverse.py``:

* a Mapping is always descended into (keys become ``str(k)``); an empty one
  contributes nothing;
* a list is descended into only when it (recursively) holds a tensor, a
  Mapping or a list that is itself descended into; otherwise it is one leaf;
* a tuple, or any other object, is always a leaf;
* the flat key is ``".".join(map(str, path))`` and ``mapping[key] = path``,
  a tuple of ``str`` dict keys and ``int`` list indices.

Checkpoints written before torch 2.4 used the older rule
(``traverse_state_dict_v_2_3``): a Mapping is a leaf as well when nothing in
it (recursively) is a tensor. ``flatten_state_dict(sd, v2_3=True)`` gives
those keys (torch switches with a module global, ``_version._derived_version``;
here it is an argument).

"Tensor" here means a ``torch.Tensor`` (when torch is loaded) or a
``numpy.ndarray``: shardstate saves NumPy arrays as tensors, so a list of
arrays is descended into like a list of tensors.

No torch import: tensors can only exist if torch is already loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TypeVar, cast

import numpy as np

__all__ = [
    "FLATTEN_MAPPING",
    "OBJ_PATH",
    "flatten_state_dict",
    "get_element",
    "is_tensor_like",
    "set_element",
    "traverse_state_dict",
    "traverse_state_dict_v_2_3",
    "unflatten_state_dict",
]

PATH_ITEM = str | int
OBJ_PATH = tuple[PATH_ITEM, ...]
FLATTEN_MAPPING = dict[str, OBJ_PATH]
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


def flatten_state_dict(
    state_dict: Mapping[Any, Any], v2_3: bool = False
) -> tuple[STATE_DICT_TYPE, FLATTEN_MAPPING]:
    """``(flat, mapping)``: ``{"a": {"b": t}}`` gives ``{"a.b": t}`` and
    ``{"a.b": ("a", "b")}``. Two paths with the same dotted key raise
    ValueError naming the key."""
    flat: STATE_DICT_TYPE = {}
    mapping: FLATTEN_MAPPING = {}

    def visit(path: OBJ_PATH, value: Any) -> None:
        key = ".".join(map(str, path))
        if key in flat:
            raise ValueError(
                f"duplicated flatten key {key}: paths {mapping[key]!r} and {path!r} "
                "flatten to the same key"
            )
        flat[key] = value
        mapping[key] = path

    (traverse_state_dict_v_2_3 if v2_3 else traverse_state_dict)(state_dict, visit)
    return flat, mapping


def set_element(root: MutableMapping[Any, Any], path: OBJ_PATH, value: Any) -> None:
    """Set ``value`` at ``path`` in ``root``, creating dicts for ``str`` keys
    and lists (padded with None) for ``int`` keys on the way."""
    cur: Any = root
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


def get_element(root: Mapping[Any, Any], path: OBJ_PATH, default_value: T | None = None) -> Any:
    """The value at ``path`` in ``root``, or ``default_value`` if there is none."""
    cur: Any = root
    for part in path:
        if type(part) is int:
            if not isinstance(cur, list) or len(cur) <= part:
                return default_value
        elif not isinstance(cur, Mapping) or part not in cur:
            return default_value
        cur = cur[part]
    return cur


def unflatten_state_dict(flat: Mapping[str, Any], mapping: FLATTEN_MAPPING) -> STATE_DICT_TYPE:
    """The nested state dict that :func:`flatten_state_dict` flattened."""
    nested: STATE_DICT_TYPE = {}
    for key, value in flat.items():
        set_element(nested, mapping[key], value)
    return nested
