"""Cascade (shared-prefix) attention, composed of the paged ops.

Requests that share a long prefix (a system prompt, the ``n`` samples of one prompt) each read
the prefix's K/V at every step when attended the plain way. Cascade attention splits each
query's keys into two disjoint sets and attends over each apart:

- the *prefix* of a group of sequences, attended once per group: one non-causal
  :func:`~.dispatch.paged_prefill` over all groups, whose query rows are the group's tokens with
  the query heads of one KV head packed into the row dimension (``[T, Hq, D]`` viewed as
  ``[T * gs, Hkv, D]``, gs = Hq / Hkv), so a KV head's prefix is read once per query tile
  instead of once per sequence and query head;
- each sequence's own *suffix*: :func:`~.dispatch.paged_decode` (one query row per sequence)
  or a causal :func:`~.dispatch.paged_prefill`;

and combines the two with their log-sum-exps (:func:`~.merge.merge_attention_states`). The
prefix precedes every suffix, so every query of a group sees all of its prefix: no mask.
Attention sinks enter the suffix call only, so the merged denominator counts them once. On
the Triton backend the merge is one launch (:mod:`.cascade_merge`), in place over the suffix part.

The result equals plain attention over the prefix followed by the suffix; the saving is the
prefix's K/V traffic (docs/performance-notes.md, "Cascade").
"""

from __future__ import annotations

import torch

from .backend import resolve_backend
from .cascade_checks import CascadeShapes, check_cascade_args, check_cascade_values
from .dispatch import paged_decode, paged_prefill
from .merge import merge_attention_states


def cascade_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, *, prefix_block_tables: torch.Tensor,
                      prefix_lens: torch.Tensor, cu_group_tokens: torch.Tensor,
                      group_tokens: torch.Tensor, suffix_block_tables: torch.Tensor,
                      suffix_lens: torch.Tensor, decode_only: bool,
                      scale: float | None = None, out: torch.Tensor | None = None,
                      backend: str = "auto", k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, softcap: float = 0.0,
                      sinks: torch.Tensor | None = None, seq_order: torch.Tensor | None = None,
                      workspace: torch.Tensor | None = None,
                      num_splits: int | None = None) -> torch.Tensor:
    """Attention of a varlen batch whose sequences share prefixes by groups.

    Sequence ``i``'s keys are its group's prefix (none if it is in no group) followed by its own
    suffix; its ``q_len_i`` query rows are the last tokens of the suffix (bottom-right causal
    within the suffix, the whole prefix visible to every row).

    Args:
        query: ``[total_q, num_q_heads, head_size]``, fp16 / bf16 / fp32, last dim contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]`` in the
            query's dtype or ``torch.float8_e4m3fn``, as in :func:`~.dispatch.paged_decode`.
        cu_seqlens_q: int32 ``[num_seqs + 1]``, cumulative query rows per sequence (with
            ``decode_only``, ``0, 1, .., num_seqs``).
        prefix_block_tables: int32 ``[num_groups, max_prefix_blocks]``: group g's shared prefix
            is its first ``prefix_lens[g]`` tokens through row g.
        prefix_lens: int32 ``[num_groups]``, prefix tokens per group (0 is valid).
        cu_group_tokens: int32 ``[num_groups + 1]``, cumulative counts of ``group_tokens``.
        group_tokens: int32 ``[num_grouped_tokens]``, the query rows (indices into ``query``)
            of each group's sequences, group after group, each row at most once; rows left
            out have no prefix part.
        suffix_block_tables: int32 ``[num_seqs, max_suffix_blocks]``.
        suffix_lens: int32 ``[num_seqs]``, each sequence's own tokens (its query rows
            included). With ``decode_only`` a suffix may hold 0 keys (the query then sees its
            prefix only); else ``q_len_i <= suffix_lens[i]``.
        decode_only: one query row per sequence: the suffix runs :func:`~.dispatch.paged_decode`
            (and takes ``seq_order``, ``workspace``, ``num_splits``), else a causal
            :func:`~.dispatch.paged_prefill`.
        scale: softmax scale, default ``head_size ** -0.5``.
        out: optional ``[total_q, num_q_heads, head_size]`` tensor in the query's dtype to write.
        backend: "auto" | "torch" | "triton", for both parts.
        k_scale, v_scale: an fp8 cache's scales, as in :func:`~.dispatch.paged_decode`.
        softcap: ``>= 0``, logit soft-capping (0: off), both parts.
        sinks: None or float32 ``[num_q_heads]``: a per-head logit in the softmax denominator,
            counted once.
        seq_order, workspace, num_splits: the suffix decode's, as in
            :func:`~.dispatch.paged_decode`; None unless ``decode_only``.

    No sliding windows: a windowed layer attends the plain way.

    Each part's output is rounded to the query's dtype before the merge (which weighs them in
    float32), so a grouped row may differ from the plain op's by a unit or two in the last
    place of that dtype.

    Returns:
        ``[total_q, num_q_heads, head_size]`` in the query's dtype (``out`` when given).

    Raises:
        ValueError: bad shapes, dtypes or devices, naming the argument (with the torch backend
            also bad lengths, block ids or group rows), before anything is written. The other
            backends read no value on the host: a decode step stays free of syncs.
    """
    shapes = check_cascade_args(
        query, key_cache, value_cache, cu_seqlens_q, prefix_block_tables=prefix_block_tables,
        prefix_lens=prefix_lens, cu_group_tokens=cu_group_tokens, group_tokens=group_tokens,
        suffix_block_tables=suffix_block_tables, suffix_lens=suffix_lens,
        decode_only=decode_only, scale=scale, out=out, k_scale=k_scale, v_scale=v_scale,
        softcap=softcap, sinks=sinks, seq_order=seq_order, workspace=workspace,
        num_splits=num_splits)
    resolved = resolve_backend(backend, query.device)
    if resolved == "torch":
        check_cascade_values(shapes, cu_seqlens_q, prefix_block_tables=prefix_block_tables,
                             prefix_lens=prefix_lens, cu_group_tokens=cu_group_tokens,
                             group_tokens=group_tokens, suffix_block_tables=suffix_block_tables,
                             suffix_lens=suffix_lens, decode_only=decode_only)
    common = dict(scale=shapes.scale, return_lse=True, backend=backend, k_scale=k_scale,
                  v_scale=v_scale, softcap=shapes.softcap)
    # The prefix first: it writes only tensors of its own, so a call that fails leaves out as
    # it was.
    prefix = None
    if shapes.num_grouped_tokens > 0:
        prefix = _prefix_attention(query, key_cache, value_cache, prefix_block_tables,
                                   prefix_lens, cu_group_tokens, group_tokens, shapes, common)
    if decode_only:
        suffix_out, suffix_lse = paged_decode(
            query, key_cache, value_cache, suffix_block_tables, suffix_lens, out=out,
            sinks=sinks, seq_order=seq_order, workspace=workspace, num_splits=num_splits,
            **common)
    else:
        suffix_out, suffix_lse = paged_prefill(
            query, key_cache, value_cache, suffix_block_tables, cu_seqlens_q, suffix_lens,
            causal=True, out=out, sinks=sinks, **common)
    if prefix is None:
        return suffix_out
    if resolved != "torch":
        from .cascade_merge import merge_prefix_into
        merge_prefix_into(prefix[0], prefix[1], suffix_out, suffix_lse, group_tokens)
        return suffix_out
    n, gs, hkv, d = shapes.num_grouped_tokens, shapes.group_size, shapes.num_kv_heads, \
        shapes.head_size
    # The prefix part's packed rows [n * gs, Hkv, ...] as [n, Hkv, gs, ...] (views), and the
    # suffix part's [N, Hq, ...] as [N, Hkv, gs, ...] (no copy).
    prefix_out = prefix[0].view(n, gs, hkv, d).transpose(1, 2)
    prefix_lse = prefix[1].view(n, gs, hkv).transpose(1, 2)
    own_out = suffix_out.index_select(0, group_tokens).unflatten(1, (hkv, gs))
    own_lse = suffix_lse.index_select(0, group_tokens).unflatten(1, (hkv, gs))
    merged, _ = merge_attention_states(prefix_out, prefix_lse, own_out, own_lse)
    suffix_out.index_copy_(0, group_tokens.long(), merged.reshape(-1, *query.shape[1:]))
    return suffix_out


def _prefix_attention(query, key_cache, value_cache, prefix_block_tables, prefix_lens,
                      cu_group_tokens, group_tokens, shapes: CascadeShapes,
                      common: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the grouped rows over their group's prefix, one non-causal prefill.

    Query head ``k * gs + j`` reads KV head ``k``; packing ``(row, j)`` into the row dimension
    gives a call with ``num_q_heads == num_kv_heads`` whose query tiles hold many rows of one
    KV head, each tile reading the prefix once.

    Returns:
        ``(out, lse)`` packed: out ``[num_grouped_tokens * gs, num_kv_heads, head_size]`` in
        the query's dtype and lse float32 ``[num_grouped_tokens * gs, num_kv_heads]``; row
        ``n * gs + j``, KV head ``k`` is query head ``k * gs + j`` of row ``group_tokens[n]``.
    """
    n, gs = shapes.num_grouped_tokens, shapes.group_size
    hkv, d = shapes.num_kv_heads, shapes.head_size
    # One gather+copy: [total_q, Hkv, gs, D] viewed [total_q, gs, Hkv, D], rows selected.
    rows = query.unflatten(1, (hkv, gs)).transpose(1, 2).index_select(0, group_tokens)
    rows = rows.reshape(n * gs, hkv, d)  # contiguous already: a view
    cu_rows = cu_group_tokens * gs if gs > 1 else cu_group_tokens
    out, lse = paged_prefill(rows, key_cache, value_cache, prefix_block_tables, cu_rows,
                             prefix_lens, causal=False, **common)
    return out, lse
