"""``flash_attn_varlen_func``: a drop-in for FlashAttention's function of that name (forward only).

Same positional order and defaults as FlashAttention's, so code written for it (seed 003's test
script, transformers' ``_flash_attention_forward``) runs unchanged. Two K/V layouts:

- contiguous varlen: ``k``, ``v`` ``[total_k, num_kv_heads, head_size]``, sequence i's keys at rows
  ``cu_seqlens_k[i] .. cu_seqlens_k[i+1]-1``;
- paged (``block_table`` given): ``k``, ``v`` are the caches
  ``[num_blocks, block_size, num_kv_heads, head_size]`` and sequence i has
  ``cu_seqlens_k[i+1] - cu_seqlens_k[i]`` keys, read through ``block_table[i]``; this runs
  :func:`~mini_paged_attn.ops.dispatch.paged_prefill`, so its queries must be the last tokens of
  the sequence (``q_len <= k_len``).

``causal`` is bottom-right aligned when ``q_len != k_len``, as in FlashAttention >= 2.1: query row
t sees keys ``<= k_len - q_len + t``; rows that see no key give 0.

Contiguous K/V run on the attention backend object
:func:`~mini_paged_attn.ops.attention.select.backend_for_call` picks for the call, as
``paged_prefill`` does (the reference, Triton, or on sm_90 where the Gluon gate holds
Hopper, :mod:`.attention`), once per call that misses the launch cache below.
"""

from __future__ import annotations

import torch

from ..core.args import check_bool, is_number, non_negative_int
from .attention.select import backend_for_call
from .checks import FLOAT_DTYPES, check_index_vector, check_scale, check_tensor
from .dispatch import _call_key, _variant_options, paged_prefill
from .launch import LaunchCache
from .variants import check_sinks, check_softcap, check_window


# Prepared launches of the triton path on contiguous K/V, by call (see :mod:`.launch`).
_CONTIGUOUS_RUNS = LaunchCache()


def _not_implemented(dropout_p, alibi_slopes) -> None:
    if not is_number(dropout_p) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    if dropout_p > 0:
        raise NotImplementedError(f"dropout_p={dropout_p}: dropout is not implemented "
                                  "(inference only); pass dropout_p=0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not implemented; pass None")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # FlashAttention copies an input whose last dim is strided rather than refusing it; so do we.
    return x if x.stride(-1) == 1 else x.contiguous()


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, sinks=None,
                           backend="auto"):
    """Attention over a varlen batch, FlashAttention's ``flash_attn_varlen_func`` (forward only).

    Args:
        q: ``[total_q, num_q_heads, head_size]``, fp16 / bf16 / fp32 (a strided last dim is
            copied, as FlashAttention does; so are contiguous-layout k and v).
        k, v: contiguous ``[total_k, num_kv_heads, head_size]``, or with ``block_table`` the paged
            caches ``[num_blocks, block_size, num_kv_heads, head_size]``; q's dtype and device.
        cu_seqlens_q, cu_seqlens_k: int32 ``[num_seqs + 1]``, cumulative lengths from 0.
        max_seqlen_q, max_seqlen_k: ints, at least the longest q / k length (launch bounds).
        dropout_p, alibi_slopes: only their defaults (0.0, None) are implemented; other
            values raise NotImplementedError naming the option.
        softmax_scale: default ``head_size ** -0.5``.
        causal: bottom-right aligned causal mask.
        window_size: ``(left, right)`` ints >= -1 (-1: unbounded): query row ``t`` of a
            sequence sits at ``p = k_len - q_len + t`` and sees keys ``p - left .. p + right``
            (``causal`` clamps ``right`` to 0). Paged K/V blocks wholly left of every query's
            window are never read.
        softcap: ``>= 0``; scores become ``softcap * tanh(scores / softcap)`` (0: off).
        deterministic: accepted and ignored (the forward pass is deterministic).
        return_attn_probs: also return the softmax's log-sum-exp and FlashAttention's
            ``S_dmask``, which it returns only under dropout: None here (dropout is 0).
        block_table: int32 ``[num_seqs, max_blocks_per_seq]`` for paged K/V, else None.
        sinks: keyword only; None or float32 ``[num_q_heads]`` on q's device, a per-head logit
            that joins the softmax denominator only (see :mod:`.variants`).
        backend: "auto" | "torch" | "triton" (keyword only; see :mod:`.dispatch`), mapped
            to its backend object on a cache miss.

    Returns:
        out ``[total_q, num_q_heads, head_size]`` in q's dtype; with ``return_attn_probs``
        the triple ``(out, softmax_lse, None)``: ``softmax_lse`` float32 ``[num_q_heads,
        total_q]``, contiguous (FlashAttention's varlen layout), the natural log-sum-exp of
        each row's scaled (and soft-capped) scores, the sink included where ``sinks`` is
        given. A row that sees no key gets ``-inf`` (log 0, what FlashAttention 3 writes and
        :func:`~mini_paged_attn.ops.merge.merge_attention_states` takes; FlashAttention 2
        writes ``+inf`` there), or its head's sink.

    Raises:
        ValueError: bad shapes, dtypes, devices, window, softcap or sinks (and, for the torch
            backend, lengths); ``backend`` where the backend refuses the call (Triton on a
            CPU outside ``TRITON_INTERPRET=1``).
        NotImplementedError: an unimplemented option.
    """
    key = None
    if (block_table is None and backend != "torch" and dropout_p == 0.0
            and alibi_slopes is None and not return_attn_probs
            and type(max_seqlen_q) is int and type(max_seqlen_k) is int
            and max_seqlen_q >= 0 and max_seqlen_k >= 0
            and (variant_key := _variant_options(window_size, softcap)) is not None):
        # A repeat of an earlier call's shapes: launch what it prepared (max_seqlen_q/k are
        # unused, so checked but not keyed on).
        key = _call_key((q, k, v, cu_seqlens_q, cu_seqlens_k, sinks),
                        (causal, softmax_scale, backend, *variant_key))
        launch = _CONTIGUOUS_RUNS.get(key) if key is not None else None
        if launch is not None:
            # empty_like over empty(shape, dtype, device): the cheaper allocation on the host
            # (docs/performance-notes.md, "Host time per call").
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            # Each pointer read once (the kernel takes k, out and cu_seqlens_k twice or more).
            q_ptr, k_ptr, o_ptr, cu_k = (q.data_ptr(), k.data_ptr(), out.data_ptr(),
                                         cu_seqlens_k.data_ptr())
            if launch.launch_checked(
                    (q_ptr, k_ptr, v.data_ptr(), k_ptr, k_ptr, o_ptr, o_ptr, cu_k,
                     cu_seqlens_q.data_ptr(), cu_k, q_ptr if sinks is None else sinks.data_ptr()),
                    launch.stream()):
                return out
    _not_implemented(dropout_p, alibi_slopes)
    check_bool("return_attn_probs", return_attn_probs)
    window_size = check_window(window_size)
    softcap = check_softcap(softcap)
    max_seqlen_q = non_negative_int("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = non_negative_int("max_seqlen_k", max_seqlen_k)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_index_vector("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), device=q.device)
    check_index_vector("cu_seqlens_k", cu_seqlens_k, dtypes=(torch.int32,), device=q.device)
    if cu_seqlens_q.shape[0] < 1 or cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k: expected the shape of cu_seqlens_q "
                         f"{tuple(cu_seqlens_q.shape)} (num_seqs + 1, at least 1), "
                         f"got {tuple(cu_seqlens_k.shape)}")
    check_bool("causal", causal)
    given = (q, k, v)
    q = _last_dim_contiguous(q)
    scale = check_scale(softmax_scale, q.shape[-1], name="softmax_scale")
    check_sinks(sinks, q.shape[1], q.device)
    variant = dict(window_size=window_size, softcap=softcap, sinks=sinks)

    if block_table is not None:
        # Paged K/V: FlashAttention's per-sequence K length is the difference of cu_seqlens_k.
        # A decode-like choice (no Hopper gate): only the lengths' host checks are the
        # backend's here; paged_prefill picks the backend that attends.
        impl = backend_for_call(backend, q.device, q.shape[-1], q.dtype, prefill=False)
        impl.check_varlen_lengths(cu_seqlens_q, cu_seqlens_k, q.shape[0], None, max_seqlen_q,
                                  max_seqlen_k)
        context_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        result = paged_prefill(q, k, v, block_table, cu_seqlens_q, context_lens, causal=causal,
                               scale=scale, backend=backend, max_seqlen_q=max_seqlen_q,
                               return_lse=return_attn_probs, **variant)
        if not return_attn_probs:
            return result
        out, lse = result
        # paged_prefill's lse is [total_q, num_q_heads]; FlashAttention's varlen layout is
        # its transpose, contiguous.
        return out, lse.t().contiguous(), None

    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=q.device)
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    if v.shape != k.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    _, num_q_heads, head_size = q.shape
    if k.shape[2] != head_size:
        raise ValueError(f"k: expected head_size {head_size} (q's last dim), got {k.shape[2]}")
    if k.shape[1] < 1 or num_q_heads % k.shape[1] != 0:
        raise ValueError(f"q: expected num_q_heads divisible by num_kv_heads={k.shape[1]} "
                         f"(k's heads), got num_q_heads={num_q_heads}")
    impl = backend_for_call(backend, q.device, head_size, q.dtype)
    # FlashAttention's [num_q_heads, total_q] lse; the kernels write it through its
    # transposed view (they take the lse's strides), so it needs no copy.
    lse = (torch.empty(num_q_heads, q.shape[0], dtype=torch.float32, device=q.device)
           if return_attn_probs else None)
    out, launch = impl.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal=causal, scale=scale, window=window_size, softcap=softcap,
                              sinks=sinks, lse=None if lse is None else lse.t())
    if return_attn_probs:
        return out, lse, None
    # Keyed on the tensors as given: only a launch on them (no copy made) is repeatable.
    if launch is not None and key is not None and all(a is b for a, b in zip((q, k, v), given)):
        _CONTIGUOUS_RUNS.put(key, launch)
    return out
