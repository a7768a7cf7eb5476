"""Triton kernels for the decoder's elementwise work: RMSNorm (with the residual add), rotary
embedding of q and k, SiLU-and-mul. One launch each instead of the 5-15 small kernels eager
PyTorch runs for the same arithmetic.

Every kernel reproduces the rounding of the torch reference in :mod:`.fused` (statistics in
float32; where the reference rounds an intermediate to the model dtype, the kernel rounds it
too), so results agree to the last bit up to the order of the float32 sum and the hardware's
rsqrt/exp. Arguments are validated by the public functions in :mod:`.fused`; launches read
nothing on the host (CUDA-graph capturable). Each kernel's ``PDL`` makes it a programmatic
dependent launch on sm_90+ (see :mod:`.pdl`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.args import cdiv
from .fused import KVWrite
from .kv_quant import is_fp8, scale_pointers, scale_stride
from .kv_write import store_kv_rows
from .launch import launch
from .pdl import wait_for_previous


def _num_warps(block: int) -> int:
    return 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, heads,
    stride_x_token, stride_x_head, stride_res, stride_res_out, eps,
    DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(rows,)``; row ``i`` is head ``i % heads`` of token ``i // heads``. The output is
    contiguous ``[rows, DIM]``; with a residual, ``heads == 1``."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    token = row // heads
    head = row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < DIM
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + token * stride_x_token + head * stride_x_head + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # The sum is rounded to the model dtype first: it is the residual stream, and the
        # reference normalises the rounded value.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / DIM + eps)
    y = (xf * rstd).to(dtype)                         # cast before the weight, as HF does
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * DIM + cols, (w.to(tl.float32) * y.to(tl.float32)).to(dtype), mask=mask)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: ``[n, dim]`` or ``[n, heads, dim]`` (last dim contiguous, any other strides);
    residual: None or ``[n, dim]``. Returns (normed contiguous like x, ``x + residual`` or None)."""
    dim = x.shape[-1]
    if x.dim() == 2:
        rows, heads, stride_token, stride_head = x.shape[0], 1, x.stride(0), 0
    else:
        rows, heads = x.shape[0] * x.shape[1], x.shape[1]
        stride_token, stride_head = x.stride(0), x.stride(1)
    # empty_like over empty(shape, dtype, device): about half the allocation's host time
    # (docs/performance-notes.md, "Host time per call").
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = (None if residual is None
               else torch.empty_like(x, memory_format=torch.contiguous_format))
    if rows == 0:
        return out, res_out
    block = triton.next_power_of_2(dim)
    launch(_rms_norm_kernel, (rows,), (
        x, residual if residual is not None else x, weight, out,
        res_out if res_out is not None else out, heads,
        stride_token, stride_head,
        residual.stride(0) if residual is not None else 0,
        res_out.stride(0) if res_out is not None else 0, eps), dict(
        DIM=dim, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=_num_warps(block)))
    return out, res_out


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, w_ptr, eps, stride_head, num_heads, heads, dims, rest,
                  cos, sin, HALF: tl.constexpr, HEAD_SIZE: tl.constexpr, HAS_REST: tl.constexpr,
                  NORM: tl.constexpr):
    """Rotate the (d, d + HALF) pairs of the first ``2 * HALF`` dims of ``num_heads`` heads
    read at ``src_ptr`` (head stride ``stride_head``) into contiguous heads of ``HEAD_SIZE`` at
    ``dst_ptr``; with ``HAS_REST`` (a partial rotary) the dims from ``2 * HALF`` on (``rest``)
    are copied. With ``NORM``, RMSNorm each whole head (weight ``w_ptr`` ``[HEAD_SIZE]``)
    first. Each product and the sum are rounded to the model dtype like the reference's
    ``x1 * cos - x2 * sin``. Returns the parts as stored: the rotated halves
    ``[HEADS_PADDED, HALF_PADDED]`` each and the rest ``[HEADS_PADDED, REST_PADDED]`` (without
    ``HAS_REST``, the low half again: a placeholder nobody reads)."""
    dtype = dst_ptr.dtype.element_ty
    head_ok = heads[:, None] < num_heads
    mask = head_ok & (dims[None, :] < HALF)
    rest_mask = head_ok & (rest[None, :] < HEAD_SIZE - 2 * HALF)
    src = src_ptr + heads[:, None] * stride_head
    x1 = tl.load(src + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_REST:
        xr = tl.load(src + 2 * HALF + rest[None, :], mask=rest_mask,
                     other=0.0).to(tl.float32)              # [HEADS_PADDED, REST_PADDED]
    if NORM:   # the rounding of rms_norm_reference: cast, times the weight, cast
        sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if HAS_REST:
            sum_sq += tl.sum(xr * xr, axis=1)
        rstd = tl.rsqrt(sum_sq / HEAD_SIZE + eps)[:, None]
        w1 = tl.load(w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if HAS_REST:
            wr = tl.load(w_ptr + 2 * HALF + rest, mask=rest < HEAD_SIZE - 2 * HALF,
                         other=0.0).to(tl.float32)[None, :]
            xr = (wr * (xr * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    a = (x1 * cos).to(dtype).to(tl.float32)
    b = (x2 * sin).to(dtype).to(tl.float32)
    c = (x2 * cos).to(dtype).to(tl.float32)
    d = (x1 * sin).to(dtype).to(tl.float32)
    lo = (a - b).to(dtype)                              # [HEADS_PADDED, HALF_PADDED]
    hi = (c + d).to(dtype)                              # [HEADS_PADDED, HALF_PADDED]
    dst = dst_ptr + heads[:, None] * HEAD_SIZE
    tl.store(dst + dims[None, :], lo, mask=mask)
    tl.store(dst + HALF + dims[None, :], hi, mask=mask)
    kept = lo
    if HAS_REST:
        kept = xr.to(dtype)                             # [HEADS_PADDED, REST_PADDED]
        tl.store(dst + 2 * HALF + rest[None, :], kept, mask=rest_mask)
    return lo, hi, kept


@triton.jit
def _store_kv_part(k_part, cols, v_row, key_cache_ptr, value_cache_ptr, k_scale_ptr,
                   v_scale_ptr, stride_k_scale, stride_v_scale, slot, num_slots, heads,
                   stride_kc_block, stride_kc_token, stride_kc_head,
                   stride_vc_block, stride_vc_token, stride_vc_head,
                   START: tl.constexpr, WIDTH: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, QUANTIZE: tl.constexpr, K_SCALED: tl.constexpr,
                   V_SCALED: tl.constexpr):
    """Write dims ``START .. START + WIDTH`` of one token's KV heads into the caches: the
    rotated keys ``k_part`` (``[HEADS_PADDED, len(cols)]``, dims ``START + cols``) and the
    values at ``v_row`` (``[HEADS_PADDED, 1]`` pointers to each head's first value dim)."""
    store_kv_rows(k_part, key_cache_ptr + START, k_scale_ptr, stride_k_scale, slot, num_slots,
                  heads, cols, stride_kc_block, stride_kc_token, stride_kc_head, NUM_KV_HEADS,
                  WIDTH, BLOCK_SIZE, QUANTIZE, K_SCALED)
    v_mask = (heads[:, None] < NUM_KV_HEADS) & (cols[None, :] < WIDTH)
    v_part = tl.load(v_row + START + cols[None, :], mask=v_mask)      # like k_part
    store_kv_rows(v_part, value_cache_ptr + START, v_scale_ptr, stride_v_scale, slot, num_slots,
                  heads, cols, stride_vc_block, stride_vc_token, stride_vc_head, NUM_KV_HEADS,
                  WIDTH, BLOCK_SIZE, QUANTIZE, V_SCALED)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr, q_w_ptr, k_w_ptr,
    v_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr, eps,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_cache,
    stride_v_token, stride_v_head, num_slots, stride_k_scale, stride_v_scale,
    stride_kc_block, stride_kc_token, stride_kc_head,
    stride_vc_block, stride_vc_token, stride_vc_head,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEADS_PADDED: tl.constexpr, HALF_PADDED: tl.constexpr,
    REST_PADDED: tl.constexpr, HAS_REST: tl.constexpr, NORM: tl.constexpr,
    STORE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANTIZE: tl.constexpr,
    K_SCALED: tl.constexpr, V_SCALED: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(num_tokens,)``: one program (norms and) rotates every q and k head of its
    token: the ``HALF`` pairs of the first ``2 * HALF`` dims, the dims after them (up to
    ``HEAD_SIZE``, a partial rotary) copied. With ``STORE_KV`` it also writes the rotated k and
    the token's v into the paged caches at its slot, as ``store_kv`` would (QUANTIZE / K_SCALED
    / V_SCALED: see there)."""
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PADDED)
    rest = tl.arange(0, REST_PADDED)
    heads = tl.arange(0, HEADS_PADDED)
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * stride_q_token, q_out_ptr + token * (NUM_Q_HEADS * HEAD_SIZE),
                  q_w_ptr, eps, stride_q_head, NUM_Q_HEADS, heads, dims, rest, cos, sin, HALF,
                  HEAD_SIZE, HAS_REST, NORM)
    k_lo, k_hi, k_rest = _rotate_heads(
        k_ptr + token * stride_k_token, k_out_ptr + token * (NUM_KV_HEADS * HEAD_SIZE),
        k_w_ptr, eps, stride_k_head, NUM_KV_HEADS, heads, dims, rest, cos, sin, HALF,
        HEAD_SIZE, HAS_REST, NORM)
    if STORE_KV:
        # k_lo, k_hi: [HEADS_PADDED, HALF_PADDED], the rotated halves of each KV head;
        # k_rest: [HEADS_PADDED, REST_PADDED], its pass-through dims (with HAS_REST)
        slot = tl.load(slot_mapping_ptr + token)
        v_row = v_ptr + token * stride_v_token + heads[:, None] * stride_v_head   # [HP, 1]
        _store_kv_part(k_lo, dims, v_row, key_cache_ptr, value_cache_ptr, k_scale_ptr,
                       v_scale_ptr, stride_k_scale, stride_v_scale, slot, num_slots, heads,
                       stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block,
                       stride_vc_token, stride_vc_head, 0, HALF, NUM_KV_HEADS, BLOCK_SIZE,
                       QUANTIZE, K_SCALED, V_SCALED)
        _store_kv_part(k_hi, dims, v_row, key_cache_ptr, value_cache_ptr, k_scale_ptr,
                       v_scale_ptr, stride_k_scale, stride_v_scale, slot, num_slots, heads,
                       stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block,
                       stride_vc_token, stride_vc_head, HALF, HALF, NUM_KV_HEADS, BLOCK_SIZE,
                       QUANTIZE, K_SCALED, V_SCALED)
        if HAS_REST:
            _store_kv_part(k_rest, rest, v_row, key_cache_ptr, value_cache_ptr, k_scale_ptr,
                           v_scale_ptr, stride_k_scale, stride_v_scale, slot, num_slots, heads,
                           stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block,
                           stride_vc_token, stride_vc_head, 2 * HALF, HEAD_SIZE - 2 * HALF,
                           NUM_KV_HEADS, BLOCK_SIZE, QUANTIZE, K_SCALED, V_SCALED)


def triton_apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor,
                        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                        store: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[n, Hq, D]``, k ``[n, Hkv, D]`` (last dim contiguous), positions ``[n]``, table
    ``[max_positions, R]`` (last dim contiguous; ``R <= D`` even, the rotated dims), optional
    per-head norm ``(q_weight [D], k_weight [D], eps)`` -> new contiguous rotated (q, k); with
    ``store`` (a checked ``fused.KVWrite``) the rotated k and ``store.value`` are also written
    into its caches."""
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out, k_out
    half = cos_sin_cache.shape[1] // 2
    heads_padded = triton.next_power_of_2(max(num_q_heads, num_kv_heads))
    half_padded = triton.next_power_of_2(half)
    rest_padded = triton.next_power_of_2(max(head_size - 2 * half, 1))   # unused without rest
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
    if store is None:
        # Never read: the pointers stand in so the launch's tensors come first (see .launch).
        v, key_cache, value_cache, slots = k, k, k, positions
        k_scale = v_scale = k
        num_slots = stride_k_scale = stride_v_scale = block_size = 0
        v_strides, kc_strides, vc_strides = (0, 0), (0, 0, 0), (0, 0, 0)
        quantize = False
    else:
        v, key_cache, value_cache, slots = (store.value, store.key_cache, store.value_cache,
                                            store.slot_mapping)
        k_scale, v_scale = scale_pointers(key_cache, store.k_scale, store.v_scale)
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        block_size = key_cache.shape[1]
        stride_k_scale, stride_v_scale = scale_stride(store.k_scale), scale_stride(store.v_scale)
        v_strides = v.stride()[:2]
        kc_strides, vc_strides = key_cache.stride()[:3], value_cache.stride()[:3]
        quantize = is_fp8(key_cache.dtype)
    launch(_rotary_kernel, (num_tokens,), (
        q, k, q_out, k_out, positions, cos_sin_cache, q_weight, k_weight,
        v, key_cache, value_cache, k_scale, v_scale, slots, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        *v_strides, num_slots, stride_k_scale, stride_v_scale, *kc_strides, *vc_strides), dict(
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, HEAD_SIZE=head_size,
        HEADS_PADDED=heads_padded, HALF_PADDED=half_padded, REST_PADDED=rest_padded,
        HAS_REST=head_size > 2 * half, NORM=qk_norm is not None,
        STORE_KV=store is not None, BLOCK_SIZE=block_size, QUANTIZE=quantize,
        K_SCALED=store is not None and store.k_scale is not None,
        V_SCALED=store is not None and store.v_scale is not None,
        num_warps=_num_warps(heads_padded * half_padded)))
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out,
                         INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid ``(n, cdiv(INTER, BLOCK))``: ``out[i, j] = silu(x[i, j]) * x[i, INTER + j]``."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)    # F.silu rounds to the dtype, then the mul
    tl.store(out_ptr + row * stride_out + cols, (act.to(tl.float32) * up).to(dtype), mask=mask)


def triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: ``[n, 2 * I]`` (last dim contiguous) -> new ``[n, I]``."""
    num_rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    if num_rows == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    launch(_silu_and_mul_kernel, (num_rows, cdiv(inter, block)), (
        x, out, x.stride(0), out.stride(0)), dict(INTER=inter, BLOCK=block,
                                                  num_warps=_num_warps(block)))
    return out
