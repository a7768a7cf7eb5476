"""What the sampler's logits processors should give, row by row, token by token (vLLM's
definitions): the reference the batched implementation is checked against.

    from helpers.sampling_reference import reference_logits
"""

from __future__ import annotations

import math

from mini_paged_attn.engine.sampling_params import SamplingParams


def reference_logits(logits: list[float], params: SamplingParams, prompt: list[int],
                     output: list[int], stop_ids: frozenset[int]) -> list[float]:
    """One row, token by token, as vLLM defines each feature."""
    out = list(logits)
    if len(output) < params.min_tokens:
        for t in stop_ids:
            out[t] = -math.inf
    for t in range(len(out)):
        count = output.count(t)
        if params.repetition_penalty != 1.0 and (count or t in prompt):
            r = params.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    return out
