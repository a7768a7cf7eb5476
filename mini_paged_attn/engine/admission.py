"""The checks a request must pass before it is queued, shared by ``LLMEngine.add_request`` and
the server's engine-process client (which runs them without an engine at hand)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.sliding_window import check_sliding_window, min_blocks_to_run
from .prompts import parse_prompt
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class Admission:
    """The limits of one engine that decide whether a request can ever run.

    vocab_size: token ids of a prompt and of a logit_bias must lie in ``[0, vocab_size)``.
    max_model_len: prompt + max_tokens may not exceed it.
    num_blocks, block_size: the KV pool; prompt + max_tokens - 1 tokens must fit in it whole,
        or, under a sliding window, one window of them (older blocks are given back as the
        sequence advances).
    max_num_seqs: ``n`` samples run side by side, so ``n`` may not exceed it.
    sliding_window: the model's window when every layer has one, else None.
    grammar: the engine's ``GrammarCompiler`` (None: no structured outputs check here). The
        checks above never compile; a frontend compiles a request's constraint with it on a
        worker thread before admitting the request (the server's request workers), so the
        engine's stepping thread only copies the cached template.
    prompt_logprobs: whether the engine computes prompt logprobs (not under tensor
        parallelism: the ranks' step has no rows for them).
    """

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    sliding_window: int | None = None
    grammar: Any = field(default=None, compare=False, repr=False)
    prompt_logprobs: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "sliding_window", check_sliding_window(self.sliding_window))

    def prompt_ids(self, prompt: Any, tokenizer: Any) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt in any form of :mod:`.prompts` (a str, a
        list of token ids, ``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``); TypeError
        for any other."""
        prompt = parse_prompt(prompt)
        if isinstance(prompt, str):
            ids, text = tokenizer.encode(prompt), prompt
        else:
            vocab = self.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt: expected token ids in [0, {vocab}), got {prompt!r:.200}")
            ids, text = prompt, None
        if not ids:
            raise ValueError("prompt: expected at least one token, got an empty prompt")
        return text, ids

    def check(self, prompt: Any, params: SamplingParams | None, tokenizer: Any
              ) -> tuple[SamplingParams, str | None, list[int]]:
        """Validate one request; returns ``(params, prompt text or None, prompt token ids)``.

        Raises:
            TypeError: a prompt of no known form (see :mod:`.prompts`).
            ValueError: a bad prompt or params, or a request that can never fit (prompt +
                max_tokens over max_model_len or over the whole KV pool).
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams or None, got {type(params).__name__}")
        text, ids = self.prompt_ids(prompt, tokenizer)
        need = len(ids) + params.max_tokens
        if need > self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} prompt tokens + max_tokens {params.max_tokens} "
                             f"= {need} exceeds max_model_len={self.max_model_len}")
        # The last sampled token's K/V is never computed.
        blocks = min_blocks_to_run(need - 1, self.block_size, self.sliding_window)
        if blocks > self.num_blocks:
            raise ValueError(f"prompt: {len(ids)} prompt tokens + max_tokens {params.max_tokens} "
                             f"need {blocks} KV blocks, more than the whole pool "
                             f"({self.num_blocks} blocks of {self.block_size})")
        if params.logit_bias is not None:
            bad = next((t for t in params.logit_bias if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        check_min_tokens(params.structured_outputs, params.min_tokens)
        if params.n > self.max_num_seqs:
            raise ValueError(f"params.n: expected <= max_num_seqs={self.max_num_seqs}, "
                             f"got {params.n}")
        if params.prompt_logprobs is not None and not self.prompt_logprobs:
            raise ValueError("prompt_logprobs: expected None with tensor_parallel_size > 1 "
                             "(prompt logprobs, which echo with logprobs asks for too, are not "
                             f"computed there), got {params.prompt_logprobs}")
        return params, text, ids


def check_min_tokens(structured: Any, min_tokens: int, param: str = "min_tokens") -> None:
    """Refuse ``min_tokens`` that a constraint's output must end before.

    Every token a grammar allows adds at least one byte, and the end-of-sequence token is
    banned until ``min_tokens`` tokens are out: a constraint whose longest output has fewer
    bytes than ``min_tokens`` can only end that sample with "error". That is known without
    tokenizing for ``choice`` (its longest entry); for other constraints the sample ends with
    "error" when it happens.

    Raises:
        ValueError: ``param: ...``, naming the constraint's longest output.
    """
    longest = None if structured is None else structured.max_output_bytes
    if longest is not None and min_tokens > longest:
        raise ValueError(f"{param}: expected at most {longest} with this structured_outputs "
                         f"{structured.kind} (its longest output is {longest} bytes, and each "
                         f"token is at least one), got {min_tokens}")
