"""Paged attention and the decoder's ops: each Triton kernel next to its torch reference, one
checked entry point each.

- :func:`paged_decode`, :func:`paged_prefill`, :func:`store_kv`: the paged attention ops, over
  an fp8 (e4m3) KV cache too (``k_scale`` / ``v_scale``), run through an attention backend
  (:mod:`.attention`); :func:`resolve_backend` is the rule every op family shares.
- FlashAttention's inference API as drop-ins over these kernels (forward only):
  :func:`flash_attn_varlen_func`, :func:`flash_attn_func`, the packed
  :func:`flash_attn_qkvpacked_func`, :func:`flash_attn_kvpacked_func`,
  :func:`flash_attn_varlen_qkvpacked_func`, :func:`flash_attn_varlen_kvpacked_func`, and
  :func:`flash_attn_with_kvcache` (rotary, in-place append, paged or not).
- Attention variants for every op and backend: sliding windows (``window_size``), logit
  soft-capping (``softcap``) and attention sinks (``sinks``).
- :func:`merge_attention_states`: the online-softmax combine of two partial results.
- :func:`cascade_attention`: attention over prefixes shared by groups of sequences (each
  prefix attended once per group, merged with each sequence's own suffix), built of the
  paged ops and the merge.
- :func:`num_splits_heuristic`, :func:`explain_decode`: how decode splits the KV sequence.
- :func:`fused_moe`: a mixture-of-experts layer's experts.
- :func:`rms_norm`, :func:`apply_rotary` (optionally writing K/V into the cache,
  :class:`KVWrite`), :func:`silu_and_mul`, :func:`linear`, :func:`sample_tokens`: the
  decoder's elementwise ops, projections and sampling.

The files and what each owns: docs/architecture.md, ``ops/``.
"""

from .dispatch import paged_decode, paged_prefill, resolve_backend, store_kv
from .attention.decode_plan import explain_decode
from .fused import KVWrite, apply_rotary, rms_norm, silu_and_mul
from .heuristics import num_splits_heuristic
from .projection import SplitKWorkspace, linear
from .merge import merge_attention_states
from .cascade import cascade_attention
from .moe import fused_moe
from .sample import sample_tokens
from .varlen import flash_attn_varlen_func
from .flash_api import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from .kvcache_api import flash_attn_with_kvcache

__all__ = ["paged_decode", "paged_prefill", "store_kv", "flash_attn_varlen_func",
           "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_with_kvcache",
           "merge_attention_states", "cascade_attention", "num_splits_heuristic",
           "explain_decode",
           "resolve_backend", "rms_norm", "apply_rotary", "KVWrite", "silu_and_mul",
           "fused_moe", "sample_tokens", "linear", "SplitKWorkspace"]
