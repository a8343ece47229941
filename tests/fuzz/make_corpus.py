"""Writes the seed corpora under tests/fuzz/corpus/ (committed; rerun only to
refresh them, e.g. for a new torch):

    PYTHONPATH=python .venv/bin/python tests/fuzz/make_corpus.py

corpus/fuzz_pickle/  pickles for the C scan (tests/fuzz/fuzz_pickle.c) and the
    restricted unpickler: ``.metadata`` files written by torch's DCP and by
    shardstate (plain, with bytes items, with zstd transforms), the data.pkl
    of torch.save tensor records, DCP bytes items' pickles, plain objects in
    every protocol, and small hand-made edge cases (each refused opcode, a
    forged memo index, FRAME/BYTEARRAY8 lengths, nesting at the bound).
corpus/fuzz_zipread/ the tensor records below (``*.rec``) and the same kinds
    written with every CRC 0, for the C record parser (tests/fuzz/fuzz_zipread.c).
corpus/fuzz_stheader/ safetensors files written by the safetensors package
    and by shardstate (every dtype, metadata, empty and scalar tensors, a
    zero-sized one amid others) and header JSON alone (escapes, surrogate
    pairs, padding), for the C header parser (tests/fuzz/fuzz_stheader.c;
    ``make_corpus.py stheader`` rewrites only this one).
corpus/records/      whole records as DCP stores them, for the Python
    parsers (tests/test_fuzz_parsers.py): torch.save tensor records
    (``*.rec``: contiguous, strided, conj/neg views, v3 dtypes, empty), bytes
    items (``*.bytes``), and zstd-transformed items as stored (``*.zst``,
    with the descriptors in ``*.zst.desc``).

Everything is written by the real writers of torch 2.13 and shardstate in
this process (one rank, no process group); nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import shutil
import sys
import tempfile
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import shardstate.checkpoint as sdcp
import torch
import torch.distributed.checkpoint as tdcp
from shardstate.checkpoint import _zipfmt
from shardstate.checkpoint._pickle import loads_metadata
from torch.distributed.checkpoint._extension import ZStandard

HERE = Path(__file__).resolve().parent
PICKLES = HERE / "corpus" / "fuzz_pickle"
RECORDS = HERE / "corpus" / "records"
ZIPREAD = HERE / "corpus" / "fuzz_zipread"
STHEADER = HERE / "corpus" / "fuzz_stheader"


def _state_dict(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g),
        "b": torch.arange(5, dtype=torch.int64),
        "h": torch.zeros(2, 2, dtype=torch.bfloat16),
        "u": torch.ones(3, dtype=torch.uint16),
        "extra": {"step": 7, "name": "run-1", "lr": [0.1, 0.01], "t": (1, 2)},
        "opt": {"state": {0: {"exp_avg": torch.ones(4, 3)}}, "param_groups": [{"lr": 0.1}]},
    }


def _save(kind: str, path: Path, zstd: bool) -> None:
    ext = [ZStandard()] if zstd else None
    sd = _state_dict(len(kind))
    if kind == "torch":
        w = tdcp.FileSystemWriter(str(path), _extensions=ext) if ext else \
            tdcp.FileSystemWriter(str(path))
        tdcp.save(sd, storage_writer=w)
    else:
        w = sdcp.FileSystemWriter(str(path), _extensions=ext) if ext else \
            sdcp.FileSystemWriter(str(path))
        sdcp.save(sd, storage_writer=w)


def _put(folder: Path, name: str, data: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)


def _items(path: Path) -> list[tuple[str, bytes, list[str] | None]]:
    """(fqn, stored bytes, transform descriptors) of every item of a save."""
    md = loads_metadata((path / ".metadata").read_bytes())
    out = []
    for idx, info in sorted(md.storage_data.items(), key=lambda kv: str(kv[0])):
        raw = (path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        out.append((idx.fqn, raw, getattr(info, "transform_descriptors", None)))
    return out


def _tensor_records() -> dict[str, bytes]:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    cases = {
        "f32_dense": base,
        "f32_strided": base.t(),  # torch.save keeps the view's strides
        "f32_offset": base[1:, 1:],
        "f64_scalar": torch.tensor(2.5, dtype=torch.float64),
        "i8_empty": torch.zeros(0, 3, dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "u32_v3": torch.arange(4).to(torch.uint32),
        "f8_v3": torch.zeros(4, dtype=torch.float8_e4m3fn),
        "c64_conj": c.conj(),
        "f32_neg": torch.ones(3)._neg_view(),
        "bf16_5d": torch.zeros(1, 2, 1, 2, 1, dtype=torch.bfloat16),
    }
    out = {}
    for name, t in cases.items():
        buf = io.BytesIO()
        torch.save(t, buf)
        out[name] = buf.getvalue()
    return out


# Hand-made streams for the scan's edges (what no pickler writes).
_DEEP = b"\x80\x02" + b"(" * 999 + b"N" + b"t" * 999 + b"."  # nesting at the bound
_EDGES: dict[str, bytes] = {
    "stop_only": b".",
    "none": b"N.",
    "proto5_bytearray8": b"\x80\x05\x96\x03\x00\x00\x00\x00\x00\x00\x00abc.",
    "proto4_frame": b"\x80\x04\x95\x03\x00\x00\x00\x00\x00\x00\x00N\x94.",
    "frame_past_stop": b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00N." + b"\x00" * 14,
    "frame_past_end": b"\x80\x04\x95\xff\xff\xff\xff\xff\x00\x00\x00N.",
    "memo_forged": b"\x80\x04Nr\xff\xff\xff\xff.",
    "memo_put_text": b"(lp0\nI1\nag0\na.",
    "memo_get_unset": b"\x80\x02Nh\x05.",
    "dup_run": b"\x80\x02]" + b"2" * 64 + b".",
    "deep_tuples": _DEEP,
    "too_deep": b"\x80\x02" + b"(" * 1001 + b"N" + b"t" * 1001 + b".",
    "proto_late": b"N\x80\x02.",
    "proto_6": b"\x80\x06N.",
    "ext1": b"\x80\x02\x82\x01.",
    "binpersid": b"\x80\x02X\x01\x00\x00\x00xQ.",
    "persid": b"Pid\n.",
    "next_buffer": b"\x80\x05\x97.",
    "readonly_buffer": b"\x80\x05\x97\x98.",
    "text_int_nul": b"I7\x00x\n.",
    "text_float": b"F1.5\n.",
    "text_long": b"L010\n.",
    "binstring_negative": b"T\xff\xff\xff\xffabc.",
    "long4_negative": b"\x80\x02\x8b\xff\xff\xff\xff.",
    "binunicode_long": b"\x80\x02X\xff\xff\xff\x7fabc.",
    "stack_global": b"\x80\x04\x8c\x08builtins\x94\x8c\x03set\x94\x93\x94)R\x94.",
    "global_os_system": b"cos\nsystem\n(S'true'\ntR.",
    "setitems_dict_key_tuple": b"\x80\x02}(K\x01K\x02\x86K\x03u.",
    "frozenset": b"\x80\x04(K\x01K\x02\x91.",
    "empty_set_additems": b"\x80\x04\x8f(K\x01\x90.",
    "underflow_append": b"\x80\x02a.",
    "pop_mark_only": b"(1N.",
    "no_stop": b"\x80\x02N",
    "junk_after_stop": b"\x80\x02N.\x82\x97garbage",
}


def _plain_pickles() -> dict[str, bytes]:
    values: dict[str, Any] = {
        "mixed": {"a": [1, 2.0, "x", b"\x00\xff", None, True], "t": (1, (2, (3,))),
                  "s": {1, 2}, "f": frozenset({"k"}), "od": OrderedDict(a=1), "c": 1 + 2j,
                  "big": 1 << 70, "neg": -(1 << 40), "sl": slice(1, 9, 2)},
        "shared": (lambda x: [x, x, {"again": x}])([1, 2, 3]),
        "nested": [[[[["deep"]]]]],
        "long_str": "é" * 300,
    }
    out = {}
    for name, v in values.items():
        for proto in range(6):
            out[f"plain_{name}_p{proto}"] = pickle.dumps(v, protocol=proto)
    return out


def _nocrc_records() -> dict[str, bytes]:
    """torch.save records written with every CRC 0 (torch's
    set_crc32_options(False)), for fuzz_zipread: a changed byte of their
    data.pkl is not refused by a CRC first."""
    tensors = {
        "f32_strided": torch.arange(12.0).reshape(3, 4).t(),
        "c64_conj": torch.ones(2, 3, dtype=torch.complex64).conj(),
        "u16_v3": torch.arange(6).to(torch.uint16)[1:],
        "neg": torch._neg_view(torch.ones(4)),
    }
    out = {}
    torch.serialization.set_crc32_options(False)
    try:
        for name, t in tensors.items():
            buf = io.BytesIO()
            torch.save(t, buf)
            out[name] = buf.getvalue()
    finally:
        torch.serialization.set_crc32_options(True)
    return out


def _stheader_seeds() -> dict[str, bytes]:
    import json

    from safetensors.torch import save
    from shardstate.checkpoint import _safetensors as st

    g = torch.Generator().manual_seed(3)
    out: dict[str, bytes] = {}
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
              torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.complex64]
    out["st_dtypes"] = save({str(d).split(".")[1]: torch.ones(2, 3, dtype=d) for d in dtypes})
    out["st_meta"] = save({"w": torch.randn(3, 4, generator=g), "b": torch.zeros(0, 2),
                           "s": torch.tensor(1.5)}, metadata={"format": "pt", "k\u00e9": "v\n"})
    out["st_empty"] = save({})
    out["st_one"] = save({"a.b.c": torch.arange(4, dtype=torch.int64)})
    for name, tensors in (("ss_spaced", [("w", "F32", (2,)), ("v", "I64", (1, 1))]),
                          ("ss_zero_mid", [("a", "F32", (1,)), ("z", "F16", (0, 3)),
                                           ("b", "F32", (1,))])):
        head, offs, _o = st.build_header(tensors, {"DCP_SHARDING_INFO": "{}"},
                                         compact=name != "ss_spaced")
        size = sum(st.DTYPE_SIZE[d] * int(torch.Size(s).numel()) for _n, d, s in tensors)
        out[name] = head + bytes(size)
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    out["json_plain"] = json.dumps({"w": entry}).encode()
    out["json_escapes"] = (b'{"\\u00e9\\ud83d\\ude00\\n\\"\\\\\\/": '
                           b'{"dtype":"U8","shape":[],"data_offsets":[0,1]}}   ')
    out["json_meta_null"] = (b'{"__metadata__":null,'
                             b'"x":{"data_offsets":[0,0],"shape":[0],"dtype":"BF16"}}')
    out["json_deep_meta"] = (b'{"__metadata__":{"a":"b","c":"d"},'
                             b'"t":{"dtype":"C64","shape":[1,1,1],"data_offsets":[0,8]}}')
    out["json_not_object"] = b'[1, -2.5e+3, true, false, null, "s", {"k": [[]]}]'
    return out


def write_stheader() -> None:
    if STHEADER.exists():
        shutil.rmtree(STHEADER)
    for name, blob in sorted(_stheader_seeds().items()):
        _put(STHEADER, name, blob)


def main() -> None:
    if sys.argv[1:] == ["stheader"]:
        write_stheader()
        return
    write_stheader()
    for d in (PICKLES, RECORDS, ZIPREAD):
        if d.exists():
            shutil.rmtree(d)
    warnings.simplefilter("ignore")
    pk: dict[str, bytes] = {}
    rec: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("torch", "shardstate"):
            for zstd in (False, True):
                tag = f"{kind}{'_zstd' if zstd else ''}"
                path = Path(tmp) / tag
                _save(kind, path, zstd)
                pk[f"metadata_{tag}"] = (path / ".metadata").read_bytes()
                if kind != "torch":
                    continue  # the data files are byte for byte the same
                for fqn, raw, desc in _items(path):
                    name = f"{tag}_{fqn.replace('.', '_')}"
                    if desc:
                        rec[f"{name}.zst"] = raw
                        rec[f"{name}.zst.desc"] = "\n".join(desc).encode() + b"\n"
                    elif raw[:2] == b"PK" and b"data/0" not in raw:
                        rec[f"{name}.bytes"] = raw
    for name, blob in _tensor_records().items():
        rec[f"tensor_{name}.rec"] = blob
        info = _zipfmt._parse_zip(memoryview(blob))[1]
        e = next(e for e in info if e.name == "data.pkl")
        pk[f"datapkl_{name}"] = blob[e.data_offset : e.data_offset + e.size]
    for name, blob in sorted(rec.items()):
        if name.endswith(".bytes"):
            e = next(e for e in _zipfmt._parse_zip(memoryview(blob))[1] if e.name == "data.pkl")
            pk[f"bytesitem_{name[:-6]}"] = blob[e.data_offset : e.data_offset + e.size]
    pk.update(_plain_pickles())
    pk.update({f"edge_{k}": v for k, v in _EDGES.items()})
    for name, blob in sorted(pk.items()):
        _put(PICKLES, name, blob)
    for name, blob in sorted(rec.items()):
        _put(RECORDS, name, blob)
        if name.endswith(".rec"):
            _put(ZIPREAD, name, blob)
    for name, blob in _nocrc_records().items():  # data.pkl's bytes reach the walker
        _put(ZIPREAD, f"nocrc_{name}.rec", blob)
    total = sum(len(b) for b in pk.values()) + sum(len(b) for b in rec.values())
    digest = hashlib.sha1(b"".join(pk.values()) + b"".join(rec.values())).hexdigest()[:12]
    print(f"{len(pk)} pickles, {len(rec)} records, {total} bytes (sha1 {digest})",
          file=sys.stderr)


if __name__ == "__main__":
    main()
