"""Mixture-of-experts feed-forward: every token through its top-k experts' gated MLPs, the
outputs summed with the router's weights.

The public op :func:`fused_moe` checks its arguments, then runs the torch reference below (a
loop over the experts, the arithmetic of Hugging Face's expert modules) or the Triton grouped
GEMMs of :mod:`.moe_triton`, by the rule of :func:`~.dispatch.resolve_backend` (``"auto"``:
Triton for CUDA tensors when it imports).

Shapes (``T`` tokens, ``H`` hidden, ``E`` experts, ``I`` the expert intermediate size on this
rank, ``k`` experts per token):

- ``hidden`` ``[T, H]``; ``w13`` ``[E, 2I, H]`` (gate and up projections, see
  :class:`MoeActivation` for the row order); ``w2`` ``[E, H, I]``; optional biases ``w13_bias``
  ``[E, 2I]`` and ``w2_bias`` ``[E, H]``, all in one float dtype;
- ``topk_weights`` float32 ``[T, k]``, ``topk_ids`` int32 ``[T, k]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.args import arg_error, is_number
from .checks import FLOAT_DTYPES, check_last_dim_contiguous, check_tensor
from .dispatch import resolve_backend

ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class MoeActivation:
    """The gated activation between the two expert projections, and where its halves live.

    Attributes:
        kind: ``"silu"``: ``silu(gate) * up`` (Qwen3-MoE, Mixtral). ``"clamped_swiglu"``
            (gpt-oss): gate clamped to ``max=limit``, up to ``[-limit, limit]``, then
            ``(up + 1) * gate * sigmoid(alpha * gate)``.
        interleaved: row ``2j`` of an expert's ``w13`` is gate column ``j`` and row ``2j + 1``
            its up column (gpt-oss's checkpoint order); otherwise the ``I`` gate rows come
            first, then the ``I`` up rows (as ``GatedMLP``).
        alpha, limit: the clamped SwiGLU's constants (ignored by ``"silu"``).
    """
    kind: str = "silu"
    interleaved: bool = False
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.kind not in ACTIVATIONS:
            raise arg_error("activation.kind", f"one of {ACTIVATIONS}", repr(self.kind))
        if not isinstance(self.interleaved, bool):
            raise arg_error("activation.interleaved", "a bool", repr(self.interleaved))
        for name in ("alpha", "limit"):
            value = getattr(self, name)
            if not (is_number(value) and value > 0):
                raise arg_error(f"activation.{name}", "a number > 0", repr(value))

    def split(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, 2I]`` projection output -> its (gate, up) columns, each ``[n, I]``."""
        if self.interleaved:
            return gate_up[:, 0::2], gate_up[:, 1::2]
        return gate_up.chunk(2, dim=-1)

    def apply(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The activation of ``[n, I]`` gate and up columns -> ``[n, I]`` in their dtype."""
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SILU = MoeActivation()


# ---- torch reference (the specification) -------------------------------------------------------

def fused_moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        activation: MoeActivation = SILU, w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """One expert at a time over the tokens routed to it, in the model dtype (as the Hugging
    Face expert loops): ``sum_j weight_j * (down_e(act(gate_up_e(x))) + b2_e)``. Returns
    ``[T, H]`` in hidden's dtype; a token's output is summed in float32, rounded once."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1).long()
    k = topk_ids.shape[1]
    for expert in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == expert).nonzero().squeeze(1)       # [n] pair = token * k + slot
        tokens = pairs // k
        bias13 = None if w13_bias is None else w13_bias[expert]
        gate_up = F.linear(hidden[tokens], w13[expert], bias13)          # [n, 2I]
        inter = activation.apply(*activation.split(gate_up))             # [n, I]
        bias2 = None if w2_bias is None else w2_bias[expert]
        down = F.linear(inter, w2[expert], bias2)                        # [n, H]
        weights = topk_weights.reshape(-1)[pairs].unsqueeze(1)           # [n, 1] float32
        out.index_add_(0, tokens, down.float() * weights)
    return out.to(hidden.dtype)


# ---- public op ----------------------------------------------------------------------------------

def _check_moe_args(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation):
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    dtype, device = hidden.dtype, hidden.device
    num_tokens, hidden_size = hidden.shape
    check_tensor("w13", w13, ndim=3, dtypes=(dtype,), device=device)
    num_experts, two_inter, _ = w13.shape
    if w13.shape[2] != hidden_size or two_inter % 2 or two_inter == 0:
        raise arg_error("w13", f"shape (E, 2 * I, {hidden_size}) with I > 0", tuple(w13.shape))
    inter = two_inter // 2
    check_tensor("w2", w2, ndim=3, dtypes=(dtype,), device=device)
    if tuple(w2.shape) != (num_experts, hidden_size, inter):
        raise arg_error("w2", f"shape ({num_experts}, {hidden_size}, {inter}) (E, H, I)",
                        tuple(w2.shape))
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32,), device=device)
    if topk_ids.shape[0] != num_tokens or topk_ids.shape[1] == 0:
        raise arg_error("topk_ids", f"shape ({num_tokens}, k) with k >= 1",
                        tuple(topk_ids.shape))
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,), device=device)
    if topk_weights.shape != topk_ids.shape:
        raise arg_error("topk_weights", f"topk_ids' shape {tuple(topk_ids.shape)}",
                        tuple(topk_weights.shape))
    for name, bias, shape in (("w13_bias", w13_bias, (num_experts, two_inter)),
                              ("w2_bias", w2_bias, (num_experts, hidden_size))):
        if bias is not None:
            check_tensor(name, bias, ndim=2, dtypes=(dtype,), device=device)
            if tuple(bias.shape) != shape:
                raise arg_error(name, f"shape {shape}", tuple(bias.shape))
    if not isinstance(activation, MoeActivation):
        raise arg_error("activation", "a MoeActivation", type(activation).__name__)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              activation: MoeActivation = SILU, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Each token through its ``k`` routed experts, outputs weighted and summed.

    ``out[t] = sum_j topk_weights[t, j] * (w2[e] @ act(w13[e] @ hidden[t] + b13[e]) + b2[e])``
    with ``e = topk_ids[t, j]``.

    Args:
        hidden: ``[T, H]`` fp16 / bf16 / fp32, last dim contiguous.
        w13: ``[E, 2I, H]`` in hidden's dtype: each expert's gate and up projections
            (row order: ``activation.interleaved``), last dim contiguous.
        w2: ``[E, H, I]`` in hidden's dtype: each expert's down projection.
        topk_weights: float32 ``[T, k]``, the router's weight of each chosen expert.
        topk_ids: int32 ``[T, k]``, the chosen experts, each in ``0 .. E-1`` (not checked on
            the Triton path: that would need a host sync). An expert may get no token.
        activation: a :class:`MoeActivation` (default SwiGLU, gate rows first).
        w13_bias: None or ``[E, 2I]`` in hidden's dtype (rows ordered as w13's).
        w2_bias: None or ``[E, H]``, added before the router weight. Under tensor parallelism
            (``I`` split over ranks, outputs all-reduced) pass it on one rank only.
        backend: "auto" | "torch" | "triton".

    Returns:
        ``[T, H]`` in hidden's dtype; each token's ``k`` contributions summed in float32.
    """
    _check_moe_args(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    chosen = resolve_backend(backend, hidden.device)
    if chosen == "torch":
        return fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids, activation,
                                   w13_bias, w2_bias)
    from .moe_triton import triton_fused_moe
    for name, t in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        check_last_dim_contiguous(name, t)
    return triton_fused_moe(hidden, w13, w2, topk_weights.contiguous(), topk_ids.contiguous(),
                            activation, w13_bias, w2_bias)


__all__ = ["MoeActivation", "SILU", "ACTIVATIONS", "fused_moe", "fused_moe_reference"]
