"""The cascade arrays of a step (``ops.cascade_attention``'s groups, prefixes and suffixes),
built with numpy into the input builder's int32 staging buffer and uploaded with the step's
other arrays: no extra sync, a few vectorised operations per step.

Which groups a step forms is ``core.cascade.plan_cascade``'s decision (the builder asks it
for every step that could use it). A decode step replays a captured graph
(``cuda_graphs.DecodeGraphs``) whose cascade arrays have fixed shapes, :class:`CascadePad`:
the plan's groups, then one group of prefix length 0 holding every other row (the padding
rows included), then empty groups; its merge then leaves the rows of that group as their
suffix part made them. Prompt and mixed steps use cascade eagerly, with the arrays as small as
the step allows. See ``docs/architecture.md``, "Cascade attention".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...core.args import cdiv
from ...core.cascade import CascadePlan
from ...models.cascade_metadata import CascadeMetadata

# The staging regions of the cascade arrays (int32), in the order CascadeMetadata lists them.
CASCADE_ARRAYS = ("cascade_prefix_tables", "cascade_prefix_lens", "cascade_cu_group_tokens",
                  "cascade_group_tokens", "cascade_suffix_tables", "cascade_suffix_lens")


GRAPH_GROUPS = 4
"""Groups a captured cascade decode graph holds (a step that forms more keeps those that save
the most reads). One shared system prompt, or a few, is the common case; each group slot costs
a few idle programs of the prefix launch when unused."""


@dataclass(frozen=True)
class CascadePad:
    """The fixed shapes of a captured cascade decode step (see the module doc).

    Attributes:
        num_rows: the graph's batch bucket (the step's sequences, then padding rows).
        num_groups: group slots: at most ``num_groups - 1`` of the plan's groups, then the
            group of the other rows.
        prefix_width: the prefix tables' width (blocks).
        suffix_widths: the suffix tables' widths captured (blocks, ascending).
    """

    num_rows: int
    num_groups: int
    prefix_width: int
    suffix_widths: tuple[int, ...]

    def suffix_width(self, blocks: int) -> int:
        """The narrowest captured suffix width that holds ``blocks`` blocks."""
        return next(w for w in self.suffix_widths if w >= blocks)

    def shapes(self, suffix_width: int) -> dict[str, tuple[int, ...]]:
        """The shape of each cascade array of a step over ``suffix_width``-block suffixes."""
        return _shapes(self.num_groups, self.prefix_width, self.num_rows, self.num_rows,
                       suffix_width)


def cascade_region_sizes(max_num_seqs: int, max_num_tokens: int, width: int,
                         enabled: bool) -> dict[str, int]:
    """Elements of each cascade staging region (all 0 when cascade is off): a group has two
    sequences at least, so at most ``max_num_seqs // 2`` groups; a graph's step holds
    ``GRAPH_GROUPS + 1`` group slots."""
    if not enabled:
        return dict.fromkeys(CASCADE_ARRAYS, 0)
    groups = max(max_num_seqs // 2, GRAPH_GROUPS + 1)
    return {"cascade_prefix_tables": groups * width, "cascade_prefix_lens": groups,
            "cascade_cu_group_tokens": groups + 1, "cascade_group_tokens": max_num_tokens,
            "cascade_suffix_tables": max_num_seqs * width, "cascade_suffix_lens": max_num_seqs}


def fill_cascade(host, plan: CascadePlan, table: np.ndarray, rows: np.ndarray,
                 context_lens: np.ndarray, q_lens: np.ndarray, cu: np.ndarray,
                 round_width, pad: CascadePad | None = None) -> dict[str, tuple[int, ...]]:
    """Write the cascade arrays of a step into the staging regions; return each region's shape.

    Args:
        host: ``name -> n -> np.ndarray``, the first ``n`` elements of a host region.
        plan: the step's plan (it uses cascade; with ``pad``, at most ``pad.num_groups - 1``
            groups).
        table: int32 ``[num_table_rows, width]``, the KV cache's host block-table rows.
        rows: int ``[num_seqs]``, each sequence's row of ``table``.
        context_lens, q_lens: int ``[num_seqs]``: tokens after the step's writes, new tokens.
        cu: int ``[num_seqs + 1]``: the query rows' cumulative counts.
        round_width: blocks -> the table width a step uses (a multiple of 16, at most
            ``width``: the kernels compiled at warm-up serve every step); with ``pad``, the
            prefix width and the suffix widths are the graph's.
        pad: a decode step's graph shapes (the module doc), or None: the arrays fit the step.

    The suffix of a sequence in a group is its table past the group's prefix; a sequence in
    no group keeps its whole table as its suffix.
    """
    groups, bs = plan.groups, plan.block_size
    n, width = len(rows), table.shape[1]
    sizes, blocks = groups.sizes, groups.prefix_blocks
    num_groups = groups.num_groups
    leaders = rows[groups.rows[groups.starts[:-1]]]
    if pad is None:
        slots, padded, prefix_width = num_groups, n, round_width(int(blocks.max()))
    else:
        assert num_groups < pad.num_groups and q_lens.max() == 1, (num_groups, pad)
        slots, padded, prefix_width = pad.num_groups, pad.num_rows, pad.prefix_width
    prefix_tables = host("cascade_prefix_tables", slots * prefix_width).reshape(
        slots, prefix_width)
    prefix_tables[:num_groups] = table[leaders, :prefix_width]
    prefix_tables[num_groups:] = 0
    prefix_lens = host("cascade_prefix_lens", slots)
    prefix_lens[:num_groups] = blocks * bs
    prefix_lens[num_groups:] = 0

    skip = np.zeros(n, dtype=np.int64)          # blocks of each sequence in its prefix
    skip[groups.rows] = np.repeat(blocks, sizes)
    suffix_lens = context_lens - skip * bs
    suffix_blocks = max(cdiv(int(suffix_lens.max()), bs), 1)
    suffix_width = (round_width(suffix_blocks) if pad is None
                    else pad.suffix_width(suffix_blocks))
    # Entries past a suffix's blocks are stale, as in any block table: clamp the gather.
    cols = np.minimum(skip[:, None] + np.arange(suffix_width), width - 1)
    suffix_tables = host("cascade_suffix_tables", padded * suffix_width).reshape(
        padded, suffix_width)
    suffix_tables[:n] = table[rows[:, None], cols]
    suffix_tables[n:] = 0
    host_suffix_lens = host("cascade_suffix_lens", padded)
    host_suffix_lens[:n] = suffix_lens
    host_suffix_lens[n:] = 0                     # the padding reads nothing

    member_q = q_lens[groups.rows]
    num_grouped = int(member_q.sum())
    # Query rows cu[i] .. cu[i+1]-1 of each member, member by member.
    before = np.zeros(len(member_q), dtype=np.int64)
    np.cumsum(member_q[:-1], out=before[1:])
    group_tokens = host("cascade_group_tokens", num_grouped if pad is None else padded)
    group_tokens[:num_grouped] = (np.repeat(cu[groups.rows] - before, member_q)
                                  + np.arange(num_grouped))
    cu_group = host("cascade_cu_group_tokens", slots + 1)
    cu_group[0] = 0
    np.cumsum(np.add.reduceat(member_q, groups.starts[:-1]), out=cu_group[1:num_groups + 1])
    if pad is not None:
        # One row per sequence: the rows in no group, then the padding's, form the group
        # after the plan's (prefix length 0); the slots after it are empty.
        grouped = np.zeros(padded, dtype=bool)
        grouped[groups.rows] = True
        group_tokens[num_grouped:] = np.flatnonzero(~grouped)
        cu_group[num_groups + 1:] = padded
        num_grouped = padded
    return _shapes(slots, prefix_width, num_grouped, padded, suffix_width)


def _shapes(num_groups: int, prefix_width: int, num_grouped: int, num_seqs: int,
            suffix_width: int) -> dict[str, tuple[int, ...]]:
    """The shape of each cascade array, from the counts that size them."""
    return {"cascade_prefix_tables": (num_groups, prefix_width),
            "cascade_prefix_lens": (num_groups,), "cascade_cu_group_tokens": (num_groups + 1,),
            "cascade_group_tokens": (num_grouped,),
            "cascade_suffix_tables": (num_seqs, suffix_width),
            "cascade_suffix_lens": (num_seqs,)}


def cascade_metadata(views: dict) -> CascadeMetadata:
    """The device tensors of :func:`fill_cascade`'s regions (``name -> view``, shaped)."""
    return CascadeMetadata(*(views[name] for name in CASCADE_ARRAYS))


def dummy_cascade(block_tables: torch.Tensor, context_lens: torch.Tensor, num_tokens: int,
                  block_size: int) -> CascadeMetadata:
    """The cascade tensors of a made-up step (warm-up, see ``input_batch.dummy_inputs``):
    every token in one group whose prefix is block 0 (``block_size`` tokens), each sequence's
    suffix its own table and length. ``block_tables`` int32 ``[num_seqs, width]`` and
    ``context_lens`` int32 ``[num_seqs]`` are the step's."""
    device = block_tables.device
    return CascadeMetadata(
        prefix_block_tables=torch.zeros(1, 16, dtype=torch.int32, device=device),
        prefix_lens=torch.full((1,), block_size, dtype=torch.int32, device=device),
        cu_group_tokens=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        group_tokens=torch.arange(num_tokens, dtype=torch.int32, device=device),
        suffix_block_tables=block_tables, suffix_lens=context_lens)


def shapes_of(arrays: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """The shapes of the cascade arrays among ``arrays`` (flat host copies, as another
    tensor-parallel rank receives them); empty when the step has none."""
    if "cascade_prefix_lens" not in arrays:
        return {}
    num_groups = len(arrays["cascade_prefix_lens"])
    num_seqs = len(arrays["cascade_suffix_lens"])     # a graph's step: padding included
    return _shapes(num_groups, len(arrays["cascade_prefix_tables"]) // num_groups,
                   len(arrays["cascade_group_tokens"]), num_seqs,
                   len(arrays["cascade_suffix_tables"]) // num_seqs)


__all__ = ["CASCADE_ARRAYS", "GRAPH_GROUPS", "CascadePad", "cascade_metadata",
           "cascade_region_sizes", "dummy_cascade", "fill_cascade", "shapes_of"]
