"""LLMEngine: requests in, one scheduler step at a time, RequestOutputs out.

``add_request`` and ``abort_request`` may be called from any thread: they validate at once
(errors reach the caller, nothing is queued then) and queue the change under a lock; ``step()``
(one thread) applies the queued changes at its start, so the scheduler, the KV cache manager and
the model runner are only ever touched by the stepping thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..cache.memory_map import MemoryMap
from ..core.request import PLACEHOLDER_TOKEN, FinishReason, Request
from ..core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from ..models.config import ModelConfig
from ..models.load_progress import LoadTimer
from ..models.loader import TINY_MODEL, load_model_and_tokenizer
from ..models.tokenizer import Tokenizer
from .admission import Admission
from .config import EngineConfig, resolve_max_model_len
from .in_flight import InFlightStep, StepMode
from .worker.model_runner import ModelRunner, Released
from .output_processor import OutputProcessor, RequestState
from .outputs import EngineStats, RequestOutput
from .sampling_params import SamplingParams
from .step_counters import RATE_WINDOW_S, StepCounters
from .structured import Advance, GrammarCompiler, StructuredOutputs
from .structured.bitmask import TokenMasks

logger = logging.getLogger(__name__)


def _await_fill(masks: Callable[[], TokenMasks | None] | None) -> None:
    """After a failure: wait for a grammar fill that may still run on the worker thread, so
    no later grammar work shares its matchers (its own error, if any, is the failure's)."""
    if masks is not None:
        with contextlib.suppress(Exception):
            masks()


class LLMEngine:
    """Continuous-batching engine over the paged KV cache (see the module doc for threads).

    Args:
        model: a ``CausalLM`` (models/) on its device.
        tokenizer: its :class:`~mini_paged_attn.models.tokenizer.Tokenizer`.
        model_config: its :class:`ModelConfig`.
        config: the :class:`EngineConfig`.
        peers: under tensor parallelism, the other ranks' :class:`~mini_paged_attn.engine.worker.tp_executor.TPWorkers`
            (``model`` is then rank 0's shard); built by :meth:`from_model`.
    """

    def __init__(self, model, tokenizer: Tokenizer, model_config: ModelConfig,
                 config: EngineConfig | None = None, *, peers=None,
                 load_timer: LoadTimer | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.model_config = model_config
        max_len = resolve_max_model_len(config, model_config.max_position_embeddings)
        self.max_model_len = max_len
        # Rank 0 under tensor parallelism: the other ranks (stopped by shutdown()).
        self.peers = peers
        self.runner = ModelRunner(model, model_config, config, max_len, peers=peers,
                                  load_timer=load_timer)
        # The one KV cache (pool, block tables, copy-on-write) and its block-level logic.
        self.cache = self.runner.cache
        self.kv_manager = self.cache.kv_manager
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_len),
            self.kv_manager)
        self.output_processor = OutputProcessor(tokenizer)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model_config.eos_token_ids)
        # Grammar matchers of structured outputs (llguidance is imported on first use).
        compiler = GrammarCompiler(getattr(tokenizer, "hf", None), model_config.vocab_size,
                                   sorted(self.eos_token_ids))
        self.structured = StructuredOutputs(compiler, self.runner.device)
        self.admission = Admission(model_config.vocab_size, max_len, self.kv_manager.num_blocks,
                                   config.block_size, config.max_num_seqs,
                                   self.kv_manager.sliding_window, grammar=compiler,
                                   prompt_logprobs=peers is None)
        self._num_structured = 0      # live requests with structured outputs (stepping thread)
        # Live requests whose steps may need their tokens at once (n > 1, prompt logprobs).
        self._num_sync_only = 0
        async_on = config.async_scheduling
        if async_on is None:
            async_on = self.runner.device.type == "cuda"
        # Tensor-parallel ranks build their inputs from rank 0's host arrays: synchronous.
        self._async = bool(async_on) and peers is None
        self._in_flight: InFlightStep | None = None    # see in_flight.py
        self._held: InFlightStep | None = None         # the step after it, sampling held
        self._carried: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        # Held for the whole of step(): two threads stepping at once would corrupt the scheduler
        # and overwrite each other's staging buffers mid-forward, so the second one raises.
        self._step_lock = threading.Lock()
        self._pending_adds: list[RequestState] = []
        self._pending_aborts: list[str] = []
        self._live: set[str] = set()          # request ids pending or in the scheduler
        self._states: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.counters = StepCounters()
        self._last_log = time.monotonic()
        # What the latest step computed (batch composition), for people watching the engine.
        self.last_schedule: SchedulerOutput | None = None

    @classmethod
    def from_model(cls, model: str | Path, *, dtype="auto", device=None,
                   config: EngineConfig | None = None,
                   tokenizer: str | Path | None = None,
                   load_timer: LoadTimer | None = None) -> LLMEngine:
        """Load a local Hugging Face model directory (or ``"tiny"``) and build the engine;
        with ``config.tensor_parallel_size > 1``, start the other ranks first (see
        :mod:`mini_paged_attn.engine.worker.tp_executor`) and load rank 0's shard here. ``tokenizer``: a local directory
        whose tokenizer replaces the model's (vLLM's ``--tokenizer``); None: the model's.
        ``load_timer`` times the load's phases (see ``models/load_progress.py``).

        Raises:
            ValueError: the tensor-parallel size does not split the model, or names more
                GPUs than there are (before any process starts).
        """
        config = config or EngineConfig()
        from ..models.gguf import is_gguf_path
        from ..models.packaged import is_packaged_model
        if config.tensor_parallel_size > 1 and (is_gguf_path(model) or is_packaged_model(model)):
            raise ValueError(f"tensor_parallel_size: expected 1 for a GGUF model, got "
                             f"{config.tensor_parallel_size} (model {str(model)!r})")
        other = None
        if tokenizer is not None:   # first: a wrong path fails before the weights load
            from ..models.tokenizer import load_tokenizer
            other = load_tokenizer(tokenizer)
        if config.tensor_parallel_size == 1:
            net, model_config, own = load_model_and_tokenizer(
                model, dtype=dtype, device=device, timer=load_timer)
            return cls(net, other or own, model_config, config, load_timer=load_timer)
        from .worker.tp_executor import start_tensor_parallel
        net, model_config, own, peers = start_tensor_parallel(model, dtype=dtype,
                                                               device=device, config=config)
        try:
            engine = cls(net, other or own, model_config, config, peers=peers)
            peers.wait_ready(config.distributed_timeout_s)
            return engine
        except BaseException as exc:
            peers.close_after_failure(exc)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, then give back this engine's device memory:
        CUDA graphs, KV pool, workspaces, model weights (``ModelRunner.release_memory``). The
        engine cannot step after (a RuntimeError says so). Idempotent. Without it, the ranks
        stop when the engine is garbage collected or at interpreter exit, and the memory goes
        with the engine's last reference (nothing in it is a reference cycle)."""
        peers = self.peers
        if peers is not None:
            # Releases rank 0's decode graphs before the group (TPWorkers.track_graphs).
            peers.close()
            if peers.failed:
                # A collective of the failed step may never finish: waiting for the device
                # or destroying graphs could hang. The memory goes with the process.
                return
        self._in_flight = self._held = None
        # The engine's own reference to the pool first, so that the runner's release (and
        # its emptying of the allocator's cache) frees it.
        self.cache = Released("LLMEngine.cache")
        self.runner.release_memory()

    # ---- requests (any thread) ----------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, final_only: bool = False,
                    detokenize: bool = True) -> str:
        """Queue a request; returns its id. Thread-safe.

        ``prompt``: a str, a list of token ids, ``{"prompt": str}`` or ``{"prompt_token_ids":
        [...]}`` (see :mod:`.prompts`).
        ``final_only``: ``step()`` reports the request only when it finishes (no text is
        produced before; what ``LLM.generate`` uses).
        ``detokenize=False``: the outputs carry token ids and an empty text, unless the request
        has stop strings (found in the text, so the engine makes it then). For a frontend that
        turns ids into text itself, off the stepping thread (the server's engine process).

        Raises:
            TypeError: a prompt of no known form.
            ValueError: a bad prompt or params, a request id in use, a request that can
                never fit (prompt + max_tokens over max_model_len or over the whole KV pool),
                or structured outputs that do not compile (or llguidance missing).
        """
        if not isinstance(detokenize, bool):
            raise ValueError(f"detokenize: expected a bool, got {detokenize!r}")
        params, text, ids = self.admission.check(prompt, params, self.tokenizer)
        if params.structured_outputs is not None:
            self.structured.compiler.compile(params.structured_outputs)  # cached for the step
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        with self._lock:
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
                while request_id in self._live:
                    request_id = f"req-{next(self._ids)}"
            elif not isinstance(request_id, str) or request_id in self._live:
                raise ValueError(f"request_id: expected a new str id, got {request_id!r}")
            request = Request(request_id, ids, params.max_tokens, stop_ids, params.n, params,
                              arrival_time=time.time(),
                              uses_prefix_cache=params.prompt_logprobs is None)
            self._pending_adds.append(RequestState(request, text, final_only, params.stop,
                                                   detokenize))
            self._live.add(request_id)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state; its blocks are freed at the next step's start.

        Returns whether the request was known and unfinished. Thread-safe.
        """
        with self._lock:
            if request_id not in self._live:
                return False
            self._pending_aborts.append(request_id)
            return True

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._live)

    # ---- stepping (one thread) -----------------------------------------------------------------
    def step(self, overlap: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Run one scheduler step; an output for every request that got tokens or finished.

        Under asynchronous scheduling (``EngineConfig.async_scheduling``, see
        :mod:`.in_flight`) the step launches the next batch and reports the tokens of the
        batch the previous call launched: outputs arrive one call later, and a call may
        return none while a step is in flight.

        ``overlap``: called exactly once during the step, once its device work is enqueued
        and before the host waits for the sampled tokens (at the end, for a step without
        device work or whose sampling is held to the next call): host work that then costs
        no step time. The server's engine process sends the previous step's outputs there.
        Not called if the step raises first. If ``overlap`` raises, ``step()`` raises that
        error: from the sampler, the step is rolled back like any failed forward; from the
        end of a step, the step has happened and its outputs are lost.

        Raises:
            RuntimeError: another thread is inside ``step()`` (one thread steps an engine; nothing
                is changed by the refused call).
        """
        if overlap is not None and not callable(overlap):
            raise ValueError(f"overlap: expected None or a callable, got {overlap!r}")
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError("step(): another thread is stepping this engine; only one thread "
                               "may call step() (others use add_request / abort_request)")
        called = overlap is None

        def overlap_once() -> None:
            nonlocal called
            if not called:
                called = True
                overlap()
        try:
            outputs = self._step(overlap_once)
            overlap_once()
            return outputs
        finally:
            self._step_lock.release()

    def _step(self, overlap: Callable[[], None]) -> list[RequestOutput]:
        start = time.perf_counter()
        with self._lock:
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
        # Results of an in-flight step that a failed step took in, reported now.
        touched, self._carried = self._carried, {}
        aborted: list[str] = []
        for state in adds:
            self._states[state.request.request_id] = state
            self.scheduler.add_request(state.request)
            self._num_structured += state.request.params.structured_outputs is not None
            self._num_sync_only += _needs_sync(state.request)
        for request_id in aborts:
            if self.scheduler.abort_request(request_id) is not None:
                touched[request_id] = self._states[request_id]
                aborted.append(request_id)

        prev, self._in_flight = self._in_flight, None
        held, self._held = self._held, None
        masks = None
        if held is not None:
            # Its masks need prev's tokens: read them, then fill while the next step is built.
            masks = self._open_held(held, prev, touched, aborted)
            prev = held
        if prev is not None:
            prev.where = self.scheduler.advance_in_flight(prev.out)
        out = None
        try:
            out = self.scheduler.schedule()
            self.last_schedule = out
            if out.is_empty:
                for seq_id in out.released_seq_ids:
                    self.runner.release(seq_id)
                if prev is not None:
                    self._finish_in_flight(prev, touched, masks)
            else:
                self._run(out, prev, masks, overlap, touched, start)
        except BaseException:
            # A step that was to run is requeued and the prefix-cache entries it registered
            # dropped (their K/V were never written), so the engine stays usable. The
            # in-flight step before it did finish: its tokens are taken and reported by the
            # next step.
            if out is not None and not out.is_empty:
                self.scheduler.rollback(out)
            if prev is not None:
                self._settle_after_failure(prev, touched, masks)
            self._carry_after_failure(touched, aborted)
            raise

        outputs = []
        finished_ids = []
        for request_id, state in touched.items():
            request = state.request
            if request.is_finished:
                if any(seq.awaits_token for seq in request.sequences):
                    continue    # its last token is still in flight (held): reported with it
                finished_ids.append(request_id)
                for seq in request.sequences:
                    self.output_processor.process(state, seq)   # flush held-back text
            elif state.final_only:
                continue
            outputs.append(self.output_processor.make_output(state))
        self._retire(finished_ids)
        self._maybe_log()
        return outputs

    def _open_held(self, held: InFlightStep, prev: InFlightStep | None,
                   touched: dict[str, RequestState], aborted: list[str]
                   ) -> Callable[[], TokenMasks | None]:
        """Take the tokens of ``prev`` (the step before the held one), then start filling the
        held step's grammar masks on the worker thread; returns the call that waits for them."""
        masks = None
        try:
            if prev is None:
                return self.structured.start(held.out)
            grew = self._resolve(prev, touched=touched)
            self._advance_grammars(grew)
            masks = self.structured.start(held.out)
            self._process_outputs(grew, touched)     # while the masks fill
            return masks
        except BaseException:
            _await_fill(masks)
            # The held step was never counted: its sequences are scheduled again.
            self.scheduler.rollback(held.out)
            if prev is not None:
                self._settle_after_failure(prev, touched)
            self._carry_after_failure(touched, aborted)
            raise

    def _carry_after_failure(self, touched: dict[str, RequestState], aborted: list[str]) -> None:
        """A step failed: report what it touched at the next call. Requests aborted at its
        start are gone from the scheduler: retire them now (no output reports them), else
        their ids would stay live forever."""
        gone = [r for r in aborted if touched[r].request.is_finished]
        self._retire(gone)
        for request_id in gone:
            touched.pop(request_id)
        self._carried = touched

    def _run(self, out: SchedulerOutput, prev: InFlightStep | None,
             masks: Callable[[], TokenMasks | None] | None, overlap: Callable[[], None],
             touched: dict[str, RequestState], start: float) -> None:
        """Launch ``out``; finish ``prev`` (the in-flight step, if any) meanwhile; then keep
        ``out`` in flight, hold its sampling (structured outputs) or wait for its tokens and
        apply them (a synchronous step). A held ``prev`` (``masks``: its grammar fill) is
        sampled once ``out``'s inputs are built."""
        previous = None
        if prev is not None:
            def previous():
                if prev.sample is None:
                    self._sample_held(prev, masks)
                return prev.sample
        logits = self.runner.forward(out, prev.pending_rows() if prev else None, previous)
        mode = self._mode(out) if logits is not None else StepMode.SYNC
        if mode is StepMode.HOLD:
            # prev's tokens are read at the next call's start, before out's masks are filled.
            self._held = InFlightStep(out, None, start, logits=logits,
                                      rows=self.runner.history_rows(out))
            self._in_flight = prev
            return
        out_masks = None
        if self._num_structured:
            if prev is not None:    # the grammars see its tokens before the masks are filled
                self._finish_in_flight(prev, touched)
                prev = None
            out_masks = self.structured.start(out)
        pending = (self.runner.sample(out, logits, overlap, out_masks) if logits is not None
                   else None)
        if prev is not None:    # while the device computes ``out``
            self._finish_in_flight(prev, touched)
        if mode is StepMode.IN_FLIGHT:
            self._in_flight = InFlightStep(out, pending, start)
            return
        result = pending.read() if pending is not None else None
        self.runner.read_prompt_logprobs()
        for computed in self.runner.prompt_logprobs:
            self._states[computed.request_id].add_prompt_logprobs(computed.start,
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
        grew = self.scheduler.update(out, sampled, logprobs, failed)
        num_failed = _log_failed_rows(grew) if failed else 0
        self._process_tokens(grew, touched)
        self._count(out, len(grew) - num_failed, start)

    def _mode(self, out: SchedulerOutput) -> StepMode:
        """How ``out``'s tokens reach the host (see :class:`StepMode`): synchronously with
        asynchronous scheduling off, when a sample forks or a request wants its prompt
        logprobs; held while a live request has structured outputs; else in flight."""
        if not self._async:
            return StepMode.SYNC
        if self._num_sync_only and (max(out.num_samples) > 1 or any(
                seq.request.params.prompt_logprobs is not None for seq in out.seqs)):
            return StepMode.SYNC
        return StepMode.HOLD if self._num_structured else StepMode.IN_FLIGHT

    def _sample_held(self, step: InFlightStep, masks: Callable[[], TokenMasks | None] | None
                     ) -> None:
        """Enqueue the sampling of held ``step`` (``masks``: its grammar fill)."""
        step.sample = self.runner.sample(step.out, step.logits, masks=masks, rows=step.rows)
        step.logits = step.rows = None

    def _finish_in_flight(self, step: InFlightStep, touched: dict[str, RequestState],
                          masks: Callable[[], TokenMasks | None] | None = None) -> None:
        """Wait for the in-flight ``step``'s tokens (a held one is sampled first, ``masks``:
        its grammar fill), put them in place (see ``Scheduler.resolve_in_flight``) and handle
        them as a synchronous step's."""
        self._process_tokens(self._resolve(step, masks, touched), touched)

    def _resolve(self, step: InFlightStep,
                 masks: Callable[[], TokenMasks | None] | None = None,
                 touched: dict[str, RequestState] | None = None) -> list:
        """Read the in-flight ``step``'s tokens (as :meth:`_finish_in_flight`) and put them in
        place; returns the sequences that got one, for :meth:`_process_tokens`."""
        if step.sample is None:
            self._sample_held(step, masks)
        result = step.sample.read()
        step.read = True
        grew = self.scheduler.resolve_in_flight(step.out, step.where, result.token_ids,
                                                result.logprobs, result.invalid_rows)
        num_failed = _log_failed_rows(grew) if result.invalid_rows else 0
        self._count(step.out, len(grew) - num_failed, step.start)
        if touched is not None:     # reported even if handling them fails
            for seq in grew:
                touched[seq.request.request_id] = self._states[seq.request.request_id]
        return grew

    def _process_tokens(self, grew: list, touched: dict[str, RequestState]) -> None:
        """Per sequence that got a token: its grammar, stop strings and text."""
        self._advance_grammars(grew)
        self._process_outputs(grew, touched)

    def _process_outputs(self, grew: list, touched: dict[str, RequestState]) -> None:
        """Per sequence that got a token: stop strings and text."""
        for seq in grew:
            state = self._states[seq.request.request_id]
            if self.output_processor.process(state, seq):
                self.scheduler.finish_sequence(seq, FinishReason.STOP)
            touched[seq.request.request_id] = state

    def _settle_after_failure(self, step: InFlightStep, touched: dict[str, RequestState],
                              masks: Callable[[], TokenMasks | None] | None = None) -> None:
        """The step after ``step`` failed: take ``step``'s tokens if they can still be read
        (a held step is sampled now, ``masks``: its grammar fill), else end its samples
        (reason "error"), whose placeholders no token will replace."""
        try:
            if not step.read:
                self._finish_in_flight(step, touched, masks)
                return
        except Exception:
            logger.exception("the tokens of the step before the failed one are lost")
            _await_fill(masks)
        for seq, at in zip(step.out.seqs, step.where):
            if at >= 0 and seq.token_ids[at] == PLACEHOLDER_TOKEN:
                del seq.token_ids[at:]
                self.scheduler.finish_sequence(seq, FinishReason.ERROR)
                seq.finish_reason = FinishReason.ERROR
                touched[seq.request.request_id] = self._states[seq.request.request_id]

    def _advance_grammars(self, grew: list) -> None:
        """Feed the new tokens of the samples with structured outputs to their grammars. The
        end-of-sequence token a complete grammar forced ends its sample (reason "stop", even
        under ignore_eos); a token the grammar rejects, or that its grammar failed on, ends it
        with reason "error", also when that token ended it anyway (a stop token, its
        max_tokens-th token). That token is dropped first, before any output shows it: the
        output is the valid prefix. Samples whose row failed (reason "error" already) got no
        token and are skipped."""
        if not self._num_structured:
            return
        constrained = [seq for seq in grew if seq.request.params.structured_outputs is not None
                       and seq.finish_reason is not FinishReason.ERROR]
        for seq, advanced in self.structured.advance(constrained):
            if advanced is Advance.REJECTED:
                _drop_last_token(seq)
                if seq.is_finished:
                    seq.finish_reason = FinishReason.ERROR
                self.scheduler.finish_sequence(seq, FinishReason.ERROR)
            else:
                self.scheduler.finish_sequence(seq, FinishReason.STOP)   # no-op if it is done

    def _retire(self, finished_ids: list[str]) -> None:
        """Forget finished requests: their ids are free again."""
        if not finished_ids:
            return
        with self._lock:
            self._live.difference_update(finished_ids)
            # An abort queued while the request was finishing anyway must not reach a new
            # request that reuses its id.
            if self._pending_aborts:
                done = set(finished_ids)
                self._pending_aborts = [r for r in self._pending_aborts if r not in done]
        for request_id in finished_ids:
            state = self._states.pop(request_id)
            self.runner.sampler.release(request_id)
            self._num_sync_only -= _needs_sync(state.request)
            if state.request.params.structured_outputs is not None:
                self._num_structured -= 1
                self.structured.release(request_id)
        self.counters.requests_finished += len(finished_ids)

    def memory_map(self) -> MemoryMap:
        """A snapshot of the live pool (``str()`` it to read): the running sequences' blocks,
        what they share (prefix hits, n > 1 samples) and what the prefix cache keeps. Call it
        between steps, from the stepping thread. Under a sliding window a sequence lists the
        blocks it holds (those left of its window are back in the pool) and their tokens."""
        bs = self.kv_manager.block_size
        return self.cache.memory_map({
            seq.seq_id: (seq.block_ids[seq.num_dropped_blocks:],
                         seq.num_computed_tokens - seq.num_dropped_blocks * bs)
            for seq in self.scheduler.running})

    # ---- statistics ---------------------------------------------------------------------------
    def _count(self, out: SchedulerOutput, num_generated: int, start: float) -> None:
        self.counters.count_step(out.num_prefill_tokens, num_generated, start)

    def stats(self) -> EngineStats:
        """A snapshot of the pool, the queues and the throughput (O(1); any thread: the server's
        engine process takes one after every step)."""
        with self._lock:
            pending = len(self._pending_adds)
        c, kv = self.counters, self.kv_manager
        return EngineStats(
            kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_free_blocks(),
            kv_blocks_cached=kv.prefix_cache.num_cached_blocks, block_size=kv.block_size,
            prefix_cache_hit_rate=kv.hit_rate, num_preemptions=self.scheduler.num_preemptions,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + pending, num_steps=c.num_steps,
            prompt_tokens_total=c.prompt_tokens, generation_tokens_total=c.generation_tokens,
            generation_tokens_per_s=c.generation_rate(),
            requests_finished=c.requests_finished, window_s=RATE_WINDOW_S)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= self.config.log_stats_interval_s:
            self._last_log = now
            logger.info("engine: %s", self.stats().summary())


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


def _needs_sync(request: Request) -> bool:
    """Some step of the request needs its tokens on the host at once: to fork its samples, or
    to read the prompt logprobs the step computed."""
    return request.n > 1 or request.params.prompt_logprobs is not None


__all__ = ["LLMEngine", "TINY_MODEL", "load_model_and_tokenizer"]
