"""One call of ``LLMEngine.step()``, read top to bottom.

:meth:`EngineStep.run` is the pipeline: apply the queued adds, aborts and pauses, open the step
the previous call left in flight (:class:`~.in_flight.InFlightStep`), schedule, build the inputs
(``ModelRunner.prepare``), launch the forward (``ModelRunner.forward``), sample, and update the
scheduler and the outputs with the tokens. What overlaps across calls is data, not callbacks:
the engine keeps the launched step whose tokens it has not read (``LLMEngine._in_flight``) and
the step whose sampling waits for its grammar masks (``LLMEngine._held``), and this object
reads them at its start.

Asynchronous scheduling (see :mod:`.in_flight`): the previous step's tokens stay on the device
while the scheduler moves past it with placeholders; the next step is built with those tokens
filled in on the device, launched, and only then are the previous tokens read and applied. A
held step (structured outputs) is opened first: the tokens of the step before it are read, its
grammar masks start filling on the worker thread, the next step is scheduled and built while
they fill, then its sampling and the next forward are enqueued.

A failure anywhere in the step is settled by :meth:`EngineStep.settle_failure`, the one place
that knows what to undo: the step that was to run (and a held step that could not be opened)
goes back to the waiting queue holding no blocks, and the previous step's tokens are taken if
they can still be read, else its samples end with reason "error".
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.request import PLACEHOLDER_TOKEN, FinishReason
from ..core.scheduler import SchedulerOutput
from .in_flight import InFlightStep, StepMode
from .output_processor import RequestState
from .outputs import RequestOutput
from .sample.sampler import PendingSample
from .spec.verify import PendingVerify, VerifyRows
from .structured import Advance

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineStep:
    """The work of one ``step()`` call (see the module doc); made and run by
    ``LLMEngine._step``, on the stepping thread.

    ``touched``: request id -> state of every request this call reports (results of an
    in-flight step that a failed call took in are carried into the next call's).
    """

    def __init__(self, engine: LLMEngine, overlap: Callable[[], None]) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.runner = engine.runner
        self.overlap = overlap
        self.start = time.perf_counter()
        self.touched: dict[str, RequestState] = engine._carried
        engine._carried = {}
        self.aborted: list[str] = []            # aborted at this call's start
        # What a failure must settle: the previous step (tokens to take or give up), a held
        # step that could not be opened, and the schedule that was to run.
        self.prev: InFlightStep | None = None
        self.unopened: InFlightStep | None = None
        self.out: SchedulerOutput | None = None

    # ---- the pipeline --------------------------------------------------------------------------
    def run(self) -> list[RequestOutput | tuple]:
        engine = self.engine
        self._apply_queued()
        prev, engine._in_flight = engine._in_flight, None
        held, engine._held = engine._held, None
        self.prev = prev
        try:
            if held is not None:
                self._open_held(held)
            if self.prev is not None:
                self.prev.where = self.scheduler.advance_in_flight(self.prev.out)
            self.out = out = self.scheduler.schedule()
            engine.last_schedule = out
            if out.is_empty:
                for seq_id in out.released_seq_ids:
                    self.runner.release(seq_id)
                if self.prev is not None:
                    self._finish_in_flight(self.prev)
            else:
                self._launch(out)
        except BaseException:
            self.settle_failure()
            raise
        return self._report()

    def _apply_queued(self) -> None:
        """The adds, aborts and pauses queued since the previous call, into the scheduler."""
        engine, scheduler, touched = self.engine, self.scheduler, self.touched
        with engine._lock:
            adds, engine._pending_adds = engine._pending_adds, []
            aborts, engine._pending_aborts = engine._pending_aborts, []
            pauses, engine._pending_pauses = engine._pending_pauses, {}
        for state in adds:
            engine._admit(state)
        for request_id in aborts:
            if scheduler.abort_request(request_id) is not None:
                touched[request_id] = engine._states[request_id]
                self.aborted.append(request_id)
        for request_id, paused in pauses.items():
            scheduler.set_paused(request_id, paused)

    def _open_held(self, held: InFlightStep) -> None:
        """Take the tokens of the step before ``held`` (the grammars need them), then start
        filling ``held``'s grammar masks on the worker thread; ``held`` becomes the previous
        step, sampled once the next step's inputs are built."""
        before, self.unopened = self.prev, held
        structured = self.engine.structured
        if before is None:
            held.masks = structured.start(held.out)
        else:
            grew = self._resolve(before)
            self._advance_grammars(grew)
            held.masks = structured.start(held.out)
            self._process_outputs(grew)     # while the masks fill
        self.prev, self.unopened = held, None

    def _launch(self, out: SchedulerOutput) -> None:
        """Build ``out``'s inputs, enqueue its forward, and sample it now (a synchronous or
        in-flight step) or leave its sampling to the next call (held); the previous step's
        tokens are read and applied while the device computes ``out``."""
        engine, runner, prev = self.engine, self.runner, self.prev
        prepared = runner.prepare(out, prev.pending_rows() if prev is not None else None)
        if prev is not None and prev.sample is None:
            _sample_held(runner, prev)      # its masks filled while out was scheduled and built
        logits = runner.forward(out, prepared, prev.sample if prev is not None else None)
        engine.counters.cascade_steps += prepared.cascade is not None
        mode = engine._mode(out) if logits is not None else StepMode.SYNC
        if mode is StepMode.HOLD:
            # prev's tokens are read at the next call's start, before out's masks are filled.
            engine._held = InFlightStep(out, None, self.start, prepared=prepared, logits=logits,
                                        rows=runner.history_rows(out))
            engine._in_flight = prev
            self.prev = None
            return
        masks = None
        if engine._num_structured:
            if prev is not None:    # the grammars see its tokens before the masks are filled
                self._finish_in_flight(prev)
            masks = engine.structured.start(out)
        pending = (runner.sample(prepared, logits, self.overlap, masks) if logits is not None
                   else None)
        checked = runner.verify(prepared, logits) if prepared.verify is not None else None
        if prev is not None and not prev.read:      # while the device computes ``out``
            self._finish_in_flight(prev)
        if mode is StepMode.IN_FLIGHT:
            engine._in_flight = InFlightStep(out, pending, self.start)
            return
        self._update(out, pending, checked, prepared.verify)

    def _update(self, out: SchedulerOutput, pending: PendingSample | None,
                checked: PendingVerify | None = None, rows: VerifyRows | None = None) -> None:
        """A synchronous step: wait for its tokens (and prompt logprobs, and what the
        verification of its proposals kept: ``checked`` for the sequences of ``rows``) and
        apply them; then make the next step's proposals."""
        engine, runner = self.engine, self.runner
        result = pending.read() if pending is not None else None
        verified = checked.read() if checked is not None else None
        runner.read_prompt_logprobs()
        for computed in runner.prompt_logprobs:
            engine._states[computed.request_id].add_prompt_logprobs(computed.start,
                                                                    computed.entries)
        sampled, logprobs = [], None
        if result is not None:
            ids, lps = result.token_ids, result.logprobs
            logprobs = [] if lps is not None else None
            at = 0
            for k in out.num_samples:
                sampled.append(ids[at:at + k])
                if logprobs is not None:
                    logprobs.append(lps[at:at + k] if k and lps[at] is not None else None)
                at += k
        else:
            sampled = [[] for _ in out.seqs]
        failed = result.invalid_rows if result is not None else ()
        failed_verify, before = (), {}
        if verified is not None:
            failed_verify = {rows.batch_index[s] for s in verified.failed}
            for i, tokens in zip(rows.batch_index, verified.tokens):
                sampled[i] = tokens
                before[out.seqs[i].seq_id] = len(out.seqs[i].token_ids)
        grew = self.scheduler.update(out, sampled, logprobs, failed, failed_verify)
        num_failed = _log_failed_rows(grew) if failed or failed_verify else 0
        self._process_tokens(grew)
        # A verified run adds several tokens to one sample (what a stop string left of them).
        extra = sum(max(0, len(seq.token_ids) - before[seq.seq_id] - 1) for seq in grew
                    if seq.seq_id in before) if before else 0
        engine._count(out, len(grew) - num_failed + extra, self.start)
        speculator = engine.speculator
        if speculator is not None:
            if verified is not None:
                speculator.record(rows, verified)
            speculator.propose(self.scheduler.running)

    # ---- the tokens of an in-flight step -------------------------------------------------------
    def _finish_in_flight(self, step: InFlightStep) -> None:
        """Wait for the in-flight ``step``'s tokens (a held one is sampled first), put them in
        place (see ``Scheduler.resolve_in_flight``) and handle them as a synchronous step's."""
        self._process_tokens(self._resolve(step))

    def _resolve(self, step: InFlightStep) -> list:
        """Read the in-flight ``step``'s tokens and put them in place; returns the sequences
        that got one, for :meth:`_process_tokens` (recorded in ``touched`` at once, so they
        are reported even if handling them fails)."""
        if step.sample is None:
            _sample_held(self.runner, step)
        result = step.sample.read()
        step.read = True
        grew = self.scheduler.resolve_in_flight(step.out, step.where, result.token_ids,
                                                result.logprobs, result.invalid_rows)
        num_failed = _log_failed_rows(grew) if result.invalid_rows else 0
        self.engine._count(step.out, len(grew) - num_failed, step.start)
        states, touched = self.engine._states, self.touched
        for seq in grew:
            touched[seq.request.request_id] = states[seq.request.request_id]
        return grew

    def _process_tokens(self, grew: list) -> None:
        """Per sequence that got a token: its grammar, stop strings and text."""
        self._advance_grammars(grew)
        self._process_outputs(grew)

    def _process_outputs(self, grew: list) -> None:
        """Per sequence that got a token: stop strings and text."""
        states, touched = self.engine._states, self.touched
        process, scheduler = self.engine.output_processor.process, self.scheduler
        for seq in grew:
            state = states[seq.request.request_id]
            if process(state, seq):
                scheduler.finish_sequence(seq, FinishReason.STOP)
            touched[seq.request.request_id] = state

    def _advance_grammars(self, grew: list) -> None:
        """Feed the new tokens of the samples with structured outputs to their grammars. The
        end-of-sequence token a complete grammar forced ends its sample (reason "stop", even
        under ignore_eos); a token the grammar rejects, or that its grammar failed on, ends it
        with reason "error", also when that token ended it anyway (a stop token, its
        max_tokens-th token). That token is dropped first, before any output shows it: the
        output is the valid prefix. Samples whose row failed (reason "error" already) got no
        token and are skipped."""
        if not self.engine._num_structured:
            return
        constrained = [seq for seq in grew if seq.request.params.structured_outputs is not None
                       and seq.finish_reason is not FinishReason.ERROR]
        scheduler = self.scheduler
        for seq, advanced in self.engine.structured.advance(constrained):
            if advanced is Advance.REJECTED:
                _drop_last_token(seq)
                if seq.is_finished:
                    seq.finish_reason = FinishReason.ERROR
                scheduler.finish_sequence(seq, FinishReason.ERROR)
            else:
                scheduler.finish_sequence(seq, FinishReason.STOP)   # no-op if it is done

    # ---- failure and report --------------------------------------------------------------------
    def settle_failure(self) -> None:
        """The step failed (an exception, an interrupt): leave the engine usable. A held step
        that could not be opened and the schedule that was to run go back to the waiting
        queue holding no blocks, the prefix-cache entries they registered dropped (their K/V
        may never have been written; neither was counted). The previous step did finish on
        the device: its tokens are taken if they can still be read, else its samples end
        with reason "error". Everything touched is reported by the next call."""
        scheduler = self.scheduler
        if self.unopened is not None:
            _await_fill(self.unopened.masks)
            scheduler.rollback(self.unopened.out)
        if self.out is not None and not self.out.is_empty:
            scheduler.rollback(self.out)
        if self.prev is not None:
            self._settle_previous(self.prev)
        self._carry()

    def _settle_previous(self, step: InFlightStep) -> None:
        """Take the tokens of ``step`` (launched before the failure) if they can still be read
        (a held step is sampled now), else end its samples (reason "error"), whose
        placeholders no token will replace."""
        try:
            if not step.read:
                self._finish_in_flight(step)
                return
        except Exception:
            logger.exception("the tokens of the step before the failed one are lost")
            _await_fill(step.masks)
        states, touched, scheduler = self.engine._states, self.touched, self.scheduler
        for seq, at in zip(step.out.seqs, step.where or ()):
            if at >= 0 and seq.token_ids[at] == PLACEHOLDER_TOKEN:
                del seq.token_ids[at:]
                scheduler.finish_sequence(seq, FinishReason.ERROR)
                seq.finish_reason = FinishReason.ERROR
                touched[seq.request.request_id] = states[seq.request.request_id]

    def _carry(self) -> None:
        """Report what the failed step touched at the next call. Requests aborted at its
        start are gone from the scheduler: retire them now (no output reports them), else
        their ids would stay live forever."""
        touched = self.touched
        gone = [r for r in self.aborted if touched[r].request.is_finished]
        self.engine._retire(gone)
        for request_id in gone:
            touched.pop(request_id)
        self.engine._carried = touched

    def _report(self) -> list[RequestOutput | tuple]:
        """An output for every request this call touched (``final_only`` ones when they
        finish; an output delta for a request added with ``deltas``); finished requests are
        retired."""
        engine = self.engine
        processor = engine.output_processor
        process, make_output, make_delta = (processor.process, processor.make_output,
                                            processor.make_delta)
        outputs, finished_ids = [], []
        for request_id, state in self.touched.items():
            request = state.request
            if request.is_finished:
                if any(seq.awaits_token for seq in request.sequences):
                    continue    # its last token is still in flight (held): reported with it
                finished_ids.append(request_id)
                for seq in request.sequences:
                    process(state, seq)   # flush held-back text
            elif state.final_only:
                continue
            outputs.append(make_delta(state) if state.deltas else make_output(state))
        engine._retire(finished_ids)
        engine._maybe_log()
        return outputs


def _sample_held(runner, step: InFlightStep) -> None:
    """Enqueue the sampling of held ``step`` with its grammar masks."""
    step.sample = runner.sample(step.prepared, step.logits, masks=step.masks, rows=step.rows)
    step.logits = step.rows = None


def _await_fill(masks: Callable[[], object] | None) -> None:
    """After a failure: wait for a grammar fill that may still run on the worker thread, so
    no later grammar work shares its matchers (its own error, if any, is the failure's)."""
    if masks is not None:
        with contextlib.suppress(Exception):
            masks()


def _drop_last_token(seq) -> None:
    """Take back a sample's newest token (and its logprob) that its grammar did not accept; no
    output has shown it yet (outputs are made after the grammars saw the step's tokens)."""
    token = seq.token_ids.pop()
    if seq.logprobs is not None and len(seq.logprobs) > seq.num_output_tokens:
        # The sampler's entry holds the sampled token's own logprob (see SamplerOutput).
        seq.cumulative_logprob -= seq.logprobs.pop().get(token, 0.0)


def _log_failed_rows(grew: list) -> int:
    """Name the samples a step ended because their row had nothing to sample (those of
    ``grew`` with reason "error", which got no token); returns how many."""
    failed = [seq for seq in grew if seq.finish_reason is FinishReason.ERROR]
    for seq in failed:
        logger.warning("request %s sample %d: no token could be sampled (every logit -inf "
                       "or NaN: a grammar with min_tokens, logit_bias, penalties or a failed "
                       "grammar mask); it ends with reason \"error\"",
                       seq.request.request_id, seq.index)
    return len(failed)


__all__ = ["EngineStep"]
