"""Converting between DCP checkpoints and torch.save files (torch 2.13's
``format_utils``: the same names, signatures and results).

* :func:`dcp_to_torch_save` reads a checkpoint through shardstate's
  FileSystemReader (the C engine, every record's checksum verified) with
  ``_EmptyStateDictLoadPlanner`` and writes torch.save's file (its pickle
  made by torch's own pickler, the storages written by the engine straight
  from memory: ``_torchsave``), atomically: the file appears whole or not
  at all.
* :func:`torch_save_to_dcp` reads a torch.save file (the pickle through
  torch's restricted weights-only unpickler, the storages read by the
  engine into place with their CRC-32s checked: ``_torchsave``) and saves
  it with shardstate's save (torch's files, byte for byte).
* :class:`BroadcastingTorchSaveReader` with :class:`DynamicMetaLoadPlanner`
  loads a torch.save file into a distributed state dict: the coordinator
  reads the file and each tensor is broadcast to every rank, which keeps
  the parts it holds.

Deliberate differences from torch:

* a torch.save file is read with ``torch.load(weights_only=True)``, never a
  full unpickler (torch uses ``weights_only=False``): one holding other
  objects is refused with an ``UnsafePickleError`` that names the file and
  the object; bytes items of a checkpoint go through the planner's
  restricted ``loads``, as for any load;
* the broadcasting reader agrees on what the file holds before any tensor
  moves: a key missing from the file, a non-tensor or a shape that differs
  from the destination's is one error on every rank (torch's coordinator
  fails alone and leaves the others in a broadcast); every rank receives
  each tensor in the file's dtype and shape and copies out what it holds,
  so a destination of another dtype gets the converted values everywhere
  and a sharded destination (a DTensor, a ShardedTensor) its own part
  (torch's other ranks receive into a buffer shaped like their destination:
  wrong values for another dtype, a hang for a sharded one); without a
  process group it loads in the one process (torch's needs one);
* ``dcp_to_torch_save`` publishes its output atomically.
"""

from __future__ import annotations

import argparse
import os
import pickle
import uuid
from enum import Enum
from typing import Any

from .. import comm
from .._util import import_torch
from . import _tensors, _torchsave
from ._dist import _Coordinator, dist_ready
from ._nested_dict import flatten_state_dict
from ._pickle import UnsafePickleError
from ._setup import _coordinator, _tool_reader, _tool_writer
from .default_planner import DefaultLoadPlanner, DefaultSavePlanner, _EmptyStateDictLoadPlanner
from .filesystem import FileSystemReader, FileSystemWriter  # noqa: F401 - torch's module has them
from .metadata import STATE_DICT_TYPE, Metadata, TensorProperties, TensorStorageMetadata
from .planner import LoadItemType, LoadPlan, LoadPlanner
from .planner_helpers import _create_chunk_list
from .state_dict_loader import _load_state_dict
from .state_dict_saver import _save_state_dict
from .storage import StorageReader

__all__ = [
    "BroadcastingTorchSaveReader",
    "DynamicMetaLoadPlanner",
    "dcp_to_safetensors",
    "dcp_to_torch_save",
    "safetensors_to_dcp",
    "torch_save_to_dcp",
]


def _load_torch_save(path: str | os.PathLike) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``, the
    storages read by the engine (``_torchsave.load``); a file its restricted
    unpickler refuses raises UnsafePickleError naming the file and what was
    refused."""
    try:
        return _torchsave.load(path)
    except pickle.UnpicklingError as e:
        text = str(e)
        # torch's message is long; its "WeightsUnpickler error:" line says what.
        why = next((line.strip() for line in text.splitlines() if "WeightsUnpickler" in line),
                   text.strip().splitlines()[0] if text.strip() else type(e).__name__)
        raise UnsafePickleError(
            f"{os.fspath(path)}: torch.load(weights_only=True) refused this torch.save file "
            f"({why}); shardstate never reads a torch.save file with a full unpickler. If "
            "you trust the file, allow its classes with "
            "torch.serialization.add_safe_globals([...]) and convert again."
        ) from e


def _save_atomically(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``'s file, its storages written by the engine
    (``_torchsave.save``), published with the durable-write recipe: a
    temporary file in the same directory, fsynced, renamed over ``path``,
    then the directory fsynced. On failure nothing is left behind."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    # Created as torch.save would create it (0666 less the umask), not mkstemp's 0600.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        os.close(fd)
        # the zip folder named as torch.save names it: after the final file
        _torchsave.save(obj, tmp, archive=_torchsave._archive_name(path))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def dcp_to_torch_save(
    dcp_checkpoint_dir: str | os.PathLike,
    torch_save_path: str | os.PathLike,
    *,
    unsafe_unpickle: bool = False,
) -> None:
    """Convert the DCP checkpoint in ``dcp_checkpoint_dir`` (a directory or
    an fsspec URL) into a torch.save file at ``torch_save_path`` (a path, or a writable binary
    file object): the state dict as it was saved, nested, tensors on CPU.

    The whole checkpoint is loaded into this process (run it on one rank).
    ``unsafe_unpickle=True`` (trusted checkpoints only) reads bytes items
    holding any class, as ``FileSystemReader(path, unsafe_unpickle=True)``.
    """
    sd: STATE_DICT_TYPE = {}
    reader = _tool_reader(dcp_checkpoint_dir, unsafe_unpickle)
    _load_state_dict(sd, reader, _coordinator(None, True),
                     _EmptyStateDictLoadPlanner())
    if isinstance(torch_save_path, (str, os.PathLike)):
        _save_atomically(sd, torch_save_path)
    else:
        import_torch().save(sd, torch_save_path)


def torch_save_to_dcp(
    torch_save_path: str | os.PathLike,
    dcp_checkpoint_dir: str | os.PathLike,
) -> None:
    """Convert the torch.save file at ``torch_save_path`` into a DCP
    checkpoint in ``dcp_checkpoint_dir`` (a directory or an fsspec URL; the
    default planner; tensors as
    they were loaded, other values as bytes items).

    The file is read with ``torch.load(weights_only=True)``: one holding
    objects it does not admit raises UnsafePickleError. Run it on one rank.
    """
    state_dict = _load_torch_save(torch_save_path)
    # Nothing torch.load gives back is Stateful: saved as it is.
    _save_state_dict(state_dict, _tool_writer(dcp_checkpoint_dir),
                     _coordinator(None, True), DefaultSavePlanner())


class BroadcastingTorchSaveReader(StorageReader):
    """A StorageReader of one torch.save file: the coordinator rank reads
    it, and every tensor is broadcast from there to all ranks (through
    ``shardstate.comm``), each keeping what its state dict holds.

    Use it with :class:`DynamicMetaLoadPlanner`; tensors only::

        sd = {"model": model.state_dict()}
        dcp.load(sd, storage_reader=BroadcastingTorchSaveReader(),
                 planner=DynamicMetaLoadPlanner(), checkpoint_id="model.pt")

    The broadcasts run on the default process group, from global rank
    ``coordinator_rank``.
    """

    def __init__(
        self,
        checkpoint_id: str | os.PathLike | None = None,
        coordinator_rank: int = 0,
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self.coordinator_rank = coordinator_rank

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        """Empty: DynamicMetaLoadPlanner builds the metadata from the state dict."""
        return Metadata(state_dict_metadata={})

    def set_up_storage_reader(self, metadata: Metadata,  # type: ignore[override]
                              is_coordinator: bool) -> None:
        self.is_coordinator = is_coordinator
        self._coord = _Coordinator(None, dist_ready(), self.coordinator_rank)
        if is_coordinator and self._coord.rank != self.coordinator_rank:
            raise AssertionError(
                f"Coordinator rank mismatch: expected {self.coordinator_rank}, got "
                f"{self._coord.rank} (the load's coordinator must be the reader's "
                "coordinator_rank)")
        if self.checkpoint_id is None:
            raise AssertionError("checkpoint_id must be set before setting up storage reader")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.checkpoint_id = checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isfile(checkpoint_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        torch = import_torch()
        coord = self._coord
        loaded: dict[str, Any] = {}
        # 1. Agree on what moves: every rank says which keys it reads (and
        # their global shapes); the coordinator reads the file and checks
        # them. Any failure is raised on every rank before a tensor moves.
        manifest = coord.reduce_scatter(
            "read torch.save file",
            lambda: self._needs(plan, planner, loaded),
            lambda needs: [self._manifest(needs, loaded)] * coord.world_size)
        # 2. One broadcast per tensor, in the manifest's order on every rank;
        # each rank copies out the boxes it reads. A rank that fails to copy
        # keeps taking part in the broadcasts and raises at the end.
        reads: dict[str, list[Any]] = {}
        for req in plan.items:
            reads.setdefault(req.storage_index.fqn, []).append(req)
        device = coord._transport_device() if coord.use_dist else "cpu"
        error: BaseException | None = None
        for fqn, shape, dtype in manifest:
            if coord.is_coordinator:
                tensor = loaded.pop(fqn).to(device).contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            if coord.use_dist and tensor.numel():
                comm.broadcast(tensor, self.coordinator_rank)
            if error is None:
                try:
                    for req in reads.get(fqn, ()):
                        self._copy_out(tensor, req, planner)
                except Exception as e:  # noqa: BLE001 - raised after the broadcasts
                    error = e
            del tensor
        if error is not None:
            raise error
        fut: Any = torch.futures.Future()
        fut.set_result(None)
        return fut

    def _needs(self, plan: LoadPlan, planner: Any, loaded: dict[str, Any]) -> dict[str, Any]:
        """This rank's keys in plan order, with the destinations' global
        shapes; the coordinator also reads the file into ``loaded``."""
        needs: dict[str, Any] = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise RuntimeError(
                    f"Non-tensor value identified at {req.storage_index.fqn}. "
                    f"At this time {type(self).__name__} only supports loading Tensors.")
            fqn = req.storage_index.fqn
            if fqn not in needs:
                needs[fqn] = _tensors.global_size(planner.state_dict[fqn])
        if self.is_coordinator:
            assert self.checkpoint_id is not None
            sd = _load_torch_save(self.checkpoint_id)
            if planner.flatten_state_dict:
                sd, _ = flatten_state_dict(sd)
            loaded.update(sd)
        return needs

    def _manifest(self, needs: list[dict[str, Any]], loaded: dict[str, Any]) -> list[Any]:
        """(key, shape, dtype) of every key some rank reads, checked against
        the file (on the coordinator)."""
        torch = import_torch()
        shapes: dict[str, Any] = {}
        for rank_needs in needs:
            for fqn, shape in rank_needs.items():
                shapes.setdefault(fqn, shape)
        out = []
        for fqn, shape in shapes.items():
            if fqn not in loaded:
                raise KeyError(
                    f"{fqn!r} is not in the torch.save file {os.fspath(self.checkpoint_id)!r} "
                    f"({len(loaded)} keys, flattened as the planner flattens them)")
            value = loaded[fqn]
            if not isinstance(value, torch.Tensor):
                raise RuntimeError(
                    f"Non-tensor value identified at {fqn}. At this time "
                    f"{type(self).__name__} only supports loading Tensors (the file holds a "
                    f"{type(value).__name__} there).")
            if shape is not None and tuple(value.shape) != tuple(shape):
                raise ValueError(
                    f"Size mismatch for {fqn}: the torch.save file "
                    f"{os.fspath(self.checkpoint_id)!r} holds shape {tuple(value.shape)}, "
                    f"the destination has shape {tuple(shape)}")
            out.append((fqn, tuple(value.shape), value.dtype))
        return out

    @staticmethod
    def _copy_out(tensor: Any, req: Any, planner: Any) -> None:
        # The saved "chunk" is the destination's own box (DynamicMetaLoadPlanner):
        # its offset places the read in the whole tensor.
        chunk_offset = req.storage_index.offset or (0,) * tensor.ndim
        start = [c + o for c, o in zip(chunk_offset, req.storage_offsets)]
        src = _tensors.narrow(tensor, start, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise AssertionError(
                f"req {req.storage_index} mismatch sizes, {target.size()} vs {src.size()}")
        target.copy_(src)
        planner.commit_tensor(req, target)


class DynamicMetaLoadPlanner(DefaultLoadPlanner):
    """A DefaultLoadPlanner that makes the checkpoint's metadata from the
    state dict itself (each tensor's shape, dtype and this rank's chunks),
    for sources with no metadata such as a torch.save file. Use it with
    :class:`BroadcastingTorchSaveReader`; tensors only."""

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        torch = import_torch()
        state_dict_metadata: dict[str, Any] = {}
        for key, tensor in self.state_dict.items():
            if not torch.is_tensor(tensor):
                raise RuntimeError(
                    f"Non-tensor value identified at {key}. "
                    f"At this time {type(self).__name__} only supports loading Tensors.")
            state_dict_metadata[key] = TensorStorageMetadata(
                TensorProperties(dtype=tensor.dtype), tensor.size(), _create_chunk_list(tensor))
        self.metadata = Metadata(state_dict_metadata=state_dict_metadata)


class _FormatMode(Enum):
    TORCH_TO_DCP = "torch_to_dcp"
    DCP_TO_TORCH = "dcp_to_torch"


def _main(argv: list[str] | None = None) -> None:
    """``python -m shardstate.checkpoint.format_utils {torch_to_dcp,dcp_to_torch} SRC DST``,
    as torch's module runs."""
    parser = argparse.ArgumentParser(prog="python -m shardstate.checkpoint.format_utils")
    parser.add_argument("mode", type=str, help="Conversion mode",
                        choices=[m.value for m in _FormatMode],
                        default=_FormatMode.TORCH_TO_DCP)
    parser.add_argument("src", type=str, help="Path to the source model")
    parser.add_argument("dst", type=str, help="Path to the destination model")
    args = parser.parse_args(argv)
    print(f"Converting checkpoint from {args.src} to {args.dst} using method: '{args.mode}'")
    missing = f"No checkpoint found at {args.src}. Skipping conversion."
    if args.mode == _FormatMode.TORCH_TO_DCP.value:
        if os.path.isfile(args.src):
            torch_save_to_dcp(args.src, args.dst)
        else:
            print(missing)
    elif os.path.isdir(args.src):
        dcp_to_torch_save(args.src, args.dst)
    else:
        print(missing)


if __name__ == "__main__":
    _main()


def dcp_to_safetensors(
    dcp_checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    fqn_to_index_mapping: dict[str, int] | None = None,
) -> None:
    """Convert the DCP checkpoint in ``dcp_checkpoint_dir`` (a directory or
    an fsspec URL) into Hugging Face
    safetensors files in ``output_dir`` (``HuggingFaceStorageWriter``: one
    file, or the files ``fqn_to_index_mapping`` names, plus
    ``model.safetensors.index.json``). Every tensor is stored whole under
    its flattened FQN; other values (bytes items) have no place in
    safetensors and are left out. Run it on one rank."""
    from .hf_storage import HuggingFaceStorageWriter

    torch = import_torch()
    reader = _tool_reader(dcp_checkpoint_dir)
    md = reader.read_metadata()
    sd: STATE_DICT_TYPE = {
        fqn: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for fqn, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    _load_state_dict(sd, reader, _coordinator(None, True), DefaultLoadPlanner())
    _save_state_dict(sd, HuggingFaceStorageWriter(os.fspath(output_dir), fqn_to_index_mapping),
                     _coordinator(None, True), DefaultSavePlanner())


def safetensors_to_dcp(
    input_dir: str | os.PathLike,
    dcp_checkpoint_dir: str | os.PathLike,
) -> None:
    """Convert the safetensors files in ``input_dir`` (every
    ``*.safetensors`` there: one consolidated file, several, or DCP's
    sharded files) into a DCP checkpoint in ``dcp_checkpoint_dir`` (a
    directory or an fsspec URL), each
    tensor whole under its name. Run it on one rank."""
    from .hf_storage import HuggingFaceStorageReader

    torch = import_torch()
    reader = HuggingFaceStorageReader(os.fspath(input_dir))
    md = reader.read_metadata()
    sd: STATE_DICT_TYPE = {fqn: torch.empty(tuple(m.size), dtype=m.properties.dtype)
                           for fqn, m in md.state_dict_metadata.items()}
    _load_state_dict(sd, reader, _coordinator(None, True), DefaultLoadPlanner())
    _save_state_dict(sd, _tool_writer(dcp_checkpoint_dir), _coordinator(None, True),
                     DefaultSavePlanner())
