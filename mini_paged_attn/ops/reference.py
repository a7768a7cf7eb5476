"""The paged attention specification in plain PyTorch, in two independent implementations.

- ``*_gather``: gather each sequence's keys and values through its block table into a dense
  tensor (decode: all sequences padded to the longest; prefill: one sequence at a time), then a
  masked float32 softmax. The obvious algorithm; the one dispatch runs.
- ``*_blockwise``: walk the logical blocks of all query rows in step and keep an online softmax
  (running max, running sum, unnormalised output) per row: seed 004's block-wise algorithm, done
  right, and the shape of what the Triton kernels do.

Tests check the two against each other and against dense ``scaled_dot_product_attention``.
Neither checks its arguments: :mod:`.dispatch` does that (:mod:`.checks`) before calling here.

Semantics shared by all ops (names as in :mod:`.dispatch`):

- the ``q_len_i`` query tokens of sequence ``i`` are the last ``q_len_i`` of its
  ``context_lens[i]`` cached tokens; with ``causal`` query token ``t`` sees cache positions
  ``<= context_lens[i] - q_len_i + t`` (bottom-right alignment); decode is ``q_len 1``;
- query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``;
- scores, softmax and the output accumulate in float32; ``lse`` is the natural log-sum-exp of
  the scaled scores;
- a row that sees no key (context length 0) gives out 0 and lse ``-inf``;
- table entries past a sequence's length are never read, and cache slots past its length never
  reach the result (unused memory may hold NaN);
- ``k_scale`` / ``v_scale`` (None, or float32 ``[]`` / ``[num_kv_heads]``): attention reads
  ``stored * scale`` from the cache (an fp8 cache, see :mod:`.kv_quant`); None reads it as is;
- ``window_size``, ``softcap``, ``sinks``: see :mod:`.variants`. Only positions inside some
  query's window are gathered (a block wholly left of every window may have been freed and
  reused), so masking never multiplies memory that was not meant to be read.

All functions are forward-only (``torch.no_grad``) and return float32 tensors; dispatch casts.
"""

from __future__ import annotations

import torch

from ..cache.slots import write_slots
from .kv_quant import is_fp8, quantize
from .reference_attend import attend_blockwise, attend_dense, gather_paged, visible_ranges
from .variants import NO_WINDOW, visible_range

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# Public reference ops. ``window_size`` is a checked (left, right) pair, ``softcap`` a float
# >= 0 and ``sinks`` None or float32 [num_q_heads] (see :mod:`.variants`).

@torch.no_grad()
def paged_decode_gather(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                        scale: float, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None,
                        window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
                        sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention by gather + dense float32 softmax, all sequences at once.

    Args:
        query: ``[num_seqs, num_q_heads, head_size]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        context_lens: int32 ``[num_seqs]``.
        scale: softmax scale.
        k_scale, v_scale: None or float32 ``[]`` / ``[num_kv_heads]``: dequantization scales.
        window_size, softcap, sinks: the variants of :mod:`.variants` (the query sits at
            position ``context_len - 1``; only its window is gathered).

    Returns:
        out float32 ``[num_seqs, num_q_heads, head_size]``, lse float32 ``[num_seqs, num_q_heads]``.
    """
    k_lens = context_lens.to(torch.int64)
    lo, hi = visible_range(k_lens - 1, k_lens, window_size[0], 0)
    n = hi - lo
    # Pad to the longest window (at least 1 so the key dim is never empty; padding is masked).
    max_k = max(int(n.max()) if n.numel() else 0, 1)
    k = gather_paged(key_cache, block_tables, lo, n, max_k, k_scale)
    v = gather_paged(value_cache, block_tables, lo, n, max_k, v_scale)
    out, lse = attend_dense(query.float()[:, None], k, v, torch.zeros_like(n)[:, None],
                            n[:, None], scale, softcap, sinks)
    return out[:, 0], lse[:, 0]


@torch.no_grad()
def paged_decode_blockwise(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, *, scale: float,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention by a block-wise online softmax; same arguments and results as
    :func:`paged_decode_gather`."""
    k_lens = context_lens.to(torch.int64)
    seq = torch.arange(k_lens.shape[0], device=k_lens.device)
    lo, hi = visible_range(k_lens - 1, k_lens, window_size[0], 0)
    return attend_blockwise(query.float(), seq, lo, hi, key_cache, value_cache, block_tables,
                            scale, k_scale, v_scale, softcap, sinks)


@torch.no_grad()
def paged_prefill_gather(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         context_lens: torch.Tensor, *, causal: bool, scale: float,
                         k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None,
                         window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
                         sinks: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen prefill attention over paged K/V: per sequence, gather + dense float32 softmax.

    One sequence at a time, because padding every sequence to the longest query *and* the longest
    context (a long prompt batched with many decode rows) would cost max_q x max_k per sequence.
    Per sequence only the union of its rows' windows is gathered.

    Args:
        query: ``[total_q, num_q_heads, head_size]``; sequence i's rows are
            ``cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        cu_seqlens_q: int32 ``[num_seqs + 1]``, from 0 to total_q.
        context_lens: int32 ``[num_seqs]``, ``>= q_len`` per sequence.
        causal: bottom-right aligned causal mask.
        scale: softmax scale.
        k_scale, v_scale: None or float32 ``[]`` / ``[num_kv_heads]``: dequantization scales.
        window_size, softcap, sinks: the variants of :mod:`.variants`.

    Returns:
        out float32 ``[total_q, num_q_heads, head_size]``, lse float32 ``[total_q, num_q_heads]``.
    """
    k_lens = context_lens.to(torch.int64)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    _, lo, hi = visible_ranges(q_lens, k_lens, causal, window_size)
    out = query.new_zeros(query.shape, dtype=torch.float32)
    lse = query.new_full(query.shape[:2], _NEG_INF, dtype=torch.float32)
    cu = cu_seqlens_q.tolist()
    for i in range(k_lens.shape[0]):
        rows = slice(cu[i], cu[i + 1])
        if rows.start == rows.stop:
            continue
        # Windows move right with the rows: their union is lo of the first row .. the last hi.
        start, end = lo[rows].min(), hi[rows].max()
        n = (end - start)[None]
        k = gather_paged(key_cache, block_tables[i:i + 1], start[None], n, max(int(n), 1),
                         k_scale)
        v = gather_paged(value_cache, block_tables[i:i + 1], start[None], n, max(int(n), 1),
                         v_scale)
        o, s = attend_dense(query[rows].float()[None], k, v, (lo[rows] - start)[None],
                            (hi[rows] - start)[None], scale, softcap, sinks)
        out[rows], lse[rows] = o[0], s[0]
    return out, lse


@torch.no_grad()
def paged_prefill_blockwise(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, *,
                            causal: bool, scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None,
                            window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen prefill attention by a block-wise online softmax over all query rows at once;
    same arguments and results as :func:`paged_prefill_gather`."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    seq, lo, hi = visible_ranges(q_lens, context_lens.to(torch.int64), causal, window_size)
    return attend_blockwise(query.float(), seq, lo, hi, key_cache, value_cache,
                            block_tables, scale, k_scale, v_scale, softcap, sinks)


@torch.no_grad()
def varlen_attention_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                                causal: bool, scale: float,
                                window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
                                sinks: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention over contiguous K/V (FlashAttention's ``flash_attn_varlen_func``).

    Args:
        q: ``[total_q, num_q_heads, head_size]``.
        k, v: ``[total_k, num_kv_heads, head_size]``; sequence i's keys are rows
            ``cu_seqlens_k[i] .. cu_seqlens_k[i+1]-1``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[num_seqs + 1]``.
        causal: bottom-right aligned; with ``q_len > k_len`` the first ``q_len - k_len`` rows
            see no key and give 0 (lse ``-inf``, or the sink with ``sinks``).
        scale: softmax scale.
        window_size, softcap, sinks: the variants of :mod:`.variants`.

    Returns:
        out float32 ``[total_q, num_q_heads, head_size]``, lse float32 ``[total_q, num_q_heads]``.
    """
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    _, lo, hi = visible_ranges(q_lens, k_lens, causal, window_size)
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full(q.shape[:2], _NEG_INF, dtype=torch.float32)
    if sinks is not None:
        lse[:] = sinks.float()  # rows of a sequence without keys: out 0, lse = the sink
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            continue  # no query, or no key
        o, s = attend_dense(q[rows].float()[None], k[keys].float()[None], v[keys].float()[None],
                            lo[None, rows], hi[None, rows], scale, softcap, sinks)
        out[rows], lse[rows] = o[0], s[0]
    return out, lse


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write K/V by slot (``block * block_size + offset``; -1 skips), in place.

    key, value ``[num_tokens, num_kv_heads, head_size]``; caches
    ``[num_blocks, block_size, num_kv_heads, head_size]``; slot_mapping int32 or int64
    ``[num_tokens]``. An fp8 cache gets ``quantize(key, k_scale)`` (``key / k_scale`` rounded to
    e4m3, saturated) and likewise for values; scales None, float32 ``[]`` or ``[num_kv_heads]``.
    Arguments are checked by ``dispatch.store_kv``.
    """
    if is_fp8(key_cache.dtype):
        key, value = quantize(key, k_scale), quantize(value, v_scale)
    write_slots(key, value, key_cache, value_cache, slot_mapping)
