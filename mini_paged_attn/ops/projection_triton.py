"""Triton kernel for projections at decode sizes: ``x @ W^T`` tiles computed as ``W @ x^T``.

At a decode step's few rows a projection reads its weight once and does little else, and
cuBLAS's GEMM takes several microseconds more than those reads (``docs/performance-notes.md``,
"Where a whole run of (a) goes"). This kernel streams the weight in ``[BLOCK_N, BLOCK_K]``
tiles that fill the MMA's 64-row side, with the batch's rows on its narrow side, and launches
as a programmatic dependent (:mod:`.pdl`), as the decoder's other kernels do: its programs are
resident before the previous kernel ends. Where a layer has few output tiles (``o_proj``,
``down_proj``) the reduction over K is split (``SPLIT_K``) to fill the GPU: each program parks
its float32 partial sums, and the last of a tile's programs (an atomic ticket) adds all of them
in split order, so results do not depend on which program finishes last.

``GATED``: the weight is ``[2 * N, K]``, SwiGLU's gate rows then up rows (``GatedMLP``'s
``gate_up_proj``), and the kernel returns ``silu(gate) * up`` with the rounding of the
reference (each projection rounded to the dtype, the SiLU rounded, then the product), and
the ``[rows, 2 * N]`` intermediate is never written. (The order of the roundings is the
reference's; the hardware's exp and division may still move a result by an ulp.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .pdl import wait_for_previous


@triton.jit
def _tile_products(x_rows, m_ok, a_rows, b_rows, n_ok, k_start, k_end,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, STAGES: tl.constexpr, PAIRED: tl.constexpr,
                   PRECISION: tl.constexpr):
    """``W[a_rows] @ x^T`` over columns ``k_start .. k_end`` (and ``W[b_rows] @ x^T`` when
    PAIRED), float32 ``[BLOCK_N, BLOCK_M]`` each."""
    cols = tl.arange(0, BLOCK_K)
    acc_a = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_b = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        k_ok = (k + cols < k_end) | EVEN_K                                   # [BLOCK_K]
        x_mask = m_ok[:, None] & k_ok[None, :]
        w_mask = n_ok[:, None] & k_ok[None, :]
        x = tl.load(x_rows + (k + cols)[None, :], mask=x_mask, other=0.0)    # [BLOCK_M, BLOCK_K]
        a = tl.load(a_rows + (k + cols)[None, :], mask=w_mask, other=0.0)    # [BLOCK_N, BLOCK_K]
        acc_a = tl.dot(a, tl.trans(x), acc_a, input_precision=PRECISION)     # [BLOCK_N, BLOCK_M]
        if PAIRED:
            b = tl.load(b_rows + (k + cols)[None, :], mask=w_mask, other=0.0)
            acc_b = tl.dot(b, tl.trans(x), acc_b, input_precision=PRECISION)
    return acc_a, acc_b


@triton.jit
def _sum_splits(acc_a, acc_b, part_ptr, counter_ptr, tile, num_tiles, split,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
                PAIRED: tl.constexpr):
    """Split-K: park this program's sums, take a ticket; the tile's last program returns
    ``is_last`` with every split's sums added in split order (and sets the counter back to
    0). Unsplit: the sums themselves, ``is_last`` True."""
    if SPLIT_K == 1:
        return acc_a, acc_b, True
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [BLOCK_N, BLOCK_M]
    TILE: tl.constexpr = BLOCK_N * BLOCK_M * (2 if PAIRED else 1)
    mine = part_ptr + (split * num_tiles + tile).to(tl.int64) * TILE
    tl.store(mine + offs, acc_a)
    if PAIRED:
        tl.store(mine + BLOCK_N * BLOCK_M + offs, acc_b)
    # Every thread's partial is stored before the ticket that publishes it (release).
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
    is_last = ticket == SPLIT_K - 1
    if is_last:
        acc_a = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for s in range(SPLIT_K):
            part = part_ptr + (s * num_tiles + tile).to(tl.int64) * TILE
            acc_a += tl.load(part + offs, cache_modifier=".cg")          # [BLOCK_N, BLOCK_M]
            if PAIRED:
                acc_b += tl.load(part + BLOCK_N * BLOCK_M + offs, cache_modifier=".cg")
        tl.store(counter_ptr + tile, 0)
    return acc_a, acc_b, is_last


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K)``: output columns
    ``pid_n * BLOCK_N ..`` of rows ``pid_m * BLOCK_M ..``, over split ``pid_k``'s share of K
    (``K / SPLIT_K`` columns, a multiple of BLOCK_K when split)."""
    wait_for_previous(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                        # [BLOCK_N]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                        # [BLOCK_M]
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_len = K // SPLIT_K
    acc_a, acc_b = _tile_products(
        x_ptr + offs_m[:, None].to(tl.int64) * stride_xm, m_ok,
        w_ptr + offs_n[:, None].to(tl.int64) * stride_wn,
        w_ptr + (offs_n + N)[:, None].to(tl.int64) * stride_wn, n_ok,
        split * k_len, split * k_len + k_len, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K, STAGES,
        GATED, PRECISION)
    acc_a, acc_b, is_last = _sum_splits(
        acc_a, acc_b, part_ptr, counter_ptr, pid_m * tl.num_programs(0) + pid_n,
        tl.num_programs(0) * tl.num_programs(1), split, BLOCK_N, BLOCK_M, SPLIT_K, GATED)
    if is_last:
        dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc_a += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            if GATED:
                acc_b += tl.load(bias_ptr + N + offs_n, mask=n_ok,
                                 other=0.0).to(tl.float32)[:, None]
        if GATED:   # the reference's roundings: each projection, the SiLU, the product
            gate = acc_a.to(dtype).to(tl.float32)                           # [BLOCK_N, BLOCK_M]
            up = acc_b.to(dtype).to(tl.float32)                             # [BLOCK_N, BLOCK_M]
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
            acc_a = act.to(tl.float32) * up
        out = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out, acc_a.to(dtype), mask=n_ok[:, None] & m_ok[None, :])


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  gated: bool, plan, partials: torch.Tensor | None,
                  counters: torch.Tensor | None) -> torch.Tensor:
    """x ``[M, K]`` (K > 0), weight ``[N, K]`` (``[2 * N, K]`` gated), both last dim
    contiguous, bias None or contiguous ``[N]`` (``[2 * N]``) -> new ``[M, N]`` in x's
    dtype, launched by ``plan`` (:func:`~.projection.plan_linear`'s, whose split fits
    ``partials`` / ``counters``, the split-K scratch, None when unsplit)."""
    rows, in_features = x.shape
    out_features = weight.shape[0] // (2 if gated else 1)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return out
    grid = (triton.cdiv(out_features, plan.block_n), triton.cdiv(rows, plan.block_m),
            plan.split_k)
    if plan.split_k > 1:
        tiles = grid[0] * grid[1]
        assert tiles <= counters.numel() and (
            plan.split_k * tiles * plan.block_n * plan.block_m * (2 if gated else 1)
            <= partials.numel()), "the plan's split does not fit its scratch"
    # Stand-ins for pointers a launch never reads keep the tensors first (see .launch).
    launch(_linear_kernel, grid, (
        x, weight, bias if bias is not None else x, out,
        partials if plan.split_k > 1 else out, counters if plan.split_k > 1 else out,
        rows, out_features, in_features, x.stride(0), weight.stride(0), out.stride(0)), dict(
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        SPLIT_K=plan.split_k, EVEN_K=in_features % (plan.block_k * plan.split_k) == 0,
        GATED=gated, HAS_BIAS=bias is not None, STAGES=plan.stages,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=plan.num_warps))
    return out
