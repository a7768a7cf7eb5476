"""The public paged attention ops: check the arguments once, pick a backend, run it.

Backends:
  - ``"torch"``: the reference in :mod:`.reference` (any device; the specification).
  - ``"triton"``: the kernels in :mod:`.decode`, :mod:`.prefill` and :mod:`.kv_write`.
  - ``"auto"`` (default): ``"triton"`` for CUDA tensors when Triton imports, else ``"torch"``
    (:func:`~.backend.resolve_backend`, the rule every op family shares).

The three ops run the backend object :func:`~.attention.select.backend_for_call` picks for
the call (the reference, Triton, or for a prefill on sm_90 Hopper, :mod:`.attention`), once
per call that misses the cache below.

A backend never falls back silently: asking for ``"triton"`` where it cannot run is an error.

Host cost: on CUDA, a call whose arguments have the shapes, strides, dtypes, device and options
of an earlier call skips the checks and the plan and repeats that call's prepared launches
(:mod:`.launch`) with its own tensors. A model's layers within one step, and a user's loop
over same-shaped calls, pay the planning once. The cache is keyed on everything the checks and
the plan read, so an argument that would fail a check never matches an entry.
"""

from __future__ import annotations

import logging

import torch

from ..core.args import check_bool, non_negative_int
from .attention.base import AttentionBackend, outputs
from .attention.select import backend_for_call
from .backend import BACKENDS, resolve_backend, triton_available
from .checks import (FLOAT_DTYPES, PagedShapes, check_cache_pair, check_index_vector,
                     check_paged_decode_args, check_paged_prefill_args, check_seq_order,
                     check_tensor)
from .kv_quant import check_kv_scales, scale_pointers
from .launch import ALIGNMENT, LaunchCache
from .variants import NO_WINDOW, check_variant

logger = logging.getLogger(__name__)

# Prepared launches of earlier CUDA calls, by call key (see the module doc).
_DECODE_RUNS = LaunchCache()
_PREFILL_RUNS = LaunchCache()
_STORE_RUNS = LaunchCache()


def _call_key(tensors: tuple, options: tuple) -> tuple | None:
    """The cache key of a call on one CUDA device; None where there is no fast path (a
    non-tensor argument, a CPU first tensor, an unhashable option). Each tensor is keyed by
    dtype, device, shape, strides and whether its pointer is 16-byte aligned (so calls of one
    shape aligned differently keep entries of their own instead of replacing each other's,
    each replacement a slow call); options are keyed with their types, so ``1`` never matches
    an entry made for ``True``. Written out inline: it runs on every repeated call."""
    try:
        if tensors[0].get_device() < 0:
            return None
        hash(options)
        key = [options, tuple(map(type, options))]
        for t in tensors:
            if t is None:
                key.append(None)
            else:       # flat: fewer tuples to build, hash and compare
                key += (t.dtype, t.get_device(), t.shape, t.stride(),
                        t.data_ptr() % ALIGNMENT == 0)
    except (AttributeError, TypeError):
        return None
    return tuple(key)


def _variant_options(window_size: object, softcap: object) -> tuple | None:
    """The call-key options of the attention variants, or None (no fast path) for a window
    that is not a tuple: a list is unhashable, and a tuple keys each side with its type."""
    if type(window_size) is not tuple or len(window_size) != 2:
        return None
    return (*window_size, softcap)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                 scale: float | None = None, out: torch.Tensor | None = None,
                 return_lse: bool = False, backend: str = "auto",
                 num_splits: int | None = None, workspace: torch.Tensor | None = None,
                 explain: bool = False, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None,
                 window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None, seq_order: torch.Tensor | None = None):
    """Attention of one new query token per sequence over its paged K/V.

    Args:
        query: ``[num_seqs, num_q_heads, head_size]``, fp16 / bf16 / fp32, last dim contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]`` in the
            query's dtype or ``torch.float8_e4m3fn`` (an fp8 cache, read as ``stored * scale``);
            any strides on the first three dims (the views of
            ``PagedAttentionManager.kv_cache`` work without a copy).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``; entry ``j`` of row ``i`` is the
            physical block holding tokens ``j*block_size .. (j+1)*block_size-1`` of sequence i.
            Entries past a sequence's length are never read.
        context_lens: int32 ``[num_seqs]``, tokens in the cache per sequence (the new one
            included). A sequence of length 0 gives zeros (and lse ``-inf``).
        scale: softmax scale, default ``head_size ** -0.5``.
        out: optional ``[num_seqs, num_q_heads, head_size]`` tensor in the query's dtype to write.
        return_lse: also return the log-sum-exp of the scaled scores, float32
            ``[num_seqs, num_q_heads]`` (natural log).
        backend: "auto" | "torch" | "triton" (see the module doc).
        num_splits: triton only; split each sequence's KV into this many chunks (None: the
            heuristic of :func:`~mini_paged_attn.ops.heuristics.num_splits_heuristic`).
            ``num_splits=1`` makes a sequence's result independent of the batch it is in.
        workspace: triton only; a float32 scratch buffer for split-KV partial results, so the
            launch allocates nothing (CUDA-graph capture). See ``decode.workspace_size``.
        explain: log which kernel runs and why (see ``explain_decode``).
        k_scale, v_scale: an fp8 cache's dequantization scales: None (= 1.0, no scaling) or a
            float32 tensor of shape ``[]`` (per tensor) or ``[num_kv_heads]`` (per KV head) on
            the query's device, positive and finite (see :mod:`.kv_quant`). A cache in the
            query's dtype takes None.
        window_size: ``(left, right)`` ints >= -1 (-1: unbounded), FlashAttention's sliding
            window; the query sits at position ``context_len - 1`` and sees keys
            ``context_len - 1 - left ..`` (``right`` has nothing to its right to bound).
            Blocks wholly left of the window are never read; split-KV planning counts only
            the window's tiles.
        softcap: ``>= 0``; scores become ``softcap * tanh(scores / softcap)`` (0: off).
        sinks: None or float32 ``[num_q_heads]`` on the query's device: a per-head logit in
            the softmax denominator only; lse then includes it (see :mod:`.variants`).
        seq_order: None or int32 ``[num_seqs]`` on the query's device, a permutation of
            ``0 .. num_seqs - 1``: the order in which the kernel's programs take the
            sequences. Results do not depend on it; launch time does when lengths differ:
            sequences ordered longest first (e.g. ``torch.argsort(context_lens,
            descending=True).int()``, made once per step) leave the short ones to fill the
            launch's tail (docs/performance-notes.md, "Decode in longest-first order"). The
            torch backend checks that it is a permutation; the triton backend reads it
            unchecked (checking would sync with the device).

    Query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)`` (MHA, GQA, MQA).
    Scores and the softmax accumulate in float32 (an fp8 cache too: the output is in the
    query's dtype).

    Returns:
        ``out`` (``[num_seqs, num_q_heads, head_size]``, the query's dtype), or
        ``(out, lse)`` when ``return_lse``.

    Raises:
        ValueError: bad shapes, dtypes, devices or scales; for the torch backend also bad
            lengths or block ids. Nothing is written then.
    """
    key = capturing = None
    # The repeat path, written out: every call pays it (see the module doc).
    if (backend != "torch" and explain is False and type(window_size) is tuple
            and len(window_size) == 2):
        key = _call_key((query, key_cache, value_cache, block_tables, context_lens, out,
                         workspace, k_scale, v_scale, sinks, seq_order),
                        (scale, return_lse, backend, num_splits, *window_size, softcap))
        if key is not None:
            # A run made under CUDA-graph capture keeps no scratch of its own (see DecodeRun).
            capturing = torch.cuda.is_current_stream_capturing()
            run = _DECODE_RUNS.get((key, capturing))
            if run is not None:
                out_ = torch.empty_like(query) if out is None else out
                lse = (torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
                       if return_lse else None)
                if run(query, key_cache, value_cache, k_scale, v_scale, block_tables,
                       context_lens, out_, lse, workspace, sinks, seq_order):
                    return (out_, lse) if return_lse else out_
            key = (key, capturing)
    shapes = check_paged_decode_args(query, key_cache, value_cache, block_tables,
                                     context_lens, scale, out)
    check_kv_scales(k_scale, v_scale, key_cache.dtype, shapes.num_kv_heads, query.device)
    window, softcap = check_variant(window_size, softcap, sinks, shapes.num_q_heads,
                                    query.device)
    check_seq_order(seq_order, shapes.num_seqs, query.device)
    check_bool("return_lse", return_lse)
    check_bool("explain", explain)
    impl = backend_for_call(backend, query.device, shapes.head_size, query.dtype,
                            prefill=False)
    out, lse, run = impl.decode(query, key_cache, value_cache, block_tables, context_lens,
                                shapes, out=out, return_lse=return_lse, num_splits=num_splits,
                                workspace=workspace, explain=explain, k_scale=k_scale,
                                v_scale=v_scale, window=window, softcap=softcap, sinks=sinks,
                                seq_order=seq_order, cacheable=key is not None,
                                capturing=capturing)
    if run is not None and key is not None:
        _DECODE_RUNS.put(key, run)
    return (out, lse) if return_lse else out


def paged_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  context_lens: torch.Tensor, *, causal: bool = True,
                  scale: float | None = None, out: torch.Tensor | None = None,
                  return_lse: bool = False, backend: str = "auto",
                  max_seqlen_q: int | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None,
                  window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
                  sinks: torch.Tensor | None = None):
    """Attention of a varlen batch of query tokens over their sequences' paged K/V.

    The ``q_len_i = cu_seqlens_q[i+1] - cu_seqlens_q[i]`` query tokens of sequence ``i`` are the
    *last* ``q_len_i`` of its ``context_lens[i]`` tokens, already written into the cache; the
    causal mask is aligned bottom-right (query token ``t`` sees cache positions
    ``<= context_lens[i] - q_len_i + t``). One call serves whole prompts, chunked prefill,
    prefix-cache hits and decode rows (``q_len 1``) together.

    Memory: on Hopper, the triton backend copies the pages of a step of long queries (on
    average over 256 a sequence, and 1024 query rows: queries x query heads a KV head) into
    contiguous rows before attending, in a workspace of at most 512 MiB allocated for the
    call (:mod:`.prefill_gather`; never under CUDA-graph capture). The result is the same.

    Args:
        query: ``[total_q, num_q_heads, head_size]``, fp16 / bf16 / fp32.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]`` as in
            :func:`paged_decode` (the query's dtype or fp8).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        cu_seqlens_q: int32 ``[num_seqs + 1]``, cumulative query lengths, from 0 to total_q.
        context_lens: int32 ``[num_seqs]``, tokens in the cache per sequence (queries included).
        causal: mask cache positions after each query token (bottom-right aligned).
        scale, out, return_lse, backend: as in :func:`paged_decode` (lse is
            ``[total_q, num_q_heads]``).
        max_seqlen_q: None or a non-negative int, accepted for callers that know it
            (FlashAttention-style); unused: the triton launch schedules its tiles without a
            bound on ``q_len`` and needs no host sync either way.
        k_scale, v_scale: an fp8 cache's scales, as in :func:`paged_decode` (None = 1.0).
        window_size: ``(left, right)`` ints >= -1, FlashAttention's sliding window: query
            token ``t`` sits at position ``p = context_lens[i] - q_len_i + t`` and sees keys
            ``p - left .. p + right`` (-1: unbounded; ``causal`` clamps ``right`` to 0).
            Blocks wholly left of every query's window are never read.
        softcap, sinks: as in :func:`paged_decode`.

    Returns:
        ``out`` ``[total_q, num_q_heads, head_size]``, or ``(out, lse)`` when ``return_lse``.
    """
    key = None
    # max_seqlen_q is unused; checked here as the full path checks it, but not keyed on.
    variant = _variant_options(window_size, softcap)
    if backend != "torch" and variant is not None and (
            max_seqlen_q is None or (type(max_seqlen_q) is int and max_seqlen_q >= 0)):
        key = _call_key((query, key_cache, value_cache, block_tables, cu_seqlens_q,
                         context_lens, out, k_scale, v_scale, sinks),
                        (causal, scale, return_lse, backend, *variant))
        if key is not None:
            # A capture plans apart: it never copies the pages (see prefill_gather).
            key = (key, torch.cuda.is_current_stream_capturing())
        launch = _PREFILL_RUNS.get(key) if key is not None else None
        if launch is not None:
            out_, lse = outputs(query, out, return_lse, query.shape[0], query.shape[1])
            if launch((query, key_cache, value_cache,
                       *scale_pointers(key_cache, k_scale, v_scale), out_,
                       lse if return_lse else out_, block_tables, cu_seqlens_q, context_lens,
                       sinks if sinks is not None else query)):
                return (out_, lse) if return_lse else out_
    shapes = check_paged_prefill_args(query, key_cache, value_cache, block_tables,
                                      cu_seqlens_q, context_lens, scale, out)
    check_kv_scales(k_scale, v_scale, key_cache.dtype, shapes.num_kv_heads, query.device)
    window, softcap = check_variant(window_size, softcap, sinks, shapes.num_q_heads,
                                    query.device)
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    if max_seqlen_q is not None:
        non_negative_int("max_seqlen_q", max_seqlen_q)
    impl = backend_for_call(backend, query.device, shapes.head_size, query.dtype)
    out, lse, launch = impl.prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q,
                                    context_lens, shapes, causal=causal, out=out,
                                    return_lse=return_lse, max_seqlen_q=max_seqlen_q,
                                    k_scale=k_scale, v_scale=v_scale, window=window,
                                    softcap=softcap, sinks=sinks)
    if launch is not None and key is not None:
        _PREFILL_RUNS.put(key, launch)
    return (out, lse) if return_lse else out


def check_store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                   backend: str) -> str:
    """Check :func:`store_kv`'s arguments (shapes, dtypes and devices as documented there;
    the torch backend also reads the slots on the host and checks their range) before
    anything is written.

    Args:
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale: as in
            :func:`store_kv`.
        backend: "auto" | "torch" | "triton".

    Returns:
        The backend that runs the write, "torch" or "triton" (its object's ``op_backend``).

    Raises:
        ValueError: naming the first bad argument (``backend`` where the backend it names
            refuses the call, e.g. Triton on a CPU outside the interpreter).
    """
    return _checked_store_backend(key, value, key_cache, value_cache, slot_mapping, k_scale,
                                  v_scale, backend).op_backend


def _checked_store_backend(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                           backend: str) -> AttentionBackend:
    """:func:`check_store_kv`, returning the backend object that runs the write."""
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    num_blocks, block_size, num_kv_heads, head_size = check_cache_pair(
        key_cache, value_cache, key.dtype, key.device)
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=key.device)
    check_kv_scales(k_scale, v_scale, key_cache.dtype, num_kv_heads, key.device)
    expected = (key.shape[0], num_kv_heads, head_size)
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected} (num_tokens, num_kv_heads, "
                             f"head_size of the cache), got {tuple(t.shape)}")
    check_index_vector("slot_mapping", slot_mapping, dtypes=(torch.int32, torch.int64),
                       device=key.device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping: expected shape ({key.shape[0]},) (one slot per token), "
                         f"got {tuple(slot_mapping.shape)}")
    # A write attends over nothing: never the Hopper backend's (its writes are Triton's).
    impl = backend_for_call(backend, key.device, head_size, key.dtype, prefill=False)
    impl.check_store_slots(slot_mapping, num_blocks * block_size)
    return impl


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
             backend: str = "auto", k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write new tokens' K/V into the paged caches, in place.

    The write runs on the backend object :func:`~.attention.select.backend_for_call` picks
    for the call (the reference or Triton; the Hopper backend's writes are Triton's), once
    per call that misses the launch cache; on CUDA a repeat of an earlier call's shapes
    relaunches that call's prepared launch (see the module doc).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, fp16 / bf16 / fp32, in the
            caches' dtype, or any of these for an fp8 cache.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, any
            strides on the first three dims; ``torch.float8_e4m3fn`` (an fp8 cache) or the
            key's dtype.
        slot_mapping: int32 or int64 ``[num_tokens]``; token ``t`` goes to block
            ``slot // block_size``, offset ``slot % block_size``. Slot ``-1`` skips the token
            (padding); nothing else in the caches changes.
        backend: "auto" | "torch" | "triton" (the string the model layers pass; mapped to
            its backend object on a cache miss).
        k_scale, v_scale: for an fp8 cache, None (= 1.0) or float32 ``[]`` / ``[num_kv_heads]``
            on the key's device: the cache gets ``key / k_scale`` (and ``value / v_scale``)
            clamped to +-448 and rounded to nearest e4m3. A cache in the key's dtype takes None
            and gets the key as is.

    Raises:
        ValueError: bad shapes, dtypes, devices or scales, a backend that refuses the call
            (for the torch backend also slots out of range; the triton backend takes key
            and value with a contiguous last dim only), before anything is written.
    """
    key_ = None
    if backend != "torch":
        key_ = _call_key((key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale),
                         (backend,))
        launch = _STORE_RUNS.get(key_) if key_ is not None else None
        if launch is not None and launch((key, value, key_cache, value_cache,
                                          *scale_pointers(key_cache, k_scale, v_scale),
                                          slot_mapping)):
            return
    impl = _checked_store_backend(key, value, key_cache, value_cache, slot_mapping, k_scale,
                                  v_scale, backend)
    launch = impl.store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    if launch is not None and key_ is not None:
        _STORE_RUNS.put(key_, launch)


# BACKENDS, resolve_backend and triton_available live in .backend; re-exported here, where
# the engine and the models look for them.
__all__ = ["paged_decode", "paged_prefill", "store_kv", "check_store_kv", "resolve_backend",
           "triton_available", "BACKENDS", "PagedShapes"]
