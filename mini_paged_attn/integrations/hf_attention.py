"""A transformers attention function that runs :func:`~mini_paged_attn.ops.flash_attn_varlen_func`.

transformers calls it from every decoder layer after the layer's cache update, so ``key`` /
``value`` hold the whole context of each batch row (a ``DynamicCache`` keeps it contiguous).
Each batch row becomes one varlen sequence: prefill is ``q_len = kv_len``, decode ``q_len = 1``
over the cached keys, and the causal mask is bottom-right aligned, as transformers expects.

Padding arrives as the 2D ``[batch, kv_len]`` boolean mask that transformers' flash mask function
builds (``None`` when no row has padding). Padded positions are packed out: their keys are never
read, and their queries give 0 (their outputs only feed positions that are never sampled).

Sliding windows, attention-logit soft-capping and attention sinks run in the op, with
transformers' meanings: ``sliding_window=w`` lets a query see itself and the ``w - 1`` keys
before it (FlashAttention's ``window_size=(w - 1, w - 1)``, as transformers' flash path passes
it), ``softcap`` caps the scaled scores, and ``s_aux`` (gpt-oss's per-head sinks) joins the
softmax denominator. Features the op does not implement raise ``NotImplementedError`` naming
the feature, never a silent fallback: position biases and dropout.
"""

from __future__ import annotations

import torch

from ..ops.varlen import flash_attn_varlen_func

IMPLEMENTATION_NAME = "mini_paged_attn"


def check_supported(module: torch.nn.Module, kv_len: int, dropout: float, kwargs: dict) -> None:
    """Raise NotImplementedError for a model feature the varlen op does not compute (``module``
    and ``kv_len``: kept for callers; no feature depends on them now)."""
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(f"{IMPLEMENTATION_NAME}: position_bias (a learned additive "
                                  "attention bias) is not implemented")
    if dropout:
        raise NotImplementedError(f"{IMPLEMENTATION_NAME}: attention dropout={dropout} is not "
                                  "implemented (inference only); call model.eval()")


def variant_kwargs(module: torch.nn.Module, query: torch.Tensor, kwargs: dict) -> dict:
    """``window_size`` / ``softcap`` / ``sinks`` for the op from transformers' kwargs
    (``sliding_window``, ``softcap``, ``s_aux``, else the module's ``sinks``)."""
    variant = {}
    window = kwargs.get("sliding_window")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window: expected a positive int or None, got {window!r}")
        variant["window_size"] = (window - 1, window - 1)
    if kwargs.get("softcap") is not None:
        variant["softcap"] = float(kwargs["softcap"])
    sinks = kwargs.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        sinks = module.sinks
    if sinks is not None:
        # The op takes float32 logits on the query's device, one per query head.
        variant["sinks"] = sinks.detach().to(device=query.device, dtype=torch.float32)
    return variant


def _cu_seqlens(lens: torch.Tensor) -> torch.Tensor:
    """int32 ``[batch + 1]`` cumulative lengths from 0 of int ``[batch]`` lengths."""
    cu = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(lens, dim=0, out=cu[1:])
    return cu


def mini_paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                                 scaling: float | None = None, dropout: float = 0.0,
                                 **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over our varlen kernel.

    Args:
        module: the calling attention layer (read for ``is_causal`` and ``sinks``, a float
            ``[num_heads]`` tensor, when ``s_aux`` is not given).
        query: ``[batch, num_heads, q_len, head_dim]``, fp16 / bf16 / fp32.
        key, value: ``[batch, num_kv_heads, kv_len, head_dim]`` after the cache update
            (``kv_len >= q_len``; the queries are the last ``q_len`` positions); query's dtype.
        attention_mask: None (no padding), or bool / int ``[batch, kv_len]``, True / 1 where the
            position is a real token (what transformers' flash mask function returns).
        scaling: softmax scale, default ``head_dim ** -0.5``.
        dropout: must be 0.
        kwargs: ``is_causal`` (default the module's, else True), ``sliding_window`` (int or
            None), ``softcap`` (float or None), ``s_aux`` (``[num_heads]`` sink logits or
            None), ``position_bias`` (see the module docstring); the rest is ignored.

    Returns:
        ``(out, None)``: out ``[batch, q_len, num_heads, head_dim]`` in query's dtype, contiguous
        (what ``sdpa_attention_forward`` returns); no attention weights.

    Raises:
        NotImplementedError: a feature the op does not implement, or a 4D mask.
        ValueError: a 2D mask whose shape is not ``[batch, kv_len]``; a bad
            ``sliding_window``, ``softcap`` or ``s_aux``.
    """
    batch, num_heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    check_supported(module, kv_len, dropout, kwargs)
    variant = variant_kwargs(module, query, kwargs)
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    q = query.transpose(1, 2)      # [batch, q_len, num_heads, head_dim]
    k = key.transpose(1, 2)        # [batch, kv_len, num_kv_heads, head_dim]
    v = value.transpose(1, 2)

    if attention_mask is None:
        # Every row is a whole sequence: equal lengths, no packing beyond a reshape.
        lens_q = torch.full((batch,), q_len, dtype=torch.int32, device=query.device)
        lens_k = torch.full((batch,), kv_len, dtype=torch.int32, device=query.device)
        out = flash_attn_varlen_func(
            q.reshape(batch * q_len, num_heads, head_dim),
            k.reshape(batch * kv_len, -1, head_dim), v.reshape(batch * kv_len, -1, head_dim),
            _cu_seqlens(lens_q), _cu_seqlens(lens_k), q_len, kv_len,
            softmax_scale=scaling, causal=causal, **variant)
        return out.view(batch, q_len, num_heads, head_dim), None

    if attention_mask.dim() != 2:
        raise NotImplementedError(
            f"{IMPLEMENTATION_NAME}: a {attention_mask.dim()}D attention mask of shape "
            f"{tuple(attention_mask.shape)} is not implemented; only None or a 2D [batch, kv_len] "
            "padding mask (the model or caller built a custom mask)")
    if tuple(attention_mask.shape) != (batch, kv_len):
        raise ValueError(f"{IMPLEMENTATION_NAME}: expected a padding mask of shape "
                         f"{(batch, kv_len)} [batch, kv_len], got {tuple(attention_mask.shape)} "
                         "(a static cache longer than the keys is not implemented)")
    # Pack the real tokens of each row into one varlen sequence. Within the queries' span a
    # position is a real key exactly when it is a real query, so bottom-right causal alignment
    # over the packed row is the same mask as causal-and-padding over the padded row.
    keep_k = attention_mask.to(torch.bool)
    keep_q = keep_k[:, kv_len - q_len:]
    lens_q = keep_q.sum(dim=1, dtype=torch.int32)
    lens_k = keep_k.sum(dim=1, dtype=torch.int32)
    # The padded lengths bound every row's (max_seqlen only bounds the launch): no host sync.
    packed = flash_attn_varlen_func(q[keep_q], k[keep_k], v[keep_k], _cu_seqlens(lens_q),
                                    _cu_seqlens(lens_k), q_len, kv_len,
                                    softmax_scale=scaling, causal=causal, **variant)
    out = query.new_zeros(batch, q_len, num_heads, head_dim)
    out[keep_q] = packed
    return out, None
