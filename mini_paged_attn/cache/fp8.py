"""The stored format of an FP8 (e4m3) KV cache, in plain PyTorch.

A cache in ``torch.float8_e4m3fn`` holds ``stored = round_e4m3(clamp(x / scale, -448, 448))``
for a key or value ``x``; reading gives ``stored * scale``. A scale is a float32 tensor of shape
``[]`` or ``[num_kv_heads]``, or None for 1.0. The format lives with the cache because the
cache writes it too (:meth:`PagedAttentionManager.write_kv`); the ops' checks of scales and
their launch arguments are in :mod:`mini_paged_attn.ops.kv_quant`.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest finite e4m3 value; quantization saturates here."""


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype is quantized (takes scales)."""
    return dtype == FP8_DTYPE


def _per_head(scale: torch.Tensor) -> torch.Tensor:
    """``[]`` or ``[num_kv_heads]`` -> a float32 tensor that broadcasts over ``[..., H, D]``."""
    return scale.float().reshape(-1, 1)


def quantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[..., num_kv_heads, head_size]`` (any float dtype) -> e4m3 of ``x / scale``,
    saturated at +-448, same shape."""
    x = x.float()
    if scale is not None:
        x = x / _per_head(scale)
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``stored`` ``[..., num_kv_heads, head_size]`` (any dtype) -> float32 ``stored * scale``
    (no scaling for None)."""
    x = stored.float()
    return x if scale is None else x * _per_head(scale)


__all__ = ["FP8_DTYPE", "FP8_MAX", "dequantize", "is_fp8", "quantize"]
