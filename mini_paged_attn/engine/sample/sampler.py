"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs,
and before them (see ``penalties``) min_tokens, logit_bias and the penalties, then the grammars
of structured outputs (see ``structured``).

Every row is sampled in vocabulary order with the exponential-race trick: with
``q ~ Exp(1)`` drawn per token, ``argmax(p / q)`` is a sample from ``p``. Filtering (top-k,
top-p, min-p) only zeroes probabilities, through per-row thresholds, so the noise a row consumes
never depends on which other rows share the batch: a seeded request gives the same tokens alone
or in any batch (for the same logits). A batch of unseeded rows with a temperature and no
filter (the common case) is sampled by :func:`~mini_paged_attn.ops.sample_tokens`: on CUDA one
Triton pass over the logits that draws the noise in registers, instead of seven passes.

One row can never fail its batch. Every filter keeps at least the row's best token (a ``top_p``
that rounds to 0 in float32 keeps just that one), logits that overflowed to ``+inf`` (a tiny
``repetition_penalty``) are the row's best tokens, and every sampled id is in the vocabulary
whatever the logits hold. A row with nothing to sample (every logit ``-inf``: a grammar that
allows nothing past min_tokens' stop tokens, a failed grammar's empty mask; or a NaN logit) is
flagged on the device, beside its id (:attr:`SamplerOutput.invalid_rows`); the engine ends
that sample with reason "error" and the other rows keep their tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from operator import attrgetter

import torch

from ...ops.sample import nothing_to_sample, sample_tokens
from ..outputs import Logprob
from ..sampling_params import SamplingParams
from ..structured.bitmask import TokenMasks, apply_token_masks
from .penalties import TokenHistory, add_logit_bias, apply_penalties, mask_tokens
from .penalties import upload as _upload

_USES_PROCESSORS = attrgetter("uses_processors")
_USES_FILTERS = attrgetter("uses_filters")
_PLAIN = attrgetter("plain")


def _one_pass(params: list[SamplingParams], seeds: list[tuple[str, int] | None]) -> bool:
    """The rows are sampled by one pass of :func:`sample_tokens` (temperature or greedy
    alone, no seeded row that samples)."""
    return not (any(map(_USES_FILTERS, params))
                or any(s is not None and not p.greedy for p, s in zip(params, seeds)))


@dataclass(frozen=True)
class SampleRow:
    """What the sampler reads of a row's sample when its params need the sample's tokens
    (``SamplingParams.uses_history``: penalties or min_tokens).

    ``key``: ``(request id, sample index)``, whose token counts the penalties keep;
    ``stop_token_ids``: what min_tokens masks (the request's stop tokens, EOS included unless
    ignore_eos).
    """

    key: tuple[str, int]
    prompt_token_ids: Seq[int]
    num_output_tokens: int
    stop_token_ids: frozenset[int]


@dataclass
class SamplerOutput:
    """Sampled token ids (host list, one per row) and, when any row asked, logprobs.

    ``logprobs[i]`` is None for rows that did not ask, else ``(logprob of the sampled token,
    {token_id: logprob} of the top-k tokens and the sampled one)``; the sampled token's entry
    is a :class:`~mini_paged_attn.engine.outputs.Logprob` (a float) that knows its rank in
    the whole vocabulary. ``invalid_rows``: the rows
    (ascending) that had nothing to sample, every logit -inf or a NaN among them; their ids
    are in the vocabulary but mean nothing.
    """

    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, float]] | None] | None = None
    invalid_rows: list[int] = field(default_factory=list)


def token_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each row's rank of its chosen token in the whole vocabulary, as vLLM counts it: 1 +
    the tokens strictly more likely (``logprobs`` float32 ``[rows, vocab]``, ``chosen``
    float32 ``[rows]``); int64 ``[rows]``."""
    return (logprobs > chosen[:, None]).sum(dim=-1) + 1


class PendingSample:
    """Sampled ids still on the device, and their copy to the host under way.

    ``token_ids``: int64 ``[num_rows]`` on the device (the next step's inputs may read them
    there). At construction, right behind the sampling in the stream, the ids (and, when some
    row asked, each row's logprob and top-k) start copying to pinned host memory and an event
    is recorded: :meth:`read` waits for that event only, not for work enqueued after it (a
    plain ``tolist()`` would also wait for the next step's forward).

    Args:
        token_ids: int64 ``[num_rows]``, the sampled ids.
        raw_logprobs: float32 ``[num_rows, vocab_size]`` log-softmax, or None when no row
            asked for logprobs.
        want_logprobs: per row, the top-k it asked for (None: no logprobs).
        invalid: bool ``[num_rows]``, the rows that had nothing to sample (copied with the
            ids, in one transfer).
    """

    def __init__(self, token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None,
                 want_logprobs: list[int | None], invalid: torch.Tensor) -> None:
        # Ids and flags travel as one int64 [2, num_rows] tensor; its first row is the ids.
        packed = torch.stack((token_ids, invalid.long()))
        self.token_ids = token_ids = packed[0]
        self.want_logprobs = want_logprobs
        pending = [packed]
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, token_ids[:, None])[:, 0]
            pending.extend((chosen, token_ranks(raw_logprobs, chosen)))
            k = max(v for v in want_logprobs if v is not None)
            if k > 0:
                pending.extend(raw_logprobs.topk(k, dim=-1))
        self._host, self._event = copy_to_host(pending)

    def read(self) -> SamplerOutput:
        """The sampled ids (and logprobs) on the host: waits for this step's copy only."""
        if self._event is not None:
            self._event.synchronize()
        ids, flags = self._host[0].tolist()
        invalid = [i for i, flag in enumerate(flags) if flag]
        if len(self._host) == 1:
            return SamplerOutput(ids, None, invalid)
        chosen, ranks = self._host[1].tolist(), self._host[2].tolist()
        top_values, top_ids = ((self._host[3].tolist(), self._host[4].tolist())
                               if len(self._host) == 5 else (None, None))
        logprobs: list[tuple[float, dict[int, float]] | None] = []
        for i, w in enumerate(self.want_logprobs):
            if w is None:
                logprobs.append(None)
                continue
            entry = {top_ids[i][j]: top_values[i][j] for j in range(w)} if w else {}
            entry[ids[i]] = Logprob(chosen[i], ranks[i])
            logprobs.append((chosen[i], entry))
        return SamplerOutput(ids, logprobs, invalid)


class Sampler:
    """Samples one token per logits row. Holds one torch.Generator per sample of each seeded
    request (keyed by request id and sample index, so a forked sample keeps its stream)."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded: dict[str, dict[int, torch.Generator]] = {}
        self.history = TokenHistory(device)

    def release(self, request_id: str) -> None:
        """Forget a request's generators and token counts (it finished or was aborted)."""
        self._seeded.pop(request_id, None)
        if len(self.history):
            self.history.release(request_id)

    @staticmethod
    def reads_model_dtype(params: list[SamplingParams],
                          seeds: list[tuple[str, int] | None]) -> bool:
        """Whether :meth:`sample` takes these rows' logits in the model dtype as they are: no
        logprobs and no processors, and every row greedy or sampled in one pass. Its other
        paths widen such logits to float32 first."""
        return all(map(_PLAIN, params)) and all(
            s is None or p.greedy for p, s in zip(params, seeds))

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
                 seeds: list[tuple[str, int] | None],
                 overlap: Callable[[], None] | None = None,
                 rows: Callable[[], list[SampleRow]] | None = None,
                 masks: Callable[[], TokenMasks | None] | None = None) -> SamplerOutput:
        """Sample one token per row: :meth:`sample`, then wait for the ids.

        Args:
            logits: float32 ``[num_rows, vocab_size]`` on the device (may be modified in
                place), or in the model dtype where :meth:`reads_model_dtype` allows.
            params: the sampling parameters of each row's request.
            seeds: per row, None (use the engine's generator) or ``(request_id, sample index)``
                of a seeded request (its ``params.seed`` seeds that sample's own generator).
            overlap: called once all the step's device work is enqueued, before the host waits
                for it (host work that then runs in the device's shadow).
            rows: makes the list of each row's :class:`SampleRow`; called (once) only when
                some row's params ``uses_history`` (the entries of the other rows are not read).
            masks: makes the grammar bitmask of the rows whose params have
                ``structured_outputs``; called (once) only when some row has them.

        Returns:
            :class:`SamplerOutput` (one host sync: the sampled ids).
        """
        return self.sample(logits, params, seeds, overlap, rows, masks).read()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               seeds: list[tuple[str, int] | None],
               overlap: Callable[[], None] | None = None,
               rows: Callable[[], list[SampleRow]] | None = None,
               masks: Callable[[], TokenMasks | None] | None = None) -> PendingSample:
        """Enqueue the sampling of one token per row and return without waiting for it
        (arguments as :meth:`__call__`). The ids stay on the device until
        :meth:`PendingSample.read`; the next step may use them as inputs before that."""
        if logits.dtype != torch.float32 and not self.reads_model_dtype(params, seeds):
            logits = logits.float()
        want_logprobs = [p.logprobs for p in params]
        raw_logprobs = None
        if any(k is not None for k in want_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        # A batch that uses none of them costs one scan of ``params``, nothing on the device.
        counted = None
        if any(map(_USES_PROCESSORS, params)):
            logits, counted = self._process(logits, params, rows, masks)

        greedy = [p.greedy for p in params]
        if all(greedy):
            # max (not argmax): the best logit also says whether the row had a candidate.
            best, sampled = logits.max(dim=-1)
            invalid = nothing_to_sample(best)
        else:
            sampled, invalid = self._sample(logits, params, seeds, greedy)
        if overlap is not None:
            overlap()
        if counted is not None:
            # After overlap: a step that raises there is rolled back, its tokens never counted.
            history_rows, at = counted
            self.history.record(history_rows, sampled if at is None else sampled[at])
        return PendingSample(sampled, raw_logprobs, want_logprobs, invalid)

    def _process(self, logits: torch.Tensor, params: list[SamplingParams],
                 rows: Callable[[], list[SampleRow]] | None,
                 masks: Callable[[], TokenMasks | None] | None = None
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None] | None]:
        """min_tokens' masks, the penalties, logit_bias, then the grammars (host loops over the
        rows that use them only; one batched operation each on the device). The grammar comes
        last: no bias can bring back a token it forbids.

        Returns the logits (a new tensor when penalised) and, when some row is penalised,
        ``(its TokenHistory rows, the batch rows they are at or None for all)``, for counting
        the sampled tokens.
        """
        counted = None
        if any(p.uses_history for p in params):
            if rows is None:
                raise ValueError("rows: required when a row's params use penalties or min_tokens")
            logits, counted = self._apply_history(logits, params, rows())
        if any(p.uses_logit_bias for p in params):
            biased = [i for i, p in enumerate(params) if p.uses_logit_bias]
            add_logit_bias(logits, biased, [params[i].logit_bias for i in biased])
        if any(p.structured_outputs is not None for p in params):
            if masks is None:
                raise ValueError("masks: required when a row's params have structured_outputs")
            token_masks = masks()
            if token_masks is not None:
                apply_token_masks(logits, token_masks)
        return logits, counted

    def _apply_history(self, logits: torch.Tensor, params: list[SamplingParams],
                       rows: list[SampleRow]
                       ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None] | None]:
        """min_tokens' masks and the penalties; returns as :meth:`_process` does."""
        early = [i for i, p in enumerate(params)
                 if p.min_tokens and rows[i].num_output_tokens < p.min_tokens]
        if early:
            mask_tokens(logits, early, [rows[i].stop_token_ids for i in early])
        penalised = [i for i, p in enumerate(params) if p.uses_penalties]
        if not penalised:
            return logits, None
        device = logits.device
        history = self.history.rows_for([rows[i].key for i in penalised],
                                        [rows[i].prompt_token_ids for i in penalised],
                                        logits.shape[1])
        every = len(penalised) == len(params)
        at = None if every else _upload(penalised, torch.int64, device)
        chosen = [params[i] for i in penalised]
        new = apply_penalties(
            logits if every else logits[at], self.history.counts[history],
            self.history.in_prompt[history],
            _upload([p.presence_penalty for p in chosen], torch.float32, device),
            _upload([p.frequency_penalty for p in chosen], torch.float32, device),
            _upload([p.repetition_penalty for p in chosen], torch.float32, device))
        if every:
            return new, (history, None)
        logits.index_copy_(0, at, new)
        return logits, (history, at)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                seeds: list[tuple[str, int] | None], greedy: list[bool]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids (int64 ``[num_rows]``) and invalid flags (bool ``[num_rows]``) of a batch that
        is not all greedy; ``logits`` (float32 unless one pass reads them) are overwritten."""
        device = logits.device
        seeded_rows = [i for i, s in enumerate(seeds) if s is not None and not greedy[i]]
        if _one_pass(params, seeds):
            # Temperature alone: one pass over the logits on CUDA (see ops.sample). Seeded
            # rows keep their own generators below, so their tokens never depend on the batch.
            temps = _upload([0.0 if g else p.temperature for g, p in zip(greedy, params)],
                            torch.float32, device)
            return sample_tokens(logits, temps, generator=self.generator, return_invalid=True)
        # One pass gives the greedy rows' ids and every row's flag (the temperature, > 0 and
        # finite, moves no logit across -inf or NaN).
        best, greedy_ids = logits.max(dim=-1)
        invalid = nothing_to_sample(best)
        temps = _upload([1.0 if p.greedy else p.temperature for p in params],
                        torch.float32, device)
        logits.div_(temps[:, None])

        mask_top_k(logits, params)

        noise = torch.empty_like(logits)
        if len(seeded_rows) < len(seeds):
            noise.exponential_(generator=self.generator)
        for i in seeded_rows:
            request_id, index = seeds[i]
            noise[i].exponential_(generator=self._generator_of(request_id, index, params[i].seed))
        # Exp(1) draws can be exactly 0 (a float uniform of 0): keep them finite.
        noise.clamp_min_(1e-20)

        if any(p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            # A logit that overflowed to +inf (a tiny repetition_penalty) would make its row's
            # softmax NaN: at the largest float it is still the row's best, sharing the mass
            # with the others there.
            probs = torch.softmax(logits.clamp_(max=torch.finfo(logits.dtype).max), dim=-1)
            filter_probs(probs, params)
            sampled = probs.div_(noise).argmax(dim=-1)
        else:
            # argmax(p / q) == argmax(logits / T - log q): no softmax needed.
            sampled = logits.sub_(noise.log_()).argmax(dim=-1)
        if any(greedy):
            is_greedy = _upload(greedy, torch.bool, device)
            sampled = torch.where(is_greedy, greedy_ids, sampled)
        return sampled, invalid


def mask_top_k(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Set each row's logits below its ``top_k``-th largest to -inf (in place; rows with
    top-k off are left as they are). ``logits``: float ``[num_rows, vocab_size]``, already
    divided by the temperature."""
    top_k = [p.top_k for p in params]
    if all(k == -1 for k in top_k):
        return
    device = logits.device
    vocab = logits.shape[1]
    k_max = min(vocab, max(top_k))
    k = _upload([min(v, vocab) if v != -1 else k_max for v in top_k], torch.int64, device)
    # The k-th largest logit of each row is its threshold (-inf: top-k off); 1 <= k <= k_max,
    # so the gather stays in range.
    kth = logits.topk(k_max, dim=-1).values.gather(1, (k - 1)[:, None])
    off = _upload([v == -1 for v in top_k], torch.bool, device)
    kth.masked_fill_(off[:, None], float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


def filter_probs(probs: torch.Tensor, params: list[SamplingParams]) -> None:
    """Zero the probabilities top-p and min-p drop (per row; thresholds, in place).

    ``probs``: float32 ``[num_rows, vocab_size]``. Each row keeps at least its most likely
    token; a row of NaN (nothing to sample, flagged by the caller) is left as it is. The rows
    are not renormalised (a sampler's argmax race does not need it)."""
    device = probs.device
    if any(p.top_p < 1.0 for p in params):
        top_p = _upload([p.top_p for p in params], torch.float32, device)
        sorted_probs = probs.sort(dim=-1, descending=True).values
        # Keep a token while the mass before it is below top_p. The first token's "before"
        # is 0, yet it must stay even where top_p is 0 in float32 (1e-46) or the row is NaN:
        # at least one kept, so the gather below never reads index -1.
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep = (before < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_min_(1)
        threshold = sorted_probs.gather(1, keep - 1)
        probs.masked_fill_(probs < threshold, 0.0)
    if any(p.min_p > 0.0 for p in params):
        min_p = _upload([p.min_p for p in params], torch.float32, device)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
        probs.masked_fill_(probs < threshold, 0.0)


def copy_to_host(tensors: list[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Start copying ``tensors`` to the host right behind the work enqueued so far: on CUDA
    into pinned memory, with an event recorded after the copies (wait on it, not on the
    stream, to read them: later work is not waited for); elsewhere they are the tensors."""
    if not tensors or tensors[0].device.type != "cuda":
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


__all__ = ["PendingSample", "SampleRow", "Sampler", "SamplerOutput", "copy_to_host",
           "filter_probs", "mask_top_k"]
