"""``HuggingFaceStorageWriter`` / ``HuggingFaceStorageReader``: DCP to and
from Hugging Face safetensors files, with torch 2.13's signatures and files.

The writer makes the files torch's makes for the same plan
(``model-0000i-of-0000N.safetensors``, ``shard-0000r-model-...`` with
``save_distributed``, ``model.safetensors.index.json``, the DCP sharding
info in each file's ``__metadata__``; with ``enable_consolidation`` the
shards in ``path/sharded`` and the full tensors in ``path``), but writes
them with the C engine straight from tensor memory, one engine call per
rank (``_safetensors.write_items``); consolidation is
``_consolidate_hf_safetensors``'s, on the engine too.

The reader needs no ``safetensors`` package: every rank reads and checks
every file's header (``_safetensors.read_header``: bounded, every entry
checked against the file) to build the metadata as torch's reader does (a
file's DCP sharding info gives its chunks' offsets, else each tensor is
whole), and reads, in one engine call, only the byte ranges of the regions
its plan needs, straight into the destinations (another dtype is
converted by torch). Files written by torch, by the ``safetensors``
package, by Hugging Face tools or by us load at any world size.

Thread safety: one instance serves one save or load at a time, as in torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any

import numpy as np

from .. import io as ssio
from .._util import import_torch
from . import _safetensors as st
from ._consolidate_hf_safetensors import (
    _outputs,
    _write_overall_metadata_file,
    consolidate_safetensors_files,
    create_outputs,
)
from ._hf_utils import (
    SHARDED_DIR_NAME,
    SUFFIX,
    _gen_file_name,
    _HFStorageInfo,
    _metadata_fn,
    _saved_offsets,
    _sharding_info,
)
from ._records import _index_key
from .filesystem import FileSystemReader, FileSystemWriter, SerializationFormat
from .metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from .planner import LoadPlan as LoadPlan
from .planner import LoadPlanner as LoadPlanner
from .planner import ReadItem as ReadItem
from .planner import SavePlan as SavePlan
from .planner import SavePlanner as SavePlanner
from .planner import WriteItem as WriteItem
from .storage import WriteResult as WriteResult
from .storage import completed_future

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["HuggingFaceStorageWriter", "HuggingFaceStorageReader"]


# storage_data key of the consolidated layout the ranks write into
_DIRECT_KEY = "_shardstate_consolidated"
# a chunk taking more separate writes than this in its full tensor leaves the
# consolidation to the coordinator after the save
_MAX_RUNS = 1 << 16


def _split_dim(sizes: list[int], full: list[int]) -> int:
    """k: the dims k.. of a chunk are whole in its full tensor, dim k-1 not."""
    k = len(full)
    while k > 0 and sizes[k - 1] == full[k - 1]:
        k -= 1
    return k


def _runs(sizes: list[int], full: list[int]) -> int:
    """How many contiguous byte runs a chunk of ``sizes`` makes in the full
    tensor (C order)."""
    k = _split_dim(sizes, full)
    return 1 if k <= 1 else math.prod(sizes[:k - 1])


def _chunk_jobs(path: str, data_off: int, full: list[int], isz: int, offs: list[int],
                sizes: list[int], buf: Any) -> list[ssio.WriteJob]:
    """Write jobs placing a C-contiguous chunk's bytes ``buf`` at their
    places in the full tensor whose data starts at ``data_off`` of ``path``."""
    if not len(buf):
        return []
    strides = st._c_strides(full, isz)
    base = data_off + sum(o * s for o, s in zip(offs, strides))
    k = _split_dim(sizes, full)
    if k <= 1:
        return [ssio.WriteJob(path, base, buf)]
    outer = sizes[:k - 1]
    run = len(buf) // math.prod(outer)
    idx = np.indices(outer).reshape(len(outer), -1).T
    starts = base + idx @ np.array(strides[:k - 1], np.int64)
    return [ssio.WriteJob(path, int(o), buf[i * run:(i + 1) * run])
            for i, o in enumerate(starts)]


class HuggingFaceStorageWriter(FileSystemWriter):
    """A writer that writes to storage in the huggingface safetensors format.

    ``fqn_to_index_mapping``: tensor FQN -> the index (1..N) of the file it
    goes to (default: one file); ``thread_count``: accepted as torch's
    (the engine's pool does the I/O); ``save_distributed``: every rank
    writes its own shard files; ``enable_consolidation``: shards go to
    ``path/sharded`` and the coordinator writes the full tensors to
    ``path`` in ``finish``; ``thread_count_consolidation`` as torch's."""

    def __init__(
        self,
        path: str,
        fqn_to_index_mapping: dict[str, int] | None = None,
        thread_count: int = 1,
        save_distributed: bool = False,
        enable_consolidation: bool = False,
        thread_count_consolidation: int = 1,
    ) -> None:
        super().__init__(path=path, serialization_format=SerializationFormat.SAFETENSORS,
                         thread_count=thread_count)
        self.fqn_to_index_mapping: dict[str, int] | None = fqn_to_index_mapping
        self.save_distributed: bool = save_distributed
        self.enable_consolidation: bool = enable_consolidation
        self.consolidated_output_path: str | None = None
        if self.enable_consolidation:
            self.consolidated_output_path = str(self.path)
            self.path = self.path / SHARDED_DIR_NAME
        self.thread_count_consolidation = thread_count_consolidation
        # the coordinator's consolidated layout, between prepare_global_plan and finish
        self._direct: tuple[Any, Any, Any] | None = None

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        new_plans = []
        direct = self._plan_direct(plans)
        for i, plan in enumerate(plans, start=1):
            storage_data: dict[str, Any] = {}
            if self.fqn_to_index_mapping is not None:
                storage_data["fqn_to_index_mapping"] = self.fqn_to_index_mapping
            if self.save_distributed:
                storage_data["shard_index"] = i
            if direct is not None:
                storage_data[_DIRECT_KEY] = {
                    it.index.fqn: direct[it.index.fqn] for it in plan.items
                    if it.index.fqn in direct}
            new_plans.append(dataclasses.replace(plan, storage_data=storage_data))
        return new_plans

    def _plan_direct(self, plans: list[Any]) -> dict[str, tuple[str, int, list[int], int]] | None:
        """With save_distributed and enable_consolidation: on the
        coordinator, lays out the consolidated files from the plans (the
        full size and dtype of every tensor), creates them (sized, headers
        written) and returns fqn -> (path, data offset, full size, element
        size) for the ranks to write their chunks in place, straight from
        memory, next to their shard files. None (consolidate after the
        save, torch's way) when a chunk would take too many writes or the
        mapping misses an FQN."""
        self._direct = None
        if not (self.save_distributed and self.enable_consolidation):
            return None
        sizes: dict[str, tuple[list[int], str]] = {}
        order: dict[str, None] = {}
        for plan in plans:
            for it in plan.items:
                if it.type.name == "BYTE_IO":
                    continue
                td = it.tensor_data
                offs, lens = list(td.chunk.offsets), list(td.chunk.sizes)
                try:
                    dtype = st.st_dtype(td.properties.dtype, it.index.fqn)
                except ValueError:
                    return None  # write_data raises it, naming the tensor
                full = [o + n for o, n in zip(offs, lens)]
                old = sizes.get(it.index.fqn)
                if old is not None:
                    full = [max(a, b) for a, b in zip(old[0], full)]
                sizes[it.index.fqn] = (full, dtype)
                order[it.index.fqn] = None
        mapping = (self.fqn_to_index_mapping if self.fqn_to_index_mapping is not None
                   else dict.fromkeys(order, 1))
        if not mapping or any(f not in mapping for f in sizes):
            return None
        for plan in plans:
            for it in plan.items:
                if it.type.name != "BYTE_IO" and _runs(
                        list(it.tensor_data.chunk.sizes),
                        sizes[it.index.fqn][0]) > _MAX_RUNS:
                    return None
        max_index = max(mapping.values())
        outputs = _outputs(str(self.consolidated_output_path),
                           {f: _gen_file_name(i, max_index) for f, i in mapping.items()})
        ssio.makedirs(str(self.consolidated_output_path))
        where, written = create_outputs(outputs, sizes, fsync=self.sync_files)
        self._direct = (outputs, sizes, written)
        return {f: (path, off, sizes[f][0], st.DTYPE_SIZE[sizes[f][1]])
                for f, (path, off) in where.items()}

    def write_data(self, plan: Any, planner: Any) -> Any:
        if len(plan.items) == 0:
            return completed_future([])
        storage_data: dict[str, Any] = plan.storage_data
        storage_plan = storage_data.get("fqn_to_index_mapping")
        shard_index = storage_data.get("shard_index")
        buckets = self._split_by_storage_plan(storage_plan, plan.items)
        highest_index = max(storage_plan.values()) if storage_plan is not None else 1
        files = [(_gen_file_name(i, highest_index, shard_index), items)
                 for i, items in buckets.items()]
        direct = storage_data.get(_DIRECT_KEY)

        def consolidated(pairs: list[tuple[Any, Any]]) -> None:
            # this rank's chunks into the consolidated files, in place,
            # while its shard files are written
            jobs: list[ssio.WriteJob] = []
            for item, buf in pairs:
                path, off, full, isz = direct[item.index.fqn]
                jobs += _chunk_jobs(path, off, full, isz, list(item.tensor_data.chunk.offsets),
                                    list(item.tensor_data.chunk.sizes), buf)
            if jobs:
                ssio.write(jobs, patch=True, fsync=self.sync_files, checksum=False)

        results = st.write_items(self.path, files, planner, self.sync_files,
                                 consolidated if direct else None)
        return completed_future(results)

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        if self.save_distributed and not self.enable_consolidation:
            # each rank's shards hold parts of the same FQNs: no index file
            logger.info("Not consolidating sharded checkpoint in finish step.")
            return
        if self.save_distributed:
            mapping = (self.fqn_to_index_mapping if self.fqn_to_index_mapping is not None
                       else dict.fromkeys(metadata.state_dict_metadata.keys(), 1))
            direct, self._direct = getattr(self, "_direct", None), None
            if direct is not None:
                outputs, sizes, written = direct
                max_index = max(mapping.values())
                want = _outputs(str(self.consolidated_output_path),
                                {f: _gen_file_name(i, max_index) for f, i in mapping.items()})
                if ({p: [f for f in fs if f in sizes] for p, fs in want.items()}
                        == {p: [f for f in fs if f in sizes] for p, fs in outputs.items()}):
                    # the ranks wrote the consolidated files already
                    _write_overall_metadata_file(str(self.consolidated_output_path), written)
                    return None
            # (laid out in another order than the metadata's: written again)
            return consolidate_safetensors_files(
                input_dir=str(self.path), output_dir=self.consolidated_output_path,
                num_threads=self.thread_count_consolidation, fqn_to_index_mapping=mapping)
        storage_md = {}
        total_size = 0
        for wr_list in results:
            storage_md.update({wr.index.fqn: wr.storage_data.relative_path for wr in wr_list})
            total_size += sum(wr.storage_data.length for wr in wr_list)
        text = json.dumps({"metadata": {"total_size": total_size}, "weight_map": storage_md},
                          indent=2)
        ssio.atomic_publish(self.path / _metadata_fn, text.encode(), fsync=self.sync_files)

    def _split_by_storage_plan(self, storage_plan: dict[str, int] | None,
                               items: list[Any]) -> dict[int, list[Any]]:
        if storage_plan is None:
            return {1: items}
        buckets: dict[int, list[Any]] = {}
        for item in items:
            key = item.index.fqn
            if key not in storage_plan:
                raise KeyError(f"{key!r} is not in fqn_to_index_mapping")
            buckets.setdefault(storage_plan[key], []).append(item)
        return buckets

    @property
    def metadata_path(self) -> str:
        return _metadata_fn


class HuggingFaceStorageReader(FileSystemReader):
    """A reader that reads a checkpoint in the huggingface safetensors format
    (every ``*.safetensors`` file directly in ``path``). ``thread_count``
    is accepted as torch's; the engine's pool reads."""

    def __init__(self, path: str, thread_count: int = 1) -> None:
        super().__init__(path=path)
        self.thread_count = thread_count
        self._headers: dict[str, st.Header] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._headers = {}

    def _header(self, path: str) -> st.Header:
        h = self._headers.get(path)
        if h is None:
            h = self._headers[path] = st.read_header(path)
        return h

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        torch = import_torch()
        state_dict_metadata: dict[str, Any] = {}
        storage_data: dict[Any, Any] = {}
        files = sorted(str(self.path / n) for n in os.listdir(self.path) if n.endswith(SUFFIX))
        for path in files:
            header = self._header(path)
            info = _sharding_info(header)
            for e in header.tensors.values():
                offset = _saved_offsets(header, info, e)
                dtype = st.torch_dtype(e.dtype)
                chunk = ChunkStorageMetadata(offsets=torch.Size(offset),
                                             sizes=torch.Size(e.shape))
                md = state_dict_metadata.get(e.name)
                if md is None:
                    state_dict_metadata[e.name] = TensorStorageMetadata(
                        properties=TensorProperties(dtype=dtype),
                        size=torch.Size([s + o for s, o in zip(e.shape, offset)]),
                        chunks=[chunk])
                else:
                    if md.properties.dtype != dtype or len(md.size) != len(e.shape):
                        raise st.SafetensorsError(
                            f"{path}: tensor {e.name!r}: {e.dtype} of {len(e.shape)} dims, "
                            f"another file holds it as {md.properties.dtype} of "
                            f"{len(md.size)} dims")
                    md.chunks.append(chunk)
                    md.size = torch.Size([max(a, s + o)
                                          for a, s, o in zip(md.size, e.shape, offset)])
                index = MetadataIndex(fqn=e.name, offset=offset)
                if index in storage_data:
                    raise st.SafetensorsError(
                        f"{path}: tensor {e.name!r}: the chunk at {offset} is also in "
                        f"{storage_data[index].relative_path}")
                storage_data[index] = _HFStorageInfo(relative_path=path,
                                                     shape=torch.Size(e.shape), dtype=dtype)
        metadata = Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise st.SafetensorsError(f"{self.path}: metadata has no storage_data")
        self.storage_data = {_index_key(k): v for k, v in metadata.storage_data.items()}
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def load_collectives(self, coord: Any) -> None:
        return None  # no shared verification: safetensors has no checksums

    def read_data(self, plan: Any, planner: Any) -> Any:
        regions = []
        for item in plan.items:
            key = _index_key(item.storage_index)
            info = self.storage_data.get(key)
            if info is None:
                raise st.SafetensorsError(
                    f"{self.path}: no safetensors chunk of {key[0]!r} at offsets {key[1]}")
            header = self._header(os.fspath(info.relative_path))
            dest = planner.resolve_tensor(item)
            if hasattr(dest, "detach"):
                dest = dest.detach()
            regions.append((item, dest, st.Region(
                header.path, header.entry(key[0]), tuple(int(o) for o in item.storage_offsets),
                tuple(int(n) for n in item.lengths), dest)))
        self.read_stats = {"storage_bytes": st.read_regions([r for _i, _d, r in regions])}
        for item, dest, _r in regions:
            planner.commit_tensor(item, dest)
        return completed_future(None)
