"""Temperature sampling of one token per logits row: the torch reference and the dispatcher.

A row with temperature ``T > 0`` gets a sample from ``softmax(logits / T)`` by the exponential
race: with ``E_v ~ Exp(1)`` drawn per token, ``argmax_v(logits_v / T - log E_v)`` (equal to
``argmax(p_v / E_v)``) is distributed as ``p``. A row with ``T == 0`` gets its argmax. On CUDA
the Triton kernel (:mod:`.sample_triton`) does it in one pass over the logits, drawing its
noise in registers; the reference draws it with ``torch.Generator``. The two draw different
noise, so for the same generator state they pick different samples of the same distribution;
greedy rows agree exactly.

Whatever the logits hold, every id is in ``[0, vocab_size)`` (an id out of range would be a
device-side assert on CUDA, which poisons the whole context). A row with nothing to sample,
every logit ``-inf`` or a NaN among them, gets some in-range id and, with
``return_invalid=True``, its flag set, computed on the device beside the ids.
"""

from __future__ import annotations

import torch

from .backend import resolve_backend
from .checks import FLOAT_DTYPES, check_last_dim_contiguous, check_tensor


def nothing_to_sample(best: torch.Tensor) -> torch.Tensor:
    """bool, like ``best``: where a row's best score (its max logit, or its best race score)
    says it had no candidate: ``-inf`` (every logit ``-inf``) or NaN (a NaN logit)."""
    return ~(best > float("-inf"))


def sample_tokens_reference(logits: torch.Tensor, temperatures: torch.Tensor,
                            generator: torch.Generator | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponential race in eager PyTorch (see the module doc); logits are not modified.
    Returns the int64 ids and the bool invalid flags, ``[num_rows]`` each."""
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    noise.exponential_(generator=generator)
    # Exp(1) draws can be exactly 0 (a float uniform of 0) or, in principle, inf: keep them
    # finite, so a finite logit always scores above a -inf one.
    noise.clamp_(1e-20, 1e30)
    greedy = temperatures == 0
    scale = torch.where(greedy, 1.0, temperatures)
    # max (not argmax): the best score says whether the row had a candidate (a NaN is kept).
    best, sampled = (logits.float() / scale[:, None] - noise.log_()).max(dim=-1)
    greedy_best, greedy_ids = logits.max(dim=-1)
    best = torch.where(greedy, greedy_best.float(), best)
    return torch.where(greedy, greedy_ids, sampled), nothing_to_sample(best)


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, *,
                  generator: torch.Generator | None = None, backend: str = "auto",
                  return_invalid: bool = False
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One token per row, sampled from ``softmax(logits / temperature)`` (argmax at 0).

    Args:
        logits: float32 / fp16 / bf16 ``[num_rows, vocab_size]`` on any device, last dim
            contiguous; not modified.
        temperatures: float32 ``[num_rows]`` on the logits' device, each ``>= 0`` (0: greedy).
            Not checked on the device (that would need a host sync).
        generator: draws the noise (the reference) or the kernel's seed (Triton), on the
            logits' device; None: the device's default generator.
        backend: "auto" (Triton for CUDA tensors) | "torch" | "triton".
        return_invalid: also return the rows that had nothing to sample.

    Returns:
        int64 ``[num_rows]`` token ids on the logits' device, each in ``[0, vocab_size)``;
        with ``return_invalid``, ``(ids, invalid)``: ``invalid`` is bool ``[num_rows]``, True
        where every logit of the row is -inf or one is NaN (that row's id means nothing).
    """
    if not isinstance(return_invalid, bool):
        raise ValueError(f"return_invalid: expected a bool, got {return_invalid!r}")
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("temperatures", temperatures, ndim=1, dtypes=(torch.float32,),
                 device=logits.device)
    if temperatures.shape[0] != logits.shape[0]:
        raise ValueError(f"temperatures: expected shape ({logits.shape[0]},) (one per logits "
                         f"row), got {tuple(temperatures.shape)}")
    if resolve_backend(backend, logits.device) == "torch":
        ids, invalid = sample_tokens_reference(logits, temperatures, generator)
    else:
        from .attention.decode_plan import num_sms_of
        from .sample_triton import triton_sample_tokens
        check_last_dim_contiguous("logits", logits)
        seed = torch.randint(0, 2**62, (1,), generator=generator, device=logits.device)
        ids, invalid = triton_sample_tokens(logits, temperatures, seed,
                                            num_sms_of(logits.device))
    return (ids, invalid) if return_invalid else ids


__all__ = ["nothing_to_sample", "sample_tokens", "sample_tokens_reference"]
