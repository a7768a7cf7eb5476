"""The two attention cores of the torch reference, and the paged gather they read through.

- :func:`attend_dense`: masked float32 softmax over padded, already gathered K/V (the
  ``*_gather`` ops of :mod:`.reference`);
- :func:`attend_blockwise`: an online softmax walking the paged blocks (the ``*_blockwise``
  ops), the shape of what the Triton kernels do.

Separate from :mod:`.reference`, which holds the op-shaped entry points (arguments as the
dispatcher's) and the specification they share: here is only the arithmetic, on rows that each
see one run of keys ``lo .. hi - 1``.
"""

from __future__ import annotations

import torch

from ..core.args import cdiv
from .kv_quant import dequantize, index_cache
from .variants import effective_right, visible_range

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# Every query row sees one run of its sequence's cache: positions lo .. hi-1 (a prefix when
# there is no left window).

def visible_ranges(q_lens: torch.Tensor, k_lens: torch.Tensor, causal: bool,
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


def gather_paged(cache: torch.Tensor, block_tables: torch.Tensor, starts: torch.Tensor,
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

def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor,
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


def attend_blockwise(q: torch.Tensor, seq: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
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


__all__ = ["visible_ranges", "gather_paged", "attend_dense", "attend_blockwise"]
