"""Continuous batching under a token budget, with preemption by recompute (no torch).

Each step, every running sequence gets the tokens it still needs (the rest of its prompt, a chunk
of it, or one decode token) while ``max_num_batched_tokens`` lasts, oldest first; then waiting
sequences are admitted (first come, first served) while the budget, ``max_num_seqs`` and the
blocks last. So prompt chunks and decodes share a step.

When a running sequence cannot get a block, the newest running sequence is preempted: its blocks
are freed (full blocks stay in the prefix cache, so its recompute is mostly hits) and it goes to
the front of the waiting queue. The oldest running sequence can always proceed, since every
request fits the pool alone (checked at submission), so the scheduler never deadlocks.

A paused request (:meth:`Scheduler.set_paused`: its consumer takes none of its output, e.g. a
stream whose client stopped reading) gets no tokens: its running sequences keep their blocks but
are skipped, its waiting ones are passed over at admission (the others keep their order), and
when blocks run out (or seats, for a waiting sequence) the newest paused running sequence is
preempted before any sequence that computes. So the scheduler still always makes progress on
the requests that are not paused, and a request nobody reads costs them neither compute nor,
under pressure, memory or seats.

With ``SchedulerConfig.max_num_batched_context_tokens`` a step's running sequences attend over
that many KV tokens at most, shortest context first (``core/context_budget.py``): long requests
then take turns instead of slowing every step of the short ones.

Under a sliding window (``KVCacheManager.sliding_window``) a sequence gives back the blocks left
of its window after every step, and "fits the pool alone" means one window: a prompt chunk is
then also capped at what the pool holds next to the window (``KVCacheManager.chunk_limit``).

Speculative decoding: a decoding sequence that holds proposals (``Sequence.spec_token_ids``)
computes its token and ``k`` of them in one step (``SchedulerOutput.spec_token_ids``): ``k + 1``
tokens of the budget and of slots, ``k`` cut to the budget, to what its length allows and to
0 when the pool has no room for them (proposals never preempt anyone). :meth:`Scheduler.update`
takes the tokens verification accepted (1 to ``k + 1``), gives back the slots of the rejected
ones, and stops a sample at a stop token or its length exactly where it would have stopped
decoding one token a step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from .args import positive_int
from .context_budget import context_cost, defer_for_context
from .kv_cache_manager import KVCacheManager
from .request import PLACEHOLDER_TOKEN, FinishReason, Request, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step and of one sequence.

    ``max_num_batched_context_tokens``: the most KV tokens a step's running sequences may
    attend over, summed (see ``core/context_budget.py``: shortest context first, the long
    ones in turn); None: no bound. Admissions are not counted: a new request's prefill is
    bounded by ``max_num_batched_tokens`` alone.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    max_num_batched_context_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        if self.max_num_batched_context_tokens is not None:
            object.__setattr__(self, "max_num_batched_context_tokens", positive_int(
                "max_num_batched_context_tokens", self.max_num_batched_context_tokens))


@dataclass
class SchedulerOutput:
    """What one step computes.

    Sequence ``seqs[i]`` computes its tokens ``num_computed_tokens .. + num_new_tokens[i] - 1``
    (``num_computed_tokens`` as it is now, before the step), and the model samples
    ``num_samples[i]`` tokens from the logits of its last one (0 for a prompt chunk that does not
    reach the end of the sequence; ``n`` for a request about to fork its n samples).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)
    # Copy-on-write (src, dst) block pairs, to copy in every layer before any K/V is written.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences that left the running set since the previous output (finished, aborted,
    # preempted): the model runner drops their state.
    released_seq_ids: list[int] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Sequences still computing their prompt (before this step), and their tokens this step.
    num_prefill_seqs: int = 0
    num_prefill_tokens: int = 0
    # Speculative decoding: batch index i -> the k proposals seqs[i] verifies after its one
    # token (its num_new_tokens[i] is k + 1, its num_samples[i] 0: its tokens come from the
    # verification, see Scheduler.update). Empty when no sequence verifies proposals.
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def decode_only(self) -> bool:
        """Every sequence computes exactly one token."""
        return self.num_batched_tokens == len(self.seqs)


class Scheduler:
    """Owns the waiting and running queues and decides every step (single-threaded use)."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._next_seq_id = 0
        self._released: list[int] = []

    # ---- queue management --------------------------------------------------------------------
    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, request, index, token_ids)
        self._next_seq_id += 1
        request.sequences.append(seq)
        return seq

    def add_request(self, request: Request) -> None:
        """Queue a request (already validated by the engine) behind the waiting ones."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id: expected a new id, got {request.request_id!r} "
                             "(already in use)")
        self.requests[request.request_id] = request
        self.waiting.append(self._new_sequence(request, 0, list(request.prompt_token_ids)))

    def abort_request(self, request_id: str) -> Request | None:
        """Finish every sequence of a request with reason "abort", freeing its blocks.

        Returns the request, or None if it is unknown or already finished.
        """
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.sequences:
            if not seq.is_finished:
                self.finish_sequence(seq, FinishReason.ABORT)
        return request

    def set_paused(self, request_id: str, paused: bool) -> Request | None:
        """Pause a request (its sequences get no tokens from the next :meth:`schedule` on, and
        keep their blocks unless preempted) or resume it. A request whose consumer takes none
        of its output should not be given compute: that is what pausing is for.

        Returns the request, or None if it is unknown or already finished.
        """
        if not isinstance(paused, bool):
            raise ValueError(f"paused: expected a bool, got {paused!r}")
        request = self.requests.get(request_id)
        if request is not None:
            request.paused = paused
        return request

    def finish_sequence(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence now (e.g. the engine matched a stop string): free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._released.append(seq.seq_id)
        else:
            self.waiting.remove(seq)
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        request = seq.request
        if request.is_finished:
            request.finished_time = time.time()
            del self.requests[request.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def _seats(self, seq: Sequence) -> int:
        """Running slots a sequence will take: a request about to fork takes all n at once."""
        return 1 if seq.request.forked else seq.request.n

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(released_seq_ids=self._released)
        self._released = []
        budget = self.config.max_num_batched_tokens
        kv = self.kv
        kv.begin_step()

        # 1. Running sequences, oldest first; preempt from the newest end when blocks run out.
        running = self.running
        windowed = kv.sliding_window is not None
        deferred = self._deferred_for_context()
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.request.paused or seq.seq_id in deferred:
                i += 1
                continue
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if windowed:
                n = min(n, kv.chunk_limit(seq.num_computed_tokens))
            assert n > 0, seq
            if seq.spec_token_ids:
                proposals, seq.spec_token_ids = seq.spec_token_ids, []
                k = self._num_to_verify(seq, proposals, n, budget)
                copies = kv.allocate_slots(seq, 1, num_lookahead_tokens=k) if k else None
                if copies is not None:
                    out.spec_token_ids[len(out.seqs)] = proposals[:k]
                    self._add(out, seq, 1 + k, copies)
                    budget -= 1 + k
                    i += 1
                    continue
            copies = kv.allocate_slots(seq, n)
            while copies is None:
                at = self._victim_index(deferred)
                victim = running.pop(at)
                self._preempt(victim, out)
                if victim is seq:
                    break
                if at < i:      # one before seq left out of this step: it was not scheduled
                    i -= 1
                copies = kv.allocate_slots(seq, n)
            if copies is None:
                break
            self._add(out, seq, n, copies)
            budget -= n
            i += 1

        # 2. Waiting sequences, first come first served, unless this step had to preempt.
        if self.waiting and budget > 0 and not out.preempted:
            self._admit(out, budget)
        return out

    def _num_to_verify(self, seq: Sequence, proposals: list[int], n: int, budget: int) -> int:
        """How many of ``proposals`` a decoding sequence (``n == 1`` new token) verifies this
        step: what the budget leaves beside its token, and no more than its length leaves to
        generate past the token the verification adds (so no position reaches max_model_len);
        0 for a sequence that is not decoding (a prompt still computing)."""
        if n != 1 or len(seq.token_ids) - seq.num_computed_tokens != 1:
            return 0
        room = self._max_len(seq.request) - len(seq.token_ids) - 1
        k = min(len(proposals), budget - 1, room)
        if self.kv.sliding_window is not None:
            k = min(k, self.kv.chunk_limit(seq.num_computed_tokens) - 1)
        return max(k, 0)

    def _deferred_for_context(self) -> Collection[int]:
        """The ids of the running sequences the context budget leaves out of this step."""
        limit = self.config.max_num_batched_context_tokens
        if limit is None:
            return ()
        tokens, window = self.config.max_num_batched_tokens, self.kv.sliding_window
        candidates = [s for s in self.running if not s.request.paused]
        costs = [context_cost(s, min(len(s.token_ids) - s.num_computed_tokens, tokens), window)
                 for s in candidates]
        return defer_for_context(candidates, costs, limit)

    def _victim_index(self, deferred: Collection[int]) -> int:
        """Which running sequence to preempt: the newest paused one (it computes nothing, so
        freeing its blocks delays no one), else the newest the context budget left out of
        this step (it computes nothing now either), else the newest."""
        running = self.running
        for at in range(len(running) - 1, -1, -1):
            if running[at].request.paused:
                return at
        if deferred:
            for at in range(len(running) - 1, -1, -1):
                if running[at].seq_id in deferred:
                    return at
        return len(running) - 1

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv
        waiting = self.waiting
        seats = sum(self._seats(s) for s in self.running)
        at = 0      # paused sequences before it are passed over, keeping their places
        while at < len(waiting) and budget > 0:
            seq = waiting[at]
            if seq.request.paused:
                at += 1
                continue
            if seats + self._seats(seq) > self.config.max_num_seqs:
                victim = self._preempt_paused(out)
                if victim is None:
                    break
                seats -= self._seats(victim)
                at += 1     # the victim went to the front of the queue
                continue
            hit = kv.find_cached_prefix(seq)
            n = min(seq.num_tokens - hit.num_tokens, budget, kv.chunk_limit(hit.num_tokens))
            copies = kv.allocate_slots(seq, n, hit)
            if copies is None:
                victim = self._preempt_paused(out)
                if victim is None:
                    break
                seats -= self._seats(victim)
                at += 1
                continue
            del waiting[at]
            if seq.request.first_scheduled_time is None:   # the prompt's first admission
                kv.record_lookup(seq.num_tokens, hit.num_tokens)
                seq.request.first_scheduled_time = time.time()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats += self._seats(seq)
            self._add(out, seq, n, copies)
            budget -= n

    def _preempt_paused(self, out: SchedulerOutput) -> Sequence | None:
        """Preempt the newest paused running sequence, so that a request that computes can be
        admitted in the seats and blocks it held; None if none is paused."""
        running = self.running
        for at in range(len(running) - 1, -1, -1):
            if running[at].request.paused:
                victim = running.pop(at)
                self._preempt(victim, out)
                return victim
        return None

    def _add(self, out: SchedulerOutput, seq: Sequence, n: int, copies: list) -> None:
        # (Called for every sequence of every step: plain attribute reads, no properties.)
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        computed = seq.num_computed_tokens
        if computed + n == len(seq.token_ids):
            request = seq.request
            out.num_samples.append(1 if request.forked else request.n)
        else:
            out.num_samples.append(0)
        if copies:
            out.block_copies.extend(copies)
        out.num_batched_tokens += n
        if computed < seq.request.num_prompt_tokens:
            out.num_prefill_seqs += 1
            out.num_prefill_tokens += n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv.free(seq)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = 0
        seq.num_deferred = 0
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.released_seq_ids.append(seq.seq_id)
        self.num_preemptions += 1

    def rollback(self, out: SchedulerOutput) -> None:
        """The step's forward failed (an exception, an interrupt): nothing it was to compute
        exists. Its sequences go back to the front of the waiting queue, in order, holding no
        blocks (a prefix hit taken in this step may name blocks this step was to fill), and the
        blocks it registered leave the prefix cache. ``out`` must be the latest schedule."""
        self.kv.forget_step_registrations()
        # The runner may have failed before releasing the ids this step handed it: hand them
        # out again (releasing an id twice is harmless; ids are never reused), else their
        # table rows would leak until no row is left for a new sequence.
        self._released[:0] = out.released_seq_ids
        for seq in reversed(out.seqs):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.running.remove(seq)
            self._released.append(seq.seq_id)
            self.kv.free(seq)
            seq.status = SequenceStatus.WAITING
            seq.num_cached_tokens = 0
            self.waiting.appendleft(seq)

    # ---- results of a step ------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[list[int]],
               logprobs: list[list[tuple[float, object]]] | None = None,
               failed: Collection[int] = (), failed_verify: Collection[int] = ()
               ) -> list[Sequence]:
        """Apply a step's results: advance progress, append sampled tokens, fork, finish.

        Args:
            out: the step's schedule.
            sampled: ``sampled[i]`` holds ``out.num_samples[i]`` token ids for ``out.seqs[i]``;
                for a sequence that verified proposals (``i`` in ``out.spec_token_ids``), the
                tokens its verification accepted, 1 .. k + 1 (the accepted proposals, then the
                target model's own token; fewer when a row had nothing to sample).
            logprobs: optional, aligned with ``sampled``: ``(logprob of the token, anything the
                sampler attaches)`` per sampled token, kept in ``Sequence.logprobs``.
            failed: sample rows (indices into the flattened ``sampled``) that got no token:
                their samples end with reason "error" and nothing is appended to them.
            failed_verify: batch indices of sequences that verified proposals and whose first
                row had nothing to sample: their samples end with reason "error".

        Returns:
            The sequences that got a new token (forked children included), then ended by a
            failed row, in batch order.
        """
        now = time.time()
        grew: list[Sequence] = []
        row = 0
        verified = out.spec_token_ids
        for i, seq in enumerate(out.seqs):
            if verified and i in verified:
                self._take_verified(seq, sampled[i], i in failed_verify, now, grew)
                continue
            first_row, row = row, row + out.num_samples[i]
            # (Before a fork, so the children share only the window.)
            if not self._advance(seq, out.num_new_tokens[i]):
                continue
            tokens = sampled[i]
            if not tokens:
                continue
            request = seq.request
            _stamp(request, now)
            targets = self._fork(seq, len(tokens) - 1) if len(tokens) > 1 else (seq,)
            max_len = self._max_len(request)
            for j, target in enumerate(targets):
                grew.append(target)
                if failed and first_row + j in failed:
                    self.finish_sequence(target, FinishReason.ERROR)
                    continue
                token = tokens[j]
                target.token_ids.append(token)
                if logprobs is not None and logprobs[i]:
                    _add_logprob(target, logprobs[i][j])
                if token in request.stop_token_ids:
                    self.finish_sequence(target, FinishReason.STOP)
                elif len(target.token_ids) >= max_len:     # max_tokens or max_model_len
                    self.finish_sequence(target, FinishReason.LENGTH)
        return grew

    def _take_verified(self, seq: Sequence, tokens: list[int], failed: bool, now: float,
                       grew: list[Sequence]) -> None:
        """A step verified ``seq``'s proposals and accepted ``tokens``: the K/V of its token and
        the accepted proposals is kept (those blocks join the prefix cache), the blocks only
        rejected proposals reached go back, and the tokens are appended one by one, the
        sample ending at the first stop token or at its length, where decoding one token a
        step would have ended it."""
        start = seq.num_computed_tokens
        if not self._advance(seq, len(tokens), keep=True):
            return
        kv = self.kv
        kv.truncate(seq, seq.num_computed_tokens)
        grew.append(seq)
        if failed:
            self.finish_sequence(seq, FinishReason.ERROR)
            return
        request = seq.request
        _stamp(request, now)
        max_len, stop_ids, token_ids = self._max_len(request), request.stop_token_ids, seq.token_ids
        for token in tokens:
            token_ids.append(token)
            if token in stop_ids:
                self.finish_sequence(seq, FinishReason.STOP)
                return
            if len(token_ids) >= max_len:
                self.finish_sequence(seq, FinishReason.LENGTH)
                return
        # The accepted tokens are in token_ids now: their full blocks can be named.
        kv.register_computed(seq, (start + 1) // kv.block_size)
        if kv.sliding_window is not None:
            kv.drop_out_of_window(seq)

    # ---- asynchronous scheduling: step t + 1 is scheduled before step t's tokens are known --
    def advance_in_flight(self, out: SchedulerOutput) -> list[int]:
        """Step ``out`` is running on the device, its tokens not yet known: advance progress as
        :meth:`update` does and append a ``PLACEHOLDER_TOKEN`` for each sample, so the next
        step can be scheduled now (its inputs take the tokens from the device). A sequence
        whose placeholder reaches max_tokens or max_model_len finishes now (reason "length").
        Every ``out.num_samples[i]`` must be 0 or 1: a fork needs its tokens.

        Returns:
            Per sequence of ``out``, the index of its placeholder in ``token_ids``, or -1.
        """
        assert not out.spec_token_ids, "a step that verifies proposals is read at once"
        where: list[int] = []
        for i, seq in enumerate(out.seqs):
            if not self._advance(seq, out.num_new_tokens[i]) or not out.num_samples[i]:
                where.append(-1)
                continue
            assert out.num_samples[i] == 1, out.num_samples[i]
            where.append(len(seq.token_ids))
            seq.token_ids.append(PLACEHOLDER_TOKEN)
            if len(seq.token_ids) >= self._max_len(seq.request):
                self.finish_sequence(seq, FinishReason.LENGTH)
        return where

    def resolve_in_flight(self, out: SchedulerOutput, where: list[int], sampled: list[int],
                          logprobs: list[tuple[float, object] | None] | None = None,
                          failed: Collection[int] = ()) -> list[Sequence]:
        """Step ``out``'s tokens arrived: each replaces its placeholder (``where``, from
        :meth:`advance_in_flight`), and a stop token finishes its sequence, as in
        :meth:`update`.

        Args:
            sampled: one token id per sample row of ``out`` (a sequence aborted since it was
                launched has a row, ignored).
            logprobs: optional, one entry per sample row, as in :meth:`update`.
            failed: sample rows that got no token: the placeholder is removed (no output ever
                showed it) and the sample ends with reason "error".

        Returns:
            The sequences that got a token or a failed row, in batch order (finished ones
            included).
        """
        now = time.time()
        grew: list[Sequence] = []
        row = -1
        for seq, k, at in zip(out.seqs, out.num_samples, where):
            row += k
            if at < 0:
                continue
            if failed and row in failed:
                del seq.token_ids[at:]
                if seq.is_finished:     # on its length, at the placeholder
                    seq.finish_reason = FinishReason.ERROR
                else:
                    self.finish_sequence(seq, FinishReason.ERROR)
                grew.append(seq)
                continue
            token = sampled[row]
            lp = logprobs[row] if logprobs is not None else None
            seq.token_ids[at] = token
            request = seq.request
            _stamp(request, now)
            if request.finished_time is not None:
                # It ended on its length before this, its last token, was known.
                request.finished_time = max(request.finished_time, now)
            if lp is not None:
                _add_logprob(seq, lp)
            grew.append(seq)
            if token in request.stop_token_ids:
                if seq.is_finished:     # by length, with a stop token: a stop, as update says
                    seq.finish_reason = FinishReason.STOP
                else:
                    self.finish_sequence(seq, FinishReason.STOP)
            elif seq.deferred_block is not None:
                self.kv.register_deferred(seq)
        return grew

    def _advance(self, seq: Sequence, num_new_tokens: int, keep: bool = False) -> bool:
        """A step computed ``num_new_tokens`` of ``seq``: count them and, under a sliding window,
        give back the blocks left of the next query's window (``keep``: not yet, the caller
        does). False if ``seq`` has finished (aborted, or ended by its grammar or a stop
        string) since the step was scheduled."""
        seq.num_computed_tokens += num_new_tokens
        if seq.status is SequenceStatus.FINISHED:
            return False
        if self.kv.sliding_window is not None and not keep:
            self.kv.drop_out_of_window(seq)
        return True

    def _max_len(self, request: Request) -> int:
        """Tokens (prompt included) at which a sample ends: max_tokens or max_model_len."""
        return min(self.config.max_model_len, request.num_prompt_tokens + request.max_tokens)

    def _fork(self, parent: Sequence, num_children: int) -> list[Sequence]:
        """Create a request's other samples, sharing parent's blocks; returns [parent, *children]."""
        request = parent.request
        assert not request.forked and parent.index == 0
        request.forked = True
        family = [parent]
        at = self.running.index(parent) + 1
        for k in range(num_children):
            child = self._new_sequence(request, k + 1, list(parent.token_ids))
            self.kv.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            family.append(child)
        self.running[at:at] = family[1:]
        return family


def _stamp(request: Request, now: float) -> None:
    """A token of ``request`` arrived at ``now`` (its first and latest token times)."""
    if request.first_token_time is None:
        request.first_token_time = now
    request.last_token_time = now


def _add_logprob(seq: Sequence, entry: tuple[float, object]) -> None:
    """Keep a sampled token's ``(logprob, what the sampler attached)`` on its sequence."""
    if seq.logprobs is None:
        seq.logprobs = []
    seq.logprobs.append(entry[1])
    seq.cumulative_logprob += entry[0]


__all__ = ["Scheduler", "SchedulerConfig", "SchedulerOutput"]
