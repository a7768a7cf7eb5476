"""Triton grouped GEMMs for the mixture-of-experts feed-forward (:func:`.moe.fused_moe`).

A token routed to ``k`` experts makes ``k`` *pairs*, pair ``p = token * k + slot``. The
routing plan (:func:`moe_routing_plan`, plain torch, no host sync) sorts the pairs by expert
and pads each expert's run to a multiple of ``BLOCK_M``, so an M tile of either GEMM holds the
pairs of one expert only and reads one expert's weights:

1. gate/up GEMM: ``inter[p] = act(w13[e] @ hidden[p // k] + b13[e])`` for each tile's pairs
   (``[P, I]``, model dtype), the gate and up columns of a tile accumulated side by side so the
   activation runs in registers;
2. down GEMM: ``down[p] = topk_weight[p] * (w2[e] @ inter[p] + b2[e])`` (``[P, H]``);
3. ``out[t] = sum_j down[t * k + j]`` (float32 sum, one rounding).

Grids are sized for the worst padding, ``P + min(E, P) * (BLOCK_M - 1)`` rows, and tiles past
the last expert's run exit at once: the launch never waits on the plan, so it can be captured
in a CUDA graph. Arguments are validated by :func:`.moe.fused_moe`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..core.args import cdiv, next_pow2
from .launch import launch
from .moe import MoeActivation


@dataclass(frozen=True)
class MoeRoutingPlan:
    """The pairs of a call grouped by expert, each group padded to ``block_m`` rows.

    Attributes:
        sorted_pairs: int32 ``[num_blocks * block_m]``: pair ids grouped by expert (in pair
            order within an expert); padding rows hold ``num_pairs``.
        block_expert: int32 ``[num_blocks]``: the expert of each M tile; ``num_experts`` for
            tiles past the last group (they do nothing).
        num_pairs: ``T * k``.
        block_m: rows per M tile.
    """
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_pairs: int
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def moe_routing_plan(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeRoutingPlan:
    """Group the pairs of ``topk_ids`` (int32 ``[T, k]``) by expert, padded to ``block_m``.

    Torch ops only, none of which reads a value back to the host."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    expert_of_pair = flat.long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = torch.sort(expert_of_pair, stable=True).indices       # [P] pairs by expert
    sorted_expert = expert_of_pair[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - start[sorted_expert]
    dest = padded_start[sorted_expert] + rank_in_expert
    max_rows = cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, dtype=torch.int64, device=device)
    # Tile b belongs to the expert whose padded run [start, end) holds b * block_m: the number
    # of runs ending at or before it (empty runs end where they start and are skipped).
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return MoeRoutingPlan(sorted_pairs, block_expert, num_pairs, block_m)


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes of the two GEMMs (powers of two >= 16)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def moe_tiles(num_pairs: int, num_experts: int, hidden_size: int, inter: int) -> MoeTiles:
    """Tiles for a call: ``block_m`` near the mean number of pairs per expert (small batches
    waste less padding), ``block_n`` / ``block_k`` capped by the matrix sizes."""
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    block_n = max(16, min(64, next_pow2(min(hidden_size, inter))))
    block_k = max(16, min(64, next_pow2(min(hidden_size, inter))))
    return MoeTiles(block_m, block_n, block_k, num_warps=4 if block_m <= 32 else 8)


@triton.jit
def _moe_gate_up_kernel(
    hidden_ptr, w13_ptr, b13_ptr, inter_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, num_experts, stride_hidden, stride_w13_e, stride_w13_row, stride_b13_e,
    stride_inter, alpha, limit,
    TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
    ROW_STEP: tl.constexpr, UP_OFFSET: tl.constexpr, CLAMPED: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid ``(num_blocks, cdiv(INTER, BLOCK_N))``: the activated gate/up columns of one M
    tile (pairs of one expert). Gate column ``j`` is w13 row ``j * ROW_STEP``, up column ``j``
    row ``j * ROW_STEP + UP_OFFSET`` (halves: 1, INTER; interleaved: 2, 1)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows).to(tl.int64)                      # [BLOCK_M]
    row_mask = pairs < num_pairs
    tokens = pairs // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                              # [BLOCK_N]
    col_mask = cols < INTER
    w_base = w13_ptr + expert * stride_w13_e
    gate_rows = cols * ROW_STEP
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)                   # [BLOCK_M, BLOCK_N]
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)                     # [BLOCK_M, BLOCK_N]
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < HIDDEN
        a_mask = row_mask[:, None] & k_mask[None, :]
        a = tl.load(hidden_ptr + tokens[:, None] * stride_hidden + ks[None, :],
                    mask=a_mask, other=0.0)                                    # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_gate = tl.load(w_base + gate_rows[None, :] * stride_w13_row + ks[:, None],
                         mask=w_mask, other=0.0)                               # [BLOCK_K, BLOCK_N]
        w_up = tl.load(w_base + (gate_rows + UP_OFFSET)[None, :] * stride_w13_row + ks[:, None],
                       mask=w_mask, other=0.0)                                 # [BLOCK_K, BLOCK_N]
        acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        b_base = b13_ptr + expert * stride_b13_e
        acc_gate += tl.load(b_base + gate_rows, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_base + gate_rows + UP_OFFSET, mask=col_mask,
                          other=0.0).to(tl.float32)[None, :]
    if CLAMPED:
        gate = tl.minimum(acc_gate, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))                    # [BLOCK_M, BLOCK_N]
    else:
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up                          # [BLOCK_M, BLOCK_N]
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(inter_ptr + pairs[:, None] * stride_inter + cols[None, :],
             act.to(inter_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _moe_down_kernel(
    inter_ptr, w2_ptr, b2_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, num_experts, stride_inter, stride_w2_e, stride_w2_row, stride_b2_e, stride_out,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(num_blocks, cdiv(HIDDEN, BLOCK_N))``: ``weight[p] * (w2[e] @ inter[p] + b2[e])``
    for the pairs of one M tile, written to their rows of ``out`` ``[P, HIDDEN]``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows).to(tl.int64)                      # [BLOCK_M]
    row_mask = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                              # [BLOCK_N]
    col_mask = cols < HIDDEN
    w_base = w2_ptr + expert * stride_w2_e
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)                        # [BLOCK_M, BLOCK_N]
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < INTER
        a_mask = row_mask[:, None] & k_mask[None, :]
        a = tl.load(inter_ptr + pairs[:, None] * stride_inter + ks[None, :],
                    mask=a_mask, other=0.0)                                    # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(w_base + cols[None, :] * stride_w2_row + ks[:, None],
                    mask=w_mask, other=0.0)                                    # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b2_ptr + expert * stride_b2_e + cols, mask=col_mask,
                       other=0.0).to(tl.float32)[None, :]
    weight = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)             # [BLOCK_M]
    acc = acc * weight[:, None]
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + pairs[:, None] * stride_out + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def triton_fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     activation: MoeActivation, w13_bias: torch.Tensor | None,
                     w2_bias: torch.Tensor | None, tiles: MoeTiles | None = None) -> torch.Tensor:
    """The Triton path of :func:`.moe.fused_moe` (arguments already checked; topk tensors
    contiguous): hidden ``[T, H]``, w13 ``[E, 2I, H]``, w2 ``[E, H, I]``, topk_weights
    float32 ``[T, k]``, topk_ids int32 ``[T, k]`` -> ``[T, H]`` in hidden's dtype."""
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    tiles = tiles or moe_tiles(num_pairs, num_experts, hidden_size, inter)
    plan = moe_routing_plan(topk_ids, num_experts, tiles.block_m)
    dtype, device = hidden.dtype, hidden.device
    # float32 (the correctness path) multiplies in full precision, not tf32.
    options = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                   DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                   num_warps=tiles.num_warps, num_stages=tiles.num_stages)

    inter_out = torch.empty(num_pairs, inter, dtype=dtype, device=device)      # [P, I]
    row_step, up_offset = (2, 1) if activation.interleaved else (1, inter)
    b13 = w13_bias if w13_bias is not None else w13      # never read without HAS_BIAS
    launch(_moe_gate_up_kernel, (plan.num_blocks, cdiv(inter, tiles.block_n)), (
        hidden, w13, b13, inter_out, plan.sorted_pairs, plan.block_expert,
        num_pairs, num_experts, hidden.stride(0), w13.stride(0), w13.stride(1),
        b13.stride(0), inter_out.stride(0), float(activation.alpha), float(activation.limit)),
        dict(TOP_K=top_k, HIDDEN=hidden_size, INTER=inter, ROW_STEP=row_step,
             UP_OFFSET=up_offset, CLAMPED=activation.kind == "clamped_swiglu",
             HAS_BIAS=w13_bias is not None, **options))

    down = torch.empty(num_pairs, hidden_size, dtype=dtype, device=device)     # [P, H]
    b2 = w2_bias if w2_bias is not None else w2
    launch(_moe_down_kernel, (plan.num_blocks, cdiv(hidden_size, tiles.block_n)), (
        inter_out, w2, b2, topk_weights, down, plan.sorted_pairs, plan.block_expert,
        num_pairs, num_experts, inter_out.stride(0), w2.stride(0), w2.stride(1),
        b2.stride(0), down.stride(0)),
        dict(HIDDEN=hidden_size, INTER=inter, HAS_BIAS=w2_bias is not None, **options))
    if top_k == 1:
        return down
    # A half-precision sum accumulates in float32 and rounds once.
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1)


__all__ = ["MoeRoutingPlan", "MoeTiles", "moe_routing_plan", "moe_tiles", "triton_fused_moe"]
