"""What the engine hands back: per-request outputs, their metrics, and engine statistics."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from .tools.parsers import ToolCall


class Logprob(float):
    """One token's log-probability, shaped like vLLM's ``Logprob``: ``logprob``, ``rank``,
    ``decoded_token``.

    It is also the float itself, so code written for ``{token_id: float}`` entries keeps
    working: ``entry == -0.5``, ``math.exp(entry)``, ``sorted(d.values())`` and
    ``json.dumps`` treat it as that number.

    ``rank``: 1 for the most likely token, 2 for the next ...: the returned top tokens' place
    among them, and the sampled (or prompt) token's place in the whole vocabulary, 1 + the
    tokens strictly more likely, as vLLM counts it. ``decoded_token``: the token's text (special tokens included), or None.
    """

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None,
                decoded_token: str | None = None) -> Logprob:
        obj = super().__new__(cls, logprob)
        obj.rank = rank
        obj.decoded_token = decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):
        return (Logprob, (float(self), self.rank, self.decoded_token))

    def __repr__(self) -> str:
        return (f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
                f"decoded_token={self.decoded_token!r})")


def logprob_objects(entries: dict[int, float], top: int, decode: Callable[[int], str]
                    ) -> dict[int, Logprob]:
    """``{token_id: logprob}`` (the top ``top`` tokens and maybe the sampled one) as
    :class:`Logprob` entries, ranked by logprob among the top ones; an entry that is already
    a :class:`Logprob` with a rank (the sampled or prompt token, ranked in the vocabulary by
    the sampler) keeps it. ``decode(token_id)`` gives a token's text."""
    ranked = sorted(entries.items(), key=lambda kv: kv[1], reverse=True)
    top_ids = {tid for tid, _ in ranked[:top]}
    rank = {tid: i + 1 for i, (tid, _) in enumerate(ranked) if tid in top_ids}
    return {tid: Logprob(lp, known if (known := getattr(lp, "rank", None)) is not None
                         else rank.get(tid), decode(tid))
            for tid, lp in entries.items()}


class GrowingListView(Sequence):
    """Read-only view of items ``start .. stop-1`` of a list that is only ever appended to.

    What a streamed output holds instead of a copy of a sample's token ids (or logprobs): made in
    O(1), ``len`` in O(1), ``view[a:]`` copies only the ``a:`` part. Since the engine only
    appends to the list past ``stop``, the view's items never change: it is a snapshot, safe to
    read from another thread while the engine runs. Compares equal to a list or tuple with the
    same items; ``list(view)`` gives a plain list.
    """

    __slots__ = ("_items", "_start", "_stop")

    def __init__(self, items: list, start: int, stop: int) -> None:
        assert 0 <= start <= stop <= len(items), (start, stop, len(items))
        self._items, self._start, self._stop = items, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i):
        n = self._stop - self._start
        if isinstance(i, slice):
            a, b, step = i.indices(n)
            if step == 1:
                return self._items[self._start + a:self._start + max(a, b)]
            return [self._items[self._start + k] for k in range(a, b, step)]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index out of range for a view of {n} items")
        return self._items[self._start + i]

    def __iter__(self):
        return iter(self._items[self._start:self._stop])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (GrowingListView, list, tuple)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None     # like a list

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class CompletionOutput:
    """One sample of a request.

    ``text`` and ``token_ids`` only grow between successive outputs of one request. A stop
    string is not part of ``text``; a stop token is part of ``token_ids`` but not of ``text``
    (both are, with ``SamplingParams.include_stop_str_in_output``).
    ``logprobs`` (when asked): per generated token, ``{token_id: logprob}`` for the top
    ``logprobs`` tokens and the sampled one. In the outputs of :meth:`LLM.generate
    <.llm.LLM.generate>` and :meth:`LLM.chat <.llm.LLM.chat>` each logprob is a
    :class:`Logprob` (``.logprob``, ``.rank``, ``.decoded_token``, as vLLM's), which is also
    the float; elsewhere (streamed outputs, the server's engine) plain floats. ``cumulative_logprob``: the sum of the sampled
    tokens' logprobs (when asked), else None.

    ``token_ids`` and ``logprobs`` are plain lists in a finished output. In the outputs of a
    running request they are :class:`GrowingListView` snapshots instead (read-only, made in O(1)
    so a streaming step costs O(new tokens), not O(tokens so far)); to keep track of what is
    new, keep ``len(token_ids)`` / ``len(text)`` and slice from there next time.

    ``stop_reason`` (as vLLM's): the stop string, or the token id of ``stop_token_ids``, that
    ended the sample; None when it ended otherwise (its length, an end-of-sequence token, an
    abort) or still runs.

    ``tool_calls``: set only by :meth:`LLM.chat <.llm.LLM.chat>` with ``tools``: the calls
    read from the finished ``text`` (``[]``: none, the text is all content); ``text`` itself
    stays the model's whole output.
    """

    index: int
    text: str
    token_ids: Sequence[int]
    finish_reason: str | None = None          # "stop" | "length" | "abort" | None (running)
    cumulative_logprob: float | None = None
    logprobs: Sequence[dict[int, float]] | None = None
    tool_calls: list[ToolCall] | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times are ``time.time()`` seconds; durations are seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens served by the prefix cache
    num_generation_tokens: int = 0      # over all samples
    last_token_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens per second after the first one (None until two exist)."""
        if self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        end = self.last_token_time if self.last_token_time is not None else self.first_token_time
        elapsed = end - self.first_token_time
        return (self.num_generation_tokens - 1) / elapsed if elapsed > 0 else None

    def __reduce__(self):
        # The engine process sends a request's metrics in its first and last output delta:
        # as a plain tuple of fields they pickle ~4x faster than through the dataclass's
        # __dict__.
        return (RequestMetrics, _metric_fields(self))


_metric_fields = operator.attrgetter(*(f.name for f in fields(RequestMetrics)))


@dataclass
class RequestOutput:
    """The state of one request after a step (or at the end, for ``LLM.generate``).

    ``prompt_token_ids`` is one list shared by all the outputs of the request: do not modify it.
    ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``): one entry per prompt token,
    None for the first, else ``{token_id: logprob}`` of the top ``prompt_logprobs`` tokens and
    the prompt's token there (:class:`Logprob` entries in LLM.generate's outputs, as for
    ``CompletionOutput.logprobs``); set once the whole prompt is computed (None before), and shared
    by the request's later outputs like ``prompt_token_ids``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class EngineStats:
    """A snapshot of the engine, for people and for ``/metrics``.

    ``kv_blocks_free`` counts the blocks no live request holds: free ones and cached ones that
    can be evicted. ``prefix_cache_hit_rate`` is the share of prompt tokens found in the prefix
    cache. ``generation_tokens_per_s`` is measured over the last ``window_s`` seconds of steps.

    Speculative decoding (0 without it): ``spec_steps`` steps verified proposals,
    ``spec_num_drafts`` times a sequence verified some (once per sequence and step),
    ``spec_num_draft_tokens`` tokens were proposed and ``spec_num_accepted_tokens`` of them
    kept; :attr:`spec_acceptance_rate`, :attr:`spec_mean_accepted_length` and
    :attr:`spec_proposals_per_step` follow from them.
    """

    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int = 0           # blocks findable in the prefix cache (in use or not)
    block_size: int = 16
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_steps: int = 0
    prompt_tokens_total: int = 0        # prompt tokens computed (cache hits excluded)
    generation_tokens_total: int = 0
    generation_tokens_per_s: float = 0.0
    requests_finished: int = 0
    window_s: float = 0.0
    cascade_steps: int = 0              # steps that attended over shared prefixes once
    spec_steps: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """The share of proposed tokens that verification kept (0.0 before any)."""
        n = self.spec_num_draft_tokens
        return self.spec_num_accepted_tokens / n if n else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a sequence gained per verification: the kept proposals and the target's
        own token (vLLM's "mean acceptance length"; 0.0 before any)."""
        n = self.spec_num_drafts
        return 1.0 + self.spec_num_accepted_tokens / n if n else 0.0

    @property
    def spec_proposals_per_step(self) -> float:
        """Tokens proposed per sequence and step that verified (at most
        num_speculative_tokens; 0.0 before any)."""
        n = self.spec_num_drafts
        return self.spec_num_draft_tokens / n if n else 0.0

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def __reduce__(self):
        # Sent with every step's outputs from the engine process: a tuple of fields pickles
        # several times faster than the dataclass's __dict__.
        return (EngineStats, _stats_fields(self))

    def summary(self) -> str:
        return (f"running {self.num_running}, waiting {self.num_waiting}, "
                f"KV blocks used {self.kv_blocks_used}/{self.kv_blocks_total} "
                f"({100 * self.kv_cache_usage:.1f}%), prefix hit rate "
                f"{100 * self.prefix_cache_hit_rate:.1f}%, preemptions {self.num_preemptions}, "
                f"generation {self.generation_tokens_per_s:.1f} tok/s"
                + (f", speculation kept {100 * self.spec_acceptance_rate:.1f}% "
                   f"({self.spec_mean_accepted_length:.2f} tokens a step)"
                   if self.spec_num_drafts else ""))


_stats_fields = operator.attrgetter(*(f.name for f in fields(EngineStats)))


__all__ = ["CompletionOutput", "EngineStats", "GrowingListView", "Logprob", "RequestMetrics",
           "RequestOutput", "logprob_objects"]
