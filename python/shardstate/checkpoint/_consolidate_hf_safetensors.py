"""torch 2.13's ``_consolidate_hf_safetensors``: sharded safetensors files
(written with DCP's sharding info) made into full-tensor files.

``consolidate_safetensors_files`` writes the files torch's writes, byte for
byte (the header as ``json.dumps`` makes it, tensors in the mapping's
order, no padding, no ``__metadata__``) and the same
``model.safetensors.index.json``. The work runs on the C engine: every
input header is read and checked (``_safetensors.read_header``), each
output file is sized, its header written, and its data filled by one
engine read that scatters each shard's bytes straight into the mapped file
pages, at their place in the full tensor. Unlike torch's, integer dtypes work (torch
sizes elements with ``torch.finfo``) and an FQN of the mapping found in no
input file is left out instead of written as an empty entry.

Thread safety: functions only.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import mmap
import os
import time
from typing import Any

import numpy as np

from .. import io as ssio
from .._util import pwrite_all
from . import _safetensors as st
from ._hf_utils import (
    CUSTOM_METADATA_KEY,
    SUFFIX,
    _gen_file_name,
    _metadata_fn,
    _saved_offsets,
    _sharding_info,
)

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["consolidate_safetensors_files", "consolidate_safetensors_files_on_every_rank"]


def _inputs(input_dir: str) -> tuple[dict[str, tuple[list[int], str]],
                                     dict[str, list[tuple[st.Header, st.TensorEntry, list[int]]]]]:
    """Every input file's chunks: fqn -> (full size, dtype) and fqn ->
    [(header, entry, saved offsets)]."""
    sizes: dict[str, tuple[list[int], str]] = {}
    chunks: dict[str, list[tuple[st.Header, st.TensorEntry, list[int]]]] = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(input_dir), f"*{SUFFIX}"))):
        header = st.read_header(path)
        text = (header.metadata or {}).get(CUSTOM_METADATA_KEY)
        if not text:
            raise ValueError(
                f"{path}: No DCP custom metadata found in safetensors file. The file must be "
                "saved with DCP to be consolidated.")
        info = _sharding_info(header)
        for e in header.tensors.values():
            offs = _saved_offsets(header, info, e)
            full = [s + o for s, o in zip(e.shape, offs)]
            if e.name not in sizes:
                sizes[e.name] = (full, e.dtype)
            else:
                cur, dtype = sizes[e.name]
                if dtype != e.dtype or len(cur) != len(full):
                    raise st.SafetensorsError(
                        f"{path}: tensor {e.name!r}: {e.dtype} of {len(full)} dims, another "
                        f"file holds it as {dtype} of {len(cur)} dims")
                sizes[e.name] = ([max(a, b) for a, b in zip(cur, full)], dtype)
            chunks.setdefault(e.name, []).append((header, e, offs))
    return sizes, chunks


def _write_output(path: str, fqns: list[str], sizes: dict[str, tuple[list[int], str]],
                  chunks: dict[str, list[tuple[st.Header, st.TensorEntry, list[int]]]],
                  threads: int | None) -> dict[str, int]:
    """One consolidated file, sized up front and mapped: its header is
    written, then one engine read scatters every input chunk straight into
    the mapped file pages (one copy, no staging buffer); fsynced. Returns
    fqn -> its data bytes."""
    fqns = [f for f in fqns if f in sizes]
    nbytes = {f: math.prod(sizes[f][0]) * st.DTYPE_SIZE[sizes[f][1]] for f in fqns}
    header, offs, _order = st.build_header(
        [(f, sizes[f][1], sizes[f][0]) for f in fqns], None, sort=False, align=False,
        compact=False)
    total = len(header) + sum(nbytes.values())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        os.ftruncate(fd, total)
        pwrite_all(fd, header, 0)
        if total > len(header):
            mm = mmap.mmap(fd, total)
            try:
                view = np.frombuffer(mm, np.uint8)
                _scatter(view.ctypes.data, total, len(header), fqns, offs, sizes, chunks,
                         threads)
                del view
            finally:
                mm.close()
        os.fsync(fd)
    finally:
        os.close(fd)
    return nbytes


def _scatter(base: int, size: int, data_start: int, fqns: list[str], offs: list[int],
             sizes: dict[str, tuple[list[int], str]],
             chunks: dict[str, list[tuple[st.Header, st.TensorEntry, list[int]]]],
             threads: int | None) -> None:
    """Reads every chunk of ``fqns`` into its place in memory at ``base``
    (``size`` bytes; tensor i's data at ``data_start + offs[i]``), one
    engine call."""
    files: dict[str, int] = {}
    rows: list[tuple[int, ...]] = []
    geom: list[int] = []
    for fqn, off in zip(fqns, offs):
        full, dtype = sizes[fqn]
        strides = st._c_strides(full, st.DTYPE_SIZE[dtype])
        for header, e, saved in chunks[fqn]:
            start = data_start + off + sum(o * s for o, s in zip(saved, strides))
            f = files.setdefault(header.path, len(files))
            st._region_rows(f, e, [0] * len(e.shape), list(e.shape), base + start,
                            size - start, strides, rows, geom)
    if rows:
        ssio.read_records(list(files), np.array(rows, np.int64).reshape(-1, 14),
                          np.array(geom, np.int64), verify=False, checksum=False,
                          scratch=st._SCRATCH, threads=threads)


def _outputs(output_dir: str, fqn_to_file: dict[str, str]) -> dict[str, list[str]]:
    """Output path -> its FQNs, in the mapping's order (torch's)."""
    outputs: dict[str, list[str]] = {}
    for fqn, name in fqn_to_file.items():
        outputs.setdefault(os.path.join(output_dir, name), []).append(fqn)
    return outputs


def create_outputs(outputs: dict[str, list[str]], sizes: dict[str, tuple[list[int], str]],
                   fsync: bool = True) -> tuple[dict[str, tuple[str, int]],
                                                dict[str, dict[str, int]]]:
    """Creates the consolidated files for tensors of known full sizes and
    dtypes, each sized and its header written, the data left to be written
    in place (HuggingFaceStorageWriter's ranks write their chunks there).
    Returns fqn -> (path, file offset of its data) and what
    ``_write_overall_metadata_file`` takes."""
    where: dict[str, tuple[str, int]] = {}
    written: dict[str, dict[str, int]] = {}
    for path, fqns in outputs.items():
        fqns = [f for f in fqns if f in sizes]
        header, offs, _order = st.build_header(
            [(f, sizes[f][1], sizes[f][0]) for f in fqns], None, sort=False, align=False,
            compact=False)
        nbytes = {f: math.prod(sizes[f][0]) * st.DTYPE_SIZE[sizes[f][1]] for f in fqns}
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            os.ftruncate(fd, len(header) + sum(nbytes.values()))
            pwrite_all(fd, header, 0)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        for f, off in zip(fqns, offs):
            where[f] = (path, len(header) + off)
        written[path] = nbytes
    return where, written


def _consolidate(input_dir: str, output_dir: str, fqn_to_file: dict[str, str],
                 num_threads: int) -> dict[str, dict[str, int]]:
    sizes, chunks = _inputs(input_dir)
    outputs = _outputs(output_dir, fqn_to_file)
    threads = num_threads if num_threads > 1 else None
    ssio.makedirs(output_dir)
    return {path: _write_output(path, fqns, sizes, chunks, threads)
            for path, fqns in outputs.items()}


def _write_overall_metadata_file(output_dir: str, written: dict[str, dict[str, int]]) -> None:
    total_size = 0
    weight_map = {}
    for path, fqns in written.items():
        for fqn, n in fqns.items():
            total_size += n
            weight_map[fqn] = os.path.basename(path)
    text = json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map},
                      indent=2)
    ssio.atomic_publish(os.path.join(output_dir, _metadata_fn), text.encode(), fsync=True)


def consolidate_safetensors_files(
    input_dir: str,
    output_dir: str,
    fqn_to_index_mapping: dict[str, int],
    num_threads: int = 1,
) -> None:
    """Consolidates the sharded safetensors files in ``input_dir`` into
    ``output_dir``: each FQN's full tensor in file ``fqn_to_index_mapping[fqn]``
    (``model-0000i-of-0000N.safetensors``), plus ``model.safetensors.index.json``."""
    start = time.time()
    max_index = max(fqn_to_index_mapping.values())
    fqn_to_file = {fqn: _gen_file_name(idx, max_index)
                   for fqn, idx in fqn_to_index_mapping.items()}
    written = _consolidate(input_dir, output_dir, fqn_to_file, num_threads)
    _write_overall_metadata_file(output_dir, written)
    logger.info("Done consolidating. Took %.2f secs.", time.time() - start)


def consolidate_safetensors_files_on_every_rank(
    input_dir: str,
    output_dir: str,
    fqn_to_index_mapping: dict[str, int],
    num_threads: int = 1,
    process_group: Any = None,
) -> None:
    """As torch's: each rank writes the output files whose index ``% world
    size`` is its rank; rank 0 writes the index file."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank(group=process_group)
        world_size = dist.get_world_size(group=process_group)
    else:
        logger.warning("Distributed environment not initialized. Running in single process "
                       "mode.")
        rank, world_size = 0, 1
    indices = set(fqn_to_index_mapping.values())
    mine = {fqn: idx for fqn, idx in fqn_to_index_mapping.items() if idx % world_size == rank}
    written: dict[str, dict[str, int]] = {}
    if mine:
        max_index = max(indices)
        written = _consolidate(input_dir, output_dir,
                               {f: _gen_file_name(i, max_index) for f, i in mine.items()},
                               num_threads)
    if dist.is_available() and dist.is_initialized():
        gathered: list[Any] | None = [{} for _ in range(world_size)] if rank == 0 else None
        dist.gather_object(written, gathered, dst=0, group=process_group)
        if rank == 0:
            assert gathered is not None
            merged: dict[str, dict[str, int]] = {}
            for part in gathered:
                merged.update(part)
            _write_overall_metadata_file(output_dir, merged)
        dist.barrier(group=process_group)
    else:
        _write_overall_metadata_file(output_dir, written)
