"""What the sampler applies to the logits before sampling, batched on the device: ``min_tokens``
(stop tokens masked), ``logit_bias``, and the presence / frequency / repetition penalties.

The penalties need each sample's token counts. :class:`TokenHistory` keeps them on the device,
one row per sample that uses a penalty: the row is made (from the prompt) the first time the
sample is in a batch, and every step adds the sampled tokens to the rows with one scatter, so no
step reads a sample's tokens on the host or loops over samples on the device.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

# Rows of TokenHistory allocated at first (it doubles when full).
_INITIAL_ROWS = 8


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor. Pinned on CUDA: a copy from pageable memory would
    first wait for the stream, i.e. for the whole forward."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


class TokenHistory:
    """Per-sample token counts on the device, for the penalties.

    ``counts``: int32 ``[capacity, vocab_size]``, how many times each token was generated;
    ``in_prompt``: bool ``[capacity, vocab_size]``, which tokens the prompt holds. A row belongs
    to one ``(request id, sample index)`` until :meth:`release` frees the request's rows.
    Nothing is allocated before a request uses a penalty; then 5 bytes per vocabulary entry per
    row (0.7 MiB at a 152k vocabulary), outside what the KV pool's sizing set aside.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self._rows: dict[tuple[str, int], int] = {}
        self._keys_of: dict[str, list[tuple[str, int]]] = {}     # request id -> its keys
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._rows)

    def rows_for(self, keys: list[tuple[str, int]], prompts: list[Seq[int]],
                 vocab_size: int) -> torch.Tensor:
        """The rows of ``keys`` (int64 ``[len(keys)]`` on the device); a key seen for the
        first time gets a fresh row: zero counts, its prompt's tokens marked."""
        new = [(key, prompt) for key, prompt in zip(keys, prompts) if key not in self._rows]
        if new:
            self._grow(len(new), vocab_size)
            for key, prompt in new:      # once per sample, when it first samples
                row = self._rows[key] = self._free.pop()
                self._keys_of.setdefault(key[0], []).append(key)
                self.counts[row].zero_()
                self.in_prompt[row].zero_()
                ids = upload(list(prompt), torch.int64, self.device)
                self.in_prompt[row].index_fill_(0, ids, True)
        return upload([self._rows[k] for k in keys], torch.int64, self.device)

    def _grow(self, needed: int, vocab_size: int) -> None:
        if len(self._free) >= needed:
            return
        old = 0 if self.counts is None else self.counts.shape[0]
        size = max(_INITIAL_ROWS, 2 * old, old + needed)
        counts = torch.zeros(size, vocab_size, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(size, vocab_size, dtype=torch.bool, device=self.device)
        if old:
            counts[:old] = self.counts
            in_prompt[:old] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        # Popped from the end: low rows first.
        self._free = list(range(size - 1, old - 1, -1)) + self._free

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one more generated token per row: ``counts[rows[i], token_ids[i]] += 1``
        (int64 ``[m]`` each, on the device)."""
        ones = torch.ones(rows.shape[0], dtype=torch.int32, device=self.device)
        self.counts.index_put_((rows, token_ids), ones, accumulate=True)

    def release(self, request_id: str) -> None:
        """Free the rows of a request that finished or was aborted."""
        for key in self._keys_of.pop(request_id, ()):
            self._free.append(self._rows.pop(key))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties, on a batch of rows (returns new logits; the inputs are kept).

    Args:
        logits: float32 ``[m, vocab]``.
        counts: int32 ``[m, vocab]``, generated tokens so far per row.
        in_prompt: bool ``[m, vocab]``, the prompt's tokens per row.
        presence, frequency, repetition: float32 ``[m]``.

    A token seen in the prompt or the output has a positive logit divided by ``repetition`` and
    a negative one multiplied by it; then ``frequency * count + presence * (count > 0)`` is
    subtracted.
    """
    seen = counts > 0
    rep = repetition[:, None]
    scale = torch.where(seen | in_prompt, rep, torch.ones_like(rep))
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    return logits - frequency[:, None] * counts - presence[:, None] * seen


def add_logit_bias(logits: torch.Tensor, rows: list[int],
                   biases: list[dict[int, float]]) -> None:
    """``logits[rows[i], t] += biases[i][t]`` for every entry, in one scatter (in place)."""
    flat_rows = [r for r, bias in zip(rows, biases) for _ in range(len(bias))]
    ids = [t for bias in biases for t in bias]
    values = [v for bias in biases for v in bias.values()]
    device = logits.device
    logits.index_put_((upload(flat_rows, torch.int64, device), upload(ids, torch.int64, device)),
                      upload(values, logits.dtype, device), accumulate=True)


def mask_tokens(logits: torch.Tensor, rows: list[int], banned: list[Seq[int]]) -> None:
    """``logits[rows[i], t] = -inf`` for every ``t`` in ``banned[i]`` (in place, one scatter);
    ids outside the vocabulary are skipped."""
    vocab = logits.shape[1]
    flat_rows = [r for r, ids in zip(rows, banned) for t in ids if t < vocab]
    ids = [t for ids in banned for t in ids if t < vocab]
    if not ids:
        return
    device = logits.device
    logits.index_put_((upload(flat_rows, torch.int64, device), upload(ids, torch.int64, device)),
                      torch.tensor(float("-inf"), dtype=logits.dtype, device=device))


__all__ = ["TokenHistory", "add_logit_bias", "apply_penalties", "mask_tokens", "upload"]
