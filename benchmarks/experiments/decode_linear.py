"""``ops.linear`` at decode sizes against cuBLAS, per projection and over a layer (GPU).

Qwen3-0.6B's projections (qkv, o, gate_up with SwiGLU's product, down) at 1-256 rows, each
in a CUDA graph of 28 calls over 28 weights (as 28 layers: the weights never sit in L2), us
per call: cuBLAS (``F.linear``, and for gate_up the SiLU-and-mul kernel after it), the op's
plan (:func:`~mini_paged_attn.ops.projection.plan_linear`), and the best of a small sweep of
other tiles and splits (how far the plan is from it; only those whose partial sums fit the
sweep's own, larger workspace). Then a layer's chain (RMSNorm, qkv,
rotary writing K/V, o, RMSNorm with the residual, gate_up, down; no attention) x 28 in one
graph, us per layer, both ways.

    python -m benchmarks.experiments.decode_linear [--out DIR]

"floor" is the weight's bytes at the run's copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks.common import environment, start_gpu_run
from benchmarks.experiments.decode_gemm import LAYERS, graph_us
from mini_paged_attn.ops import projection
from mini_paged_attn.ops.fused import KVWrite, apply_rotary, rms_norm, silu_and_mul
from mini_paged_attn.ops.projection import SplitKWorkspace, linear, plan_linear
from mini_paged_attn.ops.projection_triton import triton_linear

SHAPES = {"qkv": (4096, 1024, False), "o": (1024, 2048, False), "gate_up": (3072, 1024, True),
          "down": (1024, 3072, False)}
ROWS = (1, 16, 32, 64, 128, 192, 256)
HIDDEN, Q_HEADS, KV_HEADS, HEAD = 1024, 16, 8, 128


def _alternatives(plan, rows, out_features, in_features, gated, sweep):
    """Plans around ``plan``: other splits and row tiles, those whose partial sums fit the
    workspace ``sweep``."""
    for split in (1, 2, 4):
        if in_features % (split * plan.block_k) or in_features // split < plan.block_k:
            continue
        for block_m in {plan.block_m, min(128, 2 * plan.block_m)}:
            need = (split * -(-out_features // plan.block_n) * plan.block_n
                    * -(-rows // block_m) * block_m * (2 if gated else 1))
            if split > 1 and need > sweep.partials.numel():
                continue
            yield dataclasses.replace(plan, split_k=split, block_m=block_m,
                                      stages=plan.stages if block_m <= 64 else 3,
                                      num_warps=8 if block_m >= 128 else plan.num_warps)


def projections(workspace, sweep, copy_gbps: float) -> list[dict]:
    rows_out = []
    for name, (n, k, gated) in SHAPES.items():
        weights = [torch.randn(2 * n if gated else n, k, device="cuda").bfloat16() * 0.02
                   for _ in range(LAYERS)]
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda").bfloat16()
            act = "silu" if gated else None
            cublas = graph_us([
                (lambda w=w: silu_and_mul(F.linear(x, w))) if gated else
                (lambda w=w: F.linear(x, w)) for w in weights])
            ours = graph_us([lambda w=w: linear(x, w, activation=act, workspace=workspace)
                             for w in weights])
            plan = plan_linear(rows, n, k, gated=gated, workspace=workspace)
            best = min((graph_us([lambda w=w, p=p: triton_linear(
                x, w, None, gated, p, sweep.partials, sweep.counters)
                for w in weights]), p) for p in _alternatives(plan, rows, n, k, gated, sweep))
            floor = weights[0].numel() * 2 / (copy_gbps * 1e3)
            row = dict(proj=name, rows=rows, floor_us=floor, cublas_us=cublas, ops_linear_us=ours,
                       plan=dataclasses.asdict(plan), best_us=best[0],
                       best=dataclasses.asdict(best[1]))
            rows_out.append(row)
            print(f"{name:8} {rows:4d}  floor {floor:5.2f}  cublas {cublas:6.2f}  "
                  f"ops.linear {ours:6.2f} "
                  f"(split {plan.split_k}, block_m {plan.block_m})  best {best[0]:6.2f} "
                  f"(split {best[1].split_k}, block_m {best[1].block_m}, "
                  f"stages {best[1].stages})", flush=True)
    return rows_out


def layer_chain(rows: int, workspace, layers, cos_sin) -> float:
    """us per layer of the decoder's chain (no attention) in one graph of 28 layers."""
    positions = torch.arange(rows, device="cuda") + 100
    slots = torch.randperm(512 * 16, device="cuda")[:rows]
    hidden = torch.randn(rows, HIDDEN, device="cuda").bfloat16()

    def step():
        h, residual = hidden, hidden
        for layer in layers:
            x, residual = rms_norm(h, layer["norm"], 1e-6, residual=residual)
            qkv = linear(x, layer["qkv"], workspace=workspace).view(rows, -1, HEAD)
            q, k, v = qkv.split([Q_HEADS, KV_HEADS, KV_HEADS], dim=1)
            q, _ = apply_rotary(q, k, positions, cos_sin,
                                store=KVWrite(v, layer["key_cache"], layer["value_cache"], slots))
            x = linear(q.view(rows, -1), layer["o"], workspace=workspace)
            x, residual = rms_norm(x, layer["norm"], 1e-6, residual=residual)
            x = linear(x, layer["gate_up"], activation="silu", workspace=workspace)
            h = linear(x, layer["down"], workspace=workspace)
        return h
    return graph_us([step]) / len(layers)


def chains(workspace) -> list[dict]:
    def weight(*shape):
        return torch.randn(*shape, device="cuda").bfloat16() * 0.02
    layers = [dict(norm=torch.ones(HIDDEN, device="cuda").bfloat16(),
                   qkv=weight((Q_HEADS + 2 * KV_HEADS) * HEAD, HIDDEN),
                   o=weight(HIDDEN, Q_HEADS * HEAD), gate_up=weight(6144, HIDDEN),
                   down=weight(HIDDEN, 3072),
                   key_cache=torch.zeros(512, 16, KV_HEADS, HEAD, device="cuda").bfloat16(),
                   value_cache=torch.zeros(512, 16, KV_HEADS, HEAD, device="cuda").bfloat16())
              for _ in range(LAYERS)]
    cos_sin = torch.randn(4096, HEAD, device="cuda").bfloat16()
    out = []
    print("us per layer   rows  cublas  ops.linear")
    for rows in ROWS:
        ours = layer_chain(rows, workspace, layers, cos_sin)
        with mock.patch.object(projection, "MAX_TRITON_ROWS", 0):   # every projection by cuBLAS
            cublas = layer_chain(rows, workspace, layers, cos_sin)
        out.append(dict(rows=rows, cublas_us=cublas, ops_linear_us=ours))
        print(f"               {rows:4d}  {cublas:6.2f}  {ours:6.2f}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="decode_linear_out")
    args = parser.parse_args()
    ceilings = start_gpu_run(args.out, "decode_linear")
    torch.manual_seed(0)
    workspace = SplitKWorkspace("cuda")
    sweep = SplitKWorkspace("cuda", partials=8 << 20, counters=1 << 14)   # any split fits
    env = environment()
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, copy "
          f"{ceilings.copy_gbps:.0f} GB/s; us per call (graph of {LAYERS})")
    result = dict(environment=env, copy_gbps=ceilings.copy_gbps,
                  projections=projections(workspace, sweep, ceilings.copy_gbps),
                  layers=chains(workspace))
    Path(args.out, "decode_linear.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
