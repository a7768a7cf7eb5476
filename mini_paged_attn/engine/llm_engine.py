"""LLMEngine: requests in, one scheduler step at a time, RequestOutputs out.

``add_request``, ``abort_request`` and ``pause_request`` may be called from any thread: they validate at once
(errors reach the caller, nothing is queued then) and queue the change under a lock; ``step()``
(one thread) applies the queued changes at its start, so the scheduler, the KV cache manager and
the model runner are only ever touched by the stepping thread.

The engine builds the block bookkeeping (one ``KVCacheManager`` of the block count the model
runner sized) and hands it to both the scheduler and the runner's KV pool. Each ``step()`` is an
:class:`~.engine_step.EngineStep`, the step's pipeline read top to bottom; what one call leaves
to the next (the step in flight, a held step, what a failed call touched) stays here as data.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from ..cache.memory_map import MemoryMap
from ..core.block_manager import BlockManager
from ..core.kv_cache_manager import KVCacheManager
from ..core.request import Request
from ..core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from ..models.config import ModelConfig
from ..models.load_progress import LoadTimer
from ..models.loader import TINY_MODEL, load_model_and_tokenizer, start_loading
from ..models.tokenizer import Tokenizer
from ..ops.kv_quant import kv_cache_torch_dtype
from .admission import Admission
from .config import EngineConfig, resolve_context_budget, resolve_max_model_len
from .engine_step import EngineStep
from .in_flight import InFlightStep, StepMode
from .output_processor import OutputProcessor, RequestState
from .outputs import EngineStats, RequestOutput
from .sampling_params import SamplingParams
from .spec.draft import DraftProposer, load_draft_model
from .spec.speculator import build_speculator
from .step_counters import RATE_WINDOW_S, StepCounters
from .structured import GrammarCompiler, StructuredOutputs
from .worker.model_runner import ModelRunner, Released
from .worker.pool_sizing import kv_block_bytes

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over the paged KV cache (see the module doc for threads).

    Args:
        model: a ``CausalLM`` (models/) on its device.
        tokenizer: its :class:`~mini_paged_attn.models.tokenizer.Tokenizer`, or a Future of it
            still loading (:func:`~mini_paged_attn.models.loader.start_loading`), waited for
            once the runner has built the KV pool, the CUDA graphs and the warm-up.
        model_config: its :class:`ModelConfig`.
        config: the :class:`EngineConfig`.
        peers: under tensor parallelism, the other ranks' :class:`~mini_paged_attn.engine.worker.tp_executor.TPWorkers`
            (``model`` is then rank 0's shard); built by :meth:`from_model`.
    """

    def __init__(self, model, tokenizer: Tokenizer | Future, model_config: ModelConfig,
                 config: EngineConfig | None = None, *, peers=None,
                 load_timer: LoadTimer | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model_config = model_config
        max_len = resolve_max_model_len(config, model_config.max_position_embeddings)
        self.max_model_len = max_len
        # Rank 0 under tensor parallelism: the other ranks (stopped by shutdown()).
        self.peers = peers
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            # Loaded first, so that the target's pool is sized in what the draft leaves; each
            # of its blocks takes a draft block beside it.
            draft = load_draft_model(spec.model, model_config, dtype=model.dtype,
                                     device=model.device)
        self.runner = ModelRunner(
            model, model_config, config, max_len, peers=peers, load_timer=load_timer,
            extra_block_bytes=0 if draft is None else kv_block_bytes(
                draft[1], config.block_size,
                kv_cache_torch_dtype(config.kv_cache_dtype, model.dtype)))
        if draft is not None:
            draft = DraftProposer(*draft, config, max_len, self.runner.num_blocks)
        # The scheduler's block bookkeeping, over as many blocks as the runner's pool holds;
        # the pool (the one KV cache: K/V, block tables, copy-on-write) follows the same one.
        self.kv_manager = KVCacheManager(BlockManager(self.runner.num_blocks), config.block_size,
                                         config.enable_prefix_caching,
                                         model_config.uniform_sliding_window)
        self.runner.build_cache(self.kv_manager)
        self.cache = self.runner.cache
        if isinstance(tokenizer, Future):   # loaded beside the runner's build
            tokenizer = tokenizer.result()
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_len,
                            resolve_context_budget(config, self.runner.device.type)),
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
        # Speculative decoding: proposals after each synchronous step, what verification kept.
        self.speculator = build_speculator(spec, max_len, draft)
        self._num_structured = 0      # live requests with structured outputs (stepping thread)
        # Live requests whose steps may need their tokens at once (n > 1, prompt logprobs).
        self._num_sync_only = 0
        async_on = config.async_scheduling
        if async_on is None:
            async_on = self.runner.device.type == "cuda"
        # Tensor-parallel ranks build their inputs from rank 0's host arrays: synchronous.
        self._async = bool(async_on) and peers is None
        # Between step() calls (see engine_step.py): the launched step whose tokens are not
        # read yet, the step after it whose sampling waits for its grammar masks, and what a
        # failed call touched, reported by the next one.
        self._in_flight: InFlightStep | None = None
        self._held: InFlightStep | None = None
        self._carried: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        # Held for the whole of step(): two threads stepping at once would corrupt the scheduler
        # and overwrite each other's staging buffers mid-forward, so the second one raises.
        self._step_lock = threading.Lock()
        self._pending_adds: list[RequestState] = []
        self._pending_aborts: list[str] = []
        self._pending_pauses: dict[str, bool] = {}     # request id -> paused, the latest wins
        self._paused: set[str] = set()        # live request ids whose latest ask was "pause"
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
        if config.tensor_parallel_size == 1:
            # The tokenizer loads on a thread while the weights load and the runner builds.
            net, model_config, pending = start_loading(model, dtype=dtype, device=device,
                                                       timer=load_timer, tokenizer=tokenizer)
            return cls(net, pending, model_config, config, load_timer=load_timer)
        other = None
        if tokenizer is not None:   # first: a wrong path fails before the weights load
            from ..models.tokenizer import load_tokenizer
            other = load_tokenizer(tokenizer)
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
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.release_memory()
        self.runner.release_memory()

    # ---- requests (any thread) ----------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, final_only: bool = False,
                    detokenize: bool = True, deltas: bool = False) -> str:
        """Queue a request; returns its id. Thread-safe.

        ``prompt``: a str, a list of token ids, ``{"prompt": str}`` or ``{"prompt_token_ids":
        [...]}`` (see :mod:`.prompts`).
        ``final_only``: ``step()`` reports the request only when it finishes (no text is
        produced before; what ``LLM.generate`` uses).
        ``detokenize=False``: the outputs carry token ids and an empty text, unless the request
        has stop strings (found in the text, so the engine makes it then). For a frontend that
        turns ids into text itself, off the stepping thread (the server's engine process).
        ``deltas=True``: ``step()`` reports the request as what changed since its previous
        report (an output delta, ``engine/deltas.py``) instead of a cumulative
        ``RequestOutput``; what the server's engine process sends its client.

        Raises:
            TypeError: a prompt of no known form.
            ValueError: a bad prompt or params, a request id in use, a request that can
                never fit (prompt + max_tokens over max_model_len or over the whole KV pool),
                or structured outputs that do not compile (or llguidance missing).
        """
        for name, flag in (("detokenize", detokenize), ("deltas", deltas)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}: expected a bool, got {flag!r}")
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
                                                   detokenize, deltas))
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

    def pause_request(self, request_id: str, paused: bool = True) -> bool:
        """Pause a live request (from the next step on its sequences get no tokens and keep
        their KV blocks, unless the scheduler needs them for a request that computes, see
        ``core/scheduler.py``) or, with ``paused=False``, resume it. For a consumer that has
        stopped taking the request's output, e.g. a stream whose client does not read.

        Returns whether the request was known and unfinished. Thread-safe.
        """
        if not isinstance(paused, bool):
            raise ValueError(f"paused: expected a bool, got {paused!r}")
        with self._lock:
            if request_id not in self._live:
                return False
            self._pending_pauses[request_id] = paused
            if paused:
                self._paused.add(request_id)
            else:
                self._paused.discard(request_id)
            return True

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._live)

    def only_paused_requests(self) -> bool:
        """Every unfinished request is paused and no change or step is pending: a step would
        compute nothing, so whoever steps the engine may wait for a resume, an add or an abort.
        (Stepping thread.)"""
        with self._lock:
            if (not self._live or self._pending_adds or self._pending_aborts
                    or self._pending_pauses or not self._live <= self._paused):
                return False
        return self._in_flight is None and self._held is None and not self._carried

    # ---- stepping (one thread) -----------------------------------------------------------------
    def step(self, overlap: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Run one scheduler step; an output for every request that got tokens or finished
        (a ``RequestOutput``, or an output delta for a request added with ``deltas=True``).

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
        return EngineStep(self, overlap).run()

    def _admit(self, state: RequestState) -> None:
        """A queued request joins the scheduler (stepping thread)."""
        self._states[state.request.request_id] = state
        self.scheduler.add_request(state.request)
        self._num_structured += state.request.params.structured_outputs is not None
        self._num_sync_only += _needs_sync(state.request)

    def _mode(self, out: SchedulerOutput) -> StepMode:
        """How ``out``'s tokens reach the host (see :class:`StepMode`): synchronously with
        asynchronous scheduling off, when the step verifies proposals or the batch is small
        enough to speculate (``SpeculativeConfig.disable_by_batch_size``), when a sample forks
        or a request wants its prompt logprobs; held while a live request has structured
        outputs; else in flight."""
        if not self._async:
            return StepMode.SYNC
        # Proposals are made from a step's tokens on the host, for the step after it.
        speculator = self.speculator
        if out.spec_token_ids or (speculator is not None
                                  and speculator.active(self.scheduler.num_running)):
            return StepMode.SYNC
        if self._num_sync_only and (max(out.num_samples) > 1 or any(
                seq.request.params.prompt_logprobs is not None for seq in out.seqs)):
            return StepMode.SYNC
        return StepMode.HOLD if self._num_structured else StepMode.IN_FLIGHT

    def _retire(self, finished_ids: list[str]) -> None:
        """Forget finished requests: their ids are free again."""
        if not finished_ids:
            return
        with self._lock:
            self._live.difference_update(finished_ids)
            self._paused.difference_update(finished_ids)
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
            requests_finished=c.requests_finished, window_s=RATE_WINDOW_S,
            cascade_steps=c.cascade_steps, **self._spec_stats())

    def _spec_stats(self) -> dict[str, int]:
        """The speculator's counters, as EngineStats fields (none without speculation)."""
        spec = self.speculator
        if spec is None:
            return {}
        return dict(spec_steps=spec.num_steps, spec_num_drafts=spec.num_drafts,
                    spec_num_draft_tokens=spec.num_draft_tokens,
                    spec_num_accepted_tokens=spec.num_accepted_tokens)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= self.config.log_stats_interval_s:
            self._last_log = now
            logger.info("engine: %s", self.stats().summary())


def _needs_sync(request: Request) -> bool:
    """Some step of the request needs its tokens on the host at once: to fork its samples, or
    to read the prompt logprobs the step computed."""
    return request.n > 1 or request.params.prompt_logprobs is not None


__all__ = ["LLMEngine", "TINY_MODEL", "load_model_and_tokenizer"]
