"""The C recognition of tensor records (csrc/core/ss_zipread.c, through
``_core.parse_tensor_record``) against its reference, the Python parser
(``_zipfmt.parse_record``): on torch.save records of many dtypes, shapes,
strides and views it gives the same answer; on mutated and truncated ones
it never accepts what Python refuses, never answers differently, and never
crashes."""

from __future__ import annotations

import io
import random
import struct

import pytest
import torch
from _dtypes import DTYPES, seeded
from shardstate import _core
from shardstate.checkpoint._zipfmt import RecordFormatError, parse_record


def _fields(p) -> tuple:
    return (p.dtype, p.shape, p.stride, p.storage_offset, p.storage_numel, p.requires_grad,
            p.data_offset, p.data_length, p.data_crc32, p.conj, p.neg)


def _both(b: bytes) -> tuple:
    """(C answer, Python answer or None); fails if C accepts what Python
    refuses or answers differently."""
    c = _core.parse_tensor_record(b)
    try:
        p = _fields(parse_record(b))
    except RecordFormatError:
        p = None
    if c is not None:
        assert p is not None, "C accepted a record Python refuses"
        assert c[:-1] == p
        # dense: the storage is exactly the tensor, row-major from 0
        want, strides = 1, []
        for n in reversed(c[1]):
            strides.insert(0, want)
            want *= n
        dense = (not c[9] and not c[10] and c[3] == 0 and c[4] == want
                 and c[2] == tuple(strides))
        assert c[-1] == dense
        c = c[:-1]
    return c, p


def _saved(t: torch.Tensor, crc: bool = True) -> bytes:
    buf = io.BytesIO()
    torch.serialization.set_crc32_options(crc)
    try:
        torch.save(t, buf)
    finally:
        torch.serialization.set_crc32_options(True)
    return buf.getvalue()


def _tensors() -> list[torch.Tensor]:
    out = []
    for i, dt in enumerate(DTYPES):
        base = seeded(dt, (4, 6), i)
        out += [base, base.t(), base[1:3, ::2], base[2], base.reshape(-1)[5:]]
    g = torch.Generator().manual_seed(0)
    # dtypes torch pickles with _rebuild_tensor_v3, and complex ones
    for dt in (torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
               torch.float8_e5m2, torch.complex128, torch.complex64):
        base = torch.randint(0, 50, (3, 5), generator=g).to(dt)
        out += [base, base.t(), base[1:, 2:]]
    out += [
        torch.randn(2, 3, 4, 5, generator=g).permute(3, 1, 0, 2),
        torch.tensor(3.5),
        torch.zeros(0, 7),
        torch.zeros(3, 0),
        torch.randn(4, 4, dtype=torch.complex64, generator=g).conj(),
        torch._neg_view(torch.randn(5, generator=g)),
        torch.randn(3, requires_grad=True).detach().requires_grad_(True),
        torch.arange(10).expand(3, 10),  # stride 0
    ]
    return out


def test_torch_records_are_recognised_as_python_does():
    n = 0
    for t in _tensors():
        for crc in (True, False):
            b = _saved(t.detach() if not t.requires_grad else t, crc)
            c, p = _both(b)
            assert p is not None
            assert c is not None, f"C refused torch.save's record of {t.dtype} {tuple(t.shape)}"
            n += 1
    assert n >= 100


def _mutants(b: bytes, rng: random.Random, pkl: tuple[int, int]) -> list[bytes]:
    out = []
    for _ in range(250):
        m = bytearray(b)
        kind = rng.random()
        if kind < 0.45:  # flip bytes of data.pkl (checked only by the walker with CRCs off)
            for _ in range(rng.randint(1, 3)):
                m[rng.randrange(pkl[0], pkl[0] + pkl[1])] = rng.randrange(256)
        elif kind < 0.75:  # flip bytes of the zip structures (headers, trailer)
            for _ in range(rng.randint(1, 2)):
                at = rng.choice((rng.randrange(0, 128), rng.randrange(len(b) - 400, len(b))))
                m[at] = rng.randrange(256)
        elif kind < 0.85:  # a little-endian field set to an edge value
            at = rng.randrange(len(b) - 400, len(b) - 8)
            struct.pack_into("<I", m, at, rng.choice((0, 0xFFFFFFFF, 0x7FFFFFFF, len(b))))
        elif kind < 0.95:  # truncated, at either end
            k = rng.randrange(1, len(b))
            m = m[:k] if rng.random() < 0.5 else m[k:]
        else:  # bytes inserted in the pickle
            at = rng.randrange(pkl[0], pkl[0] + pkl[1])
            m[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        out.append(bytes(m))
    return out


@pytest.mark.parametrize("crc", [True, False])
def test_mutated_records_are_never_accepted_beyond_python(crc):
    rng = random.Random(1234 + crc)
    accepted = refused = 0
    for t in _tensors()[::2]:
        b = _saved(t.detach(), crc)
        pk = next(e for e in parse_record(b).entries if e.name == "data.pkl")
        for m in _mutants(b, rng, (pk.data_offset, pk.size)):
            c, p = _both(m)
            accepted += c is not None
            refused += c is None
    # both outcomes occur: flips of unchecked bytes (the pickle's memo keys,
    # a requires_grad bit) leave a record both accept
    assert accepted > 0 and refused > accepted


def test_refusals_and_bounds():
    b = _saved(torch.arange(12.0).reshape(3, 4).t())
    assert _core.parse_tensor_record(b) is not None
    for k in range(0, len(b), 7):  # every truncation refused, none crashes
        assert _core.parse_tensor_record(b[:k]) is None
    assert _core.parse_tensor_record(b"") is None
    assert _core.parse_tensor_record(bytes(4096)) is None
    with pytest.raises(TypeError):
        _core.parse_tensor_record("not a buffer")
