"""The FP8 (e4m3) KV cache: its dtype, its scales, and quantize / dequantize in plain PyTorch.

A cache in ``torch.float8_e4m3fn`` holds ``stored = round_e4m3(clamp(x / scale, -448, 448))``
for a key or value ``x``; attention reads ``stored * scale``. Scales are float32 tensors of
shape ``[]`` (one for the whole cache) or ``[num_kv_heads]`` (one per KV head), positive and
finite (their values are not checked: that would read them on the host). A scale of None means
1.0 (no scaling), as vLLM does without calibrated scales. Keys and values have their own scale
(``k_scale``, ``v_scale``). Scales apply to an fp8 cache only; a cache in the model's dtype
takes None.

Rounding is to nearest even and saturates at +-448 (e4m3's largest finite value), so an
out-of-range input never becomes NaN; NaN stays NaN. The stored format itself (the dtype,
quantize / dequantize) is the cache's, :mod:`mini_paged_attn.cache.fp8`, re-exported here; this
module adds what the ops need on top: the dtype names, the scale checks and launch arguments.
"""

from __future__ import annotations

import torch

from ..cache.fp8 import FP8_DTYPE, FP8_MAX, dequantize, is_fp8, quantize
from ..core.args import arg_error

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""Names of a KV cache dtype: "auto" (the model's dtype), "fp8" = "fp8_e4m3"."""


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache for a ``kv_cache_dtype`` name (see
    :data:`KV_CACHE_DTYPES`) and the model's dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise arg_error("kv_cache_dtype", " or ".join(repr(n) for n in KV_CACHE_DTYPES),
                        repr(kv_cache_dtype))
    return model_dtype if kv_cache_dtype == "auto" else FP8_DTYPE


def check_kv_scales(k_scale: object, v_scale: object, cache_dtype: torch.dtype,
                    num_kv_heads: int, device: torch.device) -> None:
    """Check ``k_scale`` / ``v_scale``: None, or a float32 tensor of shape ``[]`` or
    ``[num_kv_heads]`` on ``device``, given only with an fp8 cache (ValueError naming the
    argument otherwise)."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if not is_fp8(cache_dtype):
            raise arg_error(name, f"None for a {cache_dtype} cache (scales apply to a "
                            f"{FP8_DTYPE} cache only)", "a scale")
        if not isinstance(scale, torch.Tensor):
            raise arg_error(name, "a float32 tensor or None", type(scale).__name__)
        shape = tuple(scale.shape)
        if scale.dtype != torch.float32 or shape not in ((), (num_kv_heads,)):
            raise arg_error(name, f"a float32 tensor of shape [] or [{num_kv_heads}] "
                            "(num_kv_heads)", f"{scale.dtype} tensor of shape {list(shape)}")
        if scale.device != device:
            raise arg_error(name, f"a tensor on {device} (the query's device)",
                            f"one on {scale.device}")


def scale_stride(scale: torch.Tensor | None) -> int:
    """Elements between consecutive KV heads' scales: 0 for one scale (or none), else the
    stride of the ``[num_kv_heads]`` tensor."""
    return scale.stride(0) if scale is not None and scale.dim() == 1 else 0


def scale_pointers(cache: torch.Tensor, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors a kernel launch passes for its scale pointers: the scales, or ``cache`` for
    None (the kernel then never reads the pointer; a tensor keeps the launch's argument list
    all tensors first, see :mod:`.launch`)."""
    return (cache if k_scale is None else k_scale, cache if v_scale is None else v_scale)


def index_cache(cache: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` (advanced indexing); an fp8 cache is indexed as its bytes, which works
    on every device."""
    if is_fp8(cache.dtype):
        return cache.view(torch.uint8)[index].view(cache.dtype)
    return cache[index]


__all__ = ["FP8_DTYPE", "FP8_MAX", "KV_CACHE_DTYPES", "check_kv_scales", "dequantize", "index_cache", "is_fp8",
           "kv_cache_torch_dtype", "quantize", "scale_pointers", "scale_stride"]
