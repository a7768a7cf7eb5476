"""Prompt logprobs: which hidden rows of a step predict a prompt token, and their log-softmax.

For a request with ``SamplingParams.prompt_logprobs = k``, the hidden state at prompt position
``j`` gives, through the LM head, the distribution of token ``j + 1``: the step that computes a
chunk of the prompt has those rows anyway. The last prompt position's row predicts the first
output token, which the sampler handles, so a prompt of P tokens has P - 1 rows here, spread
over the steps of its chunks. Logits are made a bounded number of rows at a time (a 150k
vocabulary is 600 KB of float32 a row) and read to the host once the step's sampled tokens are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.scheduler import SchedulerOutput
from ..outputs import Logprob
from .sampler import token_ranks

# Prompt positions whose full-vocabulary logits exist at once.
PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class PromptLogprobs:
    """The prompt logprobs one step computed for one request.

    ``entries[i]`` belongs to prompt position ``start + i`` (``start >= 1``: position 0 has
    none): ``{token_id: logprob}`` of the request's top ``prompt_logprobs`` tokens and of the
    prompt's token at that position (log-softmax of the float32 logits of the position before,
    before any sampling parameter applies).
    """

    request_id: str
    start: int
    entries: list[dict[int, float]]


@dataclass
class PromptRows:
    """The hidden rows of a step whose logits give prompt logprobs: ``rows[i]`` predicts prompt
    token ``targets[i]``; ``top_k[i]`` its request's k; ``requests``: ``(request_id, first
    prompt position, first index into rows, count, k)`` per request."""

    rows: list[int]
    targets: list[int]
    top_k: list[int]
    requests: list[tuple[str, int, int, int, int]]


def prompt_logprob_rows(out: SchedulerOutput) -> PromptRows | None:
    """Which rows of ``out``'s hidden states (its tokens, flattened in batch order) predict a
    prompt token of a request that asked for prompt logprobs; None if none does."""
    if not out.num_prefill_seqs:    # no prompt token in the step: O(1) for decode steps
        return None
    found: PromptRows | None = None
    row = 0
    for seq, q in zip(out.seqs, out.num_new_tokens):
        params = seq.request.params
        k = params.prompt_logprobs if params is not None else None
        computed = seq.num_computed_tokens
        last = min(computed + q, seq.request.num_prompt_tokens - 1)   # exclusive
        if k is not None and last > computed:
            if found is None:
                found = PromptRows([], [], [], [])
            found.requests.append((seq.request.request_id, computed + 1, len(found.rows),
                                   last - computed, k))
            found.rows.extend(range(row, row + last - computed))
            found.targets.extend(seq.token_ids[computed + 1:last + 1])
            found.top_k.extend([k] * (last - computed))
        row += q
    return found


@dataclass
class PendingPromptLogprobs:
    """A step's prompt logprobs on the device: ``chosen`` float32 ``[num_rows]`` (of each
    row's prompt token) and ``ranks`` int64 ``[num_rows]`` (its rank in the vocabulary); ``top_values`` float32 / ``top_ids`` int64 ``[num_rows, k]`` for the
    largest k asked (None when it is 0)."""

    wanted: PromptRows
    chosen: torch.Tensor
    ranks: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None

    def read(self) -> list[PromptLogprobs]:
        """To the host (a sync), one :class:`PromptLogprobs` per request."""
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        values = self.top_values.tolist() if self.top_values is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        targets = self.wanted.targets
        results = []
        for request_id, start, first, count, k in self.wanted.requests:
            entries = []
            for r in range(first, first + count):
                entry = {ids[r][j]: values[r][j] for j in range(k)} if k else {}
                entry[targets[r]] = Logprob(chosen[r], ranks[r])
                entries.append(entry)
            results.append(PromptLogprobs(request_id, start, entries))
        return results


def compute_prompt_logprobs(model, hidden: torch.Tensor,
                            wanted: PromptRows) -> PendingPromptLogprobs:
    """Log-softmax of ``model.compute_logits`` of the hidden rows ``wanted.rows`` (``hidden``:
    ``[num_tokens, hidden_size]``, the model's dtype), PROMPT_LOGPROBS_CHUNK rows at a time,
    read at each row's prompt token and at the top k; enqueued on the device, not read."""
    device = hidden.device
    rows = torch.tensor(wanted.rows, dtype=torch.int64, device=device)
    targets = torch.tensor(wanted.targets, dtype=torch.int64, device=device)
    k = max(wanted.top_k)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for at in range(0, len(wanted.rows), PROMPT_LOGPROBS_CHUNK):
        part = slice(at, at + PROMPT_LOGPROBS_CHUNK)
        logprobs = torch.log_softmax(model.compute_logits(hidden.index_select(0, rows[part])),
                                     dim=-1)
        chosen.append(logprobs.gather(1, targets[part, None])[:, 0])
        ranks.append(token_ranks(logprobs, chosen[-1]))
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    return PendingPromptLogprobs(wanted, torch.cat(chosen), torch.cat(ranks),
                                 torch.cat(top_values) if k else None,
                                 torch.cat(top_ids) if k else None)


__all__ = ["PROMPT_LOGPROBS_CHUNK", "PendingPromptLogprobs", "PromptLogprobs", "PromptRows",
           "compute_prompt_logprobs", "prompt_logprob_rows"]
