"""The decoder's elementwise ops: RMSNorm (optionally fused with the residual add), rotary
embedding of q and k, SiLU-and-mul.

Each public function checks its arguments, then runs the torch reference below (the arithmetic
of Hugging Face's Llama/Qwen modules, op for op) or one Triton kernel from
:mod:`.fused_triton`, by the rule of :func:`~.dispatch.resolve_backend` (``"auto"``: Triton for
CUDA tensors when it imports). Eager PyTorch needs ~10 kernels for an RMSNorm and ~7 per
tensor for rope; each Triton path is one launch, with no host sync (CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.args import arg_error, is_number
from .checks import FLOAT_DTYPES, check_index_vector, check_last_dim_contiguous, check_tensor
from . import reference
from .dispatch import check_store_kv, resolve_backend


@dataclass(frozen=True, eq=False)
class KVWrite:
    """Where :func:`apply_rotary` also writes the rotated keys, with their values: the
    arguments of :func:`~.dispatch.store_kv` other than the key.

    Attributes:
        value: ``[num_tokens, num_kv_heads, head_size]`` in k's dtype (any strides, last dim
            contiguous on the Triton backend).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, k's
            dtype or ``torch.float8_e4m3fn``; any strides on the first three dims.
        slot_mapping: int32 / int64 ``[num_tokens]``, each token's slot (``block *
            block_size + offset``); -1 skips the token.
        k_scale, v_scale: an fp8 cache's float32 ``[]`` or ``[num_kv_heads]`` scales (None:
            1.0); None for a cache in k's dtype.
    """

    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def _check_eps(name: str, eps: object) -> None:
    if not is_number(eps) or not eps >= 0:
        raise arg_error(name, "a float >= 0", repr(eps))


# ---- torch references (the specification) ----------------------------------------------------

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim, statistics in float32, the
    normalised value cast to x's dtype before the weight (as ``LlamaRMSNorm``)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the (i, i + R/2) pairs of the first ``R`` dims of every head, pass the others
    through (partial rotary, as transformers' Phi-3). x: ``[n, heads, D]`` (any strides); cos,
    sin: ``[n, R/2]`` in x's dtype, ``R <= D`` (``R = D``: the whole head). Returns a new
    contiguous tensor like x."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    return torch.cat(rotated + ([x[..., 2 * half:]] if 2 * half < x.shape[-1] else []), dim=-1)


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor,
                           qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    return rotate_half_reference(q, cos, sin), rotate_half_reference(k, cos, sin)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- public ops ---------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             residual: torch.Tensor | None = None, backend: str = "auto"):
    """RMSNorm over the last dim; with ``residual``, of ``x + residual`` (one kernel).

    Args:
        x: float ``[..., dim]``, last dim contiguous. The Triton path reads ``[n, dim]`` and
            ``[n, heads, dim]`` with any other strides (e.g. Qwen3's per-head q/k norm on views
            of the fused qkv output); other ranks are reshaped.
        weight: ``[dim]`` in x's dtype.
        eps: added to the mean square.
        residual: None, or ``[n, dim]`` (x then 2-D) in x's dtype.
        backend: "auto" | "torch" | "triton".

    Returns:
        ``normed`` (x's shape and dtype, contiguous), or with ``residual`` the pair
        ``(normed, x + residual)``; the sum is rounded to x's dtype and is what gets normalised.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise arg_error("x", "a float tensor [..., dim]", got)
    check_tensor("x", x, ndim=x.dim(), dtypes=FLOAT_DTYPES)
    dim = x.shape[-1]
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), device=x.device)
    if weight.shape[0] != dim:
        raise arg_error("weight", f"shape ({dim},) (x's last dim)", tuple(weight.shape))
    _check_eps("eps", eps)
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
        if x.dim() != 2 or residual.shape != x.shape:
            raise arg_error("residual", f"x's shape with x 2-D (x is {tuple(x.shape)})",
                            tuple(residual.shape))
    chosen = resolve_backend(backend, x.device)
    if chosen == "torch":
        if residual is None:
            return rms_norm_reference(x, weight, eps)
        summed = x + residual
        return rms_norm_reference(summed, weight, eps), summed
    from .fused_triton import triton_rms_norm
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None:
            check_last_dim_contiguous(name, t)
    shape = x.shape
    if x.dim() not in (2, 3):
        x = x.reshape(-1, dim)
    out, summed = triton_rms_norm(x, weight, float(eps), residual)
    out = out.view(shape)
    return out if residual is None else (out, summed)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, *,
                 qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                 backend: str = "auto", store: KVWrite | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding ("rotate half", the Llama/Qwen layout) of q and k, one kernel for both;
    optionally preceded by Qwen3's per-head RMSNorm of q and k, and followed by the write of
    the rotated keys and their values into the paged KV cache, in the same kernel. A table
    narrower than the head (``rotary_dim < head_size``, Phi-3's ``partial_rotary_factor``)
    rotates the first ``rotary_dim`` dims of each head and passes the rest through.

    Args:
        q: ``[n, num_q_heads, head_size]``, float, last dim contiguous, any other strides (the
            split views of the fused qkv output work without a copy).
        k: ``[n, num_kv_heads, head_size]`` likewise, q's dtype.
        positions: int32/int64 ``[n]``, each token's position; must be ``< max_positions`` (not
            checked: that would need a host sync).
        cos_sin_cache: ``[max_positions, rotary_dim]`` in q's dtype, ``rotary_dim`` even and
            ``<= head_size``: the cosines of the ``rotary_dim / 2`` pair angles, then their
            sines (``RotaryEmbedding.cos_sin_cache``).
        qk_norm: None, or ``(q_weight, k_weight, eps)``: RMSNorm every head of q and k
            (weights ``[head_size]`` in q's dtype) before rotating, as :func:`rms_norm` would.
        backend: "auto" | "torch" | "triton".
        store: None, or a :class:`KVWrite`: also ``store_kv(k_rotated, store.value, ...)``
            (the same values and rounding as that call; on the Triton backend in the rotary
            kernel, saving a launch and a read of k).

    Returns:
        New contiguous ``(q_rotated, k_rotated)`` of q's and k's shapes and dtype.

    Raises:
        ValueError: bad arguments (those of ``store`` as :func:`~.dispatch.store_kv` names
            them), before anything is written.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_index_vector("positions", positions, dtypes=(torch.int32, torch.int64),
                       device=q.device)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(q.dtype,), device=q.device)
    n, _, head_size = q.shape
    if head_size % 2 != 0:
        raise arg_error("q", "an even head_size", head_size)
    if k.shape[0] != n or k.shape[2] != head_size:
        raise arg_error("k", f"shape ({n}, num_kv_heads, {head_size})", tuple(k.shape))
    if positions.shape[0] != n:
        raise arg_error("positions", f"shape ({n},) (one per token)", tuple(positions.shape))
    rotary_dim = cos_sin_cache.shape[1]
    if not (0 < rotary_dim <= head_size and rotary_dim % 2 == 0):
        raise arg_error("cos_sin_cache", f"shape (max_positions, rotary_dim) with rotary_dim "
                        f"even, > 0 and <= head_size {head_size}", tuple(cos_sin_cache.shape))
    if qk_norm is not None:
        if not isinstance(qk_norm, tuple) or len(qk_norm) != 3:
            raise arg_error("qk_norm", "None or a tuple (q_weight, k_weight, eps)", repr(qk_norm))
        for name, w in zip(("qk_norm[0] (q_weight)", "qk_norm[1] (k_weight)"), qk_norm[:2]):
            check_tensor(name, w, ndim=1, dtypes=(q.dtype,), device=q.device)
            if w.shape[0] != head_size:
                raise arg_error(name, f"shape ({head_size},)", tuple(w.shape))
        _check_eps("qk_norm[2] (eps)", qk_norm[2])
    chosen = resolve_backend(backend, q.device)
    if store is not None:
        if not isinstance(store, KVWrite):
            raise arg_error("store", "None or a KVWrite", type(store).__name__)
        # k stands for the rotated keys: same shape, dtype and device.
        check_store_kv(k, store.value, store.key_cache, store.value_cache, store.slot_mapping,
                       store.k_scale, store.v_scale, chosen)
    if chosen == "torch":
        q_rot, k_rot = apply_rotary_reference(q, k, positions, cos_sin_cache, qk_norm)
        if store is not None:       # checked above, the slots' range included
            reference.store_kv(k_rot, store.value, store.key_cache, store.value_cache,
                               store.slot_mapping, store.k_scale, store.v_scale)
        return q_rot, k_rot
    from .fused_triton import triton_apply_rotary
    weights = () if qk_norm is None else (("q_weight", qk_norm[0]), ("k_weight", qk_norm[1]))
    values = () if store is None else (("value", store.value),)
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache), *weights, *values):
        check_last_dim_contiguous(name, t)
    return triton_apply_rotary(q, k, positions, cos_sin_cache, qk_norm, store)


def silu_and_mul(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` for the fused gate/up projection's output.

    Args:
        x: float ``[n, 2 * I]``: the gate columns, then the up columns (``GatedMLP``'s
            ``gate_up_proj`` layout); last dim contiguous.
        backend: "auto" | "torch" | "triton".

    Returns:
        ``[n, I]`` in x's dtype.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] % 2 != 0:
        raise arg_error("x", "an even last dim (gate and up halves)", tuple(x.shape))
    chosen = resolve_backend(backend, x.device)
    if chosen == "torch":
        return silu_and_mul_reference(x)
    from .fused_triton import triton_silu_and_mul
    check_last_dim_contiguous("x", x)
    return triton_silu_and_mul(x)


__all__ = ["KVWrite", "rms_norm", "apply_rotary", "silu_and_mul", "rms_norm_reference",
           "apply_rotary_reference", "rotate_half_reference", "silu_and_mul_reference"]
