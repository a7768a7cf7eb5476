"""Merge two partial attention results over disjoint key sets (the online-softmax combine).

If ``(out_a, lse_a)`` is attention over keys A and ``(out_b, lse_b)`` over keys B, attention over
A ∪ B is a weighted mean of the two outputs, each weighted by its share of the softmax mass::

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

This is what seed 004's ``combine_result`` means (it weighs by ``M - M_new`` where
``exp(M - M_new)`` belongs) and what split-KV decoding does to combine its splits.
"""

from __future__ import annotations

import torch

from .checks import FLOAT_DTYPES, check_tensor

_NEG_INF = float("-inf")


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results computed over disjoint sets of keys.

    Args:
        out_a, out_b: ``[..., num_heads, head_size]``, fp16 / bf16 / fp32, same shape, dtype and
            device; each is the softmax-weighted mean of its side's values.
        lse_a, lse_b: float32 ``[..., num_heads]``, the natural log-sum-exp of each side's scaled
            scores; ``-inf`` marks a side that saw no key (its ``out`` is ignored, even if NaN).
            Finite or ``-inf``; ``+inf`` and NaN are not valid lse values.

    Returns:
        ``(out, lse)``: out ``[..., num_heads, head_size]`` in ``out_a``'s dtype, lse float32
        ``[..., num_heads]``. The weights are computed in float32. Where both sides are ``-inf``,
        out is 0 and lse is ``-inf``.

    Raises:
        ValueError: mismatched shapes, dtypes or devices, naming the argument.
    """
    if not isinstance(out_a, torch.Tensor) or out_a.dim() < 2:
        got = tuple(out_a.shape) if isinstance(out_a, torch.Tensor) else type(out_a).__name__
        raise ValueError(f"out_a: expected a tensor [..., num_heads, head_size] (at least 2-D), "
                         f"got {got}")
    check_tensor("out_a", out_a, ndim=out_a.dim(), dtypes=FLOAT_DTYPES)
    check_tensor("out_b", out_b, ndim=out_a.dim(), dtypes=(out_a.dtype,), device=out_a.device)
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b: expected shape {tuple(out_a.shape)} (out_a's), "
                         f"got {tuple(out_b.shape)}")
    lse_shape = out_a.shape[:-1]
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(name, lse, ndim=out_a.dim() - 1, dtypes=(torch.float32,), device=out_a.device)
        if lse.shape != lse_shape:
            raise ValueError(f"{name}: expected shape {tuple(lse_shape)} (out_a's without "
                             f"head_size), got {tuple(lse.shape)}")

    # Shift by the larger lse so the exps stay <= 1; an all-empty row shifts by 0 instead of
    # -inf, which would make -inf - -inf = NaN.
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == _NEG_INF, 0.0, m)
    w_a = torch.exp(lse_a - m)  # [..., num_heads], 0 where lse_a is -inf
    w_b = torch.exp(lse_b - m)
    total = w_a + w_b
    lse = m + torch.log(total)  # log(0) = -inf for rows where both sides are empty
    safe_total = torch.where(total > 0, total, 1.0)
    # Select before multiplying: an empty side's out may hold NaN, and 0 * NaN = NaN.
    term_a = torch.where((w_a > 0)[..., None], out_a.float() * (w_a / safe_total)[..., None], 0.0)
    term_b = torch.where((w_b > 0)[..., None], out_b.float() * (w_b / safe_total)[..., None], 0.0)
    return (term_a + term_b).to(out_a.dtype), lse
