"""The ``shardstate`` command (also ``python -m shardstate``).

    shardstate ls ROOT [--json]                step checkpoints under ROOT
    shardstate inspect CKPT [--chunks] [--json]
    shardstate verify CKPT [--quiet]           every reference and record CRC
    shardstate diff A B [--rtol R] [--atol A] [--quiet]  keys, dtypes, shapes, values
    shardstate convert SRC DST [--to torch_save|safetensors|dcp] [--max-shard-size SIZE]
    shardstate prune ROOT --keep K [--incomplete] [--dry-run]

Exit status: 0 success (verify: sound; diff: no difference); 1 verify found
damage, diff found differences; 2 bad usage; 3 no checkpoint at the path or
its metadata cannot be read; 4 any other error (I/O, a failed conversion).
Errors are one line on stderr, ``shardstate: error: ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_UNREADABLE, EXIT_ERROR = 0, 1, 2, 3, 4


class _Usage(Exception):
    """A command line that parses but makes no sense (exit status 2)."""


def _human(n: int | None) -> str:
    from ._progress import _human

    return "?" if n is None else _human(n)


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _cmd_inspect(a: argparse.Namespace) -> int:
    from .checkpoint._inspect import describe

    d = describe(a.ckpt)
    if a.json:
        json.dump(d, sys.stdout, indent=1)
        print()
        return EXIT_OK
    items = d["items"]
    n_t = sum(1 for it in items if it["kind"] == "tensor")
    nf = len(d["files"])
    print(f"{d['path']}: {len(items)} items ({n_t} tensors, {len(items) - n_t} bytes items), "
          f"{nf} data file{'' if nf == 1 else 's'} from ranks {_ranks(d['ranks'])}, "
          f"{_human(d['total_bytes'])}")
    width = max([len(it["key"]) for it in items] + [3])
    print(f"  {'key':<{width}}  {'dtype':<14} {'shape':<20} {'chunks':>6}  {'ranks':<8} stored")
    for it in items:
        if it["kind"] == "bytes":
            print(f"  {it['key']:<{width}}  {'bytes':<14} {'':<20} {'':>6}  "
                  f"{_ranks([it['rank']] if it['rank'] is not None else []):<8} "
                  f"{_human(it['stored_bytes'])}")
            continue
        ranks = sorted({c["rank"] for c in it["chunks"] if c["rank"] is not None})
        print(f"  {it['key']:<{width}}  {it['dtype']:<14} {str(it['shape']):<20} "
              f"{len(it['chunks']):>6}  {_ranks(ranks):<8} {_human(it['stored_bytes'])}")
        if a.chunks:
            for c in it["chunks"]:
                print(f"      {c['offsets']} + {c['sizes']}: {c['file']} at {c['offset']}, "
                      f"{c['length']} bytes")
    return EXIT_OK


def _cmd_verify(a: argparse.Namespace) -> int:
    from ._progress import Progress
    from .checkpoint._inspect import verify

    bar = Progress("verify", 0, enabled=False if a.quiet else None)
    try:
        report = verify(a.ckpt, progress=bar)
    finally:
        bar.close()
    for w in report.warnings:
        print(f"warning: {w}")
    for p in report.problems:
        print(f"damaged: {p}")
    summary = (f"{report.items} items, {report.records} records, "
               f"{_human(report.checked_bytes)} checked")
    if report.ok:
        print(f"OK: {a.ckpt}: {summary}")
        return EXIT_OK
    print(f"DAMAGED: {a.ckpt}: {len(report.problems)} problems ({summary})")
    return EXIT_FOUND


def _cmd_diff(a: argparse.Namespace) -> int:
    from ._progress import Progress
    from .checkpoint._inspect import diff

    bar = Progress("diff", 0, enabled=False if a.quiet else None)
    try:
        lines = diff(a.a, a.b, rtol=a.rtol, atol=a.atol, progress=bar)
    finally:
        bar.close()
    for line in lines:
        print(line)
    if lines:
        print(f"{len(lines)} differences")
        return EXIT_FOUND
    print("no differences")
    return EXIT_OK


def _size_arg(text: str) -> int:
    """``5GB``, ``500MiB``, ``123`` (bytes) -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    try:
        n = float(num) * units[t[len(num):].strip()]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB)") from None
    if not 0 < n < 1 << 62:
        raise argparse.ArgumentTypeError(f"size out of range: {text!r}")
    return int(n)


def _shard_mapping(src: str, max_bytes: int) -> dict[str, int]:
    """Each tensor of the DCP checkpoint ``src`` -> the index (1..N) of the
    safetensors file it goes to: in the metadata's order, a new file when
    the next tensor would take this one past ``max_bytes`` (Hugging Face's
    ``max_shard_size`` rule: a tensor bigger than that gets a file alone)."""
    from .checkpoint._inspect import _itemsize, _open

    mapping, index, used = {}, 1, 0
    for fqn, tmd in _open(src)[1].state_dict_metadata.items():
        if not hasattr(tmd, "chunks"):  # a bytes item: not in safetensors
            continue
        n = math.prod(tmd.size) * _itemsize(tmd.properties.dtype)
        if used and used + n > max_bytes:
            index, used = index + 1, 0
        mapping[fqn] = index
        used += n
    return mapping


def _is_dcp(path: str) -> bool:
    from .checkpoint._steps import Store

    store = Store(path)
    return store.exists(store.join(store.root, ".metadata"))


def _cmd_convert(a: argparse.Namespace) -> int:
    from .checkpoint import format_utils as fu
    from .checkpoint._inspect import CheckpointUnreadable

    src, dst = a.src, a.dst
    is_dcp = _is_dcp(src)
    to = a.to or ("torch_save" if is_dcp else "dcp")
    if a.max_shard_size is not None and to != "safetensors":
        raise _Usage("--max-shard-size is for --to safetensors")
    if to in ("torch_save", "safetensors"):
        if not is_dcp:
            raise CheckpointUnreadable(f"{src}: no DCP checkpoint (no .metadata)")
        if to == "torch_save":
            fu.dcp_to_torch_save(src, dst)
        else:
            mapping = None if a.max_shard_size is None else _shard_mapping(src, a.max_shard_size)
            fu.dcp_to_safetensors(src, dst, mapping)
    elif Path(src).is_dir() and any(Path(src).glob("*.safetensors")):
        fu.safetensors_to_dcp(src, dst)
    elif Path(src).is_file():
        fu.torch_save_to_dcp(src, dst)
    else:
        raise CheckpointUnreadable(f"{src}: no torch.save file or directory of safetensors "
                                   "files")
    if not a.quiet:
        print(f"{src} -> {dst} ({to})")
    return EXIT_OK


def _cmd_ls(a: argparse.Namespace) -> int:
    from .checkpoint._steps import list_steps

    steps = list_steps(a.root)
    if a.json:
        json.dump([{"step": s.step, "path": os.fspath(s.path), "state": s.state,
                    "size": s.size} for s in steps], sys.stdout, indent=1)
        print()
        return EXIT_OK
    if not steps:
        print(f"{a.root}: no steps")
        return EXIT_OK
    print(f"{'step':>10}  {'state':<10} {'size':>10}  path")
    for s in steps:
        print(f"{s.step:>10}  {s.state:<10} {_human(s.size):>10}  {s.path}")
    return EXIT_OK


def _cmd_prune(a: argparse.Namespace) -> int:
    from .checkpoint._steps import list_steps, remove_step

    steps = list_steps(a.root)
    done = [s for s in steps if s.loadable]
    drop = done[: max(len(done) - a.keep, 0)]
    if a.incomplete and done:
        newest = done[-1].step
        drop += [s for s in steps if not s.loadable and s.step < newest]
    for s in sorted(drop, key=lambda s: s.step):
        if not a.dry_run:
            remove_step(s)
        if not a.quiet:
            print(f"{'would remove' if a.dry_run else 'removed'} step {s.step} ({s.state}, "
                  f"{_human(s.size)}): {s.path}")
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardstate", description="Inspect, verify, compare, "
                                "convert and prune distributed checkpoints (DCP format).")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    s = sub.add_parser("ls", help="list the step checkpoints under a root")
    s.add_argument("root")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=_cmd_ls)
    s = sub.add_parser("inspect", help="keys, dtypes, shapes, chunks, files and ranks")
    s.add_argument("ckpt")
    s.add_argument("--chunks", action="store_true", help="list every chunk and where it is")
    s.add_argument("--json", action="store_true", help="everything, as JSON")
    s.set_defaults(run=_cmd_inspect)
    s = sub.add_parser("verify", help="check every metadata reference and record CRC-32")
    s.add_argument("ckpt")
    s.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    s.set_defaults(run=_cmd_verify)
    s = sub.add_parser("diff", help="compare two checkpoints' keys, shapes and values")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--rtol", type=float, default=0.0)
    s.add_argument("--atol", type=float, default=0.0)
    s.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    s.set_defaults(run=_cmd_diff)
    s = sub.add_parser("convert", help="DCP checkpoint <-> torch.save file or safetensors")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--to", choices=("torch_save", "safetensors", "dcp"),
                   help="default: torch_save from a DCP checkpoint, dcp from a torch.save "
                   "file or a directory of safetensors files")
    s.add_argument("--max-shard-size", type=_size_arg, metavar="SIZE",
                   help="--to safetensors: files of at most SIZE (e.g. 5GB) and an index; "
                   "default: one consolidated file")
    s.add_argument("--quiet", "-q", action="store_true")
    s.set_defaults(run=_cmd_convert)
    s = sub.add_parser("prune", help="remove all but the newest K loadable steps")
    s.add_argument("root")
    s.add_argument("--keep", type=int, required=True, metavar="K")
    s.add_argument("--incomplete", action="store_true",
                   help="also remove incomplete steps older than the newest loadable one")
    s.add_argument("--dry-run", action="store_true")
    s.add_argument("--quiet", "-q", action="store_true")
    s.set_defaults(run=_cmd_prune)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "keep", 0) < 0:
        _parser().error("--keep must be >= 0")
    from .checkpoint._inspect import CheckpointUnreadable

    try:
        return args.run(args)
    except _Usage as e:
        print(f"shardstate: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointUnreadable, FileNotFoundError) as e:
        print(f"shardstate: error: {e}", file=sys.stderr)
        return EXIT_UNREADABLE
    except BrokenPipeError:
        return EXIT_OK
    except Exception as e:  # one line, not a traceback
        print(f"shardstate: error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_ERROR


def _entry() -> Any:
    sys.exit(main())
