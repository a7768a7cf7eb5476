"""How the timing method moves decode results (GPU).

Flush check: the same calls (ours, cuDNN and flash SDPA on contiguous K/V) timed three ways:
   ``zero`` (``do_bench``'s 256 MB ``zero_()`` before each call: L2 left full of dirty lines,
   written back during the timed call), ``read`` (a read-only 256 MB pass: L2 clean), ``none``
   (no flush; two input sets larger than L2 alternate). If dirty-line write-back is what keeps
   mid-size shapes under the copy bandwidth, ``read`` and ``none`` agree and ``zero`` is a
   constant ~50 MB / bandwidth slower.
Host time per call is measured by ``benchmarks.bench_host``.

    python -m benchmarks.experiments.decode_timing_check --out DIR

The rows of an H100 run: ``benchmarks/experiments/results/decode_flush_check_h100.csv``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.bench_attention import DecodeCase, make_inputs, ours, sdpa_on_contiguous
from benchmarks.common import print_table, start_gpu_run, time_us, write_csv

FLUSH_CASES = [(32, 4096), (128, 1024), (8, 16384), (64, 1024), (64, 4096), (256, 1024),
               (32, 16384), (64, 16384), (1, 65536)]


def flush_check(copy_gbps: float) -> list[dict]:
    rows = []
    for batch, ctx in FLUSH_CASES:
        case = DecodeCase(batch, ctx)
        sets = [make_inputs(case, seed=s) for s in (1, 2)]
        impls = {"ours": [ours(x) for x in sets],
                 "sdpa_cudnn": [sdpa_on_contiguous(x, case, "sdpa_cudnn",
                                                   "rows" if batch > 1 else "gqa")
                                for x in sets],
                 "sdpa_flash": [sdpa_on_contiguous(x, case, "sdpa_flash", "rows") for x in sets]}
        for name, fns in impls.items():
            row = dict(case=f"{batch}x{ctx}", impl=name)
            for flush in ("zero", "read"):
                row[f"{flush}_us"] = time_us(fns[0], flush=flush)
            turn = [0]

            def alternate(fns=fns):
                turn[0] ^= 1
                return fns[turn[0]]()
            row["none_us"] = time_us(lambda: (alternate(), alternate()), flush="none") / 2
            for flush in ("zero", "read", "none"):
                row[f"{flush}_pct"] = case.pct_of_copy(row[f"{flush}_us"], copy_gbps)
            rows.append(row)
            print(row, flush=True)
        del sets, impls
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--no-flush", dest="flush", action="store_false",
                   help="skip the flush check")
    args = p.parse_args()
    ceilings = start_gpu_run(args.out, "benchmarks.experiments.decode_timing_check")
    print(f"{torch.cuda.get_device_name()}: copy {ceilings.copy_gbps:.0f} GB/s (read flush)",
          flush=True)
    flush = flush_check(ceilings.copy_gbps) if args.flush else []
    if flush:
        write_csv(args.out / "flush_check.csv", flush)
        print_table(flush, ["case", "impl", "zero_us", "read_us", "none_us", "zero_pct",
                            "read_pct", "none_pct"])


if __name__ == "__main__":
    main()
