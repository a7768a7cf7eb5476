"""Verifying proposals: which of a sequence's k proposed tokens the target model keeps, and the
token it adds, from the logits of its k + 1 positions, so that the outputs are exactly those of
decoding one token a step.

Row ``j`` of a sequence (``j = 0 .. k``) holds the target's logits after its token and the first
``j`` proposals; ``x_{j+1}`` is the proposal it judges (none for row ``k``).

- Greedy: ``x_{j+1}`` is kept while it is the row's argmax; at the first row where it is not,
  that argmax is the added token (after all ``k``, row ``k``'s argmax).
- Sampled (temperature > 0): the row's distribution ``p`` is made exactly as the sampler makes
  it (logit_bias, temperature, top-k, then top-p and min-p, renormalised). The proposal's
  distribution ``q`` is a point mass on ``x`` (prompt lookup, and a draft model proposing its
  argmax), so the standard rule (keep ``x`` with probability ``min(1, p(x) / q(x))``; else
  draw from ``normalize(max(p - q, 0))``) keeps ``x`` with probability ``p(x)`` and else
  draws from ``p`` without ``x``. Each output token is then distributed as ``p`` given the
  tokens before it; after ``k`` kept, row ``k`` is sampled from ``p`` itself.

Everything is computed for every row on the device in one pass, without a host sync; the host
reads the ids, keep flags and "nothing to sample" flags of all rows at once and walks each
sequence's rows (:meth:`PendingVerify.read`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...ops.sample import nothing_to_sample
from ..sample.penalties import add_logit_bias
from ..sample.penalties import upload as _upload
from ..sample.sampler import copy_to_host, filter_probs, mask_top_k
from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class VerifyRows:
    """The sequences of a step that verify proposals, in batch order, and where their rows
    start in the step's logits.

    ``batch_index[s]``: sequence ``s``'s index in the step's ``SchedulerOutput.seqs``;
    ``proposals[s]``: its k proposals; ``params[s]``: its request's sampling parameters;
    ``first_row``: the logits row of the first sequence's row 0 (the sample rows of the
    other sequences come first).
    """

    batch_index: list[int]
    proposals: list[list[int]]
    params: list[SamplingParams]
    first_row: int

    @property
    def num_rows(self) -> int:
        return sum(len(p) + 1 for p in self.proposals)


@dataclass
class Verified:
    """What verification kept, per sequence of :class:`VerifyRows`.

    ``tokens[s]``: the tokens sequence ``s`` gains, its kept proposals then the target's own
    token (1 .. k + 1; fewer when a row past its first had nothing to sample: the tokens
    before that row only). ``num_accepted[s]``: how many proposals were kept. ``failed``:
    the sequences whose first row had nothing to sample (no token; their samples end with
    reason "error", as a decode step's would).
    """

    tokens: list[list[int]]
    num_accepted: list[int]
    failed: list[int] = field(default_factory=list)


class PendingVerify:
    """A verification enqueued on the device; :meth:`read` waits for its results only."""

    def __init__(self, rows: VerifyRows, packed: torch.Tensor) -> None:
        self.rows = rows
        (self._host,), self._event = copy_to_host([packed])

    def read(self) -> Verified:
        if self._event is not None:
            self._event.synchronize()
        ids, keep, invalid = self._host.tolist()
        tokens, accepted, failed = [], [], []
        row = 0
        for s, proposals in enumerate(self.rows.proposals):
            k = len(proposals)
            a = 0
            while a < k and keep[row + a]:
                a += 1
            bad = next((j for j in range(a + 1) if invalid[row + j]), None)
            if bad is None:
                tokens.append(proposals[:a] + [ids[row + a]])
            else:
                # Row ``bad`` has no distribution: the tokens the rows before it gave stand.
                tokens.append(proposals[:bad])
                if bad == 0:
                    failed.append(s)
            accepted.append(a)
            row += k + 1
        return Verified(tokens, accepted, failed)


@torch.inference_mode()
def verify(logits: torch.Tensor, rows: VerifyRows,
           generator: torch.Generator | None) -> PendingVerify:
    """Enqueue the verification of ``rows`` (see the module doc) and return without waiting.

    Args:
        logits: float32 or the model's dtype, ``[rows.num_rows, vocab_size]`` on the device:
            each sequence's k + 1 rows in order (modified in place when float32).
        rows: the sequences, their proposals and params (none with penalties, min_tokens,
            logprobs, structured outputs or a seed that samples: see
            ``speculator.speculates``).
        generator: the engine's generator, for the draws of the sampled rows.
    """
    device = logits.device
    row_params = [p for p, x in zip(rows.params, rows.proposals) for _ in range(len(x) + 1)]
    drafts = [t for x in rows.proposals for t in (*x, -1)]
    draft = _upload(drafts, torch.int64, device)
    logits = logits.float()
    if any(p.uses_logit_bias for p in row_params):
        biased = [i for i, p in enumerate(row_params) if p.uses_logit_bias]
        add_logit_bias(logits, biased, [row_params[i].logit_bias for i in biased])
    best, greedy_ids = logits.max(dim=-1)
    invalid = nothing_to_sample(best)
    greedy = [p.greedy for p in row_params]
    if all(greedy):
        ids, keep = greedy_ids, greedy_ids == draft
    else:
        ids, keep = _sample_rows(logits, row_params, draft, generator)
        if any(greedy):
            is_greedy = _upload(greedy, torch.bool, device)
            ids = torch.where(is_greedy, greedy_ids, ids)
            keep = torch.where(is_greedy, greedy_ids == draft, keep)
    keep &= draft >= 0
    return PendingVerify(rows, torch.stack((ids, keep.long(), invalid.long())))


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], draft: torch.Tensor,
                 generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule for rows sampled at a temperature: ids (int64 ``[rows]``: a draw from ``p``
    without the row's proposal, or from ``p`` for a row without one) and keep flags (bool
    ``[rows]``: the proposal kept, with probability ``p(proposal)``). ``logits`` float32
    (overwritten)."""
    device = logits.device
    temps = _upload([1.0 if p.greedy else p.temperature for p in params], torch.float32, device)
    logits.div_(temps[:, None])
    mask_top_k(logits, params)
    # An overflowed logit stays the row's best at the largest float, as in the sampler.
    probs = torch.softmax(logits.clamp_(max=torch.finfo(logits.dtype).max), dim=-1)
    if any(p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        filter_probs(probs, params)
        probs.div_(probs.sum(dim=-1, keepdim=True))
    has_draft = draft >= 0
    at = draft.clamp(min=0)[:, None]
    p_draft = probs.gather(1, at)[:, 0]
    uniform = torch.rand(p_draft.shape, device=device, generator=generator)
    keep = uniform < p_draft
    # max(p - q, 0) for a point mass q on the proposal: p without it (unnormalised: the race
    # below does not need it). A row whose whole mass was the proposal keeps it surely.
    residual = probs.scatter(1, at, torch.where(has_draft[:, None], 0.0, p_draft[:, None]))
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, probs, residual)
    noise = torch.empty_like(residual).exponential_(generator=generator).clamp_min_(1e-20)
    return residual.div_(noise).argmax(dim=-1), keep


__all__ = ["PendingVerify", "Verified", "VerifyRows", "verify"]
