"""``flash_attn_with_kvcache``: a drop-in for FlashAttention's function of that name.

Incremental decoding over a KV cache in one call: optionally rotate q and the new k (rotary
embedding at each row's cache position), append the new k / v into the cache in place, then
attend over the cache. Here those are the project's ops, not one kernel: :func:`~.fused.
apply_rotary`, :func:`~.dispatch.store_kv`, then :func:`~.dispatch.paged_decode` (one query a
row, split-KV) or :func:`~.dispatch.paged_prefill` (more), all on the backend ``backend``
names.

A non-paged cache ``[batch_cache, seqlen_cache, heads_k, d]`` already has the paged layout
``[num_blocks, block_size, heads_k, d]`` with one block per cache row: the kernels read any
block size (their K/V tiles do not depend on it) and any strides on the first three dims, so
the cache is attended and written in place through a one-column block table
(``cache_batch_idx`` or ``0 .. batch - 1``). Viewing it as contiguous varlen K/V instead would
need the rows back to back, which a row's unused tail breaks.
"""

from __future__ import annotations

import torch

from .backend import resolve_backend
from .dispatch import paged_decode, paged_prefill, store_kv
from .fused import apply_rotary
from .kvcache_checks import KVCacheCall, check_kvcache_args, check_kvcache_values


def _rotary(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
            interleaved: bool, backend: str) -> torch.Tensor:
    """``x [n, heads, d]`` rotated at ``positions [n]`` by ``table [seqlen_ro, rotary_dim]``
    (cosines, then sines). :func:`~.fused.apply_rotary` rotates the (i, i + R/2) pairs; the
    interleaved (2i, 2i + 1) pairs are the same rotation on the first R dims reordered evens
    first, so x is reordered, rotated and put back."""
    rotary_dim = table.shape[1]
    if interleaved:
        order = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                           torch.arange(rotary_dim, x.shape[-1])]).to(x.device)
        x = x.index_select(-1, order)
    # apply_rotary rotates a q and a k together; x is the k of a one-head q here.
    _, rotated = apply_rotary(x[:, :1], x, positions, table, backend=backend)
    if interleaved:
        rotated = rotated.index_select(-1, torch.argsort(order))
    return rotated


def _rotary_positions(call: KVCacheCall, cache_seqlens: torch.Tensor,
                      causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 positions of q's ``batch * seqlen_q`` rows and the new k's ``batch *
    seqlen_new`` rows: the new tokens sit at ``cache_seqlens + i``; q does too under a causal
    or local mask, else every query row sits at ``cache_seqlens`` (FlashAttention's rule; a
    window of at least the cache's capacity is no window, as there)."""
    start = cache_seqlens.to(torch.int64)[:, None]
    k_pos = (start + torch.arange(call.seqlen_new, device=start.device)).flatten()
    local = any(0 <= w < call.capacity for w in call.window)
    offsets = torch.arange(call.seqlen_q, device=start.device)
    q_pos = (start + offsets if causal or local else start.expand(-1, call.seqlen_q))
    return q_pos.flatten(), k_pos


def _append_slots(call: KVCacheCall, cache_seqlens: torch.Tensor,
                  table: torch.Tensor) -> torch.Tensor:
    """int64 ``[batch * seqlen_new]`` slots of the new tokens (``block * page + offset``) at
    positions ``cache_seqlens + i``; -1 (skipped by ``store_kv``) for a position past the
    row's capacity, which the kernels' path does not check (a host sync), so that a bad length
    never writes into another row's memory."""
    pos = cache_seqlens.to(torch.int64)[:, None] + torch.arange(call.seqlen_new,
                                                                device=table.device)
    column = torch.div(pos, call.page, rounding_mode="floor")
    inside = (pos >= 0) & (column < table.shape[1])
    blocks = table.to(torch.int64).gather(1, column.clamp(0, table.shape[1] - 1))
    slots = blocks * call.page + pos % call.page
    return torch.where(inside, slots, -1).flatten()


def _shifted(cache: torch.Tensor, rows: torch.Tensor, leftpad: torch.Tensor) -> torch.Tensor:
    """A copy of each batch row's cache row shifted left by its ``leftpad``: ``[batch,
    seqlen_cache, heads_k, d]``; positions past the row's end repeat its last slot (never
    read: the lengths end before)."""
    width = cache.shape[1]
    cols = (leftpad.to(torch.int64)[:, None] + torch.arange(width, device=cache.device))
    return cache[rows.to(torch.int64)[:, None], cols.clamp(max=width - 1)]


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, backend="auto"):
    """Attention of q over a KV cache, appending new K/V first: FlashAttention's
    ``flash_attn_with_kvcache`` (same positional order and defaults; forward only).

    Args:
        q: ``[batch, seqlen_q, num_heads, head_size]``, fp16 / bf16 / fp32 (a strided last
            dim is copied, as FlashAttention does; so are k and v's).
        k_cache, v_cache: ``[batch_cache, seqlen_cache, num_kv_heads, head_size]``, or with
            ``block_table`` paged ``[num_blocks, page_size, num_kv_heads, head_size]`` (any
            page size; FlashAttention wants multiples of 256); q's dtype and device, last dim
            contiguous, any other strides. Written in place where k / v are given.
        k, v: None, or the new tokens ``[batch, seqlen_new, num_kv_heads, head_size]``,
            written into the cache at positions ``cache_seqlens .. cache_seqlens +
            seqlen_new - 1`` of each row; the attention then covers them too. Nothing else
            in the cache changes.
        rotary_cos, rotary_sin: None, or ``[seqlen_ro, rotary_dim / 2]`` in q's dtype
            (``rotary_dim`` even, <= head_size; ``seqlen_ro`` at least the cache's tokens a
            row), with k / v only: the new k is rotated at its positions, q at
            ``cache_seqlens + i`` under a causal or local mask, else all at ``cache_seqlens``.
        cache_seqlens: None (every row holds the cache's full length; not with k / v), an
            int, or int32 ``[batch]``: tokens in each row's cache before the new ones,
            counted from slot 0 (``cache_leftpad`` included).
        cache_batch_idx: None or int32 ``[batch]``: the cache row of each batch row
            (non-paged caches; default ``0 .. batch - 1``). Rows given twice with k / v get
            the new tokens of either.
        cache_leftpad: None or int32 ``[batch]`` (non-paged caches): a row's keys start at
            this slot. Deviation: the rows in use are copied, shifted left, for the
            attention (the kernels read every sequence from its first slot); the append and
            the rotary positions use the cache itself.
        block_table: None, or int32 ``[batch, max_blocks_per_seq]`` for a paged cache.
        softmax_scale: default ``head_size ** -0.5``.
        causal: bottom-right aligned: query ``t`` sees keys up to ``k_len - seqlen_q + t``.
        window_size, softcap: as in :func:`~.varlen.flash_attn_varlen_func`.
        rotary_interleaved: rotate the (2i, 2i + 1) pairs (GPT-J) if True, else the
            (i, i + rotary_dim / 2) pairs (GPT-NeoX).
        alibi_slopes: only None; else NotImplementedError.
        num_splits: 0 (the decode planner's heuristic) or the split count of the KV
            sequence for one query a row on the triton backend (1: no split). The torch
            backend and calls of several queries a row (the prefill kernel, which does not
            split) ignore it.
        return_softmax_lse: also return the lse.
        backend: keyword only; "auto" | "torch" | "triton" for every op of the call.

    Returns:
        out ``[batch, seqlen_q, num_heads, head_size]`` in q's dtype, or ``(out, lse)``:
        lse float32 ``[batch, num_heads, seqlen_q]``, ``-inf`` for a row that sees no key.

    Deviation: each row needs at least ``seqlen_q`` keys (``cache_seqlens -
    cache_leftpad + seqlen_new``): the queries are the last tokens, as in ``paged_prefill``.

    Raises:
        ValueError: bad shapes, dtypes, devices or options, before anything is written; the
            torch backend also reads the lengths, indices and block ids and checks them
            (the kernels do not: a host sync, and FlashAttention does not either).
        NotImplementedError: ``alibi_slopes``.
    """
    call = check_kvcache_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                              cache_batch_idx, cache_leftpad, block_table, softmax_scale,
                              causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                              num_splits, return_softmax_lse)
    chosen = resolve_backend(backend, q.device)
    if cache_seqlens is None or isinstance(cache_seqlens, int):
        fill = call.capacity if cache_seqlens is None else cache_seqlens
        cache_seqlens = torch.full((call.batch,), fill, dtype=torch.int32, device=q.device)
    if call.paged:
        table = block_table
    else:
        rows = (cache_batch_idx if cache_batch_idx is not None
                else torch.arange(call.batch, dtype=torch.int32, device=q.device))
        table = rows.view(call.batch, 1)
    if chosen == "torch":
        check_kvcache_values(call, cache_seqlens, cache_batch_idx, cache_leftpad, block_table)

    # FlashAttention copies a q, k or v whose last dim is strided rather than refusing it.
    q, k, v = (x if x is None or x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    q_rows = q.reshape(call.batch * call.seqlen_q, call.num_heads, call.head_size)
    if k is not None:
        k_rows = k.reshape(-1, call.num_kv_heads, call.head_size)
        v_rows = v.reshape(-1, call.num_kv_heads, call.head_size)
        if rotary_cos is not None:
            rotary = torch.cat([rotary_cos, rotary_sin], dim=-1)
            q_pos, k_pos = _rotary_positions(call, cache_seqlens, causal)
            q_rows = _rotary(q_rows, q_pos, rotary, rotary_interleaved, backend)
            k_rows = _rotary(k_rows, k_pos, rotary, rotary_interleaved, backend)
        store_kv(k_rows, v_rows, k_cache, v_cache, _append_slots(call, cache_seqlens, table),
                 backend=backend)

    key_cache, value_cache, k_lens = k_cache, v_cache, cache_seqlens + call.seqlen_new
    if cache_leftpad is not None:
        key_cache = _shifted(k_cache, table[:, 0], cache_leftpad)
        value_cache = _shifted(v_cache, table[:, 0], cache_leftpad)
        table = torch.arange(call.batch, dtype=torch.int32, device=q.device).view(-1, 1)
        k_lens = k_lens - cache_leftpad
    k_lens = k_lens.to(torch.int32)
    variant = dict(scale=call.scale, return_lse=return_softmax_lse, backend=backend,
                   window_size=call.window, softcap=call.softcap)
    if call.seqlen_q == 1:
        # One query a row sits at its row's last key: causal or not, it sees them all.
        splits = num_splits if num_splits > 0 and chosen != "torch" else None
        result = paged_decode(q_rows.contiguous(), key_cache, value_cache, table, k_lens,
                              num_splits=splits, **variant)
    else:
        cu_q = torch.arange(0, (call.batch + 1) * call.seqlen_q, call.seqlen_q,
                            dtype=torch.int32, device=q.device)
        result = paged_prefill(q_rows, key_cache, value_cache, table, cu_q, k_lens,
                               causal=causal, max_seqlen_q=call.seqlen_q, **variant)
    out, lse = result if return_softmax_lse else (result, None)
    out = out.view(call.batch, call.seqlen_q, call.num_heads, call.head_size)
    if lse is None:
        return out
    # [batch * seqlen_q, num_heads] -> FlashAttention's [batch, num_heads, seqlen_q].
    lse = lse.view(call.batch, call.seqlen_q, call.num_heads).transpose(1, 2).contiguous()
    return out, lse


__all__ = ["flash_attn_with_kvcache"]
