"""Argument checks of :func:`~.cascade.cascade_attention`.

Shapes, dtypes and devices are checked on every call (host work only, nothing read from the
device, so a decode step stays free of syncs); the *values* (lengths, block ids, the group
rows) only where the torch backend runs, as the other paged ops do (:mod:`.checks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.args import arg_error, check_bool
from .checks import (FLOAT_DTYPES, PagedShapes, check_cache_pair, check_cu_seqlens,
                     check_heads, check_index_vector, check_last_dim_contiguous, check_out,
                     check_paged_values, check_scale, check_seq_order, check_tensor)
from .kv_quant import check_kv_scales
from .variants import NO_WINDOW, check_variant

_INT32 = (torch.int32,)


@dataclass(frozen=True)
class CascadeShapes:
    """Sizes read off a validated :func:`~.cascade.cascade_attention` call."""

    total_q: int
    num_seqs: int
    num_groups: int
    num_grouped_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    num_blocks: int
    block_size: int
    max_prefix_blocks: int
    max_suffix_blocks: int
    scale: float
    softcap: float

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA, num_q_heads for MQA)."""
        return self.num_q_heads // self.num_kv_heads

    def paged(self, part: str) -> PagedShapes:
        """The :class:`PagedShapes` of the ``"prefix"`` or the ``"suffix"`` call."""
        num_seqs, width = ((self.num_groups, self.max_prefix_blocks) if part == "prefix"
                           else (self.num_seqs, self.max_suffix_blocks))
        return PagedShapes(num_seqs, self.num_q_heads, self.num_kv_heads, self.head_size,
                           self.num_blocks, self.block_size, width, self.scale)


def _check_table(name: str, table: object, rows: int, rows_of: str,
                 device: torch.device) -> torch.Tensor:
    check_tensor(name, table, ndim=2, dtypes=_INT32, device=device)
    if table.shape[0] != rows:
        raise arg_error(name, f"{rows} rows ({rows_of})", f"shape {tuple(table.shape)}")
    check_last_dim_contiguous(name, table)
    return table


def _check_length(name: str, t: torch.Tensor, length: int, what: str) -> None:
    if t.shape[0] != length:
        raise arg_error(name, f"shape ({length},) ({what})", tuple(t.shape))


def check_cascade_args(query, key_cache, value_cache, cu_seqlens_q, *, prefix_block_tables,
                       prefix_lens, cu_group_tokens, group_tokens, suffix_block_tables,
                       suffix_lens, decode_only, scale, out, k_scale, v_scale, softcap, sinks,
                       seq_order, workspace, num_splits) -> CascadeShapes:
    """Check the shapes, dtypes and devices of a cascade call (arguments as documented in
    :func:`~.cascade.cascade_attention`); return its sizes. Reads nothing off the device."""
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    check_last_dim_contiguous("query", query)
    total_q, num_q_heads, head_size = query.shape
    device = query.device
    num_blocks, block_size, num_kv_heads, kv_head_size = check_cache_pair(
        key_cache, value_cache, query.dtype, device)
    check_heads(num_q_heads, num_kv_heads, head_size, kv_head_size)
    check_bool("decode_only", decode_only)

    check_index_vector("suffix_lens", suffix_lens, dtypes=_INT32, device=device)
    num_seqs = suffix_lens.shape[0]
    check_index_vector("cu_seqlens_q", cu_seqlens_q, dtypes=_INT32, device=device)
    _check_length("cu_seqlens_q", cu_seqlens_q, num_seqs + 1, "num_seqs + 1, num_seqs from "
                  "suffix_lens")
    _check_table("suffix_block_tables", suffix_block_tables, num_seqs, "num_seqs of suffix_lens",
                 device)
    if decode_only and total_q != num_seqs:
        raise arg_error("query", f"one row per sequence with decode_only ({num_seqs} rows, "
                        "num_seqs of suffix_lens)", f"shape {tuple(query.shape)}")

    check_index_vector("prefix_lens", prefix_lens, dtypes=_INT32, device=device)
    num_groups = prefix_lens.shape[0]
    _check_table("prefix_block_tables", prefix_block_tables, num_groups,
                 "num_groups of prefix_lens", device)
    check_index_vector("cu_group_tokens", cu_group_tokens, dtypes=_INT32, device=device)
    _check_length("cu_group_tokens", cu_group_tokens, num_groups + 1,
                  "num_groups + 1, num_groups from prefix_lens")
    check_index_vector("group_tokens", group_tokens, dtypes=_INT32, device=device)
    if group_tokens.shape[0] > total_q:
        raise arg_error("group_tokens", f"at most total_q={total_q} rows (each query row in "
                        "one group at most)", tuple(group_tokens.shape))

    check_out(out, query)
    check_kv_scales(k_scale, v_scale, key_cache.dtype, num_kv_heads, device)
    _, softcap = check_variant(NO_WINDOW, softcap, sinks, num_q_heads, device)
    if decode_only:
        check_seq_order(seq_order, num_seqs, device)
    else:
        for name, value in (("seq_order", seq_order), ("workspace", workspace),
                            ("num_splits", num_splits)):
            if value is not None:
                raise arg_error(name, "None unless decode_only (only paged_decode takes it)",
                                type(value).__name__)
    return CascadeShapes(total_q, num_seqs, num_groups, group_tokens.shape[0], num_q_heads,
                         num_kv_heads, head_size, num_blocks, block_size,
                         prefix_block_tables.shape[1], suffix_block_tables.shape[1],
                         check_scale(scale, head_size), softcap)


def check_cascade_values(shapes: CascadeShapes, cu_seqlens_q: torch.Tensor, *,
                         prefix_block_tables: torch.Tensor, prefix_lens: torch.Tensor,
                         cu_group_tokens: torch.Tensor, group_tokens: torch.Tensor,
                         suffix_block_tables: torch.Tensor, suffix_lens: torch.Tensor,
                         decode_only: bool) -> None:
    """Check the values of a cascade call's lengths, tables and group rows (a host sync on
    CUDA; the torch backend's checks):

    - ``cu_group_tokens`` runs from 0 to ``num_grouped_tokens``, never decreasing;
    - ``group_tokens`` are query rows in ``[0, total_q)``, each listed once;
    - prefix and suffix lengths fit their tables, whose used entries are block ids of the pool;
    - ``cu_seqlens_q`` runs from 0 to ``total_q``: one row per sequence with ``decode_only``
      (a suffix may then hold 0 keys), else ``q_len_i <= suffix_lens[i]``.
    """
    check_cu_seqlens("cu_group_tokens", cu_group_tokens, shapes.num_grouped_tokens,
                     "num_grouped_tokens")
    rows = group_tokens.detach().to("cpu", torch.int64)
    bad = (rows < 0) | (rows >= shapes.total_q)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise arg_error("group_tokens", f"query rows in [0, {shapes.total_q})",
                        f"group_tokens[{i}]={int(rows[i])}")
    if torch.unique(rows).numel() != rows.numel():
        raise arg_error("group_tokens", "each query row listed once", rows.tolist()[:16])
    check_paged_values(shapes.paged("prefix"), prefix_block_tables, prefix_lens,
                       names=("prefix_block_tables", "prefix_lens", "cu_group_tokens"))
    suffix_names = ("suffix_block_tables", "suffix_lens", "cu_seqlens_q")
    if decode_only:
        check_paged_values(shapes.paged("suffix"), suffix_block_tables, suffix_lens,
                           names=suffix_names)
        q_lens = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, shapes.total_q, "total_q")
        if (q_lens != 1).any():
            raise arg_error("cu_seqlens_q", "one query row per sequence with decode_only",
                            cu_seqlens_q.tolist()[:16])
    else:
        check_paged_values(shapes.paged("suffix"), suffix_block_tables, suffix_lens,
                           cu_seqlens_q, shapes.total_q, names=suffix_names)
