"""Decode tile and split sweeps (GPU): batch-1 split counts under CUDA-graph replay, and
tiles x splits for short contexts with events. What they found is in docs/performance-notes.md;
the rows of an H100 run are in ``benchmarks/experiments/results/decode_tune_h100.csv`` (taken
with the older ``zero_()`` L2 flush).

    python -m benchmarks.experiments.decode_tuning --out DIR
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from benchmarks.bench_attention import (ROTATE_BYTES, DecodeCase, make_inputs, ours_launch,
                                        sdpa_on_contiguous)
from benchmarks.common import (Ceilings, print_table, start_gpu_run, time_graph_us, time_us,
                               write_csv)
from mini_paged_attn.ops.attention.decode_plan import DecodeTiles


def run_tune(args, ceilings: Ceilings) -> None:
    """Tile and split sweeps: batch 1 under CUDA-graph replay (with cuDNN SDPA on contiguous
    K/V in the same run), larger batches with events; writes ``tune.csv`` to ``args.out``."""
    rows = []

    def pct(case, us):
        return case.pct_of_copy(us, ceilings.copy_gbps)

    batch1_tiles = [(32, 4, 5), (32, 4, 7), (32, 4, 9), (64, 4, 5), (64, 4, 7), (32, 8, 7)]
    for i, case in enumerate([DecodeCase(1, 4096), DecodeCase(1, 16384), DecodeCase(1, 65536)]):
        first = len(rows)
        sets = max(1, min(16, math.ceil(ROTATE_BYTES / case.kv_bytes)))
        xs = [make_inputs(case, seed=100 * i + j) for j in range(sets)]
        us = time_graph_us([sdpa_on_contiguous(x, case, "sdpa_cudnn", "gqa") for x in xs])
        rows.append(dict(case=case.label, impl="sdpa_cudnn", graph_us=us, pct_copy=pct(case, us)))
        for splits in (None, 16, 32, 33):
            for t in batch1_tiles:
                us = time_graph_us([ours_launch(x, DecodeTiles(*t), splits) for x in xs])
                rows.append(dict(case=case.label, impl=f"ours {t}", forced_splits=splits,
                                 graph_us=us, pct_copy=pct(case, us)))
        print_table(sorted(rows[first:], key=lambda r: r["graph_us"])[:12],
                    ["case", "impl", "forced_splits", "graph_us", "pct_copy"])
        print(flush=True)
        del xs
        torch.cuda.empty_cache()
    tiles_list = [(64, 4, 3), (32, 4, 5), (32, 4, 7), (32, 4, 9), (64, 4, 5), (64, 4, 7)]
    for i, case in enumerate([DecodeCase(128, 1024), DecodeCase(64, 1024), DecodeCase(32, 4096),
                              DecodeCase(8, 16384), DecodeCase(32, 16384), DecodeCase(8, 65536),
                              DecodeCase(128, 4096), DecodeCase(256, 4096)]):
        first = len(rows)
        x = make_inputs(case, seed=i)
        for t in tiles_list:
            for splits in (None, 1, 2):
                us = time_us(ours_launch(x, DecodeTiles(*t), splits))
                rows.append(dict(case=case.label, impl=f"ours {t}", forced_splits=splits,
                                 us=us, pct_copy=pct(case, us)))
        print_table(sorted(rows[first:], key=lambda r: r["us"])[:10],
                    ["case", "impl", "forced_splits", "us", "pct_copy"])
        print(flush=True)
        x = None  # free the inputs before the next case
        torch.cuda.empty_cache()
    if args.out:
        write_csv(Path(args.out) / "tune.csv", rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."), help="directory for tune.csv")
    args = p.parse_args(argv)
    run_tune(args, start_gpu_run(args.out, "benchmarks.experiments.decode_tuning"))


if __name__ == "__main__":
    main()
