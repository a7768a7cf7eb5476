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
  ``stored * scale`` from the cache (an fp8 cache, see :mod:`.kv_quant`); None reads it as is.

All functions are forward-only (``torch.no_grad``) and return float32 tensors; dispatch casts.
"""

from __future__ import annotations

import torch

from ..cache.slots import write_slots
from ..core.args import cdiv
from .kv_quant import dequantize, index_cache, is_fp8, quantize

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# Every query row sees a prefix of its sequence's cache: positions 0 .. n-1, where n is the
# context length (decode, or prefill without causal) or, causal, its own position plus one.

def _visible_counts(q_lens: torch.Tensor, k_lens: torch.Tensor,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row (varlen order): its sequence index and how many keys it sees, int64 [total_q].

    Causal is bottom-right aligned: row t of a sequence is position k_len - q_len + t and sees
    ``k_len - q_len + t + 1`` keys (at least 0; contiguous varlen allows q_len > k_len).
    """
    seq = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=q_lens.device), q_lens)
    if not causal:
        return seq, k_lens[seq]
    first_row = torch.cumsum(q_lens, 0) - q_lens
    t = torch.arange(seq.shape[0], device=q_lens.device) - first_row[seq]
    return seq, (k_lens[seq] - q_lens[seq] + t + 1).clamp(min=0)


def _gather_paged(cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor,
                  max_len: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence ``i``'s first ``lens[i]`` cached tokens, float32 ``[num_seqs, max_len, H_kv, D]``
    (times ``scale``, ``[]`` or ``[H_kv]``, when given).

    Only (sequence, position) pairs inside the length are looked up, so neither a table entry
    past a sequence's length nor a cache slot past it is ever read; padding is 0.
    """
    block_size = cache.shape[1]
    valid = torch.arange(max_len, device=lens.device) < lens[:, None]  # [num_seqs, max_len]
    seq, pos = torch.nonzero(valid, as_tuple=True)  # [num_tokens] each
    blocks = block_tables[seq, pos // block_size].to(torch.int64)
    padded = cache.new_zeros((lens.shape[0], max_len, *cache.shape[2:]), dtype=torch.float32)
    padded[seq, pos] = dequantize(index_cache(cache, blocks, pos % block_size), scale)
    return padded


# ---------------------------------------------------------------------------------------------
# The two attention cores.

def _attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_visible: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of padded batches, float32.

    q ``[S, Lq, Hq, D]``; k, v ``[S, Lk, Hkv, D]`` (finite: padding is 0, never NaN);
    n_visible int ``[S, Lq]``: row (s, t) sees keys ``0 .. n_visible[s, t] - 1``.
    Returns out ``[S, Lq, Hq, D]`` and lse ``[S, Lq, Hq]``.
    """
    s_, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    qg = q.reshape(s_, lq, hkv, hq // hkv, d)  # query head h = kv_head * group + g
    scores = torch.einsum("sqkgd,slkd->skgql", qg, k) * scale  # [S, Hkv, G, Lq, Lk]
    visible = torch.arange(lk, device=q.device) < n_visible[..., None]  # [S, Lq, Lk]
    scores = scores.masked_fill(~visible[:, None, None], _NEG_INF)
    row_max = scores.amax(dim=-1, keepdim=True)
    # A row with no visible key has max -inf; shift it by 0 so exp gives 0, not NaN.
    row_max = torch.where(row_max == _NEG_INF, 0.0, row_max)
    p = torch.exp(scores - row_max)
    row_sum = p.sum(dim=-1)  # [S, Hkv, G, Lq]
    safe_sum = torch.where(row_sum > 0, row_sum, 1.0)
    out = torch.einsum("skgql,slkd->skgqd", p, v) / safe_sum[..., None]  # [S, Hkv, G, Lq, D]
    lse = row_max[..., 0] + torch.log(row_sum)  # log(0) = -inf for empty rows
    return (out.permute(0, 3, 1, 2, 4).reshape(s_, lq, hq, d),
            lse.permute(0, 3, 1, 2).reshape(s_, lq, hq))


def _attend_blockwise(q: torch.Tensor, seq: torch.Tensor, n_visible: torch.Tensor,
                      key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, scale: float,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax over the paged blocks, float32.

    q ``[R, Hq, D]``, one row per query token; seq int64 ``[R]``, its sequence; n_visible int64
    ``[R]``, the keys it sees (positions ``0 .. n-1``). Walks logical block j = 0, 1, ... for all
    rows that still see keys there, reading physical block ``block_tables[seq, j]``. Per row it
    keeps the running max ``m``, the running sum ``l`` of ``exp(score - m)`` and the unnormalised
    output ``acc``; a block whose max raises ``m`` rescales ``l`` and ``acc`` by
    ``exp(m_old - m_new)``. Returns out ``[R, Hq, D]`` and lse ``[R, Hq]``.
    """
    rows, hq, d = q.shape
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    qg = q.reshape(rows, hkv, hq // hkv, d)
    m = q.new_full((rows, hkv, hq // hkv), _NEG_INF)  # [R, Hkv, G]
    l = q.new_zeros(m.shape)
    acc = q.new_zeros((*m.shape, d))  # [R, Hkv, G, D]
    num_logical = cdiv(int(n_visible.max()), block_size) if rows else 0
    offsets = torch.arange(block_size, device=q.device)
    for j in range(num_logical):
        active = torch.nonzero(n_visible > j * block_size, as_tuple=True)[0]  # [A]
        blocks = block_tables[seq[active], j].to(torch.int64)  # entries within each length only
        seen = (j * block_size + offsets)[None, :] < n_visible[active, None]  # [A, block_size]
        # Zero the slots a row must not see *before* the matmuls: 0 * NaN would be NaN.
        k = torch.where(seen[..., None, None],
                        dequantize(index_cache(key_cache, blocks), k_scale), 0.0)
        v = torch.where(seen[..., None, None],
                        dequantize(index_cache(value_cache, blocks), v_scale), 0.0)
        # k, v: [A, bs, Hkv, D]
        scores = torch.einsum("akgd,abkd->akgb", qg[active], k) * scale  # [A, Hkv, G, bs]
        scores = scores.masked_fill(~seen[:, None, None, :], _NEG_INF)
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
# Public reference ops.

@torch.no_grad()
def paged_decode_gather(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                        scale: float, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention by gather + dense float32 softmax, all sequences at once.

    Args:
        query: ``[num_seqs, num_q_heads, head_size]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        context_lens: int32 ``[num_seqs]``.
        scale: softmax scale.
        k_scale, v_scale: None or float32 ``[]`` / ``[num_kv_heads]``: dequantization scales.

    Returns:
        out float32 ``[num_seqs, num_q_heads, head_size]``, lse float32 ``[num_seqs, num_q_heads]``.
    """
    k_lens = context_lens.to(torch.int64)
    # Pad to the longest context (at least 1 so the key dim is never empty; padding is masked).
    max_k = max(int(k_lens.max()) if k_lens.numel() else 0, 1)
    k = _gather_paged(key_cache, block_tables, k_lens, max_k, k_scale)
    v = _gather_paged(value_cache, block_tables, k_lens, max_k, v_scale)
    out, lse = _attend_dense(query.float()[:, None], k, v, k_lens[:, None], scale)
    return out[:, 0], lse[:, 0]


@torch.no_grad()
def paged_decode_blockwise(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, *, scale: float,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention by a block-wise online softmax; same arguments and results as
    :func:`paged_decode_gather`."""
    k_lens = context_lens.to(torch.int64)
    seq = torch.arange(k_lens.shape[0], device=k_lens.device)
    return _attend_blockwise(query.float(), seq, k_lens, key_cache, value_cache, block_tables,
                             scale, k_scale, v_scale)


@torch.no_grad()
def paged_prefill_gather(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         context_lens: torch.Tensor, *, causal: bool, scale: float,
                         k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen prefill attention over paged K/V: per sequence, gather + dense float32 softmax.

    One sequence at a time, because padding every sequence to the longest query *and* the longest
    context (a long prompt batched with many decode rows) would cost max_q x max_k per sequence.

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

    Returns:
        out float32 ``[total_q, num_q_heads, head_size]``, lse float32 ``[total_q, num_q_heads]``.
    """
    k_lens = context_lens.to(torch.int64)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    _, n_visible = _visible_counts(q_lens, k_lens, causal)
    out = query.new_zeros(query.shape, dtype=torch.float32)
    lse = query.new_full(query.shape[:2], _NEG_INF, dtype=torch.float32)
    cu = cu_seqlens_q.tolist()
    for i, k_len in enumerate(k_lens.tolist()):
        rows = slice(cu[i], cu[i + 1])
        if rows.start == rows.stop:
            continue
        k = _gather_paged(key_cache, block_tables[i:i + 1], k_lens[i:i + 1], max(k_len, 1),
                          k_scale)
        v = _gather_paged(value_cache, block_tables[i:i + 1], k_lens[i:i + 1], max(k_len, 1),
                          v_scale)
        o, s = _attend_dense(query[rows].float()[None], k, v, n_visible[None, rows], scale)
        out[rows], lse[rows] = o[0], s[0]
    return out, lse


@torch.no_grad()
def paged_prefill_blockwise(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, *,
                            causal: bool, scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen prefill attention by a block-wise online softmax over all query rows at once;
    same arguments and results as :func:`paged_prefill_gather`."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    seq, n_visible = _visible_counts(q_lens, context_lens.to(torch.int64), causal)
    return _attend_blockwise(query.float(), seq, n_visible, key_cache, value_cache,
                             block_tables, scale, k_scale, v_scale)


@torch.no_grad()
def varlen_attention_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                                causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention over contiguous K/V (FlashAttention's ``flash_attn_varlen_func``).

    Args:
        q: ``[total_q, num_q_heads, head_size]``.
        k, v: ``[total_k, num_kv_heads, head_size]``; sequence i's keys are rows
            ``cu_seqlens_k[i] .. cu_seqlens_k[i+1]-1``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[num_seqs + 1]``.
        causal: bottom-right aligned; with ``q_len > k_len`` the first ``q_len - k_len`` rows
            see no key and give 0 (lse ``-inf``).
        scale: softmax scale.

    Returns:
        out float32 ``[total_q, num_q_heads, head_size]``, lse float32 ``[total_q, num_q_heads]``.
    """
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    _, n_visible = _visible_counts(q_lens, k_lens, causal)
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full(q.shape[:2], _NEG_INF, dtype=torch.float32)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            continue  # no query, or no key: zeros and -inf
        o, s = _attend_dense(q[rows].float()[None], k[keys].float()[None], v[keys].float()[None],
                             n_visible[None, rows], scale)
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
