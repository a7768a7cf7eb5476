"""What rank 0 sends every other tensor-parallel rank once per step.

The scheduler, the block manager and the block tables live on rank 0 only. Each other rank
needs just the step's flat input arrays (token ids, positions, slots, the block-table rows),
the copy-on-write pairs and a few counts: with them it runs its shard of the forward over its
own KV heads at the same block ids. The arrays are a few KiB per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The arrays of a step, as the input builder's staging regions name them.
STEP_ARRAYS = ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "context_lens",
               "block_tables")


@dataclass(frozen=True)
class StepMessage:
    """One step's inputs for a non-zero rank.

    Attributes:
        arrays: the host arrays of the step: int64 ``input_ids`` / ``positions`` /
            ``slot_mapping`` ``[num_tokens]`` (padded to the graph bucket for a graph
            step), int32 ``cu_seqlens_q`` ``[num_rows + 1]``, ``context_lens`` ``[num_rows]``,
            ``block_tables`` ``[num_seqs * table_width]``; and int64 ``sample_rows``
            ``[num_sample_rows]`` when the rows to sample are not simply ``0 .. num_seqs - 1``.
        num_seqs: sequences in the step (before graph padding).
        table_width: columns of the step's block table.
        max_seqlen_q: the most new tokens of one sequence.
        num_sample_rows: hidden rows the LM head runs on (0: no logits this step).
        decode_only: one new token per sequence.
        graph_bucket: the captured CUDA graph the step replays, or None for an eager step.
        block_copies: copy-on-write ``(src, dst)`` block pairs, done before the forward.
        no_prefix: no sequence has cached tokens before this step's.
    """

    arrays: dict[str, np.ndarray]
    num_seqs: int
    table_width: int
    max_seqlen_q: int
    num_sample_rows: int
    decode_only: bool
    graph_bucket: int | None = None
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    no_prefix: bool = False

    def __post_init__(self) -> None:
        missing = [name for name in STEP_ARRAYS if name not in self.arrays]
        if missing:
            raise ValueError(f"arrays: missing {missing}")


@dataclass(frozen=True)
class StopMessage:
    """Tells a rank to leave its step loop and exit."""


__all__ = ["STEP_ARRAYS", "StepMessage", "StopMessage"]
