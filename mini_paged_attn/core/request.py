"""Request and sequence state, as the scheduler and the KV cache manager see it (no torch).

A :class:`Request` is what a user submitted: one prompt, ``n`` samples wanted. Each sample is a
:class:`Sequence`: its own token ids, its own blocks, its own place in the scheduler's queues.
A request with ``n > 1`` starts with one sequence; when its prompt has been computed and the
first tokens are sampled (``n`` of them, from the same logits), the other ``n - 1`` sequences are
forked off it and share the prompt's blocks (copy-on-write, see ``kv_cache_manager``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


PLACEHOLDER_TOKEN = -1
"""Stands in ``Sequence.token_ids`` for a token sampled by a step still running on the device
(asynchronous scheduling); the step's results replace it before anything reads it."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"     # queued: not admitted yet, or preempted (its KV was dropped)
    RUNNING = "running"     # admitted: holds blocks, gets tokens every step
    FINISHED = "finished"   # done (see finish_reason); holds no blocks


class FinishReason(str, enum.Enum):
    STOP = "stop"           # a stop token or stop string
    LENGTH = "length"       # max_tokens or max_model_len
    ABORT = "abort"         # aborted by the caller
    ERROR = "error"         # the engine could not go on with it (e.g. its grammar failed)


@dataclass(eq=False)
class Sequence:
    """One sample of a request: tokens, progress, and the physical blocks holding its KV.

    ``token_ids`` are the prompt then the generated tokens. ``num_computed_tokens`` of them have
    their K/V in the cache (the last sampled token never has: it is the next step's input).
    ``block_ids[i]`` holds tokens ``i*block_size .. (i+1)*block_size - 1``. Under a sliding
    window the first ``num_dropped_blocks`` entries lie wholly left of every later query's
    window: they were given back and hold a pad id (see ``sliding_window``); the sequence owns
    ``block_ids[num_dropped_blocks:]``.

    ``token_ids`` and ``logprobs`` are only ever appended to, never shrunk or replaced (not even
    by preemption): the engine's streamed outputs are views into them (``GrowingListView``).
    The one exception is a sample ending with reason "error": the token it could not keep (a
    placeholder, or a token its grammar rejected) is removed before any output showed it.
    """

    seq_id: int
    request: Request
    index: int                       # sample index within the request, 0 .. n-1
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_dropped_blocks: int = 0
    # Chained hashes of the first len(block_hashes) full blocks of token_ids (a function of the
    # tokens only, so it survives preemption); extended lazily by the KV cache manager.
    block_hashes: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # Tokens served by the prefix cache when this sequence was last admitted.
    num_cached_tokens: int = 0
    # Index of the first entry of block_ids that changed since the model runner last copied
    # this sequence's block table row (the KV cache manager lowers it, the runner raises it).
    blocks_changed_from: int = 0
    # Per generated token, whatever the sampler attached (logprobs); None when not asked for.
    logprobs: list[Any] | None = None
    cumulative_logprob: float = 0.0
    # A full block whose prefix-cache registration waits for its last token, a
    # PLACEHOLDER_TOKEN when it was allocated (see KVCacheManager.register_deferred).
    deferred_block: int | None = None
    # Steps in a row the context budget left it out of (``core/context_budget.py``).
    num_deferred: int = 0
    # Speculative decoding: tokens proposed to follow token_ids, for its next step to verify
    # (the scheduler takes them; they join token_ids only once the target model accepts them).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def awaits_token(self) -> bool:
        """Its newest token is a PLACEHOLDER_TOKEN: sampled by a step still in flight."""
        return self.token_ids[-1] == PLACEHOLDER_TOKEN

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        dropped = f"dropped={self.num_dropped_blocks}, " if self.num_dropped_blocks else ""
        return (f"Sequence(seq_id={self.seq_id}, request={self.request.request_id!r}, "
                f"index={self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids}, {dropped}"
                f"status={self.status.value})")


@dataclass(eq=False)
class Request:
    """A submitted request: the prompt, the limits the scheduler enforces, its sequences.

    ``params`` is the engine's sampling parameters object, carried through untouched (core does
    not look inside it); the fields the scheduler needs are copied out into plain values.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    n: int = 1
    params: Any = None
    arrival_time: float = 0.0
    sequences: list[Sequence] = field(default_factory=list)
    # Whether the n - 1 siblings of sequence 0 exist yet (always True when n == 1).
    forked: bool = False
    # False: the prompt is computed in full, never served from the prefix cache (the engine
    # needs every prompt position's logits for prompt logprobs).
    uses_prefix_cache: bool = True
    # True: its consumer has stopped taking its output (e.g. a stream whose client does not
    # read): the scheduler gives its sequences no tokens until it is resumed; they keep their
    # blocks, and are the first preempted when blocks run out (see ``Scheduler.set_paused``).
    paused: bool = False
    # Wall-clock times (time.time()) for the request's metrics, set by the scheduler/engine.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        if self.n == 1:
            self.forked = True
        self.num_prompt_tokens = len(self.prompt_token_ids)   # the prompt never changes

    @property
    def is_finished(self) -> bool:
        """All samples are done. (Before forking, sequence 0 can only finish by abort, which
        ends the whole request, so no sibling is missing then.)"""
        return all(s.is_finished for s in self.sequences)



__all__ = ["FinishReason", "PLACEHOLDER_TOKEN", "Request", "Sequence", "SequenceStatus"]
