"""A step launched on the device whose sampled tokens the host has not read yet (asynchronous
scheduling, ``EngineConfig.async_scheduling``).

The engine keeps at most one. Its next ``step()`` call first advances the scheduler past it
(``Scheduler.advance_in_flight``: progress counted, a placeholder token per sample), schedules
and launches the following step, whose inputs take those tokens from the device
(:class:`~mini_paged_attn.engine.worker.input_batch.TokenFill`), and only then reads the tokens
(:meth:`~mini_paged_attn.engine.sample.sampler.PendingSample.read`, by then mostly done) and hands them to the scheduler and
the outputs (``Scheduler.resolve_in_flight``). The host's scheduling, input building and output
handling so run while the GPU computes, instead of between its steps.

What it costs: a sample that ends on a stop token has already been scheduled once more; that
step's token for it is dropped (its K/V written into blocks it no longer holds, harmless: the
stream orders any later use after it). The same holds for a sample whose row had nothing to
sample (the sampler's flag, read with the ids): its placeholder is removed, no token replaces
it, and the sample ends with reason "error" (``Scheduler.resolve_in_flight``).

With structured outputs, a step's grammar masks need the previous step's tokens, so its
sampling cannot be enqueued right behind its forward. Such a step is *held*: its forward is
enqueued and its logits wait on the device. The next call reads the tokens before it, starts
filling its masks on the grammar worker, schedules and builds the following step meanwhile,
and then enqueues the held step's sampling and that following forward (see
:class:`~mini_paged_attn.engine.engine_step.EngineStep`). The host's fill so overlaps the device's forward and the host's own
scheduling, instead of sitting between a forward and its sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

from ..core.scheduler import SchedulerOutput
from .sample.sampler import PendingSample, SampleRow
from .structured.bitmask import TokenMasks

if TYPE_CHECKING:
    from .worker.model_runner import PreparedStep


class StepMode(Enum):
    """How a launched step's sampled tokens reach the host."""

    SYNC = "sync"             # sampled and read at once, in the same call
    IN_FLIGHT = "in flight"   # sampled now, read by the next call
    HOLD = "hold"             # sampled and read by the next call (its grammar masks wait)


@dataclass
class InFlightStep:
    """``out``'s forward is enqueued, and so is its sampling once ``sample`` (its ids on the
    device) is set; until then the step is held, and ``prepared`` (its
    :class:`~mini_paged_attn.engine.worker.model_runner.PreparedStep`: the sample rows' params),
    ``logits`` (``[sum(out.num_samples), vocab_size]`` on the device, float32 or the model's
    dtype) and ``rows`` (the sampler's
    :meth:`~mini_paged_attn.engine.worker.model_runner.ModelRunner.history_rows`, taken at
    launch) wait for it, and ``masks`` is the wait for its grammar masks once the next call
    started filling them.

    ``where``: set once the scheduler advanced past it, per sequence of ``out`` the index of
    its placeholder token, or -1. ``start``: ``time.perf_counter()`` when the step began (for
    the statistics).
    """

    out: SchedulerOutput
    sample: PendingSample | None
    start: float
    prepared: PreparedStep | None = None
    logits: torch.Tensor | None = None
    rows: list[SampleRow] | None = None
    masks: Callable[[], TokenMasks | None] | None = None
    where: list[int] | None = None
    read: bool = False      # its tokens were read (they may not have been applied yet)

    def pending_rows(self) -> dict[int, int]:
        """``seq_id -> row`` of ``sample.token_ids`` for each sequence with a placeholder."""
        assert self.where is not None, "advance the scheduler first"
        rows: dict[int, int] = {}
        row = 0
        for seq, k, at in zip(self.out.seqs, self.out.num_samples, self.where):
            if at >= 0:
                rows[seq.seq_id] = row
            row += k
        return rows


__all__ = ["InFlightStep", "StepMode"]
