"""FlashAttention's batched and packed entry points, thin over
:func:`~.varlen.flash_attn_varlen_func` (forward only).

- :func:`flash_attn_func`: ``[batch, seqlen, heads, head_size]`` q, k, v (every sequence of a
  batch one length; q's and k's lengths may differ);
- :func:`flash_attn_qkvpacked_func`, :func:`flash_attn_kvpacked_func`: the same with q, k, v
  (or k, v) stacked in one tensor;
- :func:`flash_attn_varlen_qkvpacked_func`, :func:`flash_attn_varlen_kvpacked_func`: the varlen
  layout, stacked.

Each flattens the batch into varlen rows (a view where the strides allow; the packed tensors
are read through their slices' strides, never unstacked by a copy) and takes the options of
``flash_attn_varlen_func``, whose docstring holds their meaning: ``dropout_p`` > 0 and
``alibi_slopes`` raise NotImplementedError, ``deterministic`` is accepted and ignored,
``return_attn_probs`` returns ``(out, softmax_lse, None)``. The keyword-only ``backend``
("auto" | "torch" | "triton") and ``sinks`` pass through.
"""

from __future__ import annotations

import torch

from ..core.args import arg_error
from .checks import FLOAT_DTYPES, check_tensor
from .varlen import flash_attn_varlen_func


def _check_packed(name: str, t: object, ndim: int, size: int, dim: int) -> None:
    """``t`` a float tensor of ``ndim`` dims whose dim ``dim`` holds ``size`` tensors."""
    check_tensor(name, t, ndim=ndim, dtypes=FLOAT_DTYPES)
    if t.shape[dim] != size:
        raise arg_error(name, f"dim {dim} of size {size} (the stacked "
                        f"{'q, k, v' if size == 3 else 'k, v'})", tuple(t.shape))


def _offsets(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """int32 ``[batch + 1]``: ``0, seqlen, 2 * seqlen, ...``."""
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, sinks=None, backend="auto"):
    """Batched attention, FlashAttention's ``flash_attn_func`` (forward only).

    Args:
        q: ``[batch, seqlen_q, num_heads, head_size]``, fp16 / bf16 / fp32.
        k, v: ``[batch, seqlen_k, num_kv_heads, head_size]`` in q's dtype and device
            (``num_heads`` a multiple of ``num_kv_heads``: MHA, GQA, MQA).
        causal: bottom-right aligned when ``seqlen_q != seqlen_k``.
        dropout_p, softmax_scale, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, sinks, backend: as in :func:`~.varlen.flash_attn_varlen_func`.

    Returns:
        out ``[batch, seqlen_q, num_heads, head_size]`` in q's dtype, or with
        ``return_attn_probs`` ``(out, softmax_lse, None)``: lse float32 ``[batch, num_heads,
        seqlen_q]`` (``-inf`` for a row that sees no key).
    """
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    batch, seqlen_q, num_heads, head_size = q.shape
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, ndim=4, dtypes=(q.dtype,), device=q.device)
        if t.shape[0] != batch:
            raise arg_error(name, f"batch {batch} (q's)", tuple(t.shape))
    if v.shape != k.shape:
        raise arg_error("v", f"the shape of k {tuple(k.shape)}", tuple(v.shape))
    seqlen_k = k.shape[1]
    result = flash_attn_varlen_func(
        q.reshape(batch * seqlen_q, num_heads, head_size),
        k.reshape(batch * seqlen_k, *k.shape[2:]), v.reshape(batch * seqlen_k, *v.shape[2:]),
        _offsets(batch, seqlen_q, q.device), _offsets(batch, seqlen_k, q.device), seqlen_q,
        seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs, sinks=sinks, backend=backend)
    out = (result[0] if return_attn_probs else result).view(batch, seqlen_q, num_heads,
                                                             head_size)
    if not return_attn_probs:
        return out
    # [num_heads, batch * seqlen_q] -> FlashAttention's batched [batch, num_heads, seqlen_q].
    lse = result[1].view(num_heads, batch, seqlen_q).transpose(0, 1).contiguous()
    return out, lse, None


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, sinks=None,
                              backend="auto"):
    """:func:`flash_attn_func` of ``qkv [batch, seqlen, 3, num_heads, head_size]`` (q, k, v
    stacked on dim 2, one head count). Returns as :func:`flash_attn_func`."""
    _check_packed("qkv", qkv, 5, 3, 2)
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs, sinks=sinks, backend=backend)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, sinks=None,
                             backend="auto"):
    """:func:`flash_attn_func` of q ``[batch, seqlen_q, num_heads, head_size]`` and ``kv
    [batch, seqlen_k, 2, num_kv_heads, head_size]`` (k, v stacked on dim 2). Returns as
    :func:`flash_attn_func`."""
    _check_packed("kv", kv, 5, 2, 2)
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs, sinks=sinks, backend=backend)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, sinks=None, backend="auto"):
    """:func:`~.varlen.flash_attn_varlen_func` of ``qkv [total, 3, num_heads, head_size]``
    with one int32 ``cu_seqlens [num_seqs + 1]`` and ``max_seqlen`` for q and k. Returns as
    ``flash_attn_varlen_func`` (lse ``[num_heads, total]``)."""
    _check_packed("qkv", qkv, 4, 3, 1)
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens,
                                  max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, sinks=sinks, backend=backend)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, sinks=None, backend="auto"):
    """:func:`~.varlen.flash_attn_varlen_func` of q ``[total_q, num_heads, head_size]`` and
    ``kv [total_k, 2, num_kv_heads, head_size]`` (k, v stacked on dim 1). Returns as
    ``flash_attn_varlen_func``."""
    _check_packed("kv", kv, 4, 2, 1)
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, sinks=sinks, backend=backend)


__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func"]
