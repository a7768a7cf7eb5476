"""The client of an engine core in a child process (:mod:`mini_paged_attn.engine.process.child`).

:class:`MPEngineClient` starts the child, validates each request with the child's own limits
(:class:`~mini_paged_attn.engine.admission.Admission`) before sending it, so a bad request still
fails at once with a ``ValueError`` and nothing is queued, and rebuilds cumulative
``RequestOutput`` objects from the output deltas the child's engine makes (``engine/deltas.py``)
on its output thread, making the text here from the token ids where the child sent none
(detokenizing was ~60% of the engine's host work per step at 64 requests: here it runs off the
engine's interpreter lock).

The rebuilt outputs are the engine's cumulative ones, but for their metrics: the child sends a
request's metrics in its first and its finished delta only, so a running request's outputs
carry those of its first output (arrival, scheduling and first-token times, cached prompt
tokens), and the finished output all of them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from ...models.load_progress import ProgressCallback
from ..outputs import (CompletionOutput, EngineStats, GrowingListView, RequestMetrics,
                       RequestOutput)
from ..sampling_params import SamplingParams
from .child import CoreLaunch
from .client import ClientBookkeeping
from .messages import (AbortRequest, AddRequest, EngineDead, Loading, Message, Outputs,
                       PauseRequest, Ready, Shutdown, StepFailed, decode, encode)
from .spawn import EngineProcess

logger = logging.getLogger(__name__)


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
    prompt_logprobs: list | None = None
    metrics: RequestMetrics | None = None     # the latest the engine sent

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

    def rebuild(self, delta: tuple, tokenizer: Any) -> RequestOutput:
        """The request's cumulative output after ``delta`` (laid out as
        :class:`~mini_paged_attn.engine.deltas.OutputDelta`)."""
        request_id, completions, finished, metrics, prompt_logprobs = delta
        outs = []
        for (index, keep, suffix, new_ids, reason, cum_logprob, new_logprobs,
             stop_reason) in completions:
            text = self.text_of(index, keep, suffix, new_ids, reason, tokenizer)
            tokens = self.tokens.setdefault(index, [])
            tokens += new_ids
            logprobs = None
            if new_logprobs is not None:
                all_logprobs = self.logprobs.setdefault(index, [])
                all_logprobs += new_logprobs
                logprobs = GrowingListView(all_logprobs, 0, len(all_logprobs))
            # O(1) snapshots: the lists only grow, and each view keeps its own length.
            outs.append(CompletionOutput(index, text, GrowingListView(tokens, 0, len(tokens)),
                                         reason, cum_logprob, logprobs,
                                         stop_reason=stop_reason))
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        if metrics is not None:
            self.metrics = metrics
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, outs, finished,
                             self.metrics, self.prompt_logprobs)


def _import_tokenizer_modules() -> None:
    # The base fast class: what most engines' tokenizers unpickle to (models/hf_tokenizer.py);
    # not AutoTokenizer, whose import brings transformers' auto-model stack (seconds).
    try:
        from transformers import PreTrainedTokenizerFast  # noqa: F401
    except Exception:    # a missing or broken install shows where the tokenizer is used
        logger.debug("could not import transformers' tokenizers ahead", exc_info=True)


def _engine_text(params: SamplingParams) -> bool:
    """Whether the engine's process makes the request's text (else the client does)."""
    return bool(params.stop) or not params.default_text


class MPEngineClient(ClientBookkeeping):
    """An ``LLMEngine`` stepped by an engine core in a child process.

    Args:
        model: what ``LLM(model, ...)`` takes (a local model directory or ``"tiny"``).
        llm_kwargs: the other ``LLM`` arguments (dtype, device, block_size, ...).
        start_timeout: seconds to wait for the engine to load (RuntimeError after).
        engine_factory: ``"module:function"`` that builds the engine in the child instead of
            ``LLM`` (see :class:`~mini_paged_attn.engine.process.child.CoreLaunch`).
        max_consecutive_failures: failed steps in a row after which the engine is dead.
        load_progress: called with each :class:`~mini_paged_attn.models.load_progress.LoadEvent`
            of the child's load, on this thread, before the constructor returns.
        started: a child already started (:meth:`.spawn.EngineProcess.start`, with the same
            launch), e.g. before this process imported torch; None: start it here.

    Raises:
        RuntimeError: the child did not start, or its engine could not be built.
        ValueError, FileNotFoundError: what it was asked to load cannot be (e.g. the model
            directory; the message is the engine's own).
    """

    def __init__(self, model: str, llm_kwargs: dict | None = None, *,
                 start_timeout: float = 900.0, engine_factory: str | None = None,
                 max_consecutive_failures: int = 3,
                 load_progress: ProgressCallback | None = None,
                 started: EngineProcess | None = None) -> None:
        if max_consecutive_failures < 1:
            raise ValueError("max_consecutive_failures: expected >= 1, "
                             f"got {max_consecutive_failures}")
        if started is None:
            started = EngineProcess.start(CoreLaunch(str(model), dict(llm_kwargs or {}),
                                                     engine_factory, max_consecutive_failures))
        self._child = started
        self.process, self._commands, self._results = (started.process, started.commands,
                                                       started.results)
        # Ready brings the tokenizer, whose unpickling imports transformers' tokenizer stack
        # (seconds on a cold host); import it here while the child loads, not after.
        threading.Thread(target=_import_tokenizer_modules, name="engine-client-imports",
                         daemon=True).start()
        ready = self._await_ready(start_timeout, load_progress)
        super().__init__(ready.tokenizer, ready.admission)
        self.model_config = ready.model_config
        self.max_model_len = ready.max_model_len
        self._stats = ready.stats
        self._seen_adds = 0
        self._send_lock = threading.Lock()
        self._closing = False
        self._reader = threading.Thread(target=self._read_outputs, name="engine-client-outputs",
                                        daemon=True)
        self._reader.start()

    def _await_ready(self, timeout: float, load_progress: ProgressCallback | None) -> Ready:
        deadline = time.monotonic() + timeout
        try:
            while True:
                if not self._results.poll(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"the engine process did not start within {timeout} s")
                message = decode(self._results.recv_bytes())
                if not isinstance(message, Loading):
                    break
                if load_progress is not None:
                    load_progress(message.event)
        except (EOFError, OSError) as exc:
            message = EngineDead(f"the engine process exited while starting "
                                 f"({type(exc).__name__})")
        except RuntimeError:
            self._stop_process(0)
            raise
        if not isinstance(message, Ready):
            self._stop_process(5)
            user_error = getattr(message, "user_error", None)
            if user_error is not None:   # e.g. the model directory: the caller's to fix
                raise (FileNotFoundError if user_error == "FileNotFoundError"
                       else ValueError)(message.message)
            raise RuntimeError(getattr(message, "message", f"unexpected {message!r}"))
        return message

    # ---- the EngineClient interface -------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, final_only: bool = False) -> None:
        params, text, ids = self._admit(request_id, prompt, params)
        # Text is made here (_Rebuilt), off the engine's process, unless stop strings need it
        # there, or it is not made the usual way (special tokens kept, stops included).
        self._send(AddRequest(request_id, None, ids, params, _engine_text(params), final_only))

    def abort_request(self, request_id: str) -> bool:
        known = self._forget(request_id)
        if known:
            self._send(AbortRequest(request_id))
        return known

    def pause_request(self, request_id: str, paused: bool = True) -> bool:
        if not self._is_live(request_id, paused):
            return False
        self._send(PauseRequest(request_id, paused))
        return True

    def _new_state(self, params: SamplingParams, text: str | None, ids: list[int]) -> _Rebuilt:
        return _Rebuilt(text, ids, None if _engine_text(params) else {})

    def stats(self) -> EngineStats:
        with self._lock:
            return replace(self._stats, num_waiting=self._stats.num_waiting
                           + self._sent_adds - self._seen_adds)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child (requests in it are dropped) and the output thread."""
        self._closing = True
        if self.process.is_alive():
            try:
                self._send(Shutdown())
            except (OSError, ValueError):
                pass
        self._stop_process(timeout)
        self._reader.join(timeout)
        self._commands.close()
        self._results.close()

    # ---- internals ------------------------------------------------------------------------
    def _send(self, message: Message) -> None:
        data = encode(message)
        with self._send_lock:
            self._commands.send_bytes(data)

    def _stop_process(self, timeout: float) -> None:
        self._child.stop(timeout)

    def _read_outputs(self) -> None:
        """The output thread: read the child's messages and hand them on until it is gone."""
        while True:
            try:
                message = decode(self._results.recv_bytes())
            except (EOFError, OSError):
                self.process.join(5)
                reason = ("the engine was shut down" if self._closing else
                          f"the engine process is gone (exit code {self.process.exitcode})")
                self._die(reason)
                return
            if isinstance(message, Outputs):
                self._on_outputs(message)
            elif isinstance(message, StepFailed):
                self._on_failed(message.message, message.request_ids)
            elif isinstance(message, EngineDead):
                self._die(message.message)
                return
            else:
                logger.error("unexpected message from the engine process: %s", message.kind)

    def _on_outputs(self, message: Outputs) -> None:
        with self._lock:
            self._stats, self._seen_adds = message.stats, message.adds_seen
            outputs = []
            for delta in message.deltas:
                request_id = delta[0]
                state = self._live.get(request_id)
                if state is None:  # aborted here after the child had stepped it
                    continue
                output = state.rebuild(delta, self.tokenizer)
                outputs.append(output)
                if output.finished:
                    del self._live[request_id]
        handler = self._handler
        if handler is not None and outputs:
            handler.on_outputs(outputs)


__all__ = ["MPEngineClient"]
