"""FP8 paged batches for tests: a :class:`PagedBatch` whose caches are quantized to e4m3.

Use from any test (tests/ is on sys.path through tests/conftest.py)::

    from helpers.fp8_batch import fp8_batch, dequantized_batch
"""

from __future__ import annotations

import dataclasses

import torch

from helpers.paged_batch import PagedBatch
from mini_paged_attn.ops.kv_quant import FP8_DTYPE, dequantize, quantize


def per_head_scales(num_kv_heads: int, device, *, base: float = 0.01) -> torch.Tensor:
    """Distinct float32 ``[num_kv_heads]`` scales: ``base * (1 + h / 2)``, so N(0, 1) keys use
    most of e4m3's range (|x| / 0.01 reaches a few hundred) without all saturating."""
    return base * (1 + torch.arange(num_kv_heads, dtype=torch.float32, device=device) / 2)


def fp8_batch(batch: PagedBatch, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
              query_dtype: torch.dtype) -> PagedBatch:
    """``batch`` (float32 caches, NaN in unused slots) with its caches quantized to e4m3 with
    the scales (NaN stays NaN: 0x7F / 0xFF) and its query cast to ``query_dtype``. The layout
    (contiguous or the manager's strided pool views) is kept."""
    kc = batch.key_cache
    pool = torch.empty((*kc.shape[:2], 2, *kc.shape[2:]), dtype=FP8_DTYPE, device=kc.device)
    pool[:, :, 0].copy_(quantize(batch.key_cache, k_scale))
    pool[:, :, 1].copy_(quantize(batch.value_cache, v_scale))
    kc, vc = pool[:, :, 0], pool[:, :, 1]
    if batch.key_cache.is_contiguous():
        kc, vc = kc.contiguous(), vc.contiguous()
    assert kc.dtype == FP8_DTYPE
    return dataclasses.replace(batch, query=batch.query.to(query_dtype), key_cache=kc,
                               value_cache=vc)


def dequantized_batch(batch: PagedBatch, k_scale: torch.Tensor | None,
                      v_scale: torch.Tensor | None) -> PagedBatch:
    """An fp8 ``batch`` with float32 caches holding ``stored * scale`` (what attention over
    the fp8 cache must read) and a float32 query."""
    return dataclasses.replace(batch, query=batch.query.float(),
                               key_cache=dequantize(batch.key_cache, k_scale),
                               value_cache=dequantize(batch.value_cache, v_scale))
