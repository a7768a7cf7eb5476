"""Tile configs of the contiguous prefill launch (tensor-descriptor loads) on the causal
cases of ``bench_prefill`` (GPU): the library's default against other tile shapes, warps
and stages, with cuDNN SDPA in the same run; each output is checked against the default's.

    python -m benchmarks.experiments.prefill_contiguous_tiles
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.attention import SDPBackend

from benchmarks.bench_prefill import CASES, D, contiguous_kv, paged_batch, sdpa_tflops
from benchmarks.common import environment, start_gpu_run, time_us
from mini_paged_attn.ops.prefill import triton_varlen_contiguous
from mini_paged_attn.ops.prefill_plan import PrefillConfig

CONFIGS = [None] + [PrefillConfig(m, n, w, s, tma=True) for m, n, w, s in (
    (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3), (64, 64, 4, 3),
    (64, 128, 4, 2), (64, 128, 4, 3), (256, 64, 8, 2))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    start_gpu_run(args.out, "prefill_contiguous_tiles")
    env = environment()
    print(f"{env['device']} torch {env['torch']} triton {env['triton']} {env['date']}")
    for case in (c for c in CASES if c.name.startswith("causal")):
        batch = paged_batch(case)
        q, _, _, _, cu, _ = batch
        k, v, cu_k = contiguous_kv(batch)
        cudnn = sdpa_tflops(case, SDPBackend.CUDNN_ATTENTION)
        ref = None
        for config in CONFIGS:
            out = torch.empty_like(q)
            run = triton_varlen_contiguous(q, k, v, cu, cu_k, 0, 0, causal=True,
                                           scale=D ** -0.5, out=out, config=config)
            launch_args = (q, k, v, k, k, out, out, cu_k, cu, cu_k, q)
            us = time_us(lambda: run(launch_args))
            ref = out.clone() if ref is None else ref
            diff = (out.float() - ref.float()).abs().max().item()
            tflops = case.flops / (us * 1e-6) / 1e12
            name = "default" if config is None else (
                f"{config.block_m}x{config.block_n}/w{config.num_warps}/s{config.num_stages}")
            print(f"{case.name:14} {name:16} {tflops:6.0f} TFLOP/s  {tflops / cudnn:.2f}x cuDNN"
                  f"  max diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
