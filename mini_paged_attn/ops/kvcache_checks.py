"""The argument checks of :func:`~.kvcache_api.flash_attn_with_kvcache`, all made before the
call writes anything.

:func:`check_kvcache_args` checks shapes, dtypes, devices and options (no host sync) and
returns the call's sizes; :func:`check_kvcache_values` reads the lengths, indices and block
ids on the host, which only the torch backend does (the kernels never sync, as
FlashAttention's do not check them either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.args import arg_error, check_bool, is_int
from .checks import (FLOAT_DTYPES, check_index_vector, check_last_dim_contiguous,
                     check_scale, check_tensor)
from .variants import check_softcap, check_window


@dataclass(frozen=True)
class KVCacheCall:
    """The sizes and options of one checked call.

    batch, seqlen_q, num_heads, head_size: q's shape. num_kv_heads: the caches'. seqlen_new:
    new tokens a row (0 without k / v). paged: block_table given. page: tokens a cache block
    (a non-paged cache's row length). capacity: tokens a row's cache holds (FlashAttention's
    ``seqlen_k``). num_cache_rows: a non-paged cache's rows (``batch_cache``), else blocks.
    """

    batch: int
    seqlen_q: int
    num_heads: int
    head_size: int
    num_kv_heads: int
    seqlen_new: int
    paged: bool
    page: int
    capacity: int
    num_cache_rows: int
    scale: float
    window: tuple[int, int]
    softcap: float


def _check_vector(name: str, t, batch: int, device: torch.device) -> None:
    """None, or an int32 ``[batch]`` on ``device``."""
    if t is None:
        return
    check_index_vector(name, t, dtypes=(torch.int32,), device=device)
    if t.shape[0] != batch:
        raise arg_error(name, f"shape ({batch},) (q's batch)", tuple(t.shape))


def check_kvcache_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                       cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                       window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                       return_softmax_lse) -> KVCacheCall:
    """Check every argument of ``flash_attn_with_kvcache`` (as documented there) but the
    values inside its index tensors. Raises ValueError naming the first bad argument, or
    NotImplementedError for ``alibi_slopes``."""
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not implemented; pass None")
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    batch, seqlen_q, num_heads, head_size = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, ndim=4, dtypes=(q.dtype,), device=q.device)
        check_last_dim_contiguous(name, t)
    if v_cache.shape != k_cache.shape:
        raise arg_error("v_cache", f"the shape of k_cache {tuple(k_cache.shape)}",
                        tuple(v_cache.shape))
    num_cache_rows, page, num_kv_heads, kv_head_size = k_cache.shape
    if min(num_cache_rows, page) < 1:
        raise arg_error("k_cache", "non-empty dimensions", tuple(k_cache.shape))
    if kv_head_size != head_size:
        raise arg_error("k_cache", f"head_size {head_size} (q's last dim)", kv_head_size)
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise arg_error("q", f"num_heads divisible by num_kv_heads={num_kv_heads} (the "
                        "caches' heads)", num_heads)
    paged = block_table is not None
    capacity = page
    if paged:
        check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,),
                     device=q.device)
        if block_table.shape[0] != batch:
            raise arg_error("block_table", f"{batch} rows (q's batch)",
                            tuple(block_table.shape))
        check_last_dim_contiguous("block_table", block_table)
        capacity = block_table.shape[1] * page
        for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if t is not None:
                raise arg_error(name, "None with a paged cache (block_table given), as "
                                "FlashAttention", "a tensor")
    _check_vector("cache_batch_idx", cache_batch_idx, batch, q.device)
    _check_vector("cache_leftpad", cache_leftpad, batch, q.device)
    if isinstance(cache_seqlens, torch.Tensor):
        _check_vector("cache_seqlens", cache_seqlens, batch, q.device)
    elif cache_seqlens is not None and not (is_int(cache_seqlens) and cache_seqlens >= 0):
        raise arg_error("cache_seqlens", "None, an int >= 0 or an int32 tensor [batch]",
                        repr(cache_seqlens))
    seqlen_new = 0
    if (k is None) != (v is None):
        raise arg_error("v" if k is not None else "k", "a tensor when "
                        f"{'k' if k is not None else 'v'} is given (both or neither)", "None")
    if k is not None:
        expected = (batch, k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else -1,
                    num_kv_heads, head_size)
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, ndim=4, dtypes=(q.dtype,), device=q.device)
            if tuple(t.shape) != expected:
                raise arg_error(name, f"shape {expected} (batch, seqlen_new, num_kv_heads, "
                                "head_size)", tuple(t.shape))
        seqlen_new = k.shape[1]
        if cache_seqlens is None:
            raise arg_error("cache_seqlens", "where the new k / v go (an int or int32 [batch])"
                            " when k and v are given", "None")
        if seqlen_new > capacity:
            raise arg_error("k", f"seqlen_new <= the cache's {capacity} tokens a row",
                            seqlen_new)
    if (rotary_cos is None) != (rotary_sin is None):
        raise arg_error("rotary_sin" if rotary_cos is not None else "rotary_cos",
                        "a tensor when the other of rotary_cos / rotary_sin is given", "None")
    if rotary_cos is not None:
        if k is None:
            raise arg_error("k", "the new keys when rotary_cos / rotary_sin are given "
                            "(rotary applies to q and the new k)", "None")
        check_tensor("rotary_cos", rotary_cos, ndim=2, dtypes=(q.dtype,), device=q.device)
        check_tensor("rotary_sin", rotary_sin, ndim=2, dtypes=(q.dtype,), device=q.device)
        if rotary_sin.shape != rotary_cos.shape:
            raise arg_error("rotary_sin", f"the shape of rotary_cos {tuple(rotary_cos.shape)}",
                            tuple(rotary_sin.shape))
        seqlen_ro, half = rotary_cos.shape
        if not 0 < 2 * half <= head_size:
            raise arg_error("rotary_cos", f"shape (seqlen_ro, rotary_dim / 2) with 0 < "
                            f"rotary_dim <= head_size {head_size}", tuple(rotary_cos.shape))
        if seqlen_ro < capacity:
            raise arg_error("rotary_cos", f"at least the cache's {capacity} positions "
                            "(seqlen_ro >= seqlen_k, as FlashAttention)", seqlen_ro)
    scale = check_scale(softmax_scale, head_size, name="softmax_scale")
    for name, flag in (("causal", causal), ("rotary_interleaved", rotary_interleaved),
                       ("return_softmax_lse", return_softmax_lse)):
        check_bool(name, flag)
    window = check_window(window_size)
    softcap = check_softcap(softcap)
    if not (is_int(num_splits) and num_splits >= 0):
        raise arg_error("num_splits", "an int >= 0 (0: the heuristic)", repr(num_splits))
    return KVCacheCall(batch, seqlen_q, num_heads, head_size, num_kv_heads, seqlen_new, paged,
                       page, capacity, num_cache_rows, scale, window, softcap)


def check_kvcache_values(call: KVCacheCall, cache_seqlens: torch.Tensor,
                         cache_batch_idx: torch.Tensor | None,
                         cache_leftpad: torch.Tensor | None,
                         block_table: torch.Tensor | None) -> None:
    """The values of the int32 ``[batch]`` index tensors and the used block ids, read on the
    host: ``0 <= cache_leftpad <= cache_seqlens``, ``cache_seqlens + seqlen_new <=
    capacity``, at least ``seqlen_q`` keys a row, cache rows and block ids in range."""
    lens = cache_seqlens.detach().to("cpu", torch.int64)
    pad = (torch.zeros_like(lens) if cache_leftpad is None
           else cache_leftpad.detach().to("cpu", torch.int64))
    ends = lens + call.seqlen_new

    def first(bad: torch.Tensor) -> int:
        return int(torch.nonzero(bad)[0])

    if ((pad < 0) | (pad > lens)).any():
        i = first((pad < 0) | (pad > lens))
        raise arg_error("cache_leftpad", "0 <= cache_leftpad <= cache_seqlens",
                        f"cache_leftpad[{i}]={int(pad[i])}, cache_seqlens[{i}]={int(lens[i])}")
    if ((lens < 0) | (ends > call.capacity)).any():
        i = first((lens < 0) | (ends > call.capacity))
        raise arg_error("cache_seqlens", f"0 <= cache_seqlens and cache_seqlens + seqlen_new "
                        f"({call.seqlen_new}) <= the cache's {call.capacity} tokens a row",
                        f"cache_seqlens[{i}]={int(lens[i])}")
    if (ends - pad < call.seqlen_q).any():
        i = first(ends - pad < call.seqlen_q)
        raise arg_error("cache_seqlens", f"at least seqlen_q={call.seqlen_q} keys a row "
                        "(cache_seqlens - cache_leftpad + seqlen_new; the queries are the "
                        "last tokens)", f"{int(ends[i] - pad[i])} keys in row {i}")
    if cache_batch_idx is not None:
        rows = cache_batch_idx.detach().to("cpu", torch.int64)
        if ((rows < 0) | (rows >= call.num_cache_rows)).any():
            i = first((rows < 0) | (rows >= call.num_cache_rows))
            raise arg_error("cache_batch_idx", f"rows in [0, {call.num_cache_rows})",
                            f"cache_batch_idx[{i}]={int(rows[i])}")
    if block_table is not None:
        table = block_table.detach().to("cpu", torch.int64)
        used = torch.arange(table.shape[1]) < (ends + call.page - 1)[:, None] // call.page
        bad = used & ((table < 0) | (table >= call.num_cache_rows))
        if bad.any():
            i, j = (int(x) for x in torch.nonzero(bad)[0])
            raise arg_error("block_table", f"block ids in [0, {call.num_cache_rows}) for "
                            "used entries", f"block_table[{i}, {j}]={int(table[i, j])}")


__all__ = ["KVCacheCall", "check_kvcache_args", "check_kvcache_values"]
