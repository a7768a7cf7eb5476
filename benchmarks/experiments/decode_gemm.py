"""The decoder's projections at decode batch sizes: cuBLAS (``F.linear``) against a Triton
weight-streaming kernel with split K, in CUDA graphs the way a captured decode step runs them
(GPU).

Each row times one projection of Qwen3-0.6B shapes (qkv, o, gate_up, down) at batch ``M``: a
graph of 28 calls, each over its own weight (as 28 layers: the weights never sit in L2),
replayed; us per call. "floor" is the weight's bytes at the run's copy bandwidth. The Triton
kernel computes ``W @ x^T`` tiles (the weight's rows fill the MMA's 64-row side, the batch its
narrow side); with ``SPLIT_K > 1`` each program sums one slice of K and the last of a tile's
programs (an atomic ticket) adds the others' float32 partials and writes the tile.

    python -m benchmarks.experiments.decode_gemm [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from benchmarks.common import environment, start_gpu_run

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
BATCHES = (1, 16, 64, 128, 256)
LAYERS = 28


@triton.jit
def _prefetch_l2(ptrs, nbytes):
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // dummy $0", "=r,l,r",
                              [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _scale_kernel(x_ptr, w_ptr, out_ptr, D, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """A stand-in for the elementwise kernels between the projections (one row a program)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * D + cols, mask=mask)
    tl.store(out_ptr + row * D + cols, x * w, mask=mask)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, out_ptr, part_ptr, counter_ptr, M, N, K,
                   stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False,
                   PREFETCH: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                # [BLOCK_N]
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                # [BLOCK_M]
    n_valid = rows_n < N
    m_valid = rows_m < M
    cols = tl.arange(0, BLOCK_K)
    k_len = K // SPLIT_K
    k0 = split * k_len
    w_rows = w_ptr + rows_n[:, None].to(tl.int64) * stride_wn       # [BLOCK_N, 1]
    x_rows = x_ptr + rows_m[:, None].to(tl.int64) * stride_xm       # [BLOCK_M, 1]
    if PREFETCH:
        # The weights do not depend on the previous kernel: pull this program's slice of them
        # into L2 while that kernel finishes.
        pf_rows = w_ptr + tl.minimum(rows_n, N - 1).to(tl.int64) * stride_wn + k0
        _prefetch_l2(pf_rows, tl.full([BLOCK_N], 0, tl.int32) + k_len * 2)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in tl.range(k0, k0 + k_len, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_rows + (k + cols)[None, :], mask=n_valid[:, None], other=0.0)
        x = tl.load(x_rows + (k + cols)[None, :], mask=m_valid[:, None], other=0.0)
        # w: [BLOCK_N, BLOCK_K], x: [BLOCK_M, BLOCK_K]
        acc = tl.dot(w, tl.trans(x), acc)                           # [BLOCK_N, BLOCK_M]
    out_ptrs = out_ptr + rows_m[None, :].to(tl.int64) * stride_om + rows_n[:, None]
    out_valid = n_valid[:, None] & m_valid[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_valid)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        num_tiles = tl.num_programs(0) * tl.num_programs(1)
        tile_offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tl.store(part_ptr + (split * num_tiles + tile).to(tl.int64) * (BLOCK_N * BLOCK_M)
                 + tile_offs, acc)
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            for s in range(SPLIT_K):
                if s != split:
                    acc += tl.load(part_ptr + (s * num_tiles + tile).to(tl.int64)
                                   * (BLOCK_N * BLOCK_M) + tile_offs, cache_modifier=".cg")
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_valid)
            tl.store(counter_ptr + tile, 0)


class TritonLinear:
    def __init__(self, M, N, K, block_n, block_k, split_k, stages, warps, block_m_cap=128, *,
                 pdl=False, prefetch=False):
        self.block_m = min(max(16, triton.next_power_of_2(M)), block_m_cap)
        self.cfg = (block_n, block_k, split_k, stages, warps)
        self.pdl, self.prefetch = pdl, prefetch
        self.grid = (triton.cdiv(N, block_n), triton.cdiv(M, self.block_m), split_k)
        tiles = self.grid[0] * self.grid[1]
        self.part = torch.empty(split_k * tiles * block_n * self.block_m, dtype=torch.float32,
                                device="cuda")
        self.counter = torch.zeros(tiles, dtype=torch.int32, device="cuda")

    def __call__(self, x, w, out):
        block_n, block_k, split_k, stages, warps = self.cfg
        _linear_kernel[self.grid](x, w, out, self.part, self.counter, x.shape[0], w.shape[0],
                                  w.shape[1], x.stride(0), w.stride(0), out.stride(0),
                                  BLOCK_M=self.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                  SPLIT_K=split_k, STAGES=stages, num_warps=warps,
                                  PDL=self.pdl, PREFETCH=self.prefetch, launch_pdl=self.pdl)


def graph_us(calls, reps: int = 30) -> float:
    """Median us per call of a CUDA graph that makes ``calls`` (a list of thunks) in order."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def configs(M, K):
    for block_m_cap, block_n, split_k, stages in itertools.product(
            (64, 128), (64, 128), (1, 2, 4, 8), (3, 4)):
        if K % (split_k * 128) or (block_m_cap == 128 and M <= 64):
            continue
        warps = 8 if block_n * min(max(16, triton.next_power_of_2(M)), block_m_cap) >= 128 * 128 else 4
        yield block_n, 128, split_k, stages, warps, block_m_cap


def sweep(ceilings) -> tuple[list[dict], dict]:
    rows, best_cfg = [], {}
    for name, (N, K) in SHAPES.items():
        weights = [torch.randn(N, K, dtype=torch.bfloat16, device="cuda") * 0.02
                   for _ in range(LAYERS)]
        floor = N * K * 2 / (ceilings.copy_gbps * 1e3)
        for M in BATCHES:
            x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
            outs = [torch.empty(M, N, dtype=torch.bfloat16, device="cuda") for _ in weights]
            ref = F.linear(x, weights[0])
            cublas = graph_us([lambda w=w, o=o: torch.matmul(x, w.t(), out=o)
                               for w, o in zip(weights, outs)])
            best = None
            for cfg in configs(M, K):
                for prefetch in (False, True):
                    lin = TritonLinear(M, N, K, *cfg, prefetch=prefetch)
                    try:
                        lin(x, weights[0], outs[0])
                        err = (outs[0].float() - ref.float()).abs().max().item()
                        us = graph_us([lambda w=w, o=o: lin(x, w, o)
                                       for w, o in zip(weights, outs)])
                    except Exception as e:  # noqa: BLE001 - a config that does not compile
                        print(f"  {name} M={M} {cfg}: {type(e).__name__}", flush=True)
                        break
                    if err > 0.05:
                        print(f"  {name} M={M} {cfg}: wrong, max err {err}", flush=True)
                        continue
                    if not prefetch and (best is None or us < best[0]):
                        best = (us, cfg)
                    if prefetch:
                        print(f"  {name} M={M} {cfg}: {us:.2f} us with prefetch", flush=True)
            best_cfg[name, M] = best[1]
            row = {"proj": name, "N": N, "K": K, "M": M, "floor_us": floor, "cublas_us": cublas,
                   "triton_us": best[0], "config": best[1]}
            rows.append(row)
            print(f"{name:8} M={M:4d} floor {floor:6.2f}  cublas {cublas:6.2f}  triton "
                  f"{row['triton_us']:6.2f} {row['config']}", flush=True)
        del weights
    return rows, best_cfg


def chain(M: int, best_cfg: dict, variant: str) -> float:
    """us per layer of a 28-layer graph: norm, qkv, rope stand-in, o, norm, gate_up, act
    stand-in, down; ``variant``: cublas | triton | pdl | pdl+prefetch."""
    pdl = variant.startswith("pdl")
    prefetch = variant == "pdl+prefetch"
    calls = []
    h = torch.randn(M, 1024, dtype=torch.bfloat16, device="cuda")
    scale = {d: torch.rand(d, dtype=torch.bfloat16, device="cuda") for d in (1024, 4096, 6144)}
    keep = []

    def ew(x, d):
        out = torch.empty(M, d, dtype=torch.bfloat16, device="cuda")
        keep.append(out)
        calls.append(lambda: _scale_kernel[(M,)](x, scale[d], out, d, BLOCK=triton.next_power_of_2(d),
                                                  PDL=pdl, num_warps=4, launch_pdl=pdl))
        return out

    def proj(x, name):
        N, K = SHAPES[name]
        w = torch.randn(N, K, dtype=torch.bfloat16, device="cuda") * 0.02
        out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
        keep.extend((w, out))
        if variant == "cublas":
            calls.append(lambda: torch.matmul(x, w.t(), out=out))
        else:
            lin = TritonLinear(M, N, K, *best_cfg[name, M], pdl=pdl, prefetch=prefetch)
            calls.append(lambda: lin(x, w, out))
        return out

    for _ in range(LAYERS):
        a = ew(h, 1024)
        q = ew(proj(a, "qkv"), 4096)
        o = proj(q[:, :2048], "o")
        g = ew(proj(ew(o, 1024), "gate_up"), 6144)
        h = proj(g[:, :3072], "down")
    return graph_us(calls) * len(calls) / LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="decode_gemm_out")
    args = parser.parse_args()
    ceilings = start_gpu_run(args.out, "decode_gemm")
    torch.manual_seed(0)
    rows, best_cfg = sweep(ceilings)
    chains = []
    for M in BATCHES:
        row = {"M": M}
        for variant in ("cublas", "triton", "pdl", "pdl+prefetch"):
            row[variant] = chain(M, best_cfg, variant)
        chains.append(row)
        print(row, flush=True)
    Path(args.out, "decode_gemm.json").write_text(json.dumps(
        {"environment": environment(), "copy_gbps": ceilings.copy_gbps, "rows": rows,
         "chains": chains}, indent=1))
    print(f"\n{environment()['device']}, copy {ceilings.copy_gbps:.0f} GB/s; us per call "
          f"(graph of {LAYERS})")
    print(f"{'proj':8} {'M':>4} {'floor':>7} {'cublas':>7} {'triton':>7}  config (n, k, split, st, w, m)")
    for r in rows:
        print(f"{r['proj']:8} {r['M']:4d} {r['floor_us']:7.2f} {r['cublas_us']:7.2f} "
              f"{r['triton_us']:7.2f}  {r['config']}")
    floor = sum(n * k * 2 for n, k in SHAPES.values()) / (ceilings.copy_gbps * 1e3)
    print(f"\nus per layer (4 projections + 4 elementwise), weight floor {floor:.1f} us")
    print(f"{'M':>4} {'cublas':>8} {'triton':>8} {'pdl':>8} {'pdl+pf':>8}")
    for r in chains:
        print(f"{r['M']:4d} {r['cublas']:8.1f} {r['triton']:8.1f} {r['pdl']:8.1f} "
              f"{r['pdl+prefetch']:8.1f}")


if __name__ == "__main__":
    main()
