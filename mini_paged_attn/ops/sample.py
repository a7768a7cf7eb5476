"""Temperature sampling of one token per logits row: the torch reference and the dispatcher.

A row with temperature ``T > 0`` gets a sample from ``softmax(logits / T)`` by the exponential
race: with ``E_v ~ Exp(1)`` drawn per token, ``argmax_v(logits_v / T - log E_v)`` (equal to
``argmax(p_v / E_v)``) is distributed as ``p``. A row with ``T == 0`` gets its argmax. On CUDA
the Triton kernel (:mod:`.sample_triton`) does it in one pass over the logits, drawing its
noise in registers; the reference draws it with ``torch.Generator``. The two draw different
noise, so for the same generator state they pick different samples of the same distribution;
greedy rows agree exactly.
"""

from __future__ import annotations

import torch

from .backend import resolve_backend
from .checks import FLOAT_DTYPES, check_last_dim_contiguous, check_tensor


def sample_tokens_reference(logits: torch.Tensor, temperatures: torch.Tensor,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """The exponential race in eager PyTorch (see the module doc); logits are not modified."""
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    noise.exponential_(generator=generator)
    # Exp(1) draws can be exactly 0 (a float uniform of 0): keep them finite.
    noise.clamp_min_(1e-20)
    greedy = temperatures == 0
    scale = torch.where(greedy, 1.0, temperatures)
    sampled = (logits.float() / scale[:, None] - noise.log_()).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, *,
                  generator: torch.Generator | None = None, backend: str = "auto") -> torch.Tensor:
    """One token per row, sampled from ``softmax(logits / temperature)`` (argmax at 0).

    Args:
        logits: float32 / fp16 / bf16 ``[num_rows, vocab_size]`` on any device, last dim
            contiguous; not modified.
        temperatures: float32 ``[num_rows]`` on the logits' device, each ``>= 0`` (0: greedy).
            Not checked on the device (that would need a host sync).
        generator: draws the noise (the reference) or the kernel's seed (Triton), on the
            logits' device; None: the device's default generator.
        backend: "auto" (Triton for CUDA tensors) | "torch" | "triton".

    Returns:
        int64 ``[num_rows]`` token ids on the logits' device.
    """
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("temperatures", temperatures, ndim=1, dtypes=(torch.float32,),
                 device=logits.device)
    if temperatures.shape[0] != logits.shape[0]:
        raise ValueError(f"temperatures: expected shape ({logits.shape[0]},) (one per logits "
                         f"row), got {tuple(temperatures.shape)}")
    if resolve_backend(backend, logits.device) == "torch":
        return sample_tokens_reference(logits, temperatures, generator)
    from .explain import num_sms_of
    from .sample_triton import triton_sample_tokens
    check_last_dim_contiguous("logits", logits)
    seed = torch.randint(0, 2**62, (1,), generator=generator, device=logits.device)
    return triton_sample_tokens(logits, temperatures, seed, num_sms_of(logits.device))


__all__ = ["sample_tokens", "sample_tokens_reference"]
