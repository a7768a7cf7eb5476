"""Qwen3-0.6B's projections at decode sizes through torch's two BLAS routes (GPU):
``torch.backends.cuda.preferred_blas_library`` "cublas" against "cublaslt", and the cublas
route with PyTorch's TunableOp choosing among the BLAS libraries' algorithms by timing
("tuned"), each timed as a CUDA graph of 28 calls over 28 weights (so L2 holds none of them),
and the kernels one call launches (split-K adds a reduction kernel).

    python -m benchmarks.experiments.decode_gemm_blas [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.cuda import tunable
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import environment, start_gpu_run
from benchmarks.experiments.decode_gemm import BATCHES, LAYERS, SHAPES, graph_us

LIBRARIES = ("cublas", "cublaslt", "tuned")


def linear_graph_us(n: int, k: int, rows: int) -> float:
    """Median us per call of a graph of ``LAYERS`` ``F.linear`` over as many ``[n, k]``
    weights."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    return graph_us([lambda w=w: F.linear(x, w) for w in weights])


def kernels(n: int, k: int, rows: int) -> list[str]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    F.linear(x, w)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.linear(x, w)
        torch.cuda.synchronize()
    return [e.name[:48] for e in prof.events() if e.device_type.name == "CUDA"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    out = parser.parse_args().out
    ceilings = start_gpu_run(out, "benchmarks.experiments.decode_gemm_blas")
    tunable.set_filename(str(out / "tunableop_results.csv"))
    before = torch.backends.cuda.preferred_blas_library()
    print(f"{environment()['device']}; copy {ceilings.copy_gbps:.0f} GB/s; us per call")
    print(f"{'proj':8} {'rows':>4} {'floor':>6} " + " ".join(f"{lib:>9}" for lib in LIBRARIES)
          + "  kernels (cublas)")
    try:
        for name, (n, k) in SHAPES.items():
            for rows in BATCHES:
                cells = []
                for lib in LIBRARIES:
                    torch.backends.cuda.preferred_blas_library(
                        "cublas" if lib == "tuned" else lib)
                    tunable.enable(lib == "tuned")    # tunes at the warm-up, off the capture
                    tunable.tuning_enable(lib == "tuned")
                    cells.append(linear_graph_us(n, k, rows))
                tunable.enable(False)
                torch.backends.cuda.preferred_blas_library("cublas")
                floor = n * k * 2 / ceilings.copy_gbps / 1e3
                print(f"{name:8} {rows:4d} {floor:6.2f} " + " ".join(f"{c:9.2f}" for c in cells)
                      + "  " + ", ".join(kernels(n, k, rows)), flush=True)
                tunable.enable(True)
                tunable.tuning_enable(True)
                print(f"{'':39}tuned: " + ", ".join(kernels(n, k, rows)), flush=True)
                tunable.enable(False)
    finally:
        tunable.enable(False)
        torch.backends.cuda.preferred_blas_library(before)


if __name__ == "__main__":
    main()
