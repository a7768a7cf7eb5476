"""Two variants of ``ops.linear``'s kernel at decode sizes that were measured and not kept (GPU).

- **qkv with rope**: the qkv projection with Qwen3's per-head q/k RMSNorm, the rotation and
  the new K/V's write into the paged cache in its epilogue (one program a head, its two
  halves as two accumulators, so the norm and the rotation stay in registers), against the
  projection followed by the library's rotary kernel (``apply_rotary(..., store=...)``).
- **weight first**: each program loads its first weight tile before
  ``griddepcontrol.wait`` (the weight does not depend on the previous kernel), the loop
  unpipelined after it, against ``ops.linear``'s plan.

Qwen3-0.6B shapes, graphs of 28 calls over 28 weights, us per call
(``experiments/results/decode_linear_h100.txt`` holds the plan's own timings). The numbers
in docs/performance-notes.md ("Projections at decode sizes") came from the scratch probe
these kernels were taken from, which swept the splits of each variant.

    python -m benchmarks.experiments.decode_projection_variants
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.common import environment, start_gpu_run
from benchmarks.experiments.decode_gemm import LAYERS, graph_us
from mini_paged_attn.ops.fused import KVWrite, apply_rotary
from mini_paged_attn.ops.launch import launch
from mini_paged_attn.ops.pdl import wait_for_previous
from mini_paged_attn.ops.projection import SplitKWorkspace, linear, plan_linear
from mini_paged_attn.ops.projection_triton import _sum_splits, _tile_products

Q_HEADS, KV_HEADS, HEAD, HIDDEN, BLOCK = 16, 8, 128, 1024, 16
ROWS = (1, 32, 64, 128, 256)


@triton.jit
def _qkv_rope_kernel(
    x_ptr, w_ptr, q_out_ptr, part_ptr, counter_ptr, pos_ptr, table_ptr, q_w_ptr, k_w_ptr,
    key_cache_ptr, value_cache_ptr, slot_ptr, eps, M, K, num_slots, stride_xm, stride_wn,
    stride_table, stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block,
    stride_vc_token, stride_vc_head,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, NORM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(heads, cdiv(M, BLOCK_M), SPLIT_K)``: head ``pid_h``'s two halves (the rows
    ``2 * HALF * h ..`` of the fused weight) for BLOCK_M tokens; q heads are normed, rotated
    and stored, k heads normed, rotated and written to the key cache, v heads to the value
    cache (bf16/fp16 caches only)."""
    wait_for_previous(PDL)
    head = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    dims = tl.arange(0, HALF)                                                  # [HALF]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                           # [BLOCK_M]
    m_ok = offs_m < M
    k_len = K // SPLIT_K
    lo_rows = w_ptr + (head * 2 * HALF + dims)[:, None].to(tl.int64) * stride_wn
    acc_lo, acc_hi = _tile_products(
        x_ptr + offs_m[:, None].to(tl.int64) * stride_xm, m_ok, lo_rows,
        lo_rows + HALF * stride_wn, dims < HALF, split * k_len, split * k_len + k_len, HALF,
        BLOCK_M, BLOCK_K, True, STAGES, True, "tf32")
    acc_lo, acc_hi, is_last = _sum_splits(
        acc_lo, acc_hi, part_ptr, counter_ptr, pid_m * tl.num_programs(0) + head,
        tl.num_programs(0) * tl.num_programs(1), split, HALF, BLOCK_M, SPLIT_K, True)
    if is_last:
        dtype = q_out_ptr.dtype.element_ty
        x1 = acc_lo.to(dtype).to(tl.float32)                                   # [HALF, BLOCK_M]
        x2 = acc_hi.to(dtype).to(tl.float32)                                   # [HALF, BLOCK_M]
        slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1).to(tl.int64)    # [BLOCK_M]
        cache_ok = (m_ok & (slot >= 0) & (slot < num_slots))[None, :]          # [1, BLOCK_M]
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            if NORM:
                if head < NUM_Q_HEADS:
                    w1 = tl.load(q_w_ptr + dims).to(tl.float32)
                    w2 = tl.load(q_w_ptr + HALF + dims).to(tl.float32)
                else:
                    w1 = tl.load(k_w_ptr + dims).to(tl.float32)
                    w2 = tl.load(k_w_ptr + HALF + dims).to(tl.float32)
                mean_sq = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF)
                rstd = tl.rsqrt(mean_sq + eps)[None, :]                        # [1, BLOCK_M]
                x1 = (w1[:, None] * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                x2 = (w2[:, None] * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
            row = table_ptr + pos[None, :] * stride_table + dims[:, None]      # [HALF, BLOCK_M]
            cos = tl.load(row, mask=m_ok[None, :], other=0.0).to(tl.float32)
            sin = tl.load(row + HALF, mask=m_ok[None, :], other=0.0).to(tl.float32)
            lo = ((x1 * cos).to(dtype).to(tl.float32)
                  - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)             # [HALF, BLOCK_M]
            hi = ((x2 * cos).to(dtype).to(tl.float32)
                  + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)             # [HALF, BLOCK_M]
            if head < NUM_Q_HEADS:
                dst = (q_out_ptr + offs_m[None, :].to(tl.int64) * (NUM_Q_HEADS * 2 * HALF)
                       + head * 2 * HALF + dims[:, None])
                tl.store(dst, lo, mask=m_ok[None, :])
                tl.store(dst + HALF, hi, mask=m_ok[None, :])
            else:
                dst = (key_cache_ptr + block[None, :] * stride_kc_block
                       + offset[None, :] * stride_kc_token
                       + (head - NUM_Q_HEADS) * stride_kc_head + dims[:, None])
                tl.store(dst, lo, mask=cache_ok)
                tl.store(dst + HALF, hi, mask=cache_ok)
        else:
            dst = (value_cache_ptr + block[None, :] * stride_vc_block
                   + offset[None, :] * stride_vc_token
                   + (head - NUM_Q_HEADS - NUM_KV_HEADS) * stride_vc_head + dims[:, None])
            tl.store(dst, x1.to(dtype), mask=cache_ok)
            tl.store(dst + HALF, x2.to(dtype), mask=cache_ok)


def qkv_rope(x, weight, positions, table, qk_norm, key_cache, value_cache, slots, workspace,
             split_k):
    """x ``[M, hidden]`` -> rotated q ``[M, Q_HEADS, HEAD]``; k and v written to the caches."""
    rows, in_features = x.shape
    q_out = torch.empty(rows, Q_HEADS, HEAD, dtype=x.dtype, device=x.device)
    block_m = min(max(16, triton.next_power_of_2(rows)), 64)
    grid = (Q_HEADS + 2 * KV_HEADS, triton.cdiv(rows, block_m), split_k)
    launch(_qkv_rope_kernel, grid, (
        x, weight, q_out, workspace.partials, workspace.counters, positions, table, *qk_norm[:2],
        key_cache, value_cache, slots, float(qk_norm[2]), rows, in_features,
        key_cache.shape[0] * key_cache.shape[1], x.stride(0), weight.stride(0), table.stride(0),
        *key_cache.stride()[:3], *value_cache.stride()[:3]), dict(
        NUM_Q_HEADS=Q_HEADS, NUM_KV_HEADS=KV_HEADS, HALF=HEAD // 2, BLOCK_M=block_m,
        BLOCK_K=128, SPLIT_K=split_k, NORM=True, BLOCK_SIZE=key_cache.shape[1], STAGES=4,
        num_warps=8))
    return q_out


@triton.jit
def _weight_first_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, counter_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
):
    """``ops.linear``'s kernel (unfused) with each split of one or two K steps (TILES) and
    its first weight tile loaded before the dependency wait."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                           # [BLOCK_N]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                           # [BLOCK_M]
    n_ok = offs_n < N
    m_ok = offs_m < M
    cols = tl.arange(0, BLOCK_K)
    k0 = split * (K // SPLIT_K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w0 = tl.load(w_rows + (k0 + cols)[None, :], mask=n_ok[:, None], other=0.0)  # [BLOCK_N, BLOCK_K]
    wait_for_previous(PDL)
    x0 = tl.load(x_rows + (k0 + cols)[None, :], mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
    acc = tl.dot(w0, tl.trans(x0), tl.zeros([BLOCK_N, BLOCK_M], tl.float32))
    if TILES > 1:
        w1 = tl.load(w_rows + (k0 + BLOCK_K + cols)[None, :], mask=n_ok[:, None], other=0.0)
        x1 = tl.load(x_rows + (k0 + BLOCK_K + cols)[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(w1, tl.trans(x1), acc)                                    # [BLOCK_N, BLOCK_M]
    acc, _, is_last = _sum_splits(acc, acc, part_ptr, counter_ptr,
                                  pid_m * tl.num_programs(0) + pid_n,
                                  tl.num_programs(0) * tl.num_programs(1), split, BLOCK_N,
                                  BLOCK_M, SPLIT_K, False)
    if is_last:
        out = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def weight_first(x, weight, workspace, split_k):
    """x ``[M, K]`` @ weight ``[N, K]``^T, each split one or two 128-column steps of K."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    tiles = in_features // split_k // 128
    assert tiles in (1, 2) and in_features % (split_k * 128) == 0
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    block_m = min(max(16, triton.next_power_of_2(rows)), 64)
    grid = (triton.cdiv(out_features, 64), triton.cdiv(rows, block_m), split_k)
    launch(_weight_first_kernel, grid, (
        x, weight, out, workspace.partials, workspace.counters, rows, out_features,
        in_features, x.stride(0), weight.stride(0), out.stride(0)), dict(
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, SPLIT_K=split_k, TILES=tiles,
        num_warps=4, num_stages=1))
    return out


def qkv_rows(workspace) -> None:
    """qkv with q/k norms, rope and the K/V write: three ways."""
    def weight(*shape):
        return torch.randn(*shape, device="cuda").bfloat16() * 0.02
    layers = [dict(qkv=weight((Q_HEADS + 2 * KV_HEADS) * HEAD, HIDDEN),
                   qn=torch.rand(HEAD, device="cuda").bfloat16() + 0.5,
                   kn=torch.rand(HEAD, device="cuda").bfloat16() + 0.5,
                   kc=torch.zeros(512, BLOCK, KV_HEADS, HEAD, device="cuda").bfloat16(),
                   vc=torch.zeros(512, BLOCK, KV_HEADS, HEAD, device="cuda").bfloat16())
              for _ in range(LAYERS)]
    table = torch.randn(4096, HEAD, device="cuda").bfloat16()
    print("qkv + norm + rope + K/V write, us per call: rows  cublas+rotary  "
          "ops.linear+rotary  fused (split 1 / 2)")
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
        positions = torch.arange(rows, device="cuda") + 100
        slots = torch.randperm(512 * BLOCK, device="cuda")[:rows]

        def separate(layer, backend):
            qkv = linear(x, layer["qkv"], workspace=workspace, backend=backend)
            q, k, v = qkv.view(rows, -1, HEAD).split([Q_HEADS, KV_HEADS, KV_HEADS], dim=1)
            return apply_rotary(q, k, positions, table, qk_norm=(layer["qn"], layer["kn"], 1e-6),
                                store=KVWrite(v, layer["kc"], layer["vc"], slots))[0]
        times = [graph_us([lambda layer=layer: separate(layer, b) for layer in layers])
                 for b in ("torch", "auto")]
        times += [graph_us([lambda layer=layer: qkv_rope(
            x, layer["qkv"], positions, table, (layer["qn"], layer["kn"], 1e-6), layer["kc"],
            layer["vc"], slots, workspace, split) for layer in layers]) for split in (1, 2)]
        print(f"{rows:50d}  " + "  ".join(f"{t:6.2f}" for t in times), flush=True)


def weight_first_rows(workspace) -> None:
    shapes = {"qkv": (4096, 1024), "o": (1024, 2048), "down": (1024, 3072)}
    print("weight tile before the wait, us per call: proj rows  ops.linear  "
          "weight first (best split of one or two K steps)")
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, device="cuda").bfloat16() * 0.02 for _ in range(LAYERS)]
        for rows in ROWS[:3]:
            x = torch.randn(rows, k, device="cuda").bfloat16()
            ours = graph_us([lambda w=w: linear(x, w, workspace=workspace) for w in weights])
            first = min(graph_us([lambda w=w: weight_first(x, w, workspace, split)
                                  for w in weights])
                        for split in (k // 256, k // 128))
            print(f"{name:>30} {rows:4d}  {ours:6.2f}  {first:6.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="decode_projection_variants_out")
    args = parser.parse_args()
    start_gpu_run(args.out, "decode_projection_variants")
    torch.manual_seed(0)
    env = environment()
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}")
    workspace = SplitKWorkspace("cuda", partials=8 << 20, counters=1 << 14)
    assert plan_linear(1, 1024, 3072, workspace=workspace).split_k > 1
    qkv_rows(workspace)
    weight_first_rows(workspace)


if __name__ == "__main__":
    main()
