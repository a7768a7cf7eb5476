"""The messages between an engine core and its client: one kind per payload.

Client to core: :class:`AddRequest`, :class:`AbortRequest`, :class:`PauseRequest`,
:class:`Shutdown`. Core to client:
:class:`Loading` (while the engine loads: its progress), :class:`Ready` (once, when the engine is
built), :class:`Outputs` (one per step),
:class:`StepFailed` (a step raised; its requests were aborted), :class:`EngineDead` (the core
stopped for good, or could not start).

In one process the payload objects travel as they are; between processes :func:`encode` /
:func:`decode` turn them into bytes as ``(kind, fields)`` pickles. Pickle rather than a schema
codec: ``Ready`` carries the tokenizer and ``AddRequest`` the ``SamplingParams`` as they are, and
the per-step output deltas are plain tuples of lists, strings and numbers (``engine/deltas.py``),
which pickle in C without a Python call per object, as fast as ``marshal`` writes them
(docs/performance-notes.md, "Start-up and the engine process's per-step outputs").
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union

from ...models.load_progress import LoadEvent
from ..deltas import CompletionDelta, OutputDelta
from ..outputs import EngineStats
from ..sampling_params import SamplingParams


class MessageKind(enum.Enum):
    """What a message is; its value is what goes over the pipe (:data:`PAYLOADS` maps each kind
    to its payload class)."""

    ADD = "add"
    ABORT = "abort"
    PAUSE = "pause"
    SHUTDOWN = "shutdown"
    LOADING = "loading"
    READY = "ready"
    OUTPUTS = "outputs"
    STEP_FAILED = "step_failed"
    ENGINE_DEAD = "engine_dead"


# ---- client -> core --------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """A validated request. ``prompt``: its text when the core should keep it in the outputs
    (None: the client keeps it, or there is none). ``detokenize``: the core makes the text (else
    the client does, from the token ids). ``final_only``: the core reports the request only
    once it finishes."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenize: bool
    final_only: bool = False
    kind: ClassVar[MessageKind] = MessageKind.ADD


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    kind: ClassVar[MessageKind] = MessageKind.ABORT


@dataclass(frozen=True)
class PauseRequest:
    """Pause (``paused``) or resume a request: see ``LLMEngine.pause_request``."""

    request_id: str
    paused: bool
    kind: ClassVar[MessageKind] = MessageKind.PAUSE


@dataclass(frozen=True)
class Shutdown:
    """Stop after the current step; requests still live are aborted."""

    kind: ClassVar[MessageKind] = MessageKind.SHUTDOWN


# ---- core -> client --------------------------------------------------------------------------
@dataclass(frozen=True)
class Loading:
    """One step of the engine's load (the client's progress bar draws it)."""

    event: LoadEvent
    kind: ClassVar[MessageKind] = MessageKind.LOADING


@dataclass(frozen=True)
class Ready:
    """What a client needs of the engine to validate and detokenize without it."""

    tokenizer: Any
    model_config: Any
    max_model_len: int
    admission: Any
    stats: EngineStats
    kind: ClassVar[MessageKind] = MessageKind.READY


@dataclass(frozen=True)
class Outputs:
    """One step: its output deltas (plain tuples laid out as :class:`OutputDelta`), the
    engine's stats after it, and how many ``AddRequest`` messages the core had received by then
    (the client counts the others as waiting)."""

    deltas: list[tuple]
    stats: EngineStats
    adds_seen: int
    kind: ClassVar[MessageKind] = MessageKind.OUTPUTS


@dataclass(frozen=True)
class StepFailed:
    """A step raised (or the engine refused a request); ``request_ids`` were aborted."""

    message: str
    request_ids: tuple[str, ...]
    kind: ClassVar[MessageKind] = MessageKind.STEP_FAILED


@dataclass(frozen=True)
class EngineDead:
    """The core has stopped, or never started; nothing more comes.

    ``user_error``: it never started because of what it was asked to load (a ValueError or
    FileNotFoundError, e.g. a model directory that cannot be loaded): ``message`` is then that
    error's own text, for the client to raise as the same type.
    """

    message: str
    user_error: str | None = None   # "ValueError" or "FileNotFoundError"
    kind: ClassVar[MessageKind] = MessageKind.ENGINE_DEAD


Message = Union[AddRequest, AbortRequest, PauseRequest, Shutdown, Loading, Ready, Outputs,
                StepFailed, EngineDead]
PAYLOADS: dict[MessageKind, type] = {cls.kind: cls for cls in (
    AddRequest, AbortRequest, PauseRequest, Shutdown, Loading, Ready, Outputs, StepFailed,
    EngineDead)}
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in PAYLOADS.values()}


def encode(message: Message) -> bytes:
    """``message`` as bytes for a pipe."""
    names = _FIELDS[type(message)]
    return pickle.dumps((message.kind.value, tuple(getattr(message, n) for n in names)),
                        protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Message:
    """The message :func:`encode` made.

    Raises:
        ValueError: ``data`` is not an encoded message.
    """
    try:
        kind, values = pickle.loads(data)
        return PAYLOADS[MessageKind(kind)](*values)
    except (ValueError, TypeError, KeyError, pickle.UnpicklingError) as exc:
        raise ValueError(f"data: not an engine core message ({type(exc).__name__}: {exc})"
                         ) from None


__all__ = ["AbortRequest", "AddRequest", "CompletionDelta", "EngineDead", "Loading", "Message",
           "MessageKind", "OutputDelta", "Outputs", "PAYLOADS", "PauseRequest", "Ready",
           "Shutdown", "StepFailed", "decode", "encode"]
