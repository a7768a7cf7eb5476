"""Building blocks of the decoder: RMSNorm, rotary embedding (see ``rope.py``), gated MLP.

Tokens are flattened: activations are ``[num_tokens, ...]`` with no batch dim and no padding.
The arithmetic follows Hugging Face's Llama/Qwen modules op for op (norm statistics in float32,
rope tables computed in float32 then cast to the model dtype), so bf16 results match
``transformers`` to the rounding of the matmuls. The elementwise work runs through
:mod:`mini_paged_attn.ops.fused` (torch reference on CPU, one Triton kernel each on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.group import TPGroup
from ..ops.fused import rms_norm, rotate_half_reference
from ..ops.projection import SplitKWorkspace, linear
from .rope import RopeConfig, rope_inv_freq, rope_table  # noqa: F401  (re-exported)
from .parallel_layers import RowParallelLinear, projection_backend


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; statistics in float32."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *,
                backend: str = "auto"):
        """x: ``[..., size]`` float -> same shape and dtype. With ``residual`` (``[n, size]``,
        x 2-D): normalise ``x + residual`` and return ``(normed, x + residual)``, one kernel
        on the Triton backend (see :func:`~mini_paged_attn.ops.fused.rms_norm`)."""
        return rms_norm(x, self.weight, self.eps, residual=residual, backend=backend)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding from a precomputed table, indexed by position on the device.

    The table ``cos_sin_cache`` is ``[max_positions, rotary_dim]`` in the model dtype
    (``rotary_dim = rope.rotary_dim(head_size)``: ``head_size`` unless the rotary is partial):
    cosines of the ``rotary_dim // 2`` pair angles, then their sines. It is a non-persistent
    buffer: call
    :meth:`reset_parameters` after materialising a model built on the meta device.
    Positions must be ``< max_positions`` (not checked: that would need a host sync).
    """

    def __init__(self, head_size: int, max_positions: int, rope: RopeConfig, *,
                 dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.head_size = head_size
        self.max_positions = max_positions
        self.rope = rope
        self.dtype = dtype
        self.register_buffer("cos_sin_cache", self._table(device), persistent=False)

    def _table(self, device) -> torch.Tensor:
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type == "meta":
            return torch.empty(self.max_positions, self.rope.rotary_dim(self.head_size),
                               dtype=self.dtype, device=device)
        return rope_table(self.head_size, self.max_positions, self.rope, dtype=self.dtype,
                          device=device)

    def reset_parameters(self) -> None:
        """Recompute the table on the buffer's current device (after ``to_empty``)."""
        self.cos_sin_cache = self._table(self.cos_sin_cache.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 ``[num_tokens]`` -> (cos, sin), each
        ``[num_tokens, rotary_dim // 2]``."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the (i, i + rotary_dim/2) pairs of every head (the "rotate half" layout HF uses);
    dims from ``rotary_dim`` on pass through (partial rotary).

    Args:
        x: ``[num_tokens, num_heads, head_size]`` (any strides).
        cos, sin: ``[num_tokens, rotary_dim // 2]`` in x's dtype, from :class:`RotaryEmbedding`.

    Returns:
        A new contiguous ``[num_tokens, num_heads, head_size]`` tensor in x's dtype.
    """
    return rotate_half_reference(x, cos, sin)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (Gemma's GeGLU) for the fused gate/up output ``[n, 2 * I]``
    -> ``[n, I]``, x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul; ``act`` is SiLU
    (SwiGLU: Llama, Qwen, Mistral, Phi-3) or tanh-approximated GELU (GeGLU: Gemma).

    ``gate_up_proj.weight`` is ``[2 * intermediate_size, hidden_size]``: the gate rows, then the
    up rows (the loader fills both halves from the checkpoint's gate_proj / up_proj). Under
    tensor parallelism ``intermediate_size`` is this rank's share: gate/up are column parallel
    (this rank's rows of each), ``down_proj`` row parallel (all-reduced).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool,
                 dtype: torch.dtype, device: torch.device | str | None = None,
                 tp: TPGroup | None = None, act: str = "silu"):
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"act: expected 'silu' or 'gelu_pytorch_tanh', got {act!r}")
        tp = tp or TPGroup.single(device or "cpu")
        self.act = act
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias,
                                      dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(intermediate_size * tp.world_size, hidden_size,
                                           bias=bias, tp=tp, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, *, backend: str = "auto",
                workspace: SplitKWorkspace | None = None) -> torch.Tensor:
        """x: ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``, same dtype.
        ``backend``: the step's attention backend (see ``projection_backend``);
        ``workspace``: the projections' split-K scratch (``ops.linear``). SwiGLU's product
        is computed inside the gate/up projection (``linear(..., activation="silu")``)."""
        args = dict(backend=projection_backend(backend), workspace=workspace)
        if self.act == "silu":
            hidden = linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias,
                            activation="silu", **args)
        else:
            hidden = gelu_tanh_and_mul(linear(x, self.gate_up_proj.weight,
                                              self.gate_up_proj.bias, **args))
        return self.down_proj(hidden, **args)
