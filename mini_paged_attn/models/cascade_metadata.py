"""CascadeMetadata: the tensors of a step that attends over shared prefixes once per group
(``ops.cascade_attention``), as the engine's input builder uploads them.

Which sequences form a group, and when it pays, is ``core.cascade``'s decision; this is only
its device form, checked by shape and dtype (reading values would sync with the device).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class CascadeMetadata:
    """Per-step inputs of ``ops.cascade_attention`` (see its documentation).

    Attributes:
        prefix_block_tables: int32 ``[num_groups, max_prefix_blocks]``: group ``g``'s shared
            blocks (a row of its first member's table).
        prefix_lens: int32 ``[num_groups]``: tokens of each group's prefix (whole blocks).
        cu_group_tokens: int32 ``[num_groups + 1]``: cumulative counts of ``group_tokens``.
        group_tokens: int32 ``[num_grouped_tokens]``: the query-token rows of the groups'
            sequences, group by group; rows not listed have no prefix part.
        suffix_block_tables: int32 ``[num_seqs, max_suffix_blocks]``: each sequence's blocks
            after its group's prefix (its whole table when it is in no group).
        suffix_lens: int32 ``[num_seqs]``: each sequence's tokens after the prefix (its
            context length when it is in no group).
    """

    prefix_block_tables: torch.Tensor
    prefix_lens: torch.Tensor
    cu_group_tokens: torch.Tensor
    group_tokens: torch.Tensor
    suffix_block_tables: torch.Tensor
    suffix_lens: torch.Tensor

    def __post_init__(self) -> None:
        for name, ndim in (("prefix_block_tables", 2), ("prefix_lens", 1),
                           ("cu_group_tokens", 1), ("group_tokens", 1),
                           ("suffix_block_tables", 2), ("suffix_lens", 1)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != ndim:
                got = (f"{t.dtype} tensor of shape {tuple(t.shape)}"
                       if isinstance(t, torch.Tensor) else type(t).__name__)
                raise ValueError(f"cascade.{name}: expected a {ndim}-D int32 tensor, got {got}")
        num_groups = self.prefix_lens.shape[0]
        if (self.prefix_block_tables.shape[0] != num_groups
                or self.cu_group_tokens.shape[0] != num_groups + 1):
            raise ValueError(
                f"cascade.prefix_block_tables / cu_group_tokens: expected {num_groups} rows / "
                f"{num_groups + 1} entries (num_groups = len(prefix_lens)), got "
                f"{tuple(self.prefix_block_tables.shape)} / {tuple(self.cu_group_tokens.shape)}")
        if self.suffix_block_tables.shape[0] != self.suffix_lens.shape[0]:
            raise ValueError(f"cascade.suffix_block_tables: expected {self.suffix_lens.shape[0]} "
                             "rows (len(suffix_lens)), got "
                             f"{tuple(self.suffix_block_tables.shape)}")

    @property
    def num_groups(self) -> int:
        return self.prefix_lens.shape[0]

    def op_args(self) -> dict:
        """The keyword arguments of ``ops.cascade_attention`` these tensors fill."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


__all__ = ["CascadeMetadata"]
