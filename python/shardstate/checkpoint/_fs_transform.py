"""Items written through stream transforms (``FileSystemWriter(_extensions=...)``,
``FileSystemReader(_extension_registry=...)``; the extensions are ``_extension``'s).

On disk, as torch 2.13 writes them: an item's usual bytes (a tensor's
``torch.save`` record, a bytes item's record) passed through the writer's
extensions. With extensions ``[E1, ..., En]`` the bytes go through En's
stream first and E1's last, E1's output is what is stored, and the item's
``_StorageInfo`` gets ``transform_descriptors = [En's, ..., E1's]``: the
order they were applied in. Its offset and length are those of the stored
(transformed) bytes. A writer without extensions leaves the field None (it
is then absent from the pickle), as before.

Writing (``WriterTransforms``): a tensor record is fed to the streams in
the very write calls ``torch.save`` makes (``record_writes``), then
``flush()`` and ``close()``; a bytes item in one write, then ``close()``.
So a transform whose output depends on how its input is split gives
torch's bytes too: zstd's does (the flush ends a block), and so would one
that frames each write.

Reading (``ReaderTransforms``): the stored bytes are read by the engine,
the descriptors made into extensions by the reader's registry (ZStandard is
known by default), and undone outermost first (E1's first). torch 2.13's
reader undoes them in the stored order instead, which is right only for one
extension (or ones that commute): it cannot read its own checkpoints written
with, say, ``[Xor, ZStandard]``; shardstate writes the same bytes and reads
them. A descriptor the registry does not know is refused with an error naming
the item and the descriptors.

Bounds: what the transforms produce is read in pieces into a buffer no
larger than the item may be (``decode``'s ``limit``): for a tensor, the
record of the chunk the metadata describes plus ``_records.RECORD_SLACK``
(``_Records.record_limit``); for a bytes item, ``MAX_BYTES_ITEM``. A stream
that produces more (a zstd bomb) is refused after at most ``limit + 1``
bytes, before the rest is inflated. The record inside is then checked as
any other (its CRC-32s), so a corrupted stored byte is found whether or not
the transform notices it.

Thread safety: the objects serve one save or load at a time.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator, Sequence
from typing import IO, Any, NamedTuple

from ._extension import ExtensionRegistry, StreamTransformExtension
from ._records import StorageFormatError
from ._zipfmt import TensorRecordPlan, _assemble

# The most bytes a bytes item's transforms may produce.
MAX_BYTES_ITEM = 4 << 30
# Pieces in which transformed bytes are read back.
_READ_PIECE = 4 << 20
# Transformed pieces smaller than this are joined before they are written.
_JOIN_BELOW = 64 << 10

# The zip structures torch.save writes in one call each: a local file
# header's fixed part (then its name, then its extra field), and the end
# records (zip64 end of central directory, its locator, end of central
# directory).
_LFH_SIZE = 30
_END_WRITES = (56, 20, 22)


def record_writes(plan: TensorRecordPlan, data: Any, crc: int) -> Iterator[memoryview]:
    """A tensor record (``plan``, its storage bytes ``data`` whose CRC-32 is
    ``crc``) as the buffers torch.save hands to its stream's ``write``, in
    order and of the same kind (read-only byte memoryviews): per zip entry
    its header's fixed part, name and extra field, its payload and its data
    descriptor; the central directory; the three end records. Empty buffers
    are not written (torch writes none)."""
    chunks, _ = _assemble(plan._records, crc)
    entries = len(plan._records) + 1  # and the serialization id
    for i, c in enumerate(chunks):
        if c is None:
            mv = memoryview(data).cast("B").toreadonly()
            if mv.nbytes:
                yield mv
            continue
        mv = memoryview(c)
        if i < 3 * entries and i % 3 == 0:  # local header, name, extra
            name_end = _LFH_SIZE + int.from_bytes(c[26:28], "little")
            cuts = [0, _LFH_SIZE, name_end, len(c)]
        elif i == len(chunks) - 1:  # the end records
            cuts = [0, *itertools.accumulate(_END_WRITES)]
            assert cuts[-1] == len(c)
        else:
            cuts = [0, len(c)]
        for a, b in itertools.pairwise(cuts):
            if b > a:
                yield mv[a:b]


class _Sink(io.RawIOBase):
    """The stream under the outermost transform: keeps the pieces it is
    given (no copy of a bytes object, which zstd's writer gives). Closing
    it only flushes (as torch's writer leaves the file open), so a
    transform that closes its output leaves the bytes here."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[bytes] = []
        self.nbytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        # A transform may reuse its buffer after write returns: keep a copy.
        piece = b if type(b) is bytes else bytes(memoryview(b).cast("B"))
        if piece:
            self.pieces.append(piece)
            self.nbytes += len(piece)
        return len(piece)

    def close(self) -> None:
        self.flush()

    def buffers(self) -> list[bytes]:
        """The pieces in order, runs of small ones joined (fewer, larger
        writes for the engine)."""
        out: list[bytes] = []
        run: list[bytes] = []
        for p in self.pieces:
            if len(p) < _JOIN_BELOW:
                run.append(p)
                continue
            if run:
                out.append(b"".join(run))
                run = []
            out.append(p)
        if run:
            out.append(b"".join(run))
        return out


class Encoded(NamedTuple):
    """An item's stored bytes (``buffers``, back to back: ``nbytes``) and
    its ``transform_descriptors``."""

    buffers: list[bytes]
    nbytes: int
    descriptors: list[str]


class _NoCloseWriter(io.IOBase):
    """The raw stream under a writer's transforms: closing it (which every
    transform's close cascades to) flushes the raw stream but leaves it
    open, as torch's writer does (it appends more items after)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def writeable(self) -> bool:  # (torch's spelling)
        return True

    def write(self, b: Any) -> int:
        return self.raw.write(b)

    def close(self) -> None:
        self.flush()
        self.raw.flush()


class WriterTransforms:
    """A writer's extensions (``FileSystemWriter(_extensions=...)``), and
    how many items it transforms at once (its ``thread_count``). Also
    torch's ``filesystem._StorageWriterTransforms``
    (``transform_save_stream``)."""

    def __init__(self, extensions: Sequence[Any] | None = None, threads: int = 1) -> None:
        extensions = () if extensions is None else extensions
        for ex in extensions:
            if not (callable(getattr(ex, "transform_to", None))
                    and callable(getattr(ex, "get_descriptor", None))):
                raise TypeError(
                    f"FileSystemWriter(_extensions=...) takes StreamTransformExtension "
                    f"instances, got {ex!r}")
        self.extensions = tuple(extensions)
        self.threads = threads

    def _encode(self, writes: Iterator[Any], flush: bool) -> Encoded:
        sink = _Sink()
        stream: IO[bytes] = sink  # type: ignore[assignment]
        for ex in self.extensions:
            stream = ex.transform_to(stream)
        for b in writes:
            stream.write(b)
        if flush:
            stream.flush()
        stream.close()
        return Encoded(sink.buffers(), sink.nbytes,
                       [ex.get_descriptor() for ex in reversed(self.extensions)])

    def transform_save_stream(self, write_item: Any, raw_stream: Any) -> tuple[IO[bytes],
                                                                               list[str]]:
        """torch's API: a stream that writes ``raw_stream`` through every
        extension (closing it never closes ``raw_stream``), and the
        descriptors to store with the item."""
        stream: IO[bytes] = _NoCloseWriter(raw_stream)  # type: ignore[assignment]
        for ex in self.extensions:
            stream = ex.transform_to(stream)
        return stream, [ex.get_descriptor() for ex in reversed(self.extensions)]

    def encode_bytes(self, buf: Any) -> Encoded:
        """A bytes item's stored bytes: its bytes in one write, then close."""
        return self._encode(iter((buf,)), flush=False)

    def encode_record(self, plan: TensorRecordPlan, data: Any, crc: int) -> Encoded:
        """A tensor record's stored bytes: ``record_writes``, flush, close."""
        return self._encode(record_writes(plan, data, crc), flush=True)


class ReaderTransforms:
    """A reader's extension registry (``FileSystemReader(_extension_registry=...)``;
    by default one that knows ZStandard). Also torch's
    ``filesystem._StorageReaderTransforms`` (``transform_load_stream``)."""

    def __init__(self, extension_registry: Any | None = None) -> None:
        self.extension_registry = (ExtensionRegistry() if extension_registry is None
                                   else extension_registry)

    @property
    def registry(self) -> Any:
        return self.extension_registry

    def transform_load_stream(self, read_item: Any, transform_descriptors: Sequence[str],
                              raw_stream: IO[bytes]) -> IO[bytes]:
        """torch's API: ``raw_stream`` read back through the transforms the
        descriptors name."""
        return self._open(transform_descriptors, raw_stream, f"item {read_item}")

    def _open(self, descriptors: Sequence[str], raw: IO[bytes], where: str) -> IO[bytes]:
        try:
            exts = self.registry.from_descriptor_list(list(descriptors))
        except ValueError as e:
            raise StorageFormatError(
                f"{where} was written with stream transforms {list(descriptors)}, which this "
                f"reader cannot undo ({e}); register the extension in the registry passed as "
                "FileSystemReader(_extension_registry=...)") from e
        stream = raw
        for ex in reversed(list(exts)):  # the outermost (applied last) first
            if isinstance(ex, StreamTransformExtension):
                stream = ex.transform_from(stream)
        return stream

    def decode_bytes(self, descriptors: Sequence[str], stored: Any, where: str) -> bytearray:
        """``decode`` for a bytes item: at most ``MAX_BYTES_ITEM`` bytes."""
        return self.decode(descriptors, stored, MAX_BYTES_ITEM, 4 * len(stored) + (64 << 10),
                           where)

    def decode(self, descriptors: Sequence[str], stored: Any, limit: int, hint: int,
               where: str) -> bytearray:
        """The bytes the stored bytes of an item stand for, at most ``limit``
        of them (``hint``: the size expected, to allocate once). Raises
        StorageFormatError when the transforms produce more, or fail."""
        stream = self._open(descriptors, io.BytesIO(stored), where)
        try:
            out = _drain(stream, limit, hint)
        except StorageFormatError:
            raise
        except Exception as e:  # noqa: BLE001 - a transform's own error, named
            raise StorageFormatError(
                f"{where}: undoing its stream transforms {list(descriptors)} failed: "
                f"{type(e).__name__}: {e}") from e
        finally:
            try:
                stream.close()
            except Exception:  # noqa: BLE001, S110 - nothing more to read from it
                pass
        if out is None:
            raise StorageFormatError(
                f"{where}: its stream transforms {list(descriptors)} produce more than "
                f"{limit} bytes, more than the item can hold; refused (a corrupted or "
                "malicious stream)")
        return out


def _drain(stream: IO[bytes], limit: int, hint: int) -> bytearray | None:
    """Reads ``stream`` to its end, or None as soon as it has given more
    than ``limit`` bytes. Into one buffer (``readinto`` where the stream has
    it), grown by doubling from ``hint``, never past ``limit + 1`` bytes."""
    buf = bytearray(min(max(hint, 1), limit) + 1)
    n = 0
    readinto = getattr(stream, "readinto", None)
    while True:
        if n == len(buf):
            if n > limit:
                return None
            buf.extend(bytes(min(n, limit + 1 - n)))
        want = min(len(buf) - n, _READ_PIECE)
        got = None
        if readinto is not None:
            try:
                with memoryview(buf) as mv, mv[n : n + want] as part:
                    got = readinto(part)
            except (NotImplementedError, io.UnsupportedOperation):
                readinto = None  # a stream with only read()
        if readinto is None:
            chunk = stream.read(want)
            got = len(chunk) if chunk else 0
            if got:
                if n + got > len(buf):  # more than asked for
                    if n + got > limit:
                        return None
                    buf.extend(bytes(n + got - len(buf)))
                buf[n : n + got] = chunk
        if not got:
            break
        n += got
    if n > limit:
        return None
    del buf[n:]
    return buf
