"""Flattening nested state dicts into dotted keys, and back: torch 2.13's
``_nested_dict`` (same names and signatures).

The flat key is ``".".join(map(str, path))`` and ``mapping[key] = path``, a
tuple of ``str`` dict keys and ``int`` list indices, over the walk of
``_traverse``. torch picks the pre-2.4 walk with a module global
(``_version._derived_version``); here it is the keyword ``v2_3``, which
defaults to that global, as torch reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import _version
from ._traverse import (
    OBJ_PATH,
    STATE_DICT_TYPE,
    set_element,
    traverse_state_dict,
    traverse_state_dict_v_2_3,
)

__all__ = ["FLATTEN_MAPPING", "flatten_state_dict", "unflatten_state_dict"]

FLATTEN_MAPPING = dict[str, OBJ_PATH]


def flatten_state_dict(
    state_dict: Mapping[Any, Any], *, v2_3: bool | None = None
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

    if v2_3 is None:
        v2_3 = _version._derived_version == "2_3"
    (traverse_state_dict_v_2_3 if v2_3 else traverse_state_dict)(state_dict, visit)
    return flat, mapping


def unflatten_state_dict(
    state_dict: Mapping[str, Any], mapping: FLATTEN_MAPPING
) -> STATE_DICT_TYPE:
    """The nested state dict that :func:`flatten_state_dict` flattened."""
    nested: STATE_DICT_TYPE = {}
    for key, value in state_dict.items():
        set_element(nested, mapping[key], value)
    return nested
