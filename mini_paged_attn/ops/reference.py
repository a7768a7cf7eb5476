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
from ..core.args import cdiv
from .kv_quant import dequantize, index_cache, is_fp8, quantize
from .variants import NO_WINDOW, effective_right, visible_range

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# Every query row sees one run of its sequence's cache: positions lo .. hi-1 (a prefix when
# there is no left window).

def _visible_ranges(q_lens: torch.Tensor, k_lens: torch.Tensor, causal: bool,
                    window: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Per query row (varlen order): its sequence and the keys it sees, int64 [total_q] each:
    ``(seq, lo, hi)``, keys ``lo .. hi - 1``.

    Row t of a sequence sits at position ``k_len - q_len + t`` (bottom-right aligned; contiguous
    varlen allows q_len > k_len, whose first rows see nothing under causal).
    """
    seq = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=q_lens.device), q_lens)
    first_row = torch.cumsum(q_lens, 0) - q_lens
    t = torch.arange(seq.shape[0], device=q_lens.device) - first_row[seq]
    pos = k_lens[seq] - q_lens[seq] + t
    lo, hi = visible_range(pos, k_lens[seq], window[0], effective_right(window, causal))
    return seq, lo, hi


def _gather_paged(cache: torch.Tensor, block_tables: torch.Tensor, starts: torch.Tensor,
                  lens: torch.Tensor, max_len: int, scale: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Sequence ``i``'s cached tokens ``starts[i] .. starts[i] + lens[i] - 1``, float32
    ``[num_seqs, max_len, H_kv, D]`` (times ``scale``, ``[]`` or ``[H_kv]``, when given).

    Only (sequence, position) pairs inside that run are looked up, so no table entry or cache
    slot outside it is ever read; padding is 0.
    """
    block_size = cache.shape[1]
    valid = torch.arange(max_len, device=lens.device) < lens[:, None]  # [num_seqs, max_len]
    seq, col = torch.nonzero(valid, as_tuple=True)  # [num_tokens] each
    pos = starts[seq] + col
    blocks = block_tables[seq, pos // block_size].to(torch.int64)
    padded = cache.new_zeros((lens.shape[0], max_len, *cache.shape[2:]), dtype=torch.float32)
    padded[seq, col] = dequantize(index_cache(cache, blocks, pos % block_size), scale)
    return padded


def _scores(scores: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Scaled (and soft-capped) float32 scores."""
    scores = scores * scale
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


# ---------------------------------------------------------------------------------------------
# The two attention cores.

def _attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor,
                  hi: torch.Tensor, scale: float, softcap: float = 0.0,
                  sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of padded batches, float32.

    q ``[S, Lq, Hq, D]``; k, v ``[S, Lk, Hkv, D]`` (finite: padding is 0, never NaN);
    lo, hi int ``[S, Lq]``: row (s, t) sees keys ``lo .. hi - 1`` of its batch entry;
    sinks None or float32 ``[Hq]``. Returns out ``[S, Lq, Hq, D]`` and lse ``[S, Lq, Hq]``.
    """
    s_, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    qg = q.reshape(s_, lq, hkv, hq // hkv, d)  # query head h = kv_head * group + g
    scores = _scores(torch.einsum("sqkgd,slkd->skgql", qg, k), scale, softcap)
    # scores: [S, Hkv, G, Lq, Lk]
    keys = torch.arange(lk, device=q.device)
    visible = (keys >= lo[..., None]) & (keys < hi[..., None])  # [S, Lq, Lk]
    scores = scores.masked_fill(~visible[:, None, None], _NEG_INF)
    row_max = scores.amax(dim=-1, keepdim=True)
    sink = None if sinks is None else sinks.float().reshape(1, hkv, hq // hkv, 1, 1)
    if sink is not None:
        row_max = torch.maximum(row_max, sink)
    # A row with no visible key (and no sink) has max -inf; shift it by 0 so exp gives 0.
    row_max = torch.where(row_max == _NEG_INF, 0.0, row_max)
    p = torch.exp(scores - row_max)
    row_sum = p.sum(dim=-1)  # [S, Hkv, G, Lq]
    if sink is not None:
        row_sum = row_sum + torch.exp(sink - row_max)[..., 0]
    safe_sum = torch.where(row_sum > 0, row_sum, 1.0)
    out = torch.einsum("skgql,slkd->skgqd", p, v) / safe_sum[..., None]  # [S, Hkv, G, Lq, D]
    lse = row_max[..., 0] + torch.log(row_sum)  # log(0) = -inf for empty rows
    return (out.permute(0, 3, 1, 2, 4).reshape(s_, lq, hq, d),
            lse.permute(0, 3, 1, 2).reshape(s_, lq, hq))


def _attend_blockwise(q: torch.Tensor, seq: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                      key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, scale: float,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      softcap: float = 0.0, sinks: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax over the paged blocks, float32.

    q ``[R, Hq, D]``, one row per query token; seq int64 ``[R]``, its sequence; lo, hi int64
    ``[R]``: it sees keys ``lo .. hi - 1``. Walks logical block j from the first any row sees,
    reading physical block ``block_tables[seq, j]`` only for rows whose run overlaps block j.
    Per row it keeps the running max ``m``, the running sum ``l`` of ``exp(score - m)`` and the
    unnormalised output ``acc``; a block whose max raises ``m`` rescales ``l`` and ``acc`` by
    ``exp(m_old - m_new)``. A sink starts a row at ``m = sink, l = 1`` (a key of value 0).
    Returns out ``[R, Hq, D]`` and lse ``[R, Hq]``.
    """
    rows, hq, d = q.shape
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    qg = q.reshape(rows, hkv, hq // hkv, d)
    if sinks is None:
        m = q.new_full((rows, hkv, hq // hkv), _NEG_INF)  # [R, Hkv, G]
        l = q.new_zeros(m.shape)
    else:
        m = sinks.float().reshape(1, hkv, hq // hkv).expand(rows, -1, -1).clone()
        l = q.new_ones(m.shape)
    acc = q.new_zeros((*m.shape, d))  # [R, Hkv, G, D]
    nonempty = hi > lo
    first = int(lo[nonempty].min()) // block_size if bool(nonempty.any()) else 0
    last = cdiv(int(hi.max()), block_size) if rows else 0
    offsets = torch.arange(block_size, device=q.device)
    for j in range(first, last):
        begin = j * block_size
        active = torch.nonzero(nonempty & (hi > begin) & (lo < begin + block_size),
                               as_tuple=True)[0]  # [A]
        if active.numel() == 0:
            continue
        blocks = block_tables[seq[active], j].to(torch.int64)  # blocks some window overlaps
        pos = begin + offsets
        seen = (pos[None, :] >= lo[active, None]) & (pos[None, :] < hi[active, None])
        # Zero the slots a row must not see *before* the matmuls: 0 * NaN would be NaN.
        k = torch.where(seen[..., None, None],
                        dequantize(index_cache(key_cache, blocks), k_scale), 0.0)
        v = torch.where(seen[..., None, None],
                        dequantize(index_cache(value_cache, blocks), v_scale), 0.0)
        # k, v: [A, bs, Hkv, D]
        scores = _scores(torch.einsum("akgd,abkd->akgb", qg[active], k), scale, softcap)
        scores = scores.masked_fill(~seen[:, None, None, :], _NEG_INF)  # [A, Hkv, G, bs]
        m_old = m[active]
        m_new = torch.maximum(m_old, scores.amax(dim=-1))
        alpha = torch.exp(m_old - m_new)  # m_old = -inf: nothing accumulated yet, alpha 0
        p = torch.exp(scores - m_new[..., None])
        # Every active row sees >= 1 key of this block, so m_new is finite: no -inf - -inf.
        l[active] = alpha * l[active] + p.sum(dim=-1)
        acc[active] = alpha[..., None] * acc[active] + torch.einsum("akgb,abkd->akgd", p, v)
        m[active] = m_new
    out = acc / torch.where(l > 0, l, 1.0)[..., None]
    lse = torch.where(l > 0, m + torch.log(l), _NEG_INF)
    return out.reshape(rows, hq, d), lse.reshape(rows, hq)


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
    k = _gather_paged(key_cache, block_tables, lo, n, max_k, k_scale)
    v = _gather_paged(value_cache, block_tables, lo, n, max_k, v_scale)
    out, lse = _attend_dense(query.float()[:, None], k, v, torch.zeros_like(n)[:, None],
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
    return _attend_blockwise(query.float(), seq, lo, hi, key_cache, value_cache, block_tables,
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
    _, lo, hi = _visible_ranges(q_lens, k_lens, causal, window_size)
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
        k = _gather_paged(key_cache, block_tables[i:i + 1], start[None], n, max(int(n), 1),
                          k_scale)
        v = _gather_paged(value_cache, block_tables[i:i + 1], start[None], n, max(int(n), 1),
                          v_scale)
        o, s = _attend_dense(query[rows].float()[None], k, v, (lo[rows] - start)[None],
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
    seq, lo, hi = _visible_ranges(q_lens, context_lens.to(torch.int64), causal, window_size)
    return _attend_blockwise(query.float(), seq, lo, hi, key_cache, value_cache,
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
    _, lo, hi = _visible_ranges(q_lens, k_lens, causal, window_size)
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full(q.shape[:2], _NEG_INF, dtype=torch.float32)
    if sinks is not None:
        lse[:] = sinks.float()  # rows of a sequence without keys: out 0, lse = the sink
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            continue  # no query, or no key
        o, s = _attend_dense(q[rows].float()[None], k[keys].float()[None], v[keys].float()[None],
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
