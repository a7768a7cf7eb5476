"""The server's side of an engine running in a process of its own (``engine_core.core_main``).

:class:`EngineCoreClient` starts the child, validates each request with the child's own limits
(:class:`~mini_paged_attn.engine.admission.Admission`) before sending it, so a bad request still
fails at once with a ``ValueError`` and nothing is queued, and rebuilds the cumulative
``RequestOutput`` objects the server expects from the child's per-step deltas, making the text
here from the token ids where the child sent none. :class:`~mini_paged_attn.server.engine_loop.
EngineLoop` runs on it unchanged.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine.outputs import CompletionOutput, GrowingListView, RequestOutput
from .engine_core import core_main


@dataclass
class _Rebuilt:
    """The client's copy of one live request's outputs, grown by deltas.

    ``detokenizers`` (completion index -> IncrementalDetokenizer): the text is made here, from
    the token ids, as the engine would have made it; None when the engine sends the text (the
    request has stop strings, which the engine finds in it) and ``texts`` keeps it.
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
            text = self.texts[index] = self.texts.get(index, "")[:keep] + suffix
            return text
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
        self._proc = ctx.Process(target=core_main, name="engine-core", daemon=True,
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
        self._early_failure: str | None = None  # a failure it read, for the next step()
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
        with self._recv_lock:  # the drain may be filling _early: wait for it
            failure = None
            with self._state_lock:
                early, self._early = self._early, []
                if not early:  # outputs read before a failure go out first
                    failure, self._early_failure = self._early_failure, None
            if early:
                return early
            if failure is not None:
                raise RuntimeError(failure)
            if not self.has_unfinished_requests():
                return []
            return self._take(self._recv())

    def _failed(self, message: tuple) -> str | None:
        """A failure from the child: forget the requests it aborted; its text if any of them
        was live here (else it is about requests already aborted or finished here)."""
        _, text, request_ids = message
        with self._state_lock:
            hit = [rid for rid in request_ids if self._live.pop(rid, None) is not None]
        return text if hit else None

    def _take(self, message: tuple) -> list[Any]:
        kind = message[0]
        if kind == "failed":
            text = self._failed(message)
            if text is not None:
                raise RuntimeError(text)
            return []
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
                elif message[0] == "failed":  # of a request added meanwhile: the next step()
                    text = self._failed(message)
                    if text is not None:
                        with self._state_lock:
                            self._early_failure = text
        finally:
            self._recv_lock.release()

    # ---- beyond the engine interface ----------------------------------------------------------
    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(engine, *args)`` in the child between steps and return its result
        (benchmarks and tests: offline runs, pool checks). Only while no request is live."""
        if self.has_unfinished_requests():
            raise RuntimeError("call(): requests are live; call between them")
        with self._recv_lock:  # before sending: a drain must not take the reply
            self._send(("call", fn, args))
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


__all__ = ["EngineCoreClient"]
