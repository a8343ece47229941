"""crc32 / crc32c / combine: equal to zlib and to a reference, on every
implementation the machine has (the accelerated one and the forced portable
one), at every alignment, for every buffer type."""

import platform
import random
import threading
import zlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import shardstate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardstate import _core

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    # impl is function-scoped on purpose: it sets process state that must
    # not outlive the test; it is the same for every example.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_T32C = _crc32c_table()


def ref_crc32c(data: bytes, value: int = 0) -> int:
    """Byte-at-a-time CRC-32C, straight from the definition."""
    c = (value & 0xFFFFFFFF) ^ 0xFFFFFFFF
    for b in data:
        c = (c >> 8) ^ _T32C[(c ^ b) & 0xFF]
    return c ^ 0xFFFFFFFF


@pytest.fixture(params=["accelerated", "portable"])
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test against each implementation; restores the setting."""
    prev = _core._crc_force_portable(request.param == "portable")
    try:
        names = shardstate.crc_implementation()
        if request.param == "portable":
            assert names == {"crc32": "portable", "crc32c": "portable"}
        yield request.param
    finally:
        _core._crc_force_portable(prev)


def _buf(seed: int, n: int, offset: int) -> memoryview:
    """n random bytes starting offset bytes into a fresh allocation."""
    raw = random.Random(seed).randbytes(n + offset)
    return memoryview(raw)[offset:]


def test_accelerated_on_this_machine() -> None:
    # x86-64 machines since 2010 have PCLMULQDQ and SSE4.2: if dispatch
    # silently fell back to the portable code the speed would be lost.
    # Other architectures have only the portable code so far.
    names = shardstate.crc_implementation()
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert names["crc32"] in ("pclmul", "vpclmul")
        assert names["crc32c"] in ("sse42", "sse42-3way", "vpclmul+sse42")
    else:
        assert names == {"crc32": "portable", "crc32c": "portable"}


def test_force_portable_returns_previous() -> None:
    assert _core._crc_force_portable(True) is False
    try:
        assert _core._crc_force_portable(True) is True
        assert shardstate.crc_implementation()["crc32"] == "portable"
    finally:
        assert _core._crc_force_portable(False) is True
    assert shardstate.crc_implementation()["crc32"] != "portable"


@SETTINGS
@given(
    n=st.integers(0, 70000),
    offset=st.integers(0, 63),
    seed=st.integers(0, 2**32),
    value=st.integers(0, 2**32 - 1),
)
def test_crc32_equals_zlib(impl: str, n: int, offset: int, seed: int, value: int) -> None:
    data = _buf(seed, n, offset)
    assert shardstate.crc32(data, value) == zlib.crc32(data, value)
    assert shardstate.crc32(data) == zlib.crc32(data)


@SETTINGS
@given(data=st.binary(max_size=600), value=st.integers(-(2**70), 2**70))
def test_crc32_small_and_value_masked_like_zlib(impl: str, data: bytes, value: int) -> None:
    assert shardstate.crc32(data, value) == zlib.crc32(data, value)
    assert shardstate.crc32(data, value=value) == zlib.crc32(data, value)


@SETTINGS
@given(
    n=st.integers(0, 4000),
    offset=st.integers(0, 63),
    seed=st.integers(0, 2**32),
    value=st.integers(0, 2**32 - 1),
)
def test_crc32c_equals_reference(impl: str, n: int, offset: int, seed: int, value: int) -> None:
    data = _buf(seed, n, offset)
    assert shardstate.crc32c(data, value) == ref_crc32c(data, value)


@SETTINGS
@given(n=st.integers(0, 70000), offset=st.integers(0, 63), seed=st.integers(0, 2**32))
def test_crc32c_accelerated_equals_portable(n: int, offset: int, seed: int) -> None:
    # Lengths up to 70000 reach the 3 x 8 KiB block path; the portable code
    # is checked against the reference above.
    data = _buf(seed, n, offset)
    fast = shardstate.crc32c(data, 12345)
    prev = _core._crc_force_portable(True)
    try:
        assert shardstate.crc32c(data, 12345) == fast
    finally:
        _core._crc_force_portable(prev)


def test_crc32c_rfc3720_vectors(impl: str) -> None:
    assert shardstate.crc32c(bytes(32)) == 0x8A9136AA
    assert shardstate.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert shardstate.crc32c(bytes(range(32))) == 0x46DD794E
    assert shardstate.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert shardstate.crc32c(b"123456789") == 0xE3069283
    assert shardstate.crc32c(b"") == 0
    assert shardstate.crc32(b"123456789") == 0xCBF43926


@SETTINGS
@given(
    n=st.integers(0, 70000),
    seed=st.integers(0, 2**32),
    cuts=st.lists(st.integers(0, 70000), max_size=5),
    value=st.integers(0, 2**32 - 1),
)
def test_running_value_chunked_equals_whole(
    impl: str, n: int, seed: int, cuts: list[int], value: int
) -> None:
    data = _buf(seed, n, 0)
    bounds = [0, *sorted(c % (n + 1) for c in cuts), n]
    for fn in (shardstate.crc32, shardstate.crc32c):
        running = value
        for lo, hi in zip(bounds, bounds[1:]):
            running = fn(data[lo:hi], running)
        assert running == fn(data, value)


@SETTINGS
@given(n=st.integers(0, 70000), seed=st.integers(0, 2**32), cut=st.integers(0, 70000))
def test_combine(impl: str, n: int, seed: int, cut: int) -> None:
    data = _buf(seed, n, 0)
    cut %= n + 1
    a, b = data[:cut], data[cut:]
    assert shardstate.crc32_combine(
        shardstate.crc32(a), shardstate.crc32(b), len(b)
    ) == zlib.crc32(data)
    assert shardstate.crc32c_combine(
        shardstate.crc32c(a), shardstate.crc32c(b), len(b)
    ) == shardstate.crc32c(data)


def test_combine_agrees_with_zlib_on_huge_lengths() -> None:
    # zlib.crc32 has no combine in Python; a run of zero bytes checksummed
    # in pieces must still agree with one computed whole, and combine must
    # handle len2 up to 2**63 - 1 without overflow.
    zeros = bytes(1 << 20)
    z = zlib.crc32(zeros)
    whole = zlib.crc32(zeros * 3)
    two = shardstate.crc32_combine(z, z, len(zeros))
    assert shardstate.crc32_combine(two, z, len(zeros)) == whole
    for fn in (shardstate.crc32_combine, shardstate.crc32c_combine):
        assert fn(0xDEADBEEF, 0, 0) == 0xDEADBEEF
        big = fn(0x12345678, 0x9ABCDEF0, 2**63 - 1)
        assert 0 <= big < 2**32
    with pytest.raises(ValueError, match="len2 must be >= 0"):
        shardstate.crc32_combine(1, 2, -1)
    with pytest.raises(TypeError):
        shardstate.crc32_combine(1, 2)


@pytest.mark.parametrize("fn", [shardstate.crc32, shardstate.crc32c])
def test_buffer_types(impl: str, fn: Callable[..., int]) -> None:
    raw = bytes(random.Random(1).randbytes(4099))
    want = fn(raw)
    assert fn(bytearray(raw)) == want
    assert fn(memoryview(raw)) == want
    arr = np.frombuffer(raw[:4096], dtype=np.uint8).copy()
    assert fn(arr) == fn(raw[:4096])
    # Multi-byte dtypes and several dimensions: the bytes in memory order.
    f32 = arr.view(np.float32).reshape(32, 32)
    assert fn(f32) == fn(f32.tobytes())
    assert fn(memoryview(raw).cast("B", (1, 4099))) == want


@pytest.mark.parametrize("fn", [zlib.crc32, shardstate.crc32, shardstate.crc32c])
def test_non_contiguous_raises_not_crashes(fn: Callable[..., int]) -> None:
    arr = np.arange(1000, dtype=np.uint8)
    # numpy reports a non-contiguous export as ValueError, memoryview as
    # BufferError; zlib.crc32 (listed here) raises exactly the same.
    with pytest.raises((BufferError, TypeError, ValueError), match="contiguous"):
        fn(arr[::2])
    with pytest.raises((BufferError, TypeError, ValueError), match="contiguous"):
        fn(np.asfortranarray(arr.reshape(10, 100)))
    with pytest.raises((BufferError, TypeError, ValueError), match="contiguous"):
        fn(memoryview(bytes(100))[::3])
    with pytest.raises(TypeError):
        fn("not bytes")


def test_same_exceptions_as_zlib() -> None:
    bad = [np.arange(10, dtype=np.uint8)[::2], memoryview(b"abcdef")[::2], "str", None]
    for obj in bad:
        with pytest.raises(Exception) as want:
            zlib.crc32(obj)
        with pytest.raises(want.type):
            shardstate.crc32(obj)
    with pytest.raises(TypeError):
        shardstate.crc32(b"x", 1.5)


@pytest.mark.parametrize("offset", [0, 1, 13])
def test_large_buffer_equals_zlib(offset: int) -> None:
    data = memoryview(np.random.default_rng(offset).bytes((64 << 20) + offset))[offset:]
    assert shardstate.crc32(data) == zlib.crc32(data)
    fast = shardstate.crc32c(data)
    a, b = data[: 40 << 20], data[40 << 20 :]
    assert shardstate.crc32c_combine(shardstate.crc32c(a), shardstate.crc32c(b), len(b)) == fast


def test_large_buffer_portable_crc32c_agrees() -> None:
    data = np.random.default_rng(7).bytes(16 << 20)
    fast = shardstate.crc32c(data)
    prev = _core._crc_force_portable(True)
    try:
        assert shardstate.crc32c(data) == fast
        assert shardstate.crc32(data) == zlib.crc32(data)
    finally:
        _core._crc_force_portable(prev)


def test_threads_while_switching_implementation() -> None:
    # The GIL is released for large buffers and the force-portable switch
    # is atomic: checksums computed while another thread flips it are
    # still right.
    data = np.random.default_rng(3).bytes(1 << 20)
    want32, want32c = zlib.crc32(data), shardstate.crc32c(data)
    errors: list[str] = []
    stop = threading.Event()

    def work() -> None:
        for _ in range(30):
            if shardstate.crc32(data) != want32 or shardstate.crc32c(data) != want32c:
                errors.append("mismatch")

    def flip() -> None:
        on = True
        while not stop.is_set():
            _core._crc_force_portable(on)
            on = not on

    flipper = threading.Thread(target=flip)
    workers = [threading.Thread(target=work) for _ in range(3)]
    flipper.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    flipper.join()
    _core._crc_force_portable(False)
    assert errors == []
