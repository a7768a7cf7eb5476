"""Paged attention ops: each Triton kernel next to its torch reference, one dispatcher.

- :func:`paged_decode`, :func:`paged_prefill`, :func:`store_kv`: ``dispatch.py`` checks the
  arguments and runs the ``torch`` reference (``reference.py``, arithmetic in
  ``reference_attend.py``) or a Triton kernel (launchers ``decode.py``, ``prefill.py``,
  ``kv_write.py``; kernels ``decode_kernel.py``, ``decode_merge.py``, ``prefill_kernel.py``),
  as :func:`resolve_backend` (``backend.py``) picks; the attention ops run it through an
  attention backend object (``attention/``: torch, Triton, Hopper, each declaring what it
  runs; an engine chooses one once and asks it for its workspaces and warm-up). The three
  take an fp8 (e4m3) KV cache with ``k_scale`` / ``v_scale`` (``kv_quant.py``).
- :func:`flash_attn_varlen_func`: FlashAttention's function of that name (``varlen.py``).
- Attention variants, for every attention op and backend (``variants.py``): sliding windows
  (``window_size``), logit soft-capping (``softcap``) and attention sinks (``sinks``).
- :func:`merge_attention_states`: the online-softmax combine of two partial results.
- :func:`num_splits_heuristic`, :func:`explain_decode`: how decode splits the KV sequence
  (the plan: ``attention/decode_plan.py``; its tiles: ``decode_tiles.py``).
- :func:`fused_moe`: a mixture-of-experts layer's experts, a Triton grouped GEMM over tokens
  sorted by expert (``moe_triton.py``) next to its torch reference (``moe.py``).
- :func:`rms_norm` (optionally fused with the residual add), :func:`apply_rotary` (optionally
  writing the new K/V into the paged cache, :class:`KVWrite`), :func:`silu_and_mul`: the
  decoder's elementwise ops (``fused.py``, kernels in ``fused_triton.py``), one Triton launch
  each on CUDA.
- :func:`linear`: ``x @ W^T + b`` (optionally with SwiGLU's ``silu(gate) * up``), a Triton
  kernel launched as a programmatic dependent at decode sizes, cuBLAS above (``projection.py``,
  kernel in ``projection_triton.py``).
- :func:`sample_tokens`: temperature sampling of one token per logits row (``sample.py``), one
  pass over the logits on CUDA (``sample_triton.py``).
"""

from .dispatch import paged_decode, paged_prefill, resolve_backend, store_kv
from .attention.decode_plan import explain_decode
from .fused import KVWrite, apply_rotary, rms_norm, silu_and_mul
from .heuristics import num_splits_heuristic
from .projection import SplitKWorkspace, linear
from .merge import merge_attention_states
from .moe import fused_moe
from .sample import sample_tokens
from .varlen import flash_attn_varlen_func

__all__ = ["paged_decode", "paged_prefill", "store_kv", "flash_attn_varlen_func",
           "merge_attention_states", "num_splits_heuristic", "explain_decode",
           "resolve_backend", "rms_norm", "apply_rotary", "KVWrite", "silu_and_mul",
           "fused_moe", "sample_tokens", "linear", "SplitKWorkspace"]
