"""``paged|mini_paged_attn``: our paged kernel inside transformers' continuous batching.

Tested with transformers 5.17; 5.22 and later no longer take custom implementations there.

transformers' ``generate_batch`` (``ContinuousBatchingManager``, 5.17) switches a model's
attention to ``"paged|<name>"`` and calls that function with its ``PagedAttentionCache``: all the
scheduled requests' query tokens packed in one row, ``cu_seq_lens_q`` / ``cu_seq_lens_k``, and
per-token page indices (``write_index`` for the new tokens, ``read_index`` for every token of
each request, in order). The attention function owns the cache update.

We write the new K/V through the cache's own ``update`` (its write-only path: no read-back), then
run :func:`~mini_paged_attn.ops.paged_prefill` straight over the cache's pages: a layer's cache
``[num_blocks * block_size, num_kv_heads, head_dim]`` is our ``[num_blocks, block_size,
num_kv_heads, head_dim]`` layout, and a request's block table is every ``block_size``-th entry
of its read indices divided by ``block_size`` (a full-attention group reads block by block, from
offset 0). A batch with nothing cached (only whole prompts) has no read indices: its keys are the
new tokens, and :func:`~mini_paged_attn.ops.flash_attn_varlen_func` runs over them.

A sliding-window layer (``sliding_window = W``) keeps a ring of ``W`` slots per request, which a
chunk's new tokens may overwrite while its earlier queries still need them: there the cache's
own ``update`` reads a request's last ``min(past, W - 1)`` keys before writing and returns them
packed with the new ones (``cu_seq_lens_k["sliding_attention"]``), and the varlen op runs over
them with ``window_size=(W - 1, 0)``, causal and bottom-right aligned.

From 5.23 on transformers accepts only its own implementations for continuous batching, and
does not call this function (see :mod:`.transformers`).
"""

from __future__ import annotations

import torch

from ..ops.dispatch import paged_prefill
from ..ops.varlen import flash_attn_varlen_func
from .hf_attention import IMPLEMENTATION_NAME, check_supported, variant_kwargs

PAGED_IMPLEMENTATION_NAME = f"paged|{IMPLEMENTATION_NAME}"


def _layer_kwarg(value, layer_type: str = "full_attention"):
    # transformers passes per-layer-type dicts when a model mixes full and sliding layers.
    return value[layer_type] if isinstance(value, dict) else value


def _block_tables(read_index: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_k: int,
                  block_size: int) -> torch.Tensor:
    """int32 ``[num_seqs, max_blocks]`` block tables from int64 per-token page indices.

    ``read_index[cu_seqlens_k[i] + t]`` is the page of token t of sequence i, block
    ``t // block_size`` at offset ``t % block_size``; unused entries are 0 (never read).
    """
    lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    max_blocks = max(1, -(-max_seqlen_k // block_size))
    j = torch.arange(max_blocks, device=read_index.device)
    used = j[None, :] * block_size < lens[:, None]
    pos = (cu_seqlens_k[:-1, None] + j[None, :] * block_size).clamp(max=read_index.numel() - 1)
    return torch.where(used, read_index[pos] // block_size, 0).to(torch.int32)


def mini_paged_attention_paged_forward(module: torch.nn.Module, query: torch.Tensor,
                                       key: torch.Tensor, value: torch.Tensor,
                                       attention_mask: torch.Tensor | None,
                                       scaling: float | None = None, dropout: float = 0.0,
                                       **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' paged attention-function call, on our kernels.

    Args:
        query: ``[1, num_heads, total_q, head_dim]``, every scheduled request's new tokens.
        key, value: ``[1, num_kv_heads, total_q, head_dim]``, the new tokens' K/V (not cached
            yet); query's dtype.
        attention_mask: transformers' packed 4D mask; unused (the mask is causal per request).
        kwargs: ``cache`` (the PagedAttentionCache), ``cu_seq_lens_q``, ``cu_seq_lens_k``,
            ``max_seqlen_q``, ``max_seqlen_k``, ``read_index``, ``write_index``.

    Returns:
        ``(out, None)``, out ``[1, total_q, num_heads, head_dim]``.
    """
    cache = kwargs.get("cache")
    if cache is None:
        raise ValueError(f"{PAGED_IMPLEMENTATION_NAME} needs transformers' paged cache (it serves "
                         f"generate_batch); use attn_implementation='{IMPLEMENTATION_NAME}' for "
                         "generate() and forward calls")
    check_supported(module, 0, dropout, kwargs)
    variant = variant_kwargs(module, query, kwargs)   # soft-capping and sinks
    _, num_heads, total_q, head_dim = query.shape
    q = query[0].transpose(0, 1)                                   # [total_q, heads, head_dim]
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    max_q = int(kwargs["max_seqlen_q"])
    window = cache.sliding_windows[module.layer_idx]
    if window != 1:
        out = _sliding_window_attention(module, q, key, value, cache, window, cu_q, max_q,
                                         scaling, variant, kwargs)
        return out.view(1, total_q, num_heads, head_dim), None
    cu_k = _layer_kwarg(kwargs["cu_seq_lens_k"]).to(torch.int32)
    max_k = int(_layer_kwarg(kwargs["max_seqlen_k"]))
    group, layer_in_group = cache.layer_index_to_group_indices[module.layer_idx]
    read_index = kwargs["read_index"][group]
    # Write the new tokens' K/V; empty read indices take the cache's write-only path.
    no_reads = [index[:0] for index in kwargs["read_index"]]
    new_k, new_v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                read_index=no_reads, write_index=kwargs["write_index"])
    if read_index.numel() == 0:
        out = flash_attn_varlen_func(q, new_k, new_v, cu_q, cu_k, max_q, max_k,
                                     softmax_scale=scaling, causal=True, **variant)
    else:
        block_size = cache.block_size
        pages = (-1, block_size, cache.num_key_value_heads, head_dim)
        key_cache = cache.key_cache[layer_in_group].view(pages)
        value_cache = cache.value_cache[layer_in_group].view(pages)
        tables = _block_tables(read_index, cu_k, max_k, block_size)
        out = paged_prefill(q, key_cache, value_cache, tables, cu_q, cu_k[1:] - cu_k[:-1],
                            causal=True, scale=scaling, **variant)
    return out.view(1, total_q, num_heads, head_dim), None


def _sliding_window_attention(module: torch.nn.Module, q: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, cache, window: int, cu_q: torch.Tensor,
                              max_q: int, scaling: float | None, variant: dict,
                              kwargs: dict) -> torch.Tensor:
    """A sliding-window layer over the keys the cache's ring still holds.

    Args:
        q: ``[total_q, num_heads, head_dim]``; key, value: ``[1, num_kv_heads, total_q,
            head_dim]``, the new tokens' K/V; query's dtype.
        window: the layer's ``W`` (a query sees itself and the ``W - 1`` keys before it).
        cu_q: int32 ``[num_seqs + 1]``.

    Returns:
        ``[total_q, num_heads, head_dim]`` in q's dtype.
    """
    # The cache reads each request's last min(past, W - 1) keys before the new tokens overwrite
    # their ring slots, then writes: [total_k, num_kv_heads, head_dim], packed per request.
    keys, values = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    cu_k = _layer_kwarg(kwargs["cu_seq_lens_k"], "sliding_attention").to(torch.int32)
    max_k = int(_layer_kwarg(kwargs["max_seqlen_k"], "sliding_attention"))
    # The cache's window is the one its ring holds; the model's sliding_window kwarg agrees.
    variant = {**variant, "window_size": (window - 1, 0)}
    return flash_attn_varlen_func(q, keys, values, cu_q, cu_k, max_q, max_k,
                                  softmax_scale=scaling, causal=True, **variant)
