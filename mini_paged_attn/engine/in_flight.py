"""A step launched on the device whose sampled tokens the host has not read yet (asynchronous
scheduling, ``EngineConfig.async_scheduling``).

The engine keeps at most one. Its next ``step()`` call first advances the scheduler past it
(``Scheduler.advance_in_flight``: progress counted, a placeholder token per sample), schedules
and launches the following step, whose inputs take those tokens from the device
(:class:`~.input_batch.TokenFill`), and only then reads the tokens
(:meth:`~.sampler.PendingSample.read`, by then mostly done) and hands them to the scheduler and
the outputs (``Scheduler.resolve_in_flight``). The host's scheduling, input building and output
handling so run while the GPU computes, instead of between its steps.

What it costs: a sample that ends on a stop token has already been scheduled once more; that
step's token for it is dropped (its K/V written into blocks it no longer holds, harmless: the
stream orders any later use after it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.scheduler import SchedulerOutput
from .sampler import PendingSample


@dataclass
class InFlightStep:
    """``out``'s forward and sampling are enqueued; ``sample`` holds its ids on the device.

    ``where``: set once the scheduler advanced past it, per sequence of ``out`` the index of
    its placeholder token, or -1. ``start``: ``time.perf_counter()`` when the step began (for
    the statistics).
    """

    out: SchedulerOutput
    sample: PendingSample
    start: float
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


__all__ = ["InFlightStep"]
