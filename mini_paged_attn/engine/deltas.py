"""Output deltas: what changed in one request since its last report, as plain tuples.

``LLMEngine.add_request(..., deltas=True)`` makes ``step()`` report such a request as an
output delta instead of a cumulative :class:`~.outputs.RequestOutput`: per sample the new
token ids, the edit of its text, the new logprobs and, once, how it ended. It is what the
server's engine process sends to its client each step (``engine/process/``): no cumulative
output is built for it and diffed again, and plain tuples of lists, strings and numbers pickle
several times faster than named tuples or dataclasses, which cost a Python call per object
(docs/performance-notes.md, "Start-up and the engine process's per-step outputs"). The client
rebuilds the cumulative outputs (``MPEngineClient``).

A delta is a plain ``tuple`` laid out as :class:`OutputDelta`, each of its completions a plain
``tuple`` laid out as :class:`CompletionDelta`; the named tuples name the fields (read a delta
by name with ``OutputDelta(*delta)``) and are equal to the plain ones.
"""

from __future__ import annotations

from typing import NamedTuple

from .outputs import RequestMetrics, RequestOutput


class CompletionDelta(NamedTuple):
    """What changed in one completion (sample) since the previous delta of its request.

    ``keep`` / ``suffix``: the text is now ``text[:keep] + suffix`` (a stop string may cut text
    already sent); both 0 and "" where the engine does not make the text. ``new_logprobs``: the
    entries of the new tokens (None: not asked); ``cumulative_logprob`` is the sample's sum so
    far. ``finish_reason`` / ``stop_reason``: as :class:`~.outputs.CompletionOutput`'s, set in
    the sample's last delta.
    """

    index: int
    keep: int
    suffix: str
    new_token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None
    new_logprobs: list[dict[int, float]] | None
    stop_reason: str | int | None = None


class OutputDelta(NamedTuple):
    """What changed in one request since its previous delta.

    ``metrics``: in the request's first delta and its finished one (None in between: the
    per-step counts and times are not sent). ``prompt_logprobs``: once, in the first delta
    after every prompt position has them (the request's first, unless it was preempted).
    """

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    metrics: RequestMetrics | None
    prompt_logprobs: list | None = None


def request_of(output: RequestOutput | tuple) -> tuple[str, bool]:
    """``(request_id, finished)`` of a cumulative output or an output delta."""
    if isinstance(output, RequestOutput):
        return output.request_id, output.finished
    return output[0], output[2]


__all__ = ["CompletionDelta", "OutputDelta", "request_of"]
