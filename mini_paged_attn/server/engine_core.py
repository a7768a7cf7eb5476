"""The engine in a process of its own, behind the interface the server's engine loop uses.

In one process the engine thread and the HTTP event loop take turns on the interpreter lock: on a
GPU, where a step is mostly Python waiting on short kernels, the event loop's per-chunk work
made steps 8-46% longer (BENCHMARKS.md). Here the engine steps in a child process, unhindered,
and sends each step's outputs as deltas (new token ids; text only where stop strings need it)
through a pipe while its next step runs on the GPU;
:class:`EngineCoreClient` rebuilds the cumulative ``RequestOutput`` objects the server expects,
so :class:`~mini_paged_attn.server.engine_loop.EngineLoop` runs on it unchanged.

Requests are validated here, before they are sent, with the child's own limits
(:class:`~mini_paged_attn.engine.admission.Admission`), so a bad request still fails at once
with a ``ValueError`` and nothing is queued.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine.outputs import CompletionOutput, GrowingListView, RequestOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreInfo:
    """What the child tells the client once its engine is built."""

    tokenizer: Any
    model_config: Any
    max_model_len: int
    admission: Any
    stats: Any


@dataclass
class _Sent:
    """What the child has sent of one completion so far."""

    text: str = ""
    tokens: int = 0


def _delta(out: Any, sent: dict[str, dict[int, _Sent]]) -> tuple:
    """One RequestOutput as what changed since the last delta of its request."""
    per_completion = sent.pop(out.request_id, {}) if out.finished else \
        sent.setdefault(out.request_id, {})
    completions = []
    for comp in out.outputs:
        s = per_completion.setdefault(comp.index, _Sent())
        keep = len(s.text) if comp.text.startswith(s.text) else 0  # stop strings may cut it
        new_logprobs = None if comp.logprobs is None else list(comp.logprobs[s.tokens:])
        completions.append((comp.index, keep, comp.text[keep:], list(comp.token_ids[s.tokens:]),
                            comp.finish_reason, comp.cumulative_logprob, new_logprobs))
        s.text, s.tokens = comp.text, len(comp.token_ids)
    return out.request_id, completions, out.finished, out.metrics


class _Outbox:
    """Everything the child sends, in order. A step's outputs wait to be sent until the next
    step has enqueued its device work (``LLMEngine.step(overlap=...)``): turning them into
    deltas, pickling and writing them then runs while the GPU computes, not between steps
    (inline, that left a 0.3-1 ms gap between steps on an H100 host; on a thread of its own,
    the interpreter lock put the same work inside the next step's host phase)."""

    def __init__(self, results: Any) -> None:
        self._results = results
        self._sent: dict[str, dict[int, _Sent]] = {}  # request id -> completion -> sent so far
        self._pending: tuple | None = None            # the last step's (outputs, stats, added)

    def outputs(self, outputs: list[Any], stats: Any, added: int) -> None:
        self.flush()
        self._pending = (outputs, stats, added)

    def flush(self) -> None:
        """Send the waiting step's outputs now."""
        if self._pending is None:
            return
        outputs, stats, added = self._pending
        self._pending = None
        self._results.send(("outputs", [_delta(o, self._sent) for o in outputs], stats, added))

    def forget(self, request_id: str) -> None:
        """The request was aborted: drop what was sent of it."""
        self.flush()
        self._sent.pop(request_id, None)

    def send(self, message: tuple) -> None:
        self.flush()
        self._results.send(message)


def _core_main(model: str, llm_kwargs: dict, commands: Any, results: Any) -> None:
    """The child: build the engine, then apply commands and step while there is work."""
    from ..engine import LLM

    try:
        engine = LLM(model, **llm_kwargs).engine
        results.send(("ready", CoreInfo(engine.tokenizer, engine.model_config,
                                        engine.max_model_len, engine.admission, engine.stats())))
    except BaseException as exc:
        results.send(("error", f"the engine could not start: {type(exc).__name__}: {exc}"))
        return
    outbox = _Outbox(results)
    try:
        _serve_commands(engine, commands, outbox)
    finally:
        try:
            outbox.flush()
        except OSError:  # the server is gone
            pass


def _serve_commands(engine: Any, commands: Any, outbox: _Outbox) -> None:
    added = 0
    while True:
        idle = not engine.has_unfinished_requests()
        if idle:  # no step will carry the last outputs out: send them now
            outbox.flush()
        while idle or commands.poll():
            try:
                kind, *args = commands.recv()
            except EOFError:  # the server is gone
                return
            idle = False
            if kind == "add":
                prompt_ids, params, request_id = args
                added += 1
                try:
                    # Text is made in the server's process (EngineCoreClient._rebuild), off
                    # this thread, unless stop strings need it here.
                    engine.add_request(prompt_ids, params, request_id=request_id,
                                       detokenize=bool(params.stop))
                except ValueError as exc:  # the client checked the same limits: a bug
                    outbox.send(("failed", f"the engine rejected {request_id}: {exc}"))
            elif kind == "abort":
                engine.abort_request(args[0])
                outbox.forget(args[0])
            elif kind == "call":  # benchmarks and tests: fn(engine, *args) in this process
                fn, fn_args = args
                try:
                    outbox.send(("called", fn(engine, *fn_args)))
                except Exception as exc:
                    outbox.send(("called_error", f"{type(exc).__name__}: {exc}"))
            elif kind == "shutdown":
                return
        if not engine.has_unfinished_requests():
            continue
        try:
            outputs = engine.step(overlap=outbox.flush)
        except Exception as exc:
            logger.exception("engine step failed")
            outbox.send(("failed", f"{type(exc).__name__}: {exc}"))
            continue
        outbox.outputs(outputs, engine.stats(), added)


@dataclass
class _Rebuilt:
    """The client's copy of one live request's outputs, grown by deltas.

    ``detokenizers`` (completion index -> IncrementalDetokenizer): the text is made here, from
    the token ids, as the engine would have made it; None when the engine sends the text (the
    request has stop strings, which the engine finds in it).
    """

    prompt: str | None
    prompt_token_ids: list[int]
    detokenizers: dict[int, Any] | None
    texts: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)

    def text_of(self, index: int, keep: int, suffix: str, new_ids: list[int],
                reason: str | None, tokenizer: Any) -> str:
        """The completion's text after a delta (``keep`` / ``suffix``: the engine's text edit;
        used when the engine makes the text)."""
        if self.detokenizers is None:
            return self.texts.get(index, "")[:keep] + suffix
        det = self.detokenizers.get(index)
        if det is None:
            det = self.detokenizers[index] = tokenizer.detokenizer(self.prompt_token_ids)
        # With no stop strings, "stop" means a stop token ended the sample: the engine leaves
        # that token out of the text.
        det.add(new_ids[:-1] if reason == "stop" and new_ids else new_ids)
        if reason is not None:
            det.flush()
        return det.text


class EngineCoreClient:
    """An ``LLMEngine`` in a child process, seen through the methods the server uses:
    ``add_request``, ``abort_request``, ``step``, ``has_unfinished_requests``, ``stats``,
    ``tokenizer``, ``model_config``, ``max_model_len``.

    ``step()`` returns the outputs of the child's next step (blocking without the interpreter
    lock meanwhile), or ``[]`` at once when no request is live here. The child steps on its own
    while it has work: it does not wait for ``step()``.

    Args:
        model: what ``LLM(model, ...)`` takes (a local model directory or ``"tiny"``).
        llm_kwargs: the other ``LLM`` arguments (dtype, device, block_size, ...).
        start_timeout: seconds to wait for the engine to load (ValueError-free: RuntimeError).
    """

    def __init__(self, model: str, llm_kwargs: dict | None = None, *,
                 start_timeout: float = 900.0) -> None:
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        child_commands, self._commands = ctx.Pipe(duplex=False)  # (receiving, sending) ends
        self._results, child_results = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_core_main, name="engine-core", daemon=True,
                                 args=(str(model), dict(llm_kwargs or {}), child_commands,
                                       child_results))
        self._proc.start()
        child_commands.close()
        child_results.close()
        if not self._results.poll(start_timeout):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start within {start_timeout} s")
        kind, info = self._results.recv()
        if kind != "ready":
            self._proc.join(5)
            raise RuntimeError(info)
        self.tokenizer = info.tokenizer
        self.model_config = info.model_config
        self.max_model_len = info.max_model_len
        self.admission = info.admission
        self._stats = info.stats
        self._send_lock = threading.Lock()     # add / abort (event loop) vs shutdown
        self._recv_lock = threading.Lock()     # step (engine thread) vs call
        self._state_lock = threading.Lock()
        self._live: dict[str, _Rebuilt] = {}
        self._early: list[Any] = []            # outputs read by _drain_when_idle
        self._sent_adds = 0
        self._seen_adds = 0

    # ---- the engine interface -----------------------------------------------------------------
    def add_request(self, prompt: Any, params: Any = None, request_id: str | None = None) -> str:
        """Validate (ValueError, nothing sent) and queue a request in the child."""
        params, text, ids = self.admission.check(prompt, params, self.tokenizer)
        if not isinstance(request_id, str):
            raise ValueError(f"request_id: expected a str, got {request_id!r}")
        with self._state_lock:
            if request_id in self._live:
                raise ValueError(f"request_id: expected a new id, got {request_id!r}")
            self._live[request_id] = _Rebuilt(text, ids, None if params.stop else {})
            self._sent_adds += 1
        self._send(("add", ids, params, request_id))
        return request_id

    def abort_request(self, request_id: str) -> bool:
        with self._state_lock:
            known = self._live.pop(request_id, None) is not None
        if known:
            self._send(("abort", request_id))
        return known

    def has_unfinished_requests(self) -> bool:
        with self._state_lock:
            return bool(self._live)

    def stats(self) -> Any:
        """The child's latest ``EngineStats``, counting requests sent but not yet received
        there as waiting."""
        self._drain_when_idle()
        with self._state_lock:
            return replace(self._stats, num_waiting=self._stats.num_waiting
                           + self._sent_adds - self._seen_adds)

    def step(self) -> list[Any]:
        """The outputs of the child's next step (cumulative ``RequestOutput`` objects).

        Raises:
            RuntimeError: that step failed in the child, or the child is gone.
        """
        with self._state_lock:
            early, self._early = self._early, []
        if early:
            return early
        if not self.has_unfinished_requests():
            return []
        with self._recv_lock:
            return self._take(self._recv())

    def _take(self, message: tuple) -> list[Any]:
        kind = message[0]
        if kind == "failed":
            raise RuntimeError(message[1])
        if kind != "outputs":
            raise RuntimeError(f"unexpected message from the engine process: {kind}")
        _, deltas, stats, seen_adds = message
        with self._state_lock:
            self._stats, self._seen_adds = stats, seen_adds
            return [out for out in map(self._rebuild, deltas) if out is not None]

    def _drain_when_idle(self) -> None:
        """With no request live here, nobody reads the child's last messages (the steps that
        applied aborts): read them now, so stats are current. Outputs of a request added
        meanwhile are kept for the next ``step()``."""
        if self.has_unfinished_requests() or not self._recv_lock.acquire(blocking=False):
            return
        try:
            while self._results.poll():
                message = self._recv()
                if message[0] == "outputs":
                    outputs = self._take(message)
                    with self._state_lock:
                        self._early += outputs
        finally:
            self._recv_lock.release()

    # ---- beyond the engine interface ----------------------------------------------------------
    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(engine, *args)`` in the child between steps and return its result
        (benchmarks and tests: offline runs, pool checks). Only while no request is live."""
        if self.has_unfinished_requests():
            raise RuntimeError("call(): requests are live; call between them")
        self._send(("call", fn, args))
        with self._recv_lock:
            while True:
                message = self._recv()
                if message[0] == "called":
                    return message[1]
                if message[0] == "called_error":
                    raise RuntimeError(message[1])
                # Outputs of requests aborted before the call: nobody waits for them.

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child (requests in it are dropped)."""
        if self._proc.is_alive():
            try:
                self._send(("shutdown",))
            except OSError:
                pass
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
        self._commands.close()
        self._results.close()

    # ---- internals ----------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._commands.send(message)

    def _recv(self) -> tuple:
        try:
            return self._results.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"the engine process is gone (exit code "
                               f"{self._proc.exitcode})") from exc

    def _rebuild(self, delta: tuple) -> Any:
        request_id, completions, finished, metrics = delta
        state = self._live.get(request_id)
        if state is None:  # aborted here after the child had stepped it
            return None
        outs = []
        for index, keep, suffix, new_ids, reason, cum_logprob, new_logprobs in completions:
            text = state.text_of(index, keep, suffix, new_ids, reason, self.tokenizer)
            tokens = state.tokens.setdefault(index, [])
            tokens += new_ids
            state.texts[index] = text
            logprobs = None
            if new_logprobs is not None:
                all_logprobs = state.logprobs.setdefault(index, [])
                all_logprobs += new_logprobs
                logprobs = GrowingListView(all_logprobs, 0, len(all_logprobs))
            # O(1) snapshots: the lists only grow, and each view keeps its own length.
            outs.append(CompletionOutput(index, text, GrowingListView(tokens, 0, len(tokens)),
                                         reason, cum_logprob, logprobs))
        if finished:
            del self._live[request_id]
        return RequestOutput(request_id, state.prompt, state.prompt_token_ids, outs, finished,
                             metrics)
