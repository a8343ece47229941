"""Compare shardstate.checkpoint's surface with the installed torch's DCP.

    python scripts/dcp_surface.py            # counts, then what is missing or differs
    python scripts/dcp_surface.py --quiet    # counts only

What is counted, for torch.distributed.checkpoint and each of its public
submodules (names not starting with "_"):
- its public names: everything in ``__all__``, plus every public class and
  function the module itself defines; for the package itself, every public
  non-module attribute (what ``import torch.distributed.checkpoint as dcp``
  gives a user);
- the private names real code imports (PRIVATE below), counted apart;
- the names a submodule takes from another DCP module by import (``from
  torch.distributed.checkpoint.filesystem import Metadata`` works): present,
  and the very object shardstate's own module of that name gives, counted
  apart; what submodules import from the rest of torch (DTensor, ...) is
  torch's, not mirrored, and only counted.

For each name: present under the same module path of shardstate.checkpoint,
and, for callables, with the same signature: torch's parameters with the
same names, kinds, order and defaults (annotations are not compared, since
they name each library's own types). shardstate's own options, keyword-only
with defaults after torch's (``verify_checksums=``, ...), keep a call
written for torch valid; they are listed apart. Exit status 0 when every
name is present with the same signature.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import pkgutil
import sys
import types
from typing import Any

# Private names that real training code and torch's own tests import.
PRIVATE = {
    "default_planner": ["_EmptyStateDictLoadPlanner", "_create_default_local_metadata",
                        "_validate_global_plan", "create_default_local_save_plan"],
    "state_dict_loader": ["_load_state_dict_from_keys"],
    "state_dict": ["_patch_model_state_dict", "_patch_optimizer_state_dict"],
    "_extension": ["StreamTransformExtension", "ZStandard", "ExtensionRegistry"],
    "_traverse": ["traverse_state_dict", "set_element", "get_element"],
    "_nested_dict": ["flatten_state_dict", "unflatten_state_dict"],
    "_dedup_save_plans": ["dedup_save_plans"],
    "_dedup_tensors": ["dedup_tensors"],
    "planner_helpers": ["_create_read_items", "_create_write_items",
                        "create_read_items_for_chunk_list"],
}


def _assigned_names(mod: types.ModuleType) -> set[str]:
    """Names the module's own source binds at top level (constants)."""
    try:
        tree = ast.parse(inspect.getsource(mod))
    except (OSError, TypeError, SyntaxError):
        return set()
    out = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def public_names(mod: types.ModuleType, is_package: bool) -> list[str]:
    names = set(getattr(mod, "__all__", []))
    assigned = _assigned_names(mod)
    for n, v in vars(mod).items():
        if n.startswith("_") or isinstance(v, types.ModuleType):
            continue
        if is_package or n in assigned or ((inspect.isclass(v) or inspect.isfunction(v))
                                           and getattr(v, "__module__", None) == mod.__name__):
            names.add(n)
    return sorted(names)


def imported_names(mod: types.ModuleType, own: set[str]) -> tuple[dict[str, str], list[str]]:
    """The public classes and functions ``mod`` imports: {name: the DCP
    module (under torch.distributed.checkpoint) they come from}, and the
    names it takes from the rest of torch."""
    dcp, rest = {}, []
    for n, v in vars(mod).items():
        if n.startswith("_") or n in own or not (inspect.isclass(v) or inspect.isfunction(v)):
            continue
        origin = getattr(v, "__module__", "") or ""
        if origin.startswith("torch.distributed.checkpoint."):
            dcp[n] = origin[len("torch.distributed.checkpoint."):]
        elif origin.startswith("torch"):
            rest.append(n)
    return dcp, rest


def compare_imported(sub: str, names: dict[str, str]) -> tuple[int, int, list]:
    """Present under shardstate's ``sub``, and the object shardstate's own
    module of the origin's name has (or the package's, for a name it
    exports)."""
    try:
        mod_o = importlib.import_module(f"shardstate.checkpoint.{sub}")
    except ImportError as e:
        return 0, 0, [(sub, "*", f"module missing: {e}")]
    present = same = 0
    problems = []
    for n, origin in sorted(names.items()):
        if not hasattr(mod_o, n):
            problems.append((sub, n, f"missing (torch's comes from {origin})"))
            continue
        present += 1
        try:
            home = importlib.import_module(f"shardstate.checkpoint.{origin}")
        except ImportError:
            home = importlib.import_module("shardstate.checkpoint")
        if getattr(home, n, None) is getattr(mod_o, n):
            same += 1
        else:
            problems.append((sub, n, f"not the object shardstate's {origin} has"))
    return present, same, problems


def _default(p: inspect.Parameter) -> Any:
    d = p.default
    if d is inspect.Parameter.empty:
        return "<required>"
    if isinstance(d, (int, float, str, bool, type(None), tuple)):
        return d
    return type(d).__name__  # an object default: compare its kind, not identity


def signature(obj: Any) -> Any:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    return [(p.name, p.kind.name, _default(p)) for p in sig.parameters.values()]


def same_signature(st: Any, so: Any) -> tuple[bool, list[str]]:
    """Whether ``so`` takes every call ``st`` takes in the same way, and
    the extra keyword-only options it adds."""
    if st is None or so is None:
        return st == so, []
    if so[: len(st)] == st:
        extra = so[len(st):]
    else:
        # keyword-only parameters may come in any order
        pos_t = [p for p in st if p[1] != "KEYWORD_ONLY"]
        if so[: len(pos_t)] != pos_t:
            return False, []
        kw_o = {p[0]: p for p in so[len(pos_t):]}
        if any(kw_o.get(p[0]) != p for p in st[len(pos_t):]):
            return False, []
        names = {p[0] for p in st}
        extra = [p for p in so[len(pos_t):] if p[0] not in names]
    ok = all(p[1] == "KEYWORD_ONLY" and p[2] != "<required>" for p in extra)
    return ok, [p[0] for p in extra]


EXTRAS: list[str] = []


def compare(sub: str, names: list[str], ours_root: str, theirs_root: str) -> tuple[int, int, list]:
    mod_t = importlib.import_module(theirs_root + ("" if sub == "__init__" else f".{sub}"))
    try:
        mod_o = importlib.import_module(ours_root + ("" if sub == "__init__" else f".{sub}"))
    except ImportError as e:
        return 0, 0, [(sub, "*", f"module missing: {e}")]
    present = equal = 0
    problems = []
    for n in names:
        if not hasattr(mod_o, n):
            problems.append((sub, n, "missing"))
            continue
        present += 1
        t, o = getattr(mod_t, n), getattr(mod_o, n)
        if callable(t):
            st, so = signature(t), signature(o)
            ok, extra = same_signature(st, so)
            if not ok:
                problems.append(
                    (sub, n, f"signature differs:\n      torch: {st}\n      ours:  {so}"))
                continue
            if extra:
                EXTRAS.append(f"{sub}.{n}: {', '.join(extra)}")
        equal += 1
    return present, equal, problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    import torch.distributed.checkpoint as dcp

    subs = sorted(m.name for m in pkgutil.iter_modules(dcp.__path__) if not m.name.startswith("_"))
    n_sub_ours = 0
    totals = [0, 0, 0]  # names, present, equal
    imp = [0, 0, 0]  # names imported from DCP modules, present, the same object
    from_torch = 0
    problems: list = []
    for sub in ["__init__", *subs]:
        if sub != "__init__":
            try:
                importlib.import_module(f"shardstate.checkpoint.{sub}")
                n_sub_ours += 1
            except ImportError:
                pass
        mod = dcp if sub == "__init__" else importlib.import_module(
            f"torch.distributed.checkpoint.{sub}")
        names = public_names(mod, sub == "__init__")
        p, e, probs = compare(sub, names, "shardstate.checkpoint", "torch.distributed.checkpoint")
        totals[0] += len(names)
        totals[1] += p
        totals[2] += e
        problems += probs
        if sub != "__init__":
            dcp_imports, rest = imported_names(mod, set(names))
            from_torch += len(rest)
            p, e, probs = compare_imported(sub, dcp_imports)
            imp[0] += len(dcp_imports)
            imp[1] += p
            imp[2] += e
            problems += [(s, n, f"(imported) {w}") for s, n, w in probs]
    priv = [0, 0, 0]
    for sub, names in PRIVATE.items():
        p, e, probs = compare(sub, names, "shardstate.checkpoint", "torch.distributed.checkpoint")
        priv[0] += len(names)
        priv[1] += p
        priv[2] += e
        problems += [(s, n, f"(private) {w}") for s, n, w in probs]
    print(f"torch {sys.modules['torch'].__version__}: public submodules of "
          f"torch.distributed.checkpoint present in shardstate.checkpoint: "
          f"{n_sub_ours} of {len(subs)}")
    print(f"public names: {totals[1]} of {totals[0]} present, {totals[2]} with the same signature")
    print(f"private names real code imports: {priv[1]} of {priv[0]} present, "
          f"{priv[2]} with the same signature")
    print(f"names submodules import from other DCP modules: {imp[1]} of {imp[0]} present, "
          f"{imp[2]} the same object as shardstate's own module gives "
          f"({from_torch} imported from the rest of torch, not mirrored)")
    if not args.quiet:
        if EXTRAS:
            print("shardstate's own keyword-only options (torch's calls unchanged):")
            for line in sorted(set(EXTRAS)):
                print(f"  {line}")
        if problems:
            print("missing or different:")
        for sub, n, what in problems:
            print(f"  {sub}.{n}: {what}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
