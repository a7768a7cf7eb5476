"""StructuredOutputs: one grammar matcher per sample of each constrained request.

Per step: :meth:`StructuredOutputs.start` picks the step's constrained sample rows and fills
their bitmask on a worker thread (llguidance fills rows in parallel, without the GIL), while
the stepping thread does other host work; the sampler then waits for the mask. At large
batches filling takes about as long as the rest of the host's step, so where it runs decides
the speed (docs/performance-notes.md, "Figures behind the code's rules"): a synchronous step starts it as soon as it is scheduled (it
overlaps the input building and the launch); under asynchronous scheduling a step's sampling
is held (see ``engine/in_flight.py``) and its fill overlaps its own forward on the device and
the scheduling and building of the next step on the host. :meth:`StructuredOutputs.advance`
feeds each matcher the token its sample got, once the step's tokens are known, and always
before the next step's fill starts: the mask of step t sees the token of step t - 1.

A grammar that fails (llguidance raises or panics compiling, filling or consuming) fails its
own sample only: a row whose fill failed gets an empty mask, which the sampler reports as a
row with nothing to sample, and a token its grammar failed on counts as rejected; either way
the engine ends that sample with reason "error" and the other rows go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from enum import Enum

import torch

from ...core.request import Sequence
from ...core.scheduler import SchedulerOutput
from .bitmask import TokenMasks, bit_values, bitmask_words
from .grammar import GrammarCompiler

logger = logging.getLogger(__name__)

# llguidance threads filling a step's rows. A row is a short job, so a pool of one thread per
# core mostly wakes threads: it fills a batch no faster than a few threads and slows the
# stepping thread (docs/performance-notes.md, "Figures behind the code's rules").
FILL_THREADS = 4


def _grammar_failed(exc: BaseException) -> bool:
    """``exc`` is one grammar's failure: an ``Exception``, or a panic of llguidance's native
    code (pyo3's ``PanicException`` derives from ``BaseException`` only)."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


class Advance(Enum):
    """How a token ended its sample's grammar (what :meth:`StructuredOutputs.advance` reports
    of the tokens that do not just go on)."""

    COMPLETE = "complete"    # the end-of-sequence token, which a complete grammar forces
    REJECTED = "rejected"    # not allowed, or its grammar failed on it (the sample cannot go on)


class StructuredOutputs:
    """The matchers of the running constrained samples, keyed by ``(request id, sample index)``.

    Args:
        compiler: compiles each request's constraint (cached by constraint).
        device: where the logits live (the host bitmask is pinned there for CUDA).
    """

    def __init__(self, compiler: GrammarCompiler, device: torch.device) -> None:
        self.compiler = compiler
        self.words = bitmask_words(compiler.vocab_size)
        self._pin = device.type == "cuda"
        self._bitmask = self._allocate(8)
        self._matchers: dict[str, dict[int, object]] = {}
        self._executor = None
        # One worker: fills run in step order, so a step's fill never overlaps the next one's
        # (they share the bitmask buffer and the matchers).
        self._worker: ThreadPoolExecutor | None = None
        self._eos = frozenset(compiler.eos_token_ids)
        self._device = device
        self._bits: torch.Tensor | None = None     # made with the first masks

    def _allocate(self, rows: int) -> torch.Tensor:
        return torch.zeros((rows, self.words), dtype=torch.int32, pin_memory=self._pin)

    def _matcher(self, request, index: int):
        per_request = self._matchers.setdefault(request.request_id, {})
        matcher = per_request.get(index)
        if matcher is None:
            matcher = per_request[index] = self.compiler.compile(
                request.params.structured_outputs)
        return matcher

    def start(self, out: SchedulerOutput) -> Callable[[], TokenMasks | None]:
        """Start filling the bitmask of ``out``'s sample rows that have a grammar, on the worker
        thread; returns the call that waits for it and gives the :class:`TokenMasks` (None if
        no row has a grammar). The caller must not touch the matchers until it returns.

        Rows follow the sampler's order: per scheduled sequence, ``out.num_samples[i]`` rows
        (a request about to fork samples all ``n`` of its samples from sequence 0's row).
        """
        rows, matchers, keys = self._rows(out)
        if not rows:
            return lambda: None
        bitmask = self._buffer(len(rows))
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        future = self._worker.submit(self._fill, matchers, bitmask, keys)

        def wait() -> TokenMasks:
            future.result()
            if self._bits is None:
                self._bits = bit_values(self._device)
            return TokenMasks(rows, bitmask, self._bits)
        return wait

    def _rows(self, out: SchedulerOutput) -> tuple[list[int], list, list[tuple[str, int]]]:
        """The sampler rows of ``out`` that have a grammar, their matchers (None where the
        grammar failed to compile: that row's mask stays empty) and their samples' keys."""
        rows: list[int] = []
        matchers = []
        keys: list[tuple[str, int]] = []
        at = 0
        for seq, k in zip(out.seqs, out.num_samples):
            request = seq.request
            # A sample that ended since it was scheduled (asynchronous scheduling) gets no
            # mask: its token is dropped, and its matcher may be gone.
            if k and request.params.structured_outputs is not None and not seq.is_finished:
                for j in range(k):
                    index = seq.index if k == 1 else j
                    rows.append(at + j)
                    keys.append((request.request_id, index))
                    try:
                        matchers.append(self._matcher(request, index))
                    except BaseException as exc:
                        if not _grammar_failed(exc):
                            raise
                        logger.exception("request %s sample %d: its grammar failed to compile",
                                         request.request_id, index)
                        matchers.append(None)
            at += k
        return rows, matchers, keys

    def _buffer(self, num_rows: int) -> torch.Tensor:
        if num_rows > len(self._bitmask):
            self._bitmask = self._allocate(max(num_rows, 2 * len(self._bitmask)))
        # The sampler waited for the previous step's upload of this buffer (its sampled ids).
        return self._bitmask[:num_rows]

    def _llexecutor(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(FILL_THREADS)
        return self._executor

    def _fill(self, matchers: list, bitmask: torch.Tensor, keys: list[tuple[str, int]]) -> None:
        """Fill ``bitmask`` (int32 ``[len(matchers), words]``, host) row by matcher. A row
        whose matcher is None, or whose fill fails, is left all zero: no token allowed."""
        import llguidance.torch as llt

        jobs = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if len(jobs) < len(matchers):
            for i, m in enumerate(matchers):
                if m is None:
                    bitmask[i].zero_()
        try:
            if len(jobs) == 1:
                llt.fill_next_token_bitmask(jobs[0][0], bitmask, jobs[0][1])
            elif jobs:
                # Rows computed in parallel by llguidance's threads.
                llt.fill_next_token_bitmask_par(self._llexecutor(), jobs, bitmask)
            return
        except BaseException as exc:
            if not _grammar_failed(exc):
                raise
            if len(jobs) == 1:
                self._fail_row(bitmask, jobs[0][1], keys)
                return
        # Which row failed is not said: fill them one at a time.
        for matcher, i in jobs:
            try:
                llt.fill_next_token_bitmask(matcher, bitmask, i)
            except BaseException as exc:
                if not _grammar_failed(exc):
                    raise
                self._fail_row(bitmask, i, keys)

    @staticmethod
    def _fail_row(bitmask: torch.Tensor, row: int, keys: list[tuple[str, int]]) -> None:
        """Log the fill failure being handled and leave the row allowing nothing."""
        logger.exception("request %s sample %d: filling its grammar mask failed", *keys[row])
        bitmask[row].zero_()

    def advance(self, seqs: list[Sequence]) -> list[tuple[Sequence, Advance]]:
        """Feed each of ``seqs`` its newest token to its grammar. Returns the samples whose
        token did not just go on: :attr:`Advance.COMPLETE` or :attr:`Advance.REJECTED`.

        (A token is a short job for llguidance: this loop costs less than handing the rows
        to llguidance's thread pool; docs/performance-notes.md, "Figures behind the code's rules".)"""
        ended = []
        for seq in seqs:
            token = seq.token_ids[-1]
            try:
                matcher = self._matcher(seq.request, seq.index)
                accepted = matcher.consume_token(token)
            except BaseException as exc:
                if not _grammar_failed(exc):
                    raise
                logger.exception("request %s sample %d: its grammar failed on token %d",
                                 seq.request.request_id, seq.index, token)
                ended.append((seq, Advance.REJECTED))
                continue
            if not accepted:
                error = matcher.get_error()
                logger.warning("request %s sample %d: token %d is not allowed by its grammar: %s",
                               seq.request.request_id, seq.index, token,
                               error.splitlines()[0] if error else "")
                ended.append((seq, Advance.REJECTED))
            elif token in self._eos:
                # Once the grammar is complete its mask allows only end-of-sequence tokens, so
                # the sample ends on one like any other (the token is not part of the text).
                ended.append((seq, Advance.COMPLETE))
        return ended

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's matchers."""
        self._matchers.pop(request_id, None)

    def __len__(self) -> int:
        """Requests with matchers."""
        return len(self._matchers)


__all__ = ["Advance", "StructuredOutputs"]
