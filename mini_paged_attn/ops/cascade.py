"""TEMPORARY local stand-in for the cascade op (replaced by fix/cascade-ops on merge)."""
from __future__ import annotations

import torch

from .dispatch import paged_decode, paged_prefill
from .merge import merge_attention_states


def cascade_attention(query, key_cache, value_cache, cu_seqlens_q, *,
                      prefix_block_tables, prefix_lens, cu_group_tokens, group_tokens,
                      suffix_block_tables, suffix_lens,
                      decode_only: bool, scale=None, out=None, backend="auto",
                      k_scale=None, v_scale=None, softcap=0.0, sinks=None,
                      seq_order=None, workspace=None, num_splits=None) -> torch.Tensor:
    if decode_only:
        suf, lse = paged_decode(query, key_cache, value_cache, suffix_block_tables, suffix_lens,
                                scale=scale, backend=backend, softcap=softcap, return_lse=True)
    else:
        suf, lse = paged_prefill(query, key_cache, value_cache, suffix_block_tables,
                                 cu_seqlens_q, suffix_lens, scale=scale, backend=backend,
                                 softcap=softcap, return_lse=True)
    rows = group_tokens.long()
    if rows.numel():
        q = query.index_select(0, rows)
        counts = (cu_group_tokens[1:] - cu_group_tokens[:-1]).long()
        g = torch.repeat_interleave(torch.arange(counts.numel(), device=q.device), counts)
        pre, plse = paged_decode(q, key_cache, value_cache,
                                 prefix_block_tables.index_select(0, g).contiguous(),
                                 prefix_lens.index_select(0, g).contiguous(), scale=scale,
                                 backend=backend, softcap=softcap, return_lse=True)
        m, mlse = merge_attention_states(pre, plse, suf.index_select(0, rows),
                                         lse.index_select(0, rows))
        suf = suf.index_copy(0, rows, m)
        lse = lse.index_copy(0, rows, mlse)
    if sinks is not None:
        sink_lse = sinks.view(1, -1).expand_as(lse).contiguous()
        suf, lse = merge_attention_states(suf, lse, torch.zeros_like(suf), sink_lse)
    if out is not None:
        out.copy_(suf)
        return out
    return suf
