"""Paged prefill through a contiguous copy of the pages (Hopper).

The prefill kernel reads contiguous K/V through tensor descriptors (the copy engine fills
shared memory ahead of the warps), but paged K/V only through pointer loads, markedly slower:
a 128-token K/V tile spans eight 16-token blocks in random places, which Triton 3.6 cannot
fetch as one box. When a step's queries are long enough, copying each sequence's pages into
contiguous rows first and running the contiguous kernel over them is faster: the copy reads
and writes the sequences' K/V once (a small share of the attention's time at 512 queries a
sequence, less for longer ones), and the attention then runs at the contiguous rate
(docs/performance-notes.md, "Paged K/V by copy" and "Figures behind the code's rules").

The copy (``_gather_kv_kernel``) writes sequence ``i``'s ``context_lens[i]`` tokens to rows
``cu_k[i] ...`` of K and V buffers ``[rows, num_kv_heads, head_size]`` in the query's dtype
(an fp8 cache is widened exactly; its scales still apply in the attention), and the int32
``cu_k`` itself (the exclusive prefix sum of ``context_lens``), so nothing is read on the
host. ``rows`` is the bound the block table gives (``num_seqs * width * block_size``); the
attention masks rows past each sequence's keys. The three live in one workspace allocated
per call and freed once the launches are queued: :data:`GATHER_MAX_BYTES` bounds it, and the
engine reserves the largest its steps can take beside its KV pool
(:func:`gather_reserve_bytes`).

On an H100 / H200 the Hopper kernel (:mod:`.prefill_hopper`, Gluon) copies each block into
its tile itself, so the copy here serves what it leaves: an fp8 cache (widened by the copy)
and blocks under 8 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..core.args import next_pow2
from .launch import PreparedLaunch
from .prefill_plan import default_config, hopper_prefill_runs_on

GATHER_MIN_Q_LEN = 256
"""Average query tokens a sequence above which the copy may pay. A prefill graph's step (two
sequences, at most 512 tokens) never averages more, so its eager warm-up compiles the
launches its capture makes."""

GATHER_MIN_ROWS = 1024
"""Average query rows a sequence (query tokens x query heads per KV head) above which the copy
pays: the copy moves each KV head's rows once, the attention's work on them grows with the
queries and with the query heads that share them, so the bound counts rows, not tokens:
with 2 query heads a KV head the copy starts above 512 tokens (the break-even measured:
docs/performance-notes.md, "Figures behind the code's rules")."""

GATHER_MAX_BYTES = 512 << 20
"""The largest workspace a call allocates for the copy; larger steps read the pages in
place."""

_TILE_ELEMENTS = 8192   # elements a program copies per iteration (K and V each)


@dataclass(frozen=True)
class GatherLayout:
    """Where the copy's K rows, V rows and ``cu_k`` sit in one byte workspace.

    rows: K/V rows each buffer holds (``num_seqs * width * block_size``).
    row_bytes: bytes of one row (``num_kv_heads * head_size`` elements of the query's dtype).
    """

    num_seqs: int
    rows: int
    row_bytes: int

    @property
    def v_offset(self) -> int:
        return self.rows * self.row_bytes

    @property
    def cu_offset(self) -> int:
        return 2 * self.rows * self.row_bytes

    @property
    def nbytes(self) -> int:
        return self.cu_offset + 4 * (self.num_seqs + 1)

    def views(self, workspace: torch.Tensor, num_kv_heads: int, head_size: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k ``[rows, num_kv_heads, head_size]``, v (same), cu_k int32 ``[num_seqs + 1]``)
        over a uint8 ``workspace`` of :attr:`nbytes`."""
        kv = workspace[:self.cu_offset].view(dtype).view(2, self.rows, num_kv_heads, head_size)
        return kv[0], kv[1], workspace[self.cu_offset:self.nbytes].view(torch.int32)


def gather_layout(num_seqs: int, width: int, block_size: int, num_kv_heads: int,
                  head_size: int, dtype: torch.dtype) -> GatherLayout:
    """The workspace of a step of ``num_seqs`` sequences over a ``width``-block table."""
    return GatherLayout(num_seqs, num_seqs * width * block_size,
                        num_kv_heads * head_size * dtype.itemsize)


def copy_pays(total_q: int, num_seqs: int, group_size: int, window_left: int,
              dtype: torch.dtype, heads_adjacent: bool, workspace_bytes: int) -> bool:
    """The shape side of :func:`should_gather`: on average more than :data:`GATHER_MIN_Q_LEN`
    queries and :data:`GATHER_MIN_ROWS` rows a sequence (``group_size``: query heads a KV
    head), no left window (the copy would move the whole context to read a window of it),
    fp16/bf16, each cached token's heads adjacent (one row to copy) and a workspace of at most
    :data:`GATHER_MAX_BYTES`."""
    return (num_seqs > 0 and total_q > GATHER_MIN_Q_LEN * num_seqs
            and total_q * group_size > GATHER_MIN_ROWS * num_seqs and window_left < 0
            and dtype in (torch.float16, torch.bfloat16) and heads_adjacent
            and workspace_bytes <= GATHER_MAX_BYTES)


def _copy_runs_on(device: torch.device, head_size: int, dtype: torch.dtype) -> bool:
    """Whether the contiguous prefill on ``device`` loads through tensor descriptors for this
    head size and dtype (Hopper or newer; :func:`~.prefill_plan.default_config`'s tiles for
    whole prompts)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return default_config(head_size, dtype, device, None, contiguous=True).tma


def heads_adjacent(cache: torch.Tensor) -> bool:
    """Whether each token's heads of ``cache`` ``[blocks, block_size, heads, head_size]`` are
    one contiguous row (what the copy reads)."""
    return cache.stride(3) == 1 and cache.stride(2) == cache.shape[3]


def should_gather(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  num_seqs: int, width: int, window_left: int) -> bool:
    """Whether a triton paged prefill copies the pages first: where :func:`copy_pays` for
    its shapes, on a GPU whose contiguous prefill loads through tensor descriptors, and not
    under CUDA-graph capture (a graph would keep its workspace for as long as it lives)."""
    total_q, num_q_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    layout = gather_layout(num_seqs, width, key_cache.shape[1], num_kv_heads, head_size,
                           query.dtype)
    return (copy_pays(total_q, num_seqs, num_q_heads // num_kv_heads, window_left, query.dtype,
                      heads_adjacent(key_cache) and heads_adjacent(value_cache), layout.nbytes)
            and _copy_runs_on(query.device, head_size, query.dtype)
            and not torch.cuda.is_current_stream_capturing())


def gather_reserve_bytes(device: torch.device, *, max_num_seqs: int, width: int,
                         block_size: int, num_kv_heads: int, head_size: int,
                         dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> int:
    """Memory a caller that sizes its KV pool from a profiled step (the engine) leaves free
    for the copy's workspace: the largest one a step of at most ``max_num_seqs`` sequences
    over ``width``-block tables can take (at most :data:`GATHER_MAX_BYTES`), or 0 where the
    copy never runs (the device, head size or dtype, or a cache in ``dtype`` whose pages the
    Hopper kernel reads in place). ``dtype``: the queries'; ``cache_dtype``: the cache's
    (default ``dtype``; an fp8 cache is widened into ``dtype`` by the copy)."""
    if dtype not in (torch.float16, torch.bfloat16) or not _copy_runs_on(device, head_size,
                                                                        dtype):
        return 0
    if (cache_dtype in (None, dtype)
            and hopper_prefill_runs_on(device, head_size, dtype, block_size)):
        return 0
    largest = gather_layout(max_num_seqs, width, block_size, num_kv_heads, head_size, dtype)
    return min(largest.nbytes, GATHER_MAX_BYTES)


@triton.jit
def _gather_kv_kernel(
    key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr, k_out_ptr, v_out_ptr,
    cu_k_ptr, num_seqs, max_len, stride_kb, stride_kt, stride_vb, stride_vt, stride_bt,
    ROW: tl.constexpr, ROW_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr, SEQ_CHUNK: tl.constexpr,
):
    # Program (j, i) copies block j of sequence i: ROW = num_kv_heads * head_size elements a
    # token (adjacent in the cache), TOKENS tokens an iteration. Its rows start at
    # cu_k[i] = context_lens[0] + ... + context_lens[i - 1], summed here; program (0, i)
    # also writes cu_k[i + 1] (and program (0, 0) cu_k[0]) for the attention launch after it.
    # Lengths are clamped to the table's max_len = width * BLOCK_SIZE tokens: a length past
    # it (unchecked on this path) must not move any row past the workspace.
    j = tl.program_id(0)
    seq = tl.program_id(1)
    n = tl.minimum(tl.load(context_lens_ptr + seq), max_len)
    start = 0
    for s0 in range(0, seq, SEQ_CHUNK):
        offs = s0 + tl.arange(0, SEQ_CHUNK)                                  # [SEQ_CHUNK]
        lens = tl.load(context_lens_ptr + offs, mask=offs < seq, other=0)    # [SEQ_CHUNK]
        start += tl.sum(tl.minimum(lens, max_len), axis=0)
    if j == 0:
        tl.store(cu_k_ptr + seq + 1, start + n)
        if seq == 0:
            tl.store(cu_k_ptr, 0)
    if j * BLOCK_SIZE >= n:
        return
    block = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + j).to(tl.int64)
    col = tl.arange(0, ROW_PADDED)                                           # [ROW_PADDED]
    col_valid = col < ROW
    for t0 in range(0, BLOCK_SIZE, TOKENS):
        tok = t0 + tl.arange(0, TOKENS)                                      # [TOKENS]
        valid = ((tok < BLOCK_SIZE) & (j * BLOCK_SIZE + tok < n))[:, None] & col_valid[None, :]
        dst = ((start + j * BLOCK_SIZE + tok).to(tl.int64) * ROW)[:, None] + col[None, :]
        k = tl.load(key_cache_ptr + block * stride_kb + tok[:, None] * stride_kt + col[None, :],
                    mask=valid)                                              # [TOKENS, ROW_PADDED]
        tl.store(k_out_ptr + dst, k.to(k_out_ptr.dtype.element_ty), mask=valid)
        v = tl.load(value_cache_ptr + block * stride_vb + tok[:, None] * stride_vt
                    + col[None, :], mask=valid)                              # [TOKENS, ROW_PADDED]
        tl.store(v_out_ptr + dst, v.to(v_out_ptr.dtype.element_ty), mask=valid)


def prepare_gather(key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_tables: torch.Tensor, context_lens: torch.Tensor, k_out: torch.Tensor,
                   v_out: torch.Tensor, cu_k: torch.Tensor) -> PreparedLaunch:
    """Copy the sequences' pages into ``k_out`` / ``v_out`` and their row starts into
    ``cu_k`` (launched now; repeatable with tensors in this order, see :mod:`.launch`).

    Args:
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, each
            token's heads adjacent (``stride(2) == head_size``, ``stride(3) == 1``).
        block_tables: int32 ``[num_seqs, width]``, last dim contiguous.
        context_lens: int32 ``[num_seqs]``, at most ``width * block_size`` each (longer
            ones are copied as that many, and ``cu_k`` counts them so).
        k_out, v_out: contiguous ``[rows, num_kv_heads, head_size]`` in the query's dtype,
            ``rows >= sum(context_lens)``.
        cu_k: int32 ``[num_seqs + 1]``, written.
    """
    num_seqs, width = block_tables.shape
    _, block_size, num_kv_heads, head_size = key_cache.shape
    row = num_kv_heads * head_size
    row_padded = next_pow2(row)
    tokens = max(1, min(next_pow2(block_size), _TILE_ELEMENTS // row_padded))
    return PreparedLaunch(_gather_kv_kernel, (width, num_seqs), (
        key_cache, value_cache, block_tables, context_lens, k_out, v_out, cu_k, num_seqs,
        width * block_size, key_cache.stride(0), key_cache.stride(1), value_cache.stride(0),
        value_cache.stride(1), block_tables.stride(0)), dict(
        ROW=row, ROW_PADDED=row_padded, BLOCK_SIZE=block_size, TOKENS=tokens,
        SEQ_CHUNK=min(1024, max(16, next_pow2(num_seqs))),
        num_warps=8 if tokens * row_padded >= 4096 else 4))


class GatheredPrefill:
    """A repeatable paged prefill by copy: the copy's launch and the contiguous attention's
    (both ready, see :mod:`.launch`), over a workspace allocated per call (see the module doc).

    Called like the paged prefill's own launch (:func:`~.prefill.triton_paged_prefill`), with
    the tensors ``(query, key_cache, value_cache, k_scale or key_cache, v_scale or key_cache,
    out, lse or out, block_tables, cu_seqlens_q, context_lens, sinks or query)``.
    """

    def __init__(self, gather: PreparedLaunch, attend: PreparedLaunch, layout: GatherLayout,
                 scaled: tuple[bool, bool]) -> None:
        self.gather, self.attend, self.layout, self.scaled = gather, attend, layout, scaled

    def __call__(self, tensors) -> bool:
        """Launch both for ``tensors``; False (nothing left in flight that matters: the
        caller's full path recomputes) if a pointer's alignment differs from the prepared
        one."""
        q, kc, vc, ks, vs, out, lse, tables, cu_q, ctx, sinks = (t.data_ptr() for t in tensors)
        layout = self.layout
        workspace = torch.empty(layout.nbytes, dtype=torch.uint8, device=tensors[0].device)
        k, v = workspace.data_ptr(), workspace.data_ptr() + layout.v_offset
        cu_k = k + layout.cu_offset
        stream = self.gather.stream()
        return (self.gather.launch_checked((kc, vc, tables, ctx, k, v, cu_k), stream)
                and self.attend.launch_checked(
                    (q, k, v, ks if self.scaled[0] else k, vs if self.scaled[1] else k, out, lse,
                     cu_k, cu_q, cu_k, sinks), stream))


__all__ = ["GATHER_MAX_BYTES", "GATHER_MIN_Q_LEN", "GATHER_MIN_ROWS", "GatherLayout",
           "GatheredPrefill", "copy_pays", "gather_layout", "gather_reserve_bytes",
           "heads_adjacent", "prepare_gather", "should_gather"]
