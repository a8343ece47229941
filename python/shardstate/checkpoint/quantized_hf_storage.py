"""``QuantizedHuggingFaceStorageReader``: torch 2.13's reader of quantized
Hugging Face checkpoints, dequantizing as it loads, on shardstate's engine.

Two schemes, recognised by name through ``model.safetensors.index.json``'s
weight map, as torch recognises them:

* block-wise float8 (DeepSeek-V3 style): ``X.weight`` (2-D) with
  ``X.weight_scale_inv`` holding one factor per ``block_size`` x
  ``block_size`` block: value = weight * factor of its block;
* MXFP4 (gpt-oss style): ``X_blocks`` ``[..., G, B]`` uint8, two 4-bit FP4
  codes a byte (low nibble first), with ``X_scales`` ``[..., G]`` uint8
  exponents (biased by 127): ``[..., G * B * 2]`` values
  ``fp4(code) * 2 ** (scale - 127)``. The metadata gives the dequantized
  size (and, unlike torch's, a matching chunk, so the default planner can
  plan it).

Each read takes only what its region needs from the files (the weight's
region, the blocks' groups it covers, the scale factors of the blocks it
touches) through the engine (``_safetensors.read_regions``); the
arithmetic is torch's (CPU). Results equal torch's reader's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import torch

from .. import io as ssio
from . import _safetensors as st
from ._hf_utils import _metadata_fn
from .hf_storage import HuggingFaceStorageReader
from .metadata import ChunkStorageMetadata, TensorStorageMetadata
from .planner import LoadPlanner as LoadPlanner
from .planner import ReadItem as ReadItem
from .storage import completed_future

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["QuantizedHuggingFaceStorageReader"]

_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MAX_INDEX = 64 << 20  # bytes of model.safetensors.index.json read at most


class QuantizedHuggingFaceStorageReader(HuggingFaceStorageReader):
    """A HuggingFaceStorageReader that dequantizes quantized tensors to
    ``target_dtype`` as it loads them (see the module). A quantized tensor
    must be whole in one file, as in torch."""

    def __init__(
        self,
        path: str,
        thread_count: int = 1,
        target_dtype: torch.dtype = torch.float32,
        block_size: int = 128,
    ):
        super().__init__(path=path, thread_count=thread_count)
        self.target_dtype: torch.dtype = target_dtype
        self.block_size: int = block_size
        self._weight_scale_mapping: dict[str, str] = {}
        self._weight_map: dict[str, str] = {}
        self._tensor_full_shapes: dict[str, torch.Size] = {}

    def read_metadata(self) -> Any:
        metadata = super().read_metadata()
        self._load_quantization_metadata()
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            if fqn.endswith("_blocks") and fqn in self._weight_scale_mapping:
                if len(md.size) < 2:
                    raise st.SafetensorsError(f"{self.path}: {fqn!r} has shape "
                                              f"{list(md.size)}, MXFP4 blocks need [..., G, B]")
                self._tensor_full_shapes[fqn + "_quantized"] = md.size
                *prefix, groups, nbytes = md.size
                md.size = torch.Size([*prefix, groups * nbytes * 2])
                md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * len(md.size)),
                                                  sizes=md.size)]
            self._tensor_full_shapes[fqn] = md.size
        return metadata

    def _load_quantization_metadata(self) -> None:
        path = self.path / _metadata_fn
        try:
            data = ssio.read_file(path, _MAX_INDEX)
            index = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise st.SafetensorsError(f"{path}: not a valid index: {e}") from None
        weight_map = index.get("weight_map", {}) if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise st.SafetensorsError(f"{path}: weight_map is not an object")
        self._build_weight_scale_mapping(weight_map)

    def _build_weight_scale_mapping(self, weight_map: dict[str, str]) -> None:
        self._weight_map = weight_map
        for name in weight_map:
            if name.endswith(".weight_scale_inv"):
                weight = name.replace(".weight_scale_inv", ".weight")
                if weight in weight_map:
                    self._weight_scale_mapping[weight] = name
            elif name.endswith("_scales"):
                blocks = name.replace("_scales", "_blocks")
                if blocks in weight_map:
                    self._weight_scale_mapping[blocks] = name

    def _is_tensor_quantized(self, tensor_fqn: str) -> bool:
        if tensor_fqn.endswith((".weight_scale_inv", "_scales")):
            return False
        return tensor_fqn in self._weight_scale_mapping

    def _entry(self, fqn: str) -> tuple[str, st.TensorEntry]:
        """The file and entry of a whole tensor (a scale, quantized weights)."""
        info = self.storage_data.get(_whole_key(fqn, self._tensor_full_shapes))
        if info is None:  # not in the metadata by that key: the index names the file
            name = self._weight_map.get(fqn)
            if name is None:
                raise ValueError(f"Scale tensor {fqn} not found in weight_map")
            header = self._header(str(self.path / name))
        else:
            header = self._header(str(info.relative_path))
        return header.path, header.entry(fqn)

    def _read(self, fqn: str, offs: list[int], lens: list[int]) -> torch.Tensor:
        path, e = self._entry(fqn)
        out = torch.empty(lens, dtype=st.torch_dtype(e.dtype))
        st.read_regions([st.Region(path, e, tuple(offs), tuple(lens), out)])
        return out

    def _dequantized(self, req: Any) -> torch.Tensor:
        fqn = req.storage_index.fqn
        scale = self._weight_scale_mapping[fqn]
        offs = [int(o) for o in req.storage_offsets]
        lens = [int(n) for n in req.lengths]
        if fqn.endswith("_blocks"):
            return self._mxfp4(fqn, scale, offs, lens)
        full = self._tensor_full_shapes.get(fqn)
        if full is None or len(full) != 2:
            raise ValueError("Unsupported quantization types")
        bs = self.block_size
        weight = self._read(fqn, offs, lens)
        r0, c0 = offs[0] // bs, offs[1] // bs
        r1, c1 = (offs[0] + lens[0] - 1) // bs + 1, (offs[1] + lens[1] - 1) // bs + 1
        factors = self._read(scale, [r0, c0], [r1 - r0, c1 - c0]) if lens[0] and lens[1] else \
            torch.empty(0, 0)
        # each element's block factor, for the region only
        rows = (torch.arange(offs[0], offs[0] + lens[0]) // bs) - r0
        cols = (torch.arange(offs[1], offs[1] + lens[1]) // bs) - c0
        per = factors[rows][:, cols] if lens[0] and lens[1] else torch.empty(lens)
        return (weight.to(torch.float32) * per).to(self.target_dtype)

    def _mxfp4(self, fqn: str, scale: str, offs: list[int], lens: list[int]) -> torch.Tensor:
        *_prefix, nbytes = self._tensor_full_shapes[fqn + "_quantized"]
        if len(offs) != 3:
            raise AssertionError(f"{fqn}: MXFP4 reads are 3-D, got {len(offs)} dims")
        per_group = nbytes * 2
        g0 = offs[2] // per_group
        g1 = (offs[2] + lens[2] + per_group - 1) // per_group
        blocks = self._read(fqn, [offs[0], offs[1], g0, 0], [lens[0], lens[1], g1 - g0, nbytes])
        exps = self._read(scale, [offs[0], offs[1], g0], [lens[0], lens[1], g1 - g0])
        lut = torch.tensor(_FP4, dtype=self.target_dtype)
        vals = torch.empty(*blocks.shape[:-1], nbytes, 2, dtype=self.target_dtype)
        vals[..., 0] = lut[(blocks & 0x0F).long()]
        vals[..., 1] = lut[(blocks >> 4).long()]
        vals = torch.ldexp(vals.reshape(*blocks.shape[:-1], per_group),
                           (exps.to(torch.int32) - 127).unsqueeze(-1)).to(self.target_dtype)
        vals = vals.reshape(lens[0], lens[1], (g1 - g0) * per_group)
        start = offs[2] - g0 * per_group
        return vals[..., start:start + lens[2]]

    def read_data(self, plan: Any, planner: Any) -> Any:
        plain = [it for it in plan.items if not self._is_tensor_quantized(it.storage_index.fqn)]
        quantized = [it for it in plan.items if self._is_tensor_quantized(it.storage_index.fqn)]
        if plain:
            super().read_data(dataclasses.replace(plan, items=plain), planner)
        for req in quantized:
            try:
                tensor = self._dequantized(req)
            except Exception:
                logger.error("Failed to read the quantized tensor!!")
                raise
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise AssertionError(f"req {req.storage_index} mismatch sizes "
                                     f"{target.size()} vs {tensor.size()}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        return completed_future(None)


def _whole_key(fqn: str, shapes: dict[str, torch.Size]) -> tuple[str, tuple]:
    """The storage key of a whole tensor saved without sharding info."""
    shape = shapes.get(fqn + "_quantized", shapes.get(fqn))
    return (fqn, tuple([0] * (len(shape) if shape is not None else 0)))
