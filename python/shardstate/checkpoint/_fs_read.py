"""Reading located records into a load's destinations (``_Reads``).

Every host tensor read of a plan is one engine call
(``shardstate.io.read_records``, one table row per item, the GIL released
around the whole call): a region that is one contiguous range of a record's
data and of a same-dtype contiguous destination is read straight into it
(the rest of a partly read record is read by the engine for its CRC only
and the CRCs combined, so every record read is checked whole); any other
region of a same-dtype host destination is read into engine scratch
(checked) and scattered out by the engine. ``verify_checksums=False`` skips
the checks; a record the ranks verify together (its key is in ``shared``)
is not checked whole: the part read is recorded as a piece for
``_fs_verify.verify_pieces``. The rest keeps the Python path: CUDA
destinations through the staging pipeline (``io.read`` batches, ``_direct``)
and other dtypes, conj/neg views or negative-stride destinations through
bounded scratch batches and ``_copy_out`` (``_staged``). Bytes items are
checked (CRC-32s, allowed globals) before ``planner.load_bytes`` sees them.
Items stored through stream transforms are read whole, taken back through
them with a bound on their size, and then checked and copied out the same
way (``_transformed``, ``_fs_transform``).

Thread safety: a ``_Reads`` serves one ``read_data`` call.
"""

from __future__ import annotations

import io
import sys
import zipfile
from typing import Any

import numpy as np

from .. import io as ssio
from .._core import ChecksumError, crc32, crc32_combine
from .._util import contiguous_strides, import_torch, is_contiguous
from ._fs_transform import MAX_BYTES_ITEM, ReaderTransforms
from ._fs_write import _cuda_stage, _device_bytes
from ._pickle import PickleFormatError, UnsafePickleError, loads_object
from ._records import StorageFormatError, _index_key, _Rec, _Records, _Req, transforms
from ._tensors import numpy_dtype, numpy_dtype_name
from .default_planner import _TrustedBytesIO

# Scratch memory a load may hold at once for items that cannot be read in place.
_SCRATCH_BUDGET = 256 << 20
# Pieces in which the unread rest of a partly read record is checksummed.
_PIECE = 16 << 20


def _new_stats() -> dict[str, int]:
    return {"storage_bytes": 0, "broadcast_sent": 0, "broadcast_received": 0}


# Pieces in which a bytes item's entries are read for their CRC-32s.
_CRC_PIECE = 1 << 20


def _check_declared_sizes(zf: zipfile.ZipFile, where: str, restricted: bool) -> None:
    """Refuses, before anything is inflated, a bytes item whose entries are
    compressed (``restricted``: torch.save stores them as they are, and the
    restricted reader reads no other) or declare more than
    ``MAX_BYTES_ITEM`` bytes in all (zipfile never inflates an entry past
    its declared size). So a deflated bomb (1 GiB of zeros in 1 MB) costs
    nothing; a trusted one is inflated in ``_CRC_PIECE`` steps."""
    total = 0
    for info in zf.infolist():
        if restricted and info.compress_type != zipfile.ZIP_STORED:
            raise StorageFormatError(
                f"{where}: bytes item refused: its entry {info.filename!r} is compressed "
                f"(method {info.compress_type}, {info.compress_size} bytes declaring "
                f"{info.file_size}); torch.save stores entries uncompressed, and the "
                "restricted reader inflates none")
        total += info.file_size
        if total > MAX_BYTES_ITEM:
            raise StorageFormatError(
                f"{where}: bytes item refused: its entries declare more than "
                f"{MAX_BYTES_ITEM} bytes, more than a bytes item may hold")


def _check_bytes_record(record: bytes, where: str, restricted: bool = True) -> None:
    """Checks a bytes item (a torch.save zip) before any planner sees it:
    every entry's CRC-32, then (``restricted``) a restricted load of its
    pickle (the same allowlist our planner's load_bytes uses). Raises
    ChecksumError or StorageFormatError; nothing from a refused item is
    imported or called."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(record))
        _check_declared_sizes(zf, where, restricted)
        for info in zf.infolist():
            with zf.open(info) as f:  # zipfile checks each entry's CRC-32 at its end
                while f.read(_CRC_PIECE):
                    pass
    except StorageFormatError:
        raise
    except zipfile.BadZipFile as e:
        if "CRC" in str(e):
            raise ChecksumError(f"{where}: CRC-32 mismatch in bytes item ({e})") from None
        raise StorageFormatError(f"{where}: bytes item is not a torch.save record: {e}") from e
    except Exception as e:  # noqa: BLE001 - zipfile raises more than BadZipFile on bad
        # bytes: UnicodeDecodeError for a name that is not UTF-8, ValueError for an
        # offset before the start, EOFError, NotImplementedError, ...
        raise StorageFormatError(f"{where}: bytes item is not a torch.save record: "
                                 f"{type(e).__name__}: {e}") from e
    if not restricted:
        return
    try:
        loads_object(record)
    except (UnsafePickleError, PickleFormatError) as e:
        raise StorageFormatError(
            f"{where}: bytes item refused: {e}; for a trusted checkpoint only, "
            "FileSystemReader(path, unsafe_unpickle=True) loads it") from e


def _region_bytes(t: Any) -> np.ndarray:
    """A writable zero-copy uint8 view of a contiguous CPU tensor's (or
    ndarray's) elements."""
    if isinstance(t, np.ndarray):
        return t.reshape(-1).view(np.uint8)
    return t.reshape(-1).view(import_torch().uint8).numpy()


def _numpy_region(rec: Any, data: np.ndarray, offsets: Any, lengths: Any) -> np.ndarray:
    """The box offsets/lengths of a record's data, as a NumPy view of the
    scratch bytes (for NumPy destinations, without torch)."""
    dt = numpy_dtype(f"torch.{rec.dtype}")
    if dt is None:
        raise StorageFormatError(
            f"a {rec.dtype} tensor cannot be loaded into a NumPy array (NumPy has no such "
            "dtype); load it into a torch tensor")
    if not data.nbytes:
        src = np.empty(rec.shape, dt)
    else:
        src = np.ndarray(rec.shape, dt, buffer=data, offset=rec.storage_offset * dt.itemsize,
                         strides=[st * dt.itemsize for st in rec.stride])
    return src[tuple(slice(int(o), int(o) + int(n)) for o, n in zip(offsets, lengths))]


def _copy_out(r: _Req, rec: _Rec, data: np.ndarray, dest: Any) -> None:
    """Copies the region ``r`` reads out of a record's storage bytes
    ``data`` into ``dest``: NumPy destinations by NumPy, tensors of the
    record's dtype on the CPU by the C ``copy_region`` (GIL released), any
    other by torch's ``copy_`` (dtype or device conversion)."""
    if isinstance(dest, np.ndarray):
        region = _numpy_region(rec, data, r.item.storage_offsets, r.item.lengths)
        if rec.conj:
            region = np.conj(region)
        if rec.neg:
            region = np.negative(region)
        dest[...] = region
        return
    torch = sys.modules["torch"]  # loaded whenever a destination is a tensor
    dt = getattr(torch, rec.dtype)
    src = torch.from_numpy(data).view(dt) if rec.data_length else torch.empty(0, dtype=dt)
    src = src.as_strided(rec.shape, rec.stride, rec.storage_offset)
    if rec.conj:
        src = src.conj()  # views: copy_ below resolves them
    if rec.neg:
        src = torch._neg_view(src)
    offs = [int(o) for o in r.item.storage_offsets]
    lens = [int(n) for n in r.item.lengths]
    if (not rec.conj and not rec.neg and dest.device.type == "cpu" and dest.dtype == dt
            and src.dim() >= 1
            and dest.numel() and all(st >= 0 for st in src.stride())):
        from ..geometry import copy_region

        copy_region(dest, [0] * len(lens), src, offs, lens)
        return
    for d, (o, ln) in enumerate(zip(offs, lens)):
        src = src.narrow(d, o, ln)
    dest.copy_(src)


def _region(r: _Req) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(storage offsets, lengths) of a tensor read, as tuples of ints."""
    return (tuple(int(o) for o in r.item.storage_offsets),
            tuple(int(n) for n in r.item.lengths))


def _destination(r: _Req, rec: _Rec, planner: Any,
                 region: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> Any:
    """The planner's destination for a tensor read (detached), checked
    against the region the read needs (``_region``) and the record it reads
    from."""
    dest = planner.resolve_tensor(r.item)
    if not isinstance(dest, np.ndarray):
        dest = dest.detach()
    offs, lengths = _region(r) if region is None else region
    if tuple(dest.shape) != lengths:
        raise StorageFormatError(
            f"{r.where()}: destination has shape {tuple(dest.shape)}, the read needs "
            f"{lengths}"
        )
    if len(offs) != len(rec.shape) or any(
        o + n > s for o, n, s in zip(offs, lengths, rec.shape)
    ):
        raise StorageFormatError(
            f"{r.where()}: region offsets {offs} lengths {lengths} fall outside the "
            f"saved chunk of shape {rec.shape}"
        )
    return dest


def _crc_message(r: _Req, rec: _Rec) -> str:
    return (
        f"CRC-32 mismatch in {r.where()}: the tensor data at file offset {rec.data_offset} "
        f"({rec.data_length} bytes) does not match the CRC {rec.data_crc32:08x} stored in "
        "its record"
    )


def _slab(
    rec: _Rec, offs: tuple[int, ...], lengths: tuple[int, ...], itemsize: int
) -> tuple[int, int] | None:
    """(byte offset, byte count) of the region ``offs``/``lengths`` inside a
    record's data when the record is dense row-major and the region is one
    contiguous range of it (the whole chunk, or a slab along its first
    non-unit dimension); None otherwise, and for a conj/neg view's record
    (its bytes are not the values)."""
    if rec.dense and lengths == rec.shape and not any(offs):
        return 0, rec.data_length  # the whole record (the caller checked the dtype)
    if rec.storage_offset or rec.conj or rec.neg or not is_contiguous(rec.shape, rec.stride):
        return None
    d = len(rec.shape) - 1
    while d >= 0 and offs[d] == 0 and lengths[d] == rec.shape[d]:
        d -= 1
    if any(lengths[i] != 1 for i in range(d)):
        return None
    stride = contiguous_strides(rec.shape)
    count = 1
    for n in lengths:
        count *= n
    start = sum(o * s for o, s in zip(offs, stride)) * itemsize
    if start + count * itemsize > rec.data_length:
        return None
    return start, count * itemsize


def _scatterable(rec: _Rec, dest: Any) -> bool:
    """Whether the engine can copy a region of ``rec`` into ``dest`` (a
    host destination of the record's dtype, strides >= 0, no conj/neg
    view); the others go through ``_copy_out``."""
    if rec.conj or rec.neg or len(rec.shape) > 64:
        return False
    if isinstance(dest, np.ndarray):
        return (dest.dtype.byteorder in "=|" and all(s >= 0 for s in dest.strides)
                and numpy_dtype_name(dest.dtype) == f"torch.{rec.dtype}")
    return dest.device.type == "cpu" and str(dest.dtype) == f"torch.{rec.dtype}"


def _host_layout(dest: Any) -> tuple[int, int, int, list[int]]:
    """(element size, address, bytes from it the destination may reach,
    byte strides) of a host destination ``_scatterable`` accepted."""
    if isinstance(dest, np.ndarray):
        isz = dest.itemsize
        strides = list(dest.strides)
        reach = isz + sum((n - 1) * s for n, s in zip(dest.shape, strides)) if dest.size else 0
        return isz, dest.ctypes.data, reach, strides
    isz = dest.element_size()
    reach = dest.untyped_storage().nbytes() - dest.storage_offset() * isz
    return isz, dest.data_ptr(), reach, [s * isz for s in dest.stride()]


class _CudaDest:
    """Which CUDA destinations a load reads into through the staging
    pipeline (pinned buffers, then host-to-device copies straight into
    them): those of the first device seen, when the CUDA runtime loads (the
    rest go through host memory). One per load."""

    def __init__(self) -> None:
        self.device: Any = None
        self.stage: Any = None

    def direct(self, dest: Any) -> bool:
        if not getattr(dest, "is_cuda", False):
            return False
        if self.device is None:
            self.device, self.stage = dest.device, _cuda_stage(dest.device)
        return self.stage is not None and dest.device == self.device


class _Reads:
    """One ``read_data``'s reads: ``stats`` counts the storage bytes read
    (the broadcast counts are the exchange's), ``pieces`` collects the
    checksummed parts of the shared chunks (keys in ``shared``)."""

    def __init__(self, records: _Records, verify: bool, unsafe_unpickle: bool,
                 cuda: _CudaDest, shared: frozenset = frozenset(),
                 transforms: ReaderTransforms | None = None) -> None:
        self.records = records
        self.verify = verify
        self.unsafe_unpickle = unsafe_unpickle
        self.cuda = cuda
        self.shared = shared
        self.transforms = ReaderTransforms() if transforms is None else transforms
        self.stats = _new_stats()
        self.pieces: list[tuple] = []

    def local(self, reqs: list[_Req], planner: Any) -> None:
        """Reads these items from storage and commits them to the planner."""
        transformed = [r for r in reqs if transforms(r.info)]
        if transformed:
            self._transformed(transformed, planner)
            reqs = [r for r in reqs if not transforms(r.info)]
        byte_reqs = [r for r in reqs if r.item.type.name == "BYTE_IO"]
        tensor_reqs = [r for r in reqs if r.item.type.name != "BYTE_IO"]
        if byte_reqs:
            self._bytes(byte_reqs, planner)
        if tensor_reqs:
            self._tensors(tensor_reqs, planner)

    def _bytes(self, reqs: list[_Req], planner: Any) -> None:
        """Reads every bytes item in one batch, checks each record (CRC-32s,
        allowed globals) and hands it to ``planner.load_bytes``."""
        bufs = [bytearray(r.info.length) for r in reqs]
        self.stats["storage_bytes"] += sum(len(b) for b in bufs)
        ssio.read([ssio.ReadJob(r.file.path, r.info.offset, b) for r, b in zip(reqs, bufs)],
                  checksum=False)
        for r, b in zip(reqs, bufs):
            self._load_bytes(r, bytes(b), planner)

    def _load_bytes(self, r: _Req, record: bytes, planner: Any) -> None:
        _check_bytes_record(record, r.where(), restricted=not self.unsafe_unpickle)
        planner.load_bytes(r.item, _TrustedBytesIO(record) if self.unsafe_unpickle
                           else io.BytesIO(record))

    def _transformed(self, reqs: list[_Req], planner: Any) -> None:
        """Items stored through stream transforms (``_fs_transform``): their
        stored bytes read in batches of bounded size, then each item's
        record taken back through its transforms (at most the size the item
        may have) and checked as any other (CRC-32s; a bytes item's
        pickle), its region copied out of it."""
        k = 0
        while k < len(reqs):
            n, used = 0, 0
            while k + n < len(reqs) and (
                n == 0 or used + reqs[k + n].info.length <= _SCRATCH_BUDGET
            ):
                used += reqs[k + n].info.length
                n += 1
            batch = reqs[k : k + n]
            stored = [bytearray(r.info.length) for r in batch]
            self.stats["storage_bytes"] += used
            ssio.read([ssio.ReadJob(r.file.path, r.info.offset, b)
                       for r, b in zip(batch, stored)], checksum=False)
            for r, b in zip(batch, stored):
                where = r.where()
                descriptors = transforms(r.info)
                if r.item.type.name == "BYTE_IO":
                    self._load_bytes(r, bytes(self.transforms.decode_bytes(descriptors, b, where)),
                                     planner)
                    continue
                limit, size = self.records.record_limit(r)
                record = self.transforms.decode(descriptors, b, limit, size, where)
                rec = self.records.parse_buffer(record, r)
                data = np.frombuffer(record, np.uint8, rec.data_length, rec.data_offset)
                if self.verify and rec.checked and crc32(data) != rec.data_crc32:
                    raise ChecksumError(
                        f"CRC-32 mismatch in {where}: the tensor data its stream transforms "
                        f"{list(descriptors)} give ({rec.data_length} bytes at offset "
                        f"{rec.data_offset} of the record) does not match the CRC "
                        f"{rec.data_crc32:08x} stored in its record")
                dest = _destination(r, rec, planner)
                _copy_out(r, rec, data, dest)
                planner.commit_tensor(r.item, dest)
            k += n

    def _tensors(self, reqs: list[_Req], planner: Any) -> None:
        infos = self.records.parse(reqs)
        if self.verify and not all(rec.checked for rec in infos):
            # Records torch wrote with set_crc32_options(False) carry no
            # CRC-32 to check their data against: read them without one.
            self._tensors_of([(r, rec) for r, rec in zip(reqs, infos) if rec.checked], planner)
            self.verify = False
            try:
                self._tensors_of([(r, rec) for r, rec in zip(reqs, infos) if not rec.checked],
                                 planner)
            finally:
                self.verify = True
            return
        self._tensors_of(list(zip(reqs, infos)), planner)

    def _tensors_of(self, located: list[tuple[_Req, _Rec]], planner: Any) -> None:
        if not located:
            return
        # (req, record, destination, (byte offset, byte count) in the record's
        # data) for regions read straight into their destination: host ones
        # through the engine's record reads, device ones through the stage.
        direct: list[tuple[_Req, _Rec, Any, tuple[int, int]]] = []
        device: list[tuple[_Req, _Rec, Any, tuple[int, int]]] = []
        # read into engine scratch and scattered out by the engine
        scatter: list[tuple[_Req, _Rec, Any, tuple[tuple[int, ...], tuple[int, ...]]]] = []
        staged: list[tuple[_Req, _Rec, Any]] = []
        for r, rec in located:
            offs, lengths = region = _region(r)
            dest = _destination(r, rec, planner, region)
            span = None
            if isinstance(dest, np.ndarray):
                same = (dest.dtype.byteorder in "=|"
                        and numpy_dtype_name(dest.dtype) == f"torch.{rec.dtype}")
                if same and dest.flags.c_contiguous:
                    span = _slab(rec, offs, lengths, dest.itemsize)
            elif (
                str(dest.dtype) == f"torch.{rec.dtype}"
                and dest.is_contiguous()
                and (dest.device.type == "cpu" or self.cuda.direct(dest))
            ):
                span = _slab(rec, offs, lengths, dest.element_size())
            if span is not None:
                (device if getattr(dest, "is_cuda", False) else direct).append(
                    (r, rec, dest, span))
            elif _scatterable(rec, dest):
                scatter.append((r, rec, dest, region))
            else:
                staged.append((r, rec, dest))
        self._records_read(direct, scatter)
        for r, _rec, dest, _x in direct + scatter:
            planner.commit_tensor(r.item, dest)
        self._direct(device)
        for r, _rec, dest, _span in device:
            planner.commit_tensor(r.item, dest)
        self._staged(staged, planner)

    def _records_read(self, direct: list[tuple[_Req, _Rec, Any, tuple[int, int]]],
                      scatter: list[tuple[_Req, _Rec, Any, Any]]) -> None:
        """Host reads, one engine call (``shardstate.io.read_records``): a
        region that is one range of a record's data straight into its
        destination (the whole record's CRC checked: the rest read into
        engine scratch, unless the ranks verify the record together), any
        other of a same-dtype host destination into engine scratch
        (checked) and scattered out by the engine."""
        direct = [x for x in direct if x[3][1]]
        if not direct and not scatter:
            return
        verify = self.verify
        files: dict[str, int] = {}
        rows: list[tuple[int, ...]] = []
        geom: list[int] = []
        read = 0
        for r, rec, dest, (start, count) in direct:
            f = files.setdefault(r.file.path, len(files))
            full = count == rec.data_length
            whole = verify and (full or not self._is_shared(r))
            if isinstance(dest, np.ndarray):
                addr = dest.ctypes.data
            else:
                addr = dest.data_ptr()
            rows.append((f, ssio.REC_RANGE, rec.data_offset, rec.data_length, rec.data_crc32,
                         whole, addr, dest.nbytes, start, count, 0, 0, 0, 0))
            read += rec.data_length if whole else count
        for r, rec, dest, (offs, lengths) in scatter:
            f = files.setdefault(r.file.path, len(files))
            isz, addr, dst_len, dst_strides = _host_layout(dest)
            src_strides = [st * isz for st in rec.stride]
            src_off = (rec.storage_offset + sum(o * st for o, st in zip(offs, rec.stride))) * isz
            rows.append((f, ssio.REC_SCATTER, rec.data_offset, rec.data_length, rec.data_crc32,
                         0, addr, dst_len, 0, 0, len(lengths), isz, src_off, len(geom)))
            geom += lengths
            geom += src_strides
            geom += dst_strides
            read += rec.data_length
        items = [(r, rec) for r, rec, _d, _x in direct] + [(r, rec) for r, rec, _d, _x in scatter]
        self.stats["storage_bytes"] += read
        try:
            crcs = ssio.read_records(list(files), np.array(rows, np.int64).reshape(-1, 14),
                                     np.array(geom, np.int64), verify=verify, checksum=False,
                                     scratch=_SCRATCH_BUDGET)
        except ChecksumError as e:
            k = getattr(e, "job", None)
            if not isinstance(k, int) or not 0 <= k < len(items):
                raise
            raise ChecksumError(_crc_message(*items[k])) from e
        if not verify or not self.shared:
            return
        for i, (r, rec, _d, (start, count)) in enumerate(direct):
            if self._is_shared(r):
                full = count == rec.data_length
                self._add_piece(r, rec, start, count, rec.data_crc32 if full else int(crcs[i]))
        for r, rec, _d, _x in scatter:
            if rec.data_length and self._is_shared(r):
                self._add_piece(r, rec, 0, rec.data_length, rec.data_crc32)

    def _direct(self, items: list[tuple[_Req, _Rec, Any, tuple[int, int]]]) -> None:
        """One batch reads every region straight into its destination. A
        whole record's CRC is checked by the engine; for part of a record the
        rest of it is read (in bounded pieces, checksummed only) and the
        pieces' CRCs combined."""
        items = [x for x in items if x[3][1]]
        verify = self.verify
        jobs, whole = [], []
        for r, rec, dest, (start, count) in items:
            is_whole = count == rec.data_length
            whole.append(is_whole)
            on_device = getattr(dest, "is_cuda", False)
            out = (_device_bytes(dest, dest.storage_offset() * dest.element_size(), dest.nbytes)
                   if on_device else _region_bytes(dest))
            jobs.append(ssio.ReadJob(r.file.path, rec.data_offset + start, out,
                                     rec.data_crc32 if verify and is_whole else None,
                                     device=on_device))
        partial = verify and not all(whole)
        crcs = self.run(jobs, [(r, rec) for r, rec, _d, _s in items], checksum=partial)
        if not verify:
            return
        shared = [self._is_shared(r) for r, _rec, _d, _s in items]
        for i, (r, rec, _d, (start, count)) in enumerate(items):
            if shared[i]:
                self._add_piece(r, rec, start, count, rec.data_crc32 if whole[i] else crcs[i])
        if not partial:
            return
        # The rest of each partly read record (unless the ranks verify it
        # together): (item, start, length) pieces.
        rest: list[tuple[int, int, int]] = []
        for i, (_r, rec, _d, (start, count)) in enumerate(items):
            if whole[i] or shared[i]:
                continue
            for a, b in ((0, start), (start + count, rec.data_length)):
                for p in range(a, b, _PIECE):
                    rest.append((i, p, min(_PIECE, b - p)))
        piece_crc: dict[tuple[int, int], int] = {}
        k = 0
        while k < len(rest):
            n, used = 0, 0
            while k + n < len(rest) and (n == 0 or used + rest[k + n][2] <= _SCRATCH_BUDGET):
                used += rest[k + n][2]
                n += 1
            scratch = np.empty(used, np.uint8)
            batch, pos = [], 0
            for i, p, ln in rest[k : k + n]:
                r, rec = items[i][0], items[i][1]
                batch.append(ssio.ReadJob(r.file.path, rec.data_offset + p,
                                          scratch[pos : pos + ln]))
                pos += ln
            self.stats["storage_bytes"] += used
            for (i, p, _ln), c in zip(rest[k : k + n], ssio.read(batch, checksum=True)):
                piece_crc[(i, p)] = c
            k += n
        for i, (r, rec, _d, (start, count)) in enumerate(items):
            if whole[i] or shared[i]:
                continue
            acc = 0
            for p in range(0, start, _PIECE):
                acc = crc32_combine(acc, piece_crc[(i, p)], min(_PIECE, start - p))
            acc = crc32_combine(acc, crcs[i], count)
            end = start + count
            for p in range(end, rec.data_length, _PIECE):
                acc = crc32_combine(acc, piece_crc[(i, p)], min(_PIECE, rec.data_length - p))
            if acc != rec.data_crc32:
                raise ChecksumError(_crc_message(r, rec))

    def _staged(self, items: list[tuple[_Req, _Rec, Any]], planner: Any) -> None:
        """Items that need a copy (strided records or destinations, another
        dtype or device): each record's storage is read whole (so its CRC is
        checked) into scratch, in batches of bounded size, then copied."""
        k = 0
        while k < len(items):
            n, used = 0, 0
            while k + n < len(items) and (
                n == 0 or used + items[k + n][1].data_length <= _SCRATCH_BUDGET
            ):
                used += items[k + n][1].data_length
                n += 1
            batch = items[k : k + n]
            scratch = [np.empty(rec.data_length, np.uint8) for _r, rec, _d in batch]
            jobs = [
                ssio.ReadJob(r.file.path, rec.data_offset, s,
                             rec.data_crc32 if self.verify else None)
                for (r, rec, _d), s in zip(batch, scratch)
                if rec.data_length
            ]
            self.run(jobs, [(r, rec) for r, rec, _d in batch if rec.data_length])
            if self.verify:
                for r, rec, _d in batch:
                    if rec.data_length and self._is_shared(r):
                        self._add_piece(r, rec, 0, rec.data_length, rec.data_crc32)
            for (r, rec, dest), s in zip(batch, scratch):
                _copy_out(r, rec, s, dest)
                planner.commit_tensor(r.item, dest)
            k += n

    def _is_shared(self, r: _Req) -> bool:
        return bool(self.shared) and _index_key(r.item.storage_index) in self.shared

    def _add_piece(self, r: _Req, rec: _Rec, start: int, count: int, crc: int) -> None:
        """One checksummed range of a shared chunk's record, for verify_pieces."""
        # keyed by the storage path, the same on every rank (a local copy's
        # path is not: an object store's records are read from per-rank copies)
        self.pieces.append((_index_key(r.item.storage_index), r.file.rel, rec.data_offset,
                            rec.data_length, rec.data_crc32, start, count, crc,
                            self.records.display(r.where())))

    def run(
        self, jobs: list[ssio.ReadJob], reqs: list[tuple[_Req, _Rec]], checksum: bool = False
    ) -> list[int]:
        """One engine batch; a CRC mismatch is reported naming its item."""
        if not jobs:
            return []
        self.stats["storage_bytes"] += sum(
            j.out.nbytes if j.device else memoryview(j.out).nbytes for j in jobs)
        stage = self.cuda.stage if any(j.device for j in jobs) else None
        try:
            return ssio.read(jobs, verify=self.verify, checksum=checksum, stage=stage)
        except ChecksumError as e:
            k = getattr(e, "job", None)
            if not isinstance(k, int) or not 0 <= k < len(reqs):
                raise
            raise ChecksumError(_crc_message(*reqs[k])) from e
