"""The paged attention specification in plain PyTorch, in two independent implementations.

- ``*_gather``: gather each sequence's keys and values through its block table into a padded
  dense tensor, then one float32 softmax per row. The obvious algorithm; the one dispatch runs.
- ``*_blockwise``: walk the logical blocks of all sequences in step and keep an online softmax
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
  reach the result (unused memory may hold NaN).

All functions are forward-only (``torch.no_grad``) and return float32 tensors; dispatch casts.
"""

from __future__ import annotations

import torch

from ..cache.slots import write_slots

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# Padding helpers: varlen <-> [num_seqs, max_len, ...] with a validity mask.

def _lengths(lens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """int64 copy of ``lens`` and its max (at least 1, so padded dims are never empty)."""
    lens = lens.to(torch.int64)
    return lens, max(int(lens.max()) if lens.numel() else 0, 1)


def _valid(lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """bool ``[num_seqs, max_len]``: position < length."""
    return torch.arange(max_len, device=lens.device) < lens[:, None]


def _pad_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[total, H, D]`` (sequence i at rows cu[i]..cu[i+1]) -> float32 ``[num_seqs, max_len, H, D]``
    with zeros in the padding."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    valid = _valid(lens, max_len)
    padded = x.new_zeros((lens.shape[0], max_len, *x.shape[1:]), dtype=torch.float32)
    # Boolean-mask assignment fills valid positions in row-major order: sequence by sequence,
    # position by position, which is exactly the varlen order of x's rows.
    padded[valid] = x[int(cu_seqlens[0]):int(cu_seqlens[-1])].float()
    return padded


def _unpad_varlen(padded: torch.Tensor, q_lens: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pad_varlen`: ``[num_seqs, max_len, ...]`` -> ``[total, ...]``."""
    return padded[_valid(q_lens, padded.shape[1])]


def _gather_paged(cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor,
                  max_len: int) -> torch.Tensor:
    """Sequence ``i``'s first ``lens[i]`` cached tokens, float32 ``[num_seqs, max_len, H_kv, D]``.

    Only (sequence, position) pairs inside the length are looked up, so neither a table entry
    past a sequence's length nor a cache slot past it is ever read; padding is 0.
    """
    block_size = cache.shape[1]
    valid = _valid(lens, max_len)
    seq, pos = torch.nonzero(valid, as_tuple=True)  # [num_tokens] each
    blocks = block_tables[seq, pos // block_size].to(torch.int64)
    padded = cache.new_zeros((lens.shape[0], max_len, *cache.shape[2:]), dtype=torch.float32)
    padded[seq, pos] = cache[blocks, pos % block_size].float()
    return padded


# ---------------------------------------------------------------------------------------------
# The two attention cores, on padded queries [num_seqs, max_q, num_q_heads, head_size].

def _key_mask(q_lens: torch.Tensor, k_lens: torch.Tensor, max_q: int, max_k: int,
              causal: bool) -> torch.Tensor:
    """bool ``[num_seqs, max_q, max_k]``: may query row t of sequence i see key position p?"""
    t = torch.arange(max_q, device=k_lens.device)[None, :, None]
    p = torch.arange(max_k, device=k_lens.device)[None, None, :]
    mask = p < k_lens[:, None, None]
    if causal:
        # Bottom-right: the last query row is the last key; row t sits at k_len - q_len + t.
        mask = mask & (p <= (k_lens - q_lens)[:, None, None] + t)
    return mask


def _attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention, float32.

    q ``[S, Lq, Hq, D]``; k, v ``[S, Lk, Hkv, D]`` (zeros where masked, never NaN);
    mask bool ``[S, Lq, Lk]``. Returns out ``[S, Lq, Hq, D]`` and lse ``[S, Lq, Hq]``.
    """
    s_, lq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(s_, lq, hkv, hq // hkv, d)  # query head h = kv_head * group + g
    scores = torch.einsum("sqkgd,slkd->skgql", qg, k) * scale  # [S, Hkv, G, Lq, Lk]
    scores = scores.masked_fill(~mask[:, None, None], _NEG_INF)
    row_max = scores.amax(dim=-1, keepdim=True)
    # A row with no visible key has max -inf; shift it by 0 so exp gives 0, not NaN.
    row_max = torch.where(row_max == _NEG_INF, 0.0, row_max)
    p = torch.exp(scores - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)  # [S, Hkv, G, Lq, 1]
    out = torch.einsum("skgql,slkd->sqkgd", p / torch.where(row_sum > 0, row_sum, 1.0), v)
    lse = (row_max + torch.log(row_sum))[..., 0]  # log(0) = -inf for empty rows
    return out.reshape(s_, lq, hq, d), lse.permute(0, 3, 1, 2).reshape(s_, lq, hq)


def _attend_blockwise(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, q_lens: torch.Tensor, k_lens: torch.Tensor,
                      causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax over the paged blocks, float32.

    q ``[S, Lq, Hq, D]`` (padded); walks logical block j = 0, 1, ... of every sequence still that
    long, reading its physical block once for all query rows and heads. Per row it keeps the
    running max ``m``, the running sum ``l`` of ``exp(score - m)`` and the unnormalised output
    ``acc``; a new block with max ``m_j`` rescales both by ``exp(m - max(m, m_j))``.
    """
    s_, lq, hq, d = q.shape
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    qg = q.reshape(s_, lq, hkv, hq // hkv, d)
    m = q.new_full((s_, hkv, hq // hkv, lq), _NEG_INF)  # [S, Hkv, G, Lq]
    l = q.new_zeros(m.shape)
    acc = q.new_zeros((*m.shape, d))  # [S, Hkv, G, Lq, D]
    num_logical = int(-(-int(k_lens.max()) // block_size)) if k_lens.numel() else 0
    offsets = torch.arange(block_size, device=q.device)
    for j in range(num_logical):
        active = torch.nonzero(k_lens > j * block_size, as_tuple=True)[0]  # [A]
        blocks = block_tables[active, j].to(torch.int64)  # only entries within each length
        pos = j * block_size + offsets  # [block_size] cache positions of this block
        in_len = pos[None, :] < k_lens[active, None]  # [A, block_size]
        # Zero the slots past the length *before* the matmuls (0 * NaN would be NaN).
        k = torch.where(in_len[..., None, None], key_cache[blocks].float(), 0.0)
        v = torch.where(in_len[..., None, None], value_cache[blocks].float(), 0.0)
        mask = in_len[:, None, :].expand(-1, lq, -1)  # [A, Lq, block_size]
        if causal:
            t = torch.arange(lq, device=q.device)[None, :, None]
            last_visible = (k_lens[active] - q_lens[active])[:, None, None] + t
            mask = mask & (pos[None, None, :] <= last_visible)
        scores = torch.einsum("aqkgd,abkd->akgqb", qg[active], k) * scale  # [A, Hkv, G, Lq, bs]
        scores = scores.masked_fill(~mask[:, None, None], _NEG_INF)
        m_old = m[active]
        m_new = torch.maximum(m_old, scores.amax(dim=-1))
        m_safe = torch.where(m_new == _NEG_INF, 0.0, m_new)  # rows with no key yet
        alpha = torch.exp(m_old - m_safe)  # rescales what was accumulated; 0 when m_old = -inf
        p = torch.exp(scores - m_safe[..., None])
        l[active] = alpha * l[active] + p.sum(dim=-1)
        acc[active] = alpha[..., None] * acc[active] + torch.einsum("akgqb,abkd->akgqd", p, v)
        m[active] = m_new
    out = acc / torch.where(l > 0, l, 1.0)[..., None]
    lse = torch.where(l > 0, m + torch.log(l), _NEG_INF)
    return (out.permute(0, 3, 1, 2, 4).reshape(s_, lq, hq, d),
            lse.permute(0, 3, 1, 2).reshape(s_, lq, hq))


# ---------------------------------------------------------------------------------------------
# Public reference ops.

@torch.no_grad()
def paged_decode_gather(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention by gather + dense float32 softmax.

    Args:
        query: ``[num_seqs, num_q_heads, head_size]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        context_lens: int32 ``[num_seqs]``.
        scale: softmax scale.

    Returns:
        out float32 ``[num_seqs, num_q_heads, head_size]``, lse float32 ``[num_seqs, num_q_heads]``.
    """
    k_lens, max_k = _lengths(context_lens)
    k = _gather_paged(key_cache, block_tables, k_lens, max_k)
    v = _gather_paged(value_cache, block_tables, k_lens, max_k)
    mask = _valid(k_lens, max_k)[:, None, :]  # [S, 1, Lk]: the one query sees every cached key
    out, lse = _attend_dense(query.float()[:, None], k, v, mask, scale)
    return out[:, 0], lse[:, 0]


@torch.no_grad()
def paged_decode_blockwise(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, *,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention by a block-wise online softmax; same arguments and results as
    :func:`paged_decode_gather`."""
    k_lens = context_lens.to(torch.int64)
    q_lens = torch.ones_like(k_lens)
    out, lse = _attend_blockwise(query.float()[:, None], key_cache, value_cache, block_tables,
                                 q_lens, k_lens, causal=False, scale=scale)
    return out[:, 0], lse[:, 0]


@torch.no_grad()
def paged_prefill_gather(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         context_lens: torch.Tensor, *, causal: bool,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen prefill attention over paged K/V by gather + dense float32 softmax.

    Args:
        query: ``[total_q, num_q_heads, head_size]``; sequence i's rows are
            ``cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        cu_seqlens_q: int32 ``[num_seqs + 1]``, from 0 to total_q.
        context_lens: int32 ``[num_seqs]``, ``>= q_len`` per sequence.
        causal: bottom-right aligned causal mask.
        scale: softmax scale.

    Returns:
        out float32 ``[total_q, num_q_heads, head_size]``, lse float32 ``[total_q, num_q_heads]``.
    """
    k_lens, max_k = _lengths(context_lens)
    q_lens, max_q = _lengths(cu_seqlens_q[1:] - cu_seqlens_q[:-1])
    k = _gather_paged(key_cache, block_tables, k_lens, max_k)
    v = _gather_paged(value_cache, block_tables, k_lens, max_k)
    q = _pad_varlen(query, cu_seqlens_q, max_q)
    out, lse = _attend_dense(q, k, v, _key_mask(q_lens, k_lens, max_q, max_k, causal), scale)
    return _unpad_varlen(out, q_lens), _unpad_varlen(lse, q_lens)


@torch.no_grad()
def paged_prefill_blockwise(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, *,
                            causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen prefill attention by a block-wise online softmax; same arguments and results as
    :func:`paged_prefill_gather`."""
    k_lens = context_lens.to(torch.int64)
    q_lens, max_q = _lengths(cu_seqlens_q[1:] - cu_seqlens_q[:-1])
    q = _pad_varlen(query, cu_seqlens_q, max_q)
    out, lse = _attend_blockwise(q, key_cache, value_cache, block_tables, q_lens, k_lens,
                                 causal=causal, scale=scale)
    return _unpad_varlen(out, q_lens), _unpad_varlen(lse, q_lens)


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
    q_lens, max_q = _lengths(cu_seqlens_q[1:] - cu_seqlens_q[:-1])
    k_lens, max_k = _lengths(cu_seqlens_k[1:] - cu_seqlens_k[:-1])
    out, lse = _attend_dense(_pad_varlen(q, cu_seqlens_q, max_q), _pad_varlen(k, cu_seqlens_k, max_k),
                             _pad_varlen(v, cu_seqlens_k, max_k),
                             _key_mask(q_lens, k_lens, max_q, max_k, causal), scale)
    return _unpad_varlen(out, q_lens), _unpad_varlen(lse, q_lens)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write K/V by slot (``block * block_size + offset``; -1 skips), in place.

    key, value ``[num_tokens, num_kv_heads, head_size]``; caches
    ``[num_blocks, block_size, num_kv_heads, head_size]``; slot_mapping int32/int64 ``[num_tokens]``.
    """
    write_slots(key, value, key_cache, value_cache, slot_mapping)
