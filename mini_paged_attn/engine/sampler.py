"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Every row is sampled in vocabulary order with the exponential-race trick: with
``q ~ Exp(1)`` drawn per token, ``argmax(p / q)`` is a sample from ``p``. Filtering (top-k,
top-p, min-p) only zeroes probabilities, through per-row thresholds, so the noise a row consumes
never depends on which other rows share the batch: a seeded request gives the same tokens alone
or in any batch (for the same logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-row parameter tensor on the device. Pinned on CUDA: a copy from pageable memory
    would first wait for the stream, i.e. for the whole forward."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


@dataclass
class SamplerOutput:
    """Sampled token ids (host list, one per row) and, when any row asked, logprobs.

    ``logprobs[i]`` is None for rows that did not ask, else ``(logprob of the sampled token,
    {token_id: logprob} of the top-k tokens and the sampled one)``.
    """

    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, float]] | None] | None = None


class Sampler:
    """Samples one token per logits row. Holds one torch.Generator per sample of each seeded
    request (keyed by request id and sample index, so a forked sample keeps its stream)."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded: dict[str, dict[int, torch.Generator]] = {}

    def release(self, request_id: str) -> None:
        """Forget a request's generators (it finished or was aborted)."""
        self._seeded.pop(request_id, None)

    def _generator_of(self, request_id: str, index: int, seed: int) -> torch.Generator:
        gens = self._seeded.setdefault(request_id, {})
        gen = gens.get(index)
        if gen is None:
            gen = gens[index] = torch.Generator(device=self.device)
            # Sample ``index`` of a seeded request draws from its own stream.
            gen.manual_seed((seed * 1_000_003 + index) % (2**63))
        return gen

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 seeds: list[tuple[int, int] | None],
                 overlap: Callable[[], None] | None = None) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: float32 ``[num_rows, vocab_size]`` on the device (modified in place).
            params: the sampling parameters of each row's request.
            seeds: per row, None (use the engine's generator) or ``(request_id, sample index)``
                of a seeded request (its ``params.seed`` seeds that sample's own generator).
            overlap: called once all the step's device work is enqueued, before the host waits
                for it (host work that then runs in the device's shadow).

        Returns:
            :class:`SamplerOutput` (one host sync: the sampled ids).
        """
        want_logprobs = [p.logprobs for p in params]
        raw_logprobs = None
        if any(k is not None for k in want_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        greedy = [p.greedy for p in params]
        if all(greedy):
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample(logits, params, seeds, greedy)

        if overlap is not None:
            overlap()
        token_ids = sampled.tolist()
        if raw_logprobs is None:
            return SamplerOutput(token_ids)
        return SamplerOutput(token_ids, self._logprobs(raw_logprobs, sampled, want_logprobs))

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                seeds: list[tuple[int, int] | None], greedy: list[bool]) -> torch.Tensor:
        device = logits.device
        greedy_ids = logits.argmax(dim=-1) if any(greedy) else None
        temps = _upload([1.0 if p.greedy else p.temperature for p in params],
                        torch.float32, device)
        logits.div_(temps[:, None])

        top_k = [p.top_k for p in params]
        if any(k != -1 for k in top_k):
            vocab = logits.shape[1]
            k_max = min(vocab, max(top_k))
            k = _upload([min(v, vocab) if v != -1 else k_max for v in top_k], torch.int64, device)
            # The k-th largest logit of each row is its threshold (-inf: top-k off).
            kth = logits.topk(k_max, dim=-1).values.gather(1, (k - 1)[:, None])
            off = _upload([v == -1 for v in top_k], torch.bool, device)
            kth.masked_fill_(off[:, None], float("-inf"))
            logits.masked_fill_(logits < kth, float("-inf"))

        noise = torch.empty_like(logits)
        seeded_rows = [i for i, s in enumerate(seeds) if s is not None and not greedy[i]]
        if len(seeded_rows) < len(seeds):
            noise.exponential_(generator=self.generator)
        for i in seeded_rows:
            request_id, index = seeds[i]
            noise[i].exponential_(generator=self._generator_of(request_id, index, params[i].seed))
        # Exp(1) draws can be exactly 0 (a float uniform of 0): keep them finite.
        noise.clamp_min_(1e-20)

        if any(p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            probs = torch.softmax(logits, dim=-1)
            self._filter_probs(probs, params)
            sampled = probs.div_(noise).argmax(dim=-1)
        else:
            # argmax(p / q) == argmax(logits / T - log q): no softmax needed.
            sampled = logits.sub_(noise.log_()).argmax(dim=-1)
        if greedy_ids is not None:
            is_greedy = _upload(greedy, torch.bool, device)
            sampled = torch.where(is_greedy, greedy_ids, sampled)
        return sampled

    @staticmethod
    def _filter_probs(probs: torch.Tensor, params: list[SamplingParams]) -> None:
        """Zero the probabilities top-p and min-p drop (per row; thresholds, in place)."""
        device = probs.device
        if any(p.top_p < 1.0 for p in params):
            top_p = _upload([p.top_p for p in params], torch.float32, device)
            sorted_probs = probs.sort(dim=-1, descending=True).values
            # Keep a token while the mass before it is below top_p (the first always stays).
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            keep = (before < top_p[:, None]).sum(dim=-1, keepdim=True)
            threshold = sorted_probs.gather(1, keep - 1)
            probs.masked_fill_(probs < threshold, 0.0)
        if any(p.min_p > 0.0 for p in params):
            min_p = _upload([p.min_p for p in params], torch.float32, device)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
            probs.masked_fill_(probs < threshold, 0.0)

    @staticmethod
    def _logprobs(raw: torch.Tensor, sampled: torch.Tensor,
                  want: list[int | None]) -> list[tuple[float, dict[int, float]] | None]:
        chosen = raw.gather(1, sampled[:, None])[:, 0].tolist()
        k = max(v for v in want if v is not None)
        top_values, top_ids = (raw.topk(k, dim=-1) if k > 0 else (None, None))
        top_values = top_values.tolist() if k > 0 else None
        top_ids = top_ids.tolist() if k > 0 else None
        ids = sampled.tolist()
        out: list[tuple[float, dict[int, float]] | None] = []
        for i, w in enumerate(want):
            if w is None:
                out.append(None)
                continue
            entry = {top_ids[i][j]: top_values[i][j] for j in range(w)} if w else {}
            entry[ids[i]] = chosen[i]
            out.append((chosen[i], entry))
        return out


__all__ = ["Sampler", "SamplerOutput"]
