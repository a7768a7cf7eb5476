"""Where each Hugging Face checkpoint tensor goes in a decoder: the parameter rows it fills, and
under tensor parallelism the part of the checkpoint tensor this rank reads.

The models fuse projections the checkpoints store apart (``q_proj``/``k_proj``/``v_proj`` ->
``qkv_proj``, ``gate_proj``/``up_proj`` -> ``gate_up_proj``): each checkpoint name maps to a view
of its rows. Phi-3 checkpoints store them fused already: the one checkpoint tensor fills the
whole fused parameter, and under tensor parallelism this rank's q, k and v rows (gate and up
rows) are read from three (two) places of it and concatenated.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..distributed.sharding import ShardLayout

Index = tuple[slice, ...]
# Where a checkpoint tensor goes: the parameter rows it fills, and the index of the part of the
# checkpoint tensor that fills them (None: the whole tensor; a list: those parts concatenated
# along dim 0).
Shard = tuple[torch.Tensor, Index | list[Index] | None]


class CheckpointParts:
    """The checkpoint names and parts of one rank's decoder layers (see the module docstring).

    ``fused``: the checkpoint stores ``qkv_proj`` and ``gate_up_proj`` (Phi-3).
    """

    def __init__(self, config, layout: ShardLayout, *, fused: bool = False):
        self.layout = layout
        self.fused = fused
        hs = config.head_size
        self.q, self.kv = layout.num_q_heads * hs, layout.num_kv_heads * hs
        self.inter = layout.intermediate_size
        self.q_part = self.part(layout.q_head_start * hs, self.q)
        self.kv_part = self.part(layout.kv_head_start * hs, self.kv)
        self.inter_part = self.part(layout.intermediate_start, self.inter)
        self.o_cols = self.part(layout.q_head_start * hs, self.q, dim=1)
        self.down_cols = self.part(layout.intermediate_start, self.inter, dim=1)
        # Offsets of k / v (up) inside a fused checkpoint tensor: after all heads of q (k).
        self.q_total, self.kv_total = config.q_size, config.kv_size
        self.inter_total = config.intermediate_size

    def part(self, start: int, size: int, dim: int = 0) -> Index | None:
        """The checkpoint index of ``size`` rows (dim 0) or columns (dim 1) from ``start``
        (None with one rank: the whole tensor)."""
        if not self.layout.sharded:
            return None
        return (slice(None),) * dim + (slice(start, start + size),)

    def _shifted(self, index: Index | None, offset: int) -> Index:
        return (slice(index[0].start + offset, index[0].stop + offset),)

    def column(self, name: str, linear: nn.Linear, rows: slice = slice(None),
               part: Index | list[Index] | None = None) -> dict[str, Shard]:
        """A column-parallel linear (weight, and bias if any) -> ``rows`` of ours."""
        shards = {f"{name}.weight": (linear.weight[rows], part)}
        if linear.bias is not None:
            shards[f"{name}.bias"] = (linear.bias[rows], part)
        return shards

    def row(self, name: str, linear: nn.Linear, columns: Index | None) -> dict[str, Shard]:
        """A row-parallel linear: input columns split; the bias is added once, after the
        all-reduce: whole."""
        shards = {f"{name}.weight": (linear.weight, columns)}
        if linear.bias is not None:
            shards[f"{name}.bias"] = (linear.bias, None)
        return shards

    def attention(self, prefix: str, attn: nn.Module) -> dict[str, Shard]:
        """``{prefix}q_proj`` .. ``o_proj`` (and q/k norms) of an :class:`Attention`."""
        q, kv = self.q, self.kv
        if self.fused:
            parts = None if not self.layout.sharded else [
                self.q_part, self._shifted(self.kv_part, self.q_total),
                self._shifted(self.kv_part, self.q_total + self.kv_total)]
            shards = self.column(f"{prefix}qkv_proj", attn.qkv_proj, part=parts)
        else:
            shards = {}
            for name, rows, part in (("q_proj", slice(0, q), self.q_part),
                                     ("k_proj", slice(q, q + kv), self.kv_part),
                                     ("v_proj", slice(q + kv, q + 2 * kv), self.kv_part)):
                shards.update(self.column(f"{prefix}{name}", attn.qkv_proj, rows, part))
        shards.update(self.row(f"{prefix}o_proj", attn.o_proj, self.o_cols))
        if attn.q_norm is not None:
            shards[f"{prefix}q_norm.weight"] = (attn.q_norm.weight, None)
            shards[f"{prefix}k_norm.weight"] = (attn.k_norm.weight, None)
        return shards

    def gated_mlp(self, prefix: str, mlp: nn.Module) -> dict[str, Shard]:
        """``{prefix}gate_proj`` / ``up_proj`` / ``down_proj`` of a :class:`GatedMLP`."""
        inter = self.inter
        if self.fused:
            parts = None if not self.layout.sharded else [
                self.inter_part, self._shifted(self.inter_part, self.inter_total)]
            shards = self.column(f"{prefix}gate_up_proj", mlp.gate_up_proj, part=parts)
        else:
            shards = {}
            halves = (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter)))
            for name, rows in halves:
                shards.update(self.column(f"{prefix}{name}", mlp.gate_up_proj, rows,
                                          self.inter_part))
        shards.update(self.row(f"{prefix}down_proj", mlp.down_proj, self.down_cols))
        return shards

    @staticmethod
    def norms(prefix: str, layer: nn.Module, names: tuple[str, ...]) -> dict[str, Shard]:
        """Replicated norm weights ``{prefix}{name}.weight``."""
        return {f"{prefix}{name}.weight": (getattr(layer, name).weight, None) for name in names}


def read_part(opened, name: str, part: Index | list[Index] | None) -> torch.Tensor:
    """The ``part`` of tensor ``name`` of an open safetensors file (see :data:`Shard`)."""
    if part is None:
        return opened.get_tensor(name)
    sliced = opened.get_slice(name)
    if isinstance(part, list):
        return torch.cat([sliced[p] for p in part])
    return sliced[part]


# ---- quantized checkpoints: refused before any weight is read ---------------------------------

# The safetensors dtypes of plain weights; a ``*.weight`` in any other (F8_E4M3, I8, U8, I32,
# ...) holds quantized values that would be cast as if they were the weights themselves.
PLAIN_WEIGHT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
# The last name part of the side tensors of quantization formats (GPTQ / AWQ qweight, qzeros,
# scales, g_idx; compressed-tensors weight_packed, weight_scale, input_scale, zero points;
# fp8 weight_scale_inv; MXFP4 *_scales): ignored, they would leave the weights meaningless.
_QUANTIZATION_TENSOR = re.compile(
    r"qweight|qzeros|scales|g_idx|weight_packed|weight_shape|\w+_zero_point"
    r"|\w+_scales?|\w+_scale_(?:inv|2)")
_SUPPORTED = "only unquantized bf16/fp16/fp32 safetensors checkpoints and GGUF files load"


def quantized_checkpoint_error(source: str, method: Any, hint: str = "") -> str:
    """The one-line refusal of a checkpoint quantized with ``method`` (its config.json's
    ``quantization_config.quant_method``), ``hint`` saying what to use instead."""
    return (f"{source}: quantization_config.quant_method {method!r} is not supported: "
            f"{_SUPPORTED}" + (f" ({hint})" if hint else ""))


def safetensors_header(path: str | Path) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file's JSON header (name -> dtype, shape, data
    offsets), read without reading any tensor; {} for a file too short or malformed to have
    one (loading it reports that, naming the file)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            return {}
        (size,) = struct.unpack("<Q", raw)
        text = f.read(size)
    try:
        header = json.loads(text) if len(text) == size else {}
    except (UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(header, dict):
        return {}
    return {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def check_unquantized(raw_config: dict[str, Any], files: Sequence[str | Path],
                      source: str) -> None:
    """Refuse a quantized checkpoint: one whose config.json (``raw_config``, named
    ``source``) has a ``quantization_config``, or whose safetensors ``files`` hold a
    ``*.weight`` tensor of a non-float dtype or a quantization format's side tensors
    (``qweight``, ``qzeros``, ``*_scale``, ...). Reads the files' headers only.

    The engine loads plain weights only: a quantized one loaded as plain weights (its scales
    ignored) would answer garbage without a word.

    Raises:
        ValueError: one line naming the quant_method, or the file, tensor and dtype.
    """
    quant = raw_config.get("quantization_config")
    if quant:      # None or {}: nothing is quantized
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise ValueError(quantized_checkpoint_error(source, method))
    for path in files:
        for name, entry in safetensors_header(path).items():
            dtype = entry.get("dtype")
            last = name.rsplit(".", 1)[-1]
            if _QUANTIZATION_TENSOR.fullmatch(last) or (
                    last == "weight" and dtype not in PLAIN_WEIGHT_DTYPES):
                raise ValueError(f"{path}: tensor {name!r} ({dtype}) is a quantized "
                                 f"checkpoint's, and {source} has no quantization_config: "
                                 f"{_SUPPORTED}")


__all__ = ["CheckpointParts", "Index", "PLAIN_WEIGHT_DTYPES", "Shard", "check_unquantized",
           "quantized_checkpoint_error", "read_part", "safetensors_header"]
