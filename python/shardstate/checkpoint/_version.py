"""torch's ``_version``: a module global that, set to ``"2_3"``, makes
``_nested_dict.flatten_state_dict`` walk a state dict as torch 2.3 did
(lists not descended into). torch's planner sets it for the length of
one flatten; shardstate's passes ``v2_3=`` instead, and reads this only
when a caller sets it."""

from __future__ import annotations

_derived_version: str | None = None
