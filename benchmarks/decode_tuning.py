"""Decode tuning helpers for ``bench_attention.py --tune`` / ``--launch-overhead`` (GPU).

- :func:`launch_overhead`: host microseconds per call of our decode and of torch SDPA, plus a
  cProfile of the split-KV path.
- :func:`run_tune`: batch-1 split counts under CUDA-graph replay, and tiles x splits for short
  contexts with ``do_bench``. What earlier sweeps found is summarised in BENCHMARKS.md.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from bench_attention import (ROTATE_BYTES, DecodeCase, gather_contiguous, make_inputs, ours,
                             ours_launch, sdpa_decode, sdpa_on_contiguous)
from common import Ceilings, print_table, time_graph_us, time_us, write_csv
from mini_paged_attn.ops.checks import check_paged_decode_args
from mini_paged_attn.ops.decode import triton_paged_decode
from mini_paged_attn.ops.explain import DecodeTiles


def launch_overhead() -> list[dict]:
    """Host microseconds per call (no sync; the GPU work is tiny, so the host is the limit)."""
    case = DecodeCase(1, 1024)
    x = make_inputs(case, seed=99)
    shapes = check_paged_decode_args(*x.args, None, x.out)
    k = gather_contiguous(x, x.key_cache, case).contiguous()
    v = gather_contiguous(x, x.value_cache, case).contiguous()
    fns = {"paged_decode split": ours(x, num_splits=4),
           "paged_decode 1 split": ours(x, num_splits=1),
           "triton_paged_decode 1 split": lambda: triton_paged_decode(
               *x.args, shapes, out=x.out, lse=None, num_splits=1),
           "sdpa (default backend)": lambda: sdpa_decode(x.query, k, v)}
    rows = []
    for repeat in range(2):
        for name, fn in fns.items():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(300):
                fn()
            host = (time.perf_counter() - t) / 300 * 1e6
            torch.cuda.synchronize()
            rows.append(dict(case=f"launch overhead #{repeat}", experiment=name, us=host))
    import cProfile
    import pstats
    profile = cProfile.Profile()
    profile.runcall(lambda: [fns["paged_decode split"]() for _ in range(300)])
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    return rows


def run_tune(args, ceilings: Ceilings) -> None:
    """Tile and split sweeps: batch 1 under CUDA-graph replay (with cuDNN SDPA on contiguous
    K/V in the same run), larger batches with do_bench. What earlier sweeps found is
    summarised in BENCHMARKS.md."""
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
