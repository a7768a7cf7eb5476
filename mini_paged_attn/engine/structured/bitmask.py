"""Token bitmasks: which tokens a grammar allows next, 32 tokens per int32 word, applied to the
logits on the device in one batched operation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sample.penalties import upload


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


@dataclass
class TokenMasks:
    """The grammar rows of one step.

    ``rows``: the batch rows (sample rows, in order) that have a grammar;
    ``bitmask``: int32 ``[len(rows), bitmask_words(vocab)]`` on the host, bit ``t % 32`` of
    word ``t // 32`` set when token ``t`` is allowed.
    """

    rows: list[int]
    bitmask: torch.Tensor
    # int32 ``[32]`` on the logits' device, word value of each bit (see :func:`bit_values`);
    # made per call when None.
    bits: torch.Tensor | None = None


def bit_values(device: torch.device) -> torch.Tensor:
    """int32 ``[32]``: bit i of a word as an int32 (bit 31 is the sign bit, -2**31)."""
    return torch.bitwise_left_shift(torch.ones(32, dtype=torch.int32, device=device),
                                    torch.arange(32, dtype=torch.int32, device=device))


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks) -> None:
    """Set the logits of the tokens each grammar row forbids to -inf (in place); other rows are
    not touched.

    Args:
        logits: float ``[num_rows, vocab_size]`` on the device.
        masks: the grammar rows and their host bitmask (uploaded here, without waiting).
    """
    device = logits.device
    num_rows, vocab = logits.shape
    pinned = device.type == "cuda"
    words = masks.bitmask.pin_memory() if pinned and not masks.bitmask.is_pinned() \
        else masks.bitmask
    words = words.to(device, non_blocking=True)
    bits = masks.bits if masks.bits is not None else bit_values(device)
    # [m, words, 32] -> [m, vocab]: True where the token is forbidden.
    forbidden = (words[:, :, None] & bits).eq(0).flatten(1)[:, :vocab]
    if len(masks.rows) == num_rows:
        logits.masked_fill_(forbidden, float("-inf"))
        return
    at = upload(masks.rows, torch.int64, device)
    logits.index_copy_(0, at, logits.index_select(0, at).masked_fill_(forbidden, float("-inf")))


__all__ = ["TokenMasks", "apply_token_masks", "bit_values", "bitmask_words"]
