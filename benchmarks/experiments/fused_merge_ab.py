"""The split-KV merge inside the decode kernel (``FUSED_MERGE``) against the merge kernel (GPU).

For each shape, both ways:

- ``host_us`` / ``eager_us``: a user's loop of ``paged_decode(*args)`` (no workspace, the
  prepared-launch repeat path), as ``bench_host`` times it, with ``explain.FUSED_MERGE`` on
  and off;
- ``events_us``: the GPU time of one such call (CUDA events, L2 flushed, the host ahead);
- ``graph_us``: the GPU time per call under CUDA-graph replay over input sets larger than L2
  (``triton_paged_decode`` with a workspace; the fused one with zeroed counters of its own).

A row ``fused - two`` per shape gives the differences. Batch-1 shapes split 32 ways on an
H100, 8 x 1k splits fewer; 64 x 4k does not split (both columns then time the same launch).

    python -m benchmarks.experiments.fused_merge_ab --out DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.bench_attention import DecodeCase, make_inputs
from benchmarks.bench_host import host_and_eager_us
from benchmarks.common import print_table, start_gpu_run, time_graph_us, time_us, write_csv
from mini_paged_attn.ops import dispatch, paged_decode
from mini_paged_attn.ops.attention import decode_plan as explain
from mini_paged_attn.ops.checks import check_paged_decode_args
from mini_paged_attn.ops.decode import triton_paged_decode

SHAPES = ((1, 1024), (1, 4096), (1, 16384), (1, 65536), (8, 1024), (4, 16384), (64, 4096))
COLUMNS = ("shape", "merge", "splits", "host_us", "eager_us", "events_us", "graph_us")


def launch_fn(x, fused: bool):
    """One decode of inputs ``x`` with a workspace, through ``triton_paged_decode``."""
    shapes = check_paged_decode_args(*x.args, None, x.out)
    counters = torch.zeros(shapes.num_seqs * shapes.num_kv_heads, dtype=torch.int32,
                           device="cuda")
    return lambda: triton_paged_decode(*x.args, shapes, out=x.out, lse=None,
                                       workspace=x.workspace, fused_merge=fused,
                                       counters=counters if fused else None)


def shape_rows(case: DecodeCase) -> list[dict]:
    sets = [make_inputs(case, seed=20 + i)
            for i in range(max(2, min(16, (256 << 20) // case.kv_bytes + 1)))]
    x = sets[0]
    plan = explain.explain_decode(case.batch, case.num_q_heads, case.num_kv_heads,
                                  case.head_size, case.context, case.block_size, case.dtype)
    rows = []
    default = explain.FUSED_MERGE
    for fused in (False, True):
        explain.FUSED_MERGE = fused
        dispatch._DECODE_RUNS.clear()
        call = lambda: paged_decode(*x.args)  # noqa: E731
        try:
            host, eager = host_and_eager_us(call)
            events = time_us(call)
        finally:
            explain.FUSED_MERGE = default
        fns = [launch_fn(s, fused) for s in sets]
        for fn in fns:
            fn()                     # compile outside the graph
        rows.append(dict(shape=f"{case.batch}x{case.context // 1024}k",
                         merge="fused" if fused else "two launches", splits=plan.num_splits,
                         host_us=host, eager_us=eager, events_us=events,
                         graph_us=time_graph_us(fns)))
    rows.append(dict(shape=rows[0]["shape"], merge="fused - two", splits=plan.num_splits,
                     **{c: rows[1][c] - rows[0][c] for c in COLUMNS[3:]}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out"),
                        help="directory for fused_merge_ab.csv")
    args = parser.parse_args()
    start_gpu_run(args.out, "benchmarks.experiments.fused_merge_ab")
    rows = []
    for batch, context in SHAPES:
        rows += shape_rows(DecodeCase(batch, context))
        torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name()}")
    print_table(rows, COLUMNS)
    write_csv(args.out / "fused_merge_ab.csv", rows)


if __name__ == "__main__":
    main()
