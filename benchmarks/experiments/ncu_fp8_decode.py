"""One planned paged decode over an fp8 cache per shape, between ``cudaProfilerStart`` and
``Stop``, for Nsight Compute (GPU): how many programs share an SM, registers, shared memory,
waves and DRAM throughput (rows in ``experiments/results/ncu_fp8_decode_h100.txt``).

    ncu --profile-from-start off -k regex:_paged_decode --section Occupancy \\
        --section LaunchStats --section SpeedOfLight \\
        python -m benchmarks.experiments.ncu_fp8_decode 64x4096 96x4096 256x4096
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_attention import DecodeCase, make_inputs
from mini_paged_attn.ops import paged_decode
from mini_paged_attn.ops.kv_quant import FP8_DTYPE


def main(shapes: list[str]) -> None:
    for shape in shapes:
        batch, context = map(int, shape.split("x"))
        x = make_inputs(DecodeCase(batch, context), seed=1)
        kc, vc = x.key_cache.to(FP8_DTYPE), x.value_cache.to(FP8_DTYPE)
        for _ in range(3):          # compile and prepare outside the profiled range
            paged_decode(x.query, kc, vc, x.block_tables, x.context_lens, out=x.out)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        paged_decode(x.query, kc, vc, x.block_tables, x.context_lens, out=x.out)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        del x, kc, vc
        torch.cuda.empty_cache()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="*", default=["64x4096", "96x4096", "256x4096"],
                        metavar="BxC", help="batch x context (default: %(default)s)")
    main(parser.parse_args().shapes)
