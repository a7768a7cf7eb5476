"""From sampled tokens to RequestOutputs: incremental detokenization, stop strings, outputs.

Text is produced incrementally only where someone needs it while the request runs (streaming
outputs, or stop strings to look for); a request that only wants its final output is decoded
once, when it finishes. While stop strings may still match, the last ``len(longest stop) - 1``
characters are held back, so the text of successive outputs only ever grows and never shows
the start of a stop string that later matches.

A request added with ``deltas=True`` is reported by :meth:`OutputProcessor.make_delta` as what
changed since its previous report (``engine/deltas.py``) instead of a cumulative output.

``SamplingParams.skip_special_tokens`` decides whether special tokens are decoded, and
``include_stop_str_in_output`` whether the stop string (or the stop token's text) that ended a
sample ends its text; ``stop_reason`` records which one it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.request import FinishReason, Request, Sequence
from ..models.tokenizer import IncrementalDetokenizer, Tokenizer
from .outputs import (CompletionOutput, GrowingListView, Logprob, RequestMetrics, RequestOutput,
                      logprob_objects)


@dataclass
class _SampleText:
    detokenizer: IncrementalDetokenizer
    num_fed: int = 0               # generated tokens given to the detokenizer
    searched: int = 0              # text before this offset holds no stop string
    final_text: str | None = None  # set when the sample finishes
    stop_string: str | None = None  # the stop string that ended the sample


class _Sent:
    """What the deltas of one sample have reported so far."""

    __slots__ = ("logprobs", "text", "tokens")

    def __init__(self) -> None:
        self.tokens = 0       # generated token ids
        self.logprobs = 0     # logprob entries
        self.text = ""        # the text as last reported


@dataclass
class RequestState:
    """The engine's side of a request: its prompt text and per-sample text state."""

    request: Request
    prompt: str | None
    final_only: bool                # only the finished output is wanted (LLM.generate)
    stop: tuple[str, ...] = ()
    detokenize: bool = True         # False: outputs carry token ids only (text "")
    deltas: bool = False            # reported by make_delta (what changed), not make_output
    texts: dict[int, _SampleText] = field(default_factory=dict)
    # With deltas: per sample index, what was reported; and whether the prompt logprobs were.
    sent: dict[int, _Sent] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False
    # One copy of the prompt for all the request's outputs (they share it: read-only).
    prompt_token_ids: list[int] = field(init=False)
    # Per prompt position so far (None at position 0), when the request asked for them.
    prompt_logprobs: list[dict[int, float] | None] | None = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.request.prompt_token_ids)
        asked = getattr(self.request.params, "prompt_logprobs", None) is not None
        self.prompt_logprobs = [None] if asked else None

    def add_prompt_logprobs(self, start: int, entries: list[dict[int, float]]) -> None:
        """Record the prompt logprobs of positions ``start ..`` (from one step). Positions
        already recorded are skipped: a preempted request computes its prompt again."""
        have = self.prompt_logprobs
        assert have is not None and 1 <= start <= len(have), (start, have and len(have))
        have.extend(entries[len(have) - start:])

    def prompt_logprobs_done(self) -> list[dict[int, float] | None] | None:
        """The prompt logprobs once every position has them, else None."""
        have = self.prompt_logprobs
        if have is None or len(have) < self.request.num_prompt_tokens:
            return None
        return have

    @property
    def incremental(self) -> bool:
        # Stop strings are looked for in the text, so they need it whatever the caller wants.
        return (self.detokenize and not self.final_only) or bool(self.stop)

    @property
    def hold(self) -> int:
        return max(map(len, self.stop)) - 1 if self.stop else 0


class OutputProcessor:
    """Turns the sequences that grew in a step into text and outputs (engine thread only)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def _num_to_decode(self, seq: Sequence) -> int:
        """Generated tokens whose text counts: a stop token ends the text without appearing
        in it. (O(1): called for every sequence every step.)"""
        tokens = seq.token_ids
        num = len(tokens) - seq.request.num_prompt_tokens
        if (num and seq.finish_reason is FinishReason.STOP
                and tokens[-1] in seq.request.stop_token_ids
                and not seq.request.params.include_stop_str_in_output):
            num -= 1
        return num

    @staticmethod
    def _stop_reason(text: _SampleText | None, seq: Sequence) -> str | int | None:
        """The stop string or the stop token id (of ``stop_token_ids``) that ended ``seq``;
        None otherwise (its length, an eos token, an abort, or still running)."""
        if text is not None and text.stop_string is not None:
            return text.stop_string
        if seq.finish_reason is FinishReason.STOP and seq.token_ids:
            last = seq.token_ids[-1]
            if last in seq.request.params.stop_token_ids:
                return last
        return None

    def _ids_to_decode(self, seq: Sequence) -> list[int]:
        start = seq.request.num_prompt_tokens
        return seq.token_ids[start:start + self._num_to_decode(seq)]

    def process(self, state: RequestState, seq: Sequence) -> bool:
        """Detokenize what ``seq`` gained; returns True if a stop string matched (the caller
        then finishes a running sequence with reason "stop"; one that already finished on its
        length with the same token gets reason "stop" here, since its text ends there).

        Several tokens gained at once (a verified speculative run) are looked at one by one,
        as steps of one token would have: a stop string that the ``j``-th completes cuts the
        sample's tokens after it off (no output has shown them)."""
        if not state.incremental:
            return False
        text = state.texts.get(seq.index)
        if text is None:
            det = self.tokenizer.detokenizer(
                seq.request.prompt_token_ids,
                skip_special_tokens=seq.request.params.skip_special_tokens)
            text = state.texts[seq.index] = _SampleText(det)
        num = self._num_to_decode(seq)
        if state.stop and num > text.num_fed + 1:
            for j in range(text.num_fed + 1, num):
                if self._advance(state, text, seq, j, finished=False):
                    del seq.token_ids[seq.request.num_prompt_tokens + j:]
                    return True
        return self._advance(state, text, seq, num, seq.is_finished)

    def _advance(self, state: RequestState, text: _SampleText, seq: Sequence, num: int,
                 finished: bool) -> bool:
        """Feed the sample's first ``num`` generated tokens to its detokenizer (flushed when
        ``finished``) and look for the stop strings in the new text; True on a match."""
        if num > text.num_fed:
            start = seq.request.num_prompt_tokens
            text.detokenizer.add(seq.token_ids[start + text.num_fed:start + num])
            text.num_fed = num
        if finished:
            text.detokenizer.flush()
        full = text.detokenizer.text
        for stop in state.stop:
            at = full.find(stop, max(0, text.searched - len(stop) + 1))
            if at != -1:
                keep = len(stop) if seq.request.params.include_stop_str_in_output else 0
                text.final_text = full[:at + keep]
                text.stop_string = stop
                if seq.finish_reason is FinishReason.LENGTH:
                    seq.finish_reason = FinishReason.STOP
                return True
        text.searched = len(full)
        return False

    def _text_of(self, state: RequestState, seq: Sequence) -> str:
        text = state.texts.get(seq.index)
        if text is None:
            if not (seq.is_finished and state.detokenize):
                return ""
            return self.tokenizer.decode(
                self._ids_to_decode(seq),
                skip_special_tokens=seq.request.params.skip_special_tokens)
        if text.final_text is not None:
            return text.final_text
        full = text.detokenizer.text
        if (seq.is_finished and not seq.awaits_token) or not state.hold:
            return full
        return full[:max(0, len(full) - state.hold)]

    def make_output(self, state: RequestState) -> RequestOutput:
        """The request's output now. O(new tokens) while it runs: token ids and logprobs are
        views (see GrowingListView), copied into lists once, in the finished output."""
        request = state.request
        finished = request.is_finished
        wants_logprobs = request.params.logprobs is not None
        start = request.num_prompt_tokens
        completions = []
        num_generated = 0
        for seq in request.sequences:    # in index order: the scheduler appends them so
            tokens = seq.token_ids
            end, reason = _reported(seq)
            num_generated += end - start
            logprobs = None
            if finished:
                token_ids = tokens[start:]
                if wants_logprobs:
                    logprobs = list(seq.logprobs or ())
                    if state.final_only:
                        logprobs = self._logprob_objects(logprobs, request.params.logprobs)
            else:
                token_ids = GrowingListView(tokens, start, end)
                if wants_logprobs:
                    lps = seq.logprobs if seq.logprobs is not None else []
                    logprobs = GrowingListView(lps, 0, len(lps))
            completions.append(CompletionOutput(
                index=seq.index, text=self._text_of(state, seq), token_ids=token_ids,
                finish_reason=reason.value if reason else None,
                cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
                logprobs=logprobs,
                stop_reason=self._stop_reason(state.texts.get(seq.index), seq)
                if reason else None))
        return RequestOutput(request_id=request.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids,
                             outputs=completions, finished=finished,
                             metrics=_metrics(request, num_generated),
                             prompt_logprobs=self._prompt_logprobs(state, finished))

    def make_delta(self, state: RequestState) -> tuple:
        """What changed in the request since its previous delta: a plain tuple laid out as
        :class:`~.deltas.OutputDelta`, its completions as :class:`~.deltas.CompletionDelta`
        (see ``engine/deltas.py``). Per sample: the new token ids, the text's edit (where the
        engine makes the text: ``keep`` is what stays of the text last reported, all of it
        unless a stop string cut it), the new logprob entries and ``cumulative_logprob`` (when
        asked), finish and stop reason once it ends; the metrics in the first and the finished
        delta; the prompt logprobs once complete. Costs O(new tokens), plus a comparison of the
        text with the one last reported. Lists in it are the delta's own (the engine only
        appends to what it copied them from), so it may be sent after the next step ran."""
        request = state.request
        finished = request.is_finished
        params = request.params
        wants_logprobs = params.logprobs is not None
        objects = finished and state.final_only   # as make_output's: vLLM's Logprob entries
        start = request.num_prompt_tokens
        sent = state.sent
        first = not sent
        completions = []
        num_generated = 0
        for seq in request.sequences:    # in index order: the scheduler appends them so
            tokens = seq.token_ids
            end, reason = _reported(seq)
            num_generated += end - start
            mark = sent.get(seq.index)
            if mark is None:
                mark = sent[seq.index] = _Sent()
            new_ids = tokens[start + mark.tokens:end]
            mark.tokens = end - start
            text = self._text_of(state, seq)
            keep = len(mark.text) if text.startswith(mark.text) else 0  # a stop string may cut
            mark.text = text
            logprobs = cumulative = None
            if wants_logprobs:
                entries = seq.logprobs if seq.logprobs is not None else ()
                logprobs = list(entries[mark.logprobs:])
                mark.logprobs = len(entries)
                if objects:
                    logprobs = self._logprob_objects(logprobs, params.logprobs)
                cumulative = seq.cumulative_logprob
            completions.append((
                seq.index, keep, text[keep:], new_ids, reason.value if reason else None,
                cumulative, logprobs,
                self._stop_reason(state.texts.get(seq.index), seq) if reason else None))
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            prompt_logprobs = self._prompt_logprobs(state, finished)
            state.prompt_logprobs_sent = prompt_logprobs is not None
        metrics = _metrics(request, num_generated) if first or finished else None
        return (request.request_id, completions, finished, metrics, prompt_logprobs)

    def _prompt_logprobs(self, state: RequestState, finished: bool
                         ) -> list[dict[int, float] | None] | None:
        """The request's prompt logprobs once complete (else None); as vLLM's Logprob entries
        in a final-only request's finished output."""
        prompt_logprobs = state.prompt_logprobs_done()
        if finished and state.final_only and prompt_logprobs is not None:
            prompt_logprobs = [None, *self._logprob_objects(prompt_logprobs[1:],
                                                            state.request.params.prompt_logprobs)]
        return prompt_logprobs

    def _logprob_objects(self, entries: list[dict[int, float]], top: int
                         ) -> list[dict[int, Logprob]]:
        """Per-position entries as vLLM's Logprob objects (once, in a final-only output: the
        LLM's; the token texts are decoded once per distinct id)."""
        texts: dict[int, str] = {}

        def decode(token_id: int) -> str:
            text = texts.get(token_id)
            if text is None:
                text = texts[token_id] = self.tokenizer.decode([token_id],
                                                               skip_special_tokens=False)
            return text

        return [logprob_objects(e, top, decode) for e in entries]


def _reported(seq: Sequence) -> tuple[int, FinishReason | None]:
    """How far ``seq``'s tokens are reported now, and its finish reason if that is reported
    too: a token still in flight (asynchronous scheduling) is not reported yet, so a sample
    that ended on its length with its last token in flight is not done yet."""
    end = len(seq.token_ids) - seq.awaits_token
    return end, seq.finish_reason if end == len(seq.token_ids) else None


def _metrics(request: Request, num_generated: int) -> RequestMetrics:
    """The request's metrics now; ``num_generated``: its tokens reported, over all samples."""
    return RequestMetrics(
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finished_time=request.finished_time,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.sequences[0].num_cached_tokens,
        num_generation_tokens=num_generated,
        last_token_time=request.last_token_time)


__all__ = ["OutputProcessor", "RequestState"]
