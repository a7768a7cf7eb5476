"""Where the Hopper prefill kernel starts to beat the Triton one: batches of equal prompts of
a given length, whole (contiguous K/V, ``flash_attn_varlen_func``) and as chunks over a cached
prefix (paged), each timed with ``prefill_plan``'s ``HOPPER_MIN_AVG_Q_LEN`` and
``HOPPER_MIN_AVG_KV_LEN`` forcing one kernel and then the other (GPU only, sm_90).

    python -m benchmarks.experiments.prefill_hopper_threshold [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.bench_prefill import Case, contiguous_fn, paged_batch, prefill_fn
from benchmarks.common import environment, print_table, time_us
from mini_paged_attn.ops import prefill_plan, varlen

LENGTHS = (32, 64, 96, 128, 160, 192, 256, 384)
ALWAYS, NEVER = 1, 1 << 40


def timed(case: Case, threshold: int, contiguous: bool) -> float:
    """GPU us of the case with the Hopper kernel's threshold set to ``threshold``."""
    saved = prefill_plan.HOPPER_MIN_AVG_Q_LEN, prefill_plan.HOPPER_MIN_AVG_KV_LEN
    prefill_plan.HOPPER_MIN_AVG_Q_LEN = prefill_plan.HOPPER_MIN_AVG_KV_LEN = threshold
    varlen._CONTIGUOUS_RUNS.clear()      # prepared under the other threshold
    try:
        batch = paged_batch(case)
        return time_us(contiguous_fn(batch) if contiguous else prefill_fn(batch, None))
    finally:
        prefill_plan.HOPPER_MIN_AVG_Q_LEN, prefill_plan.HOPPER_MIN_AVG_KV_LEN = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--seqs", type=int, nargs="+", default=[16])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[0, 1024],
                        help="cached tokens before each prompt (0: whole prompts, contiguous)")
    args = parser.parse_args()
    rows = []
    for prefix in args.prefixes:
        for seqs in args.seqs:
            for length in args.lengths:
                case = Case(f"{seqs} x {length}" + (f" on {prefix}" if prefix else " whole"),
                            (length,) * seqs, (prefix,) * seqs)
                hopper, triton_us = (timed(case, t, prefix == 0) for t in (ALWAYS, NEVER))
                rows.append({"case": case.name, "hopper_us": hopper, "triton_us": triton_us,
                             "triton_over_hopper": triton_us / hopper})
    print_table(rows, ["case", "hopper_us", "triton_us", "triton_over_hopper"])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefill_hopper_threshold.json").write_text(
            json.dumps({"environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
