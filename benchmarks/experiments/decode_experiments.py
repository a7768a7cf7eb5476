"""Decode experiments behind the tile choice, the merge launch and the benchmark's settle
(GPU). What they found is in docs/performance-notes.md; the rows of the H100 run are in
``benchmarks/experiments/results/decode_experiments_h100/``.

- ``tiles``: unsplit tiles over batch x context, head sizes and block sizes; split tiles at
  small batches (events) and batch 1 (graph replay). Each row names the kernel's shared memory,
  registers and spills (how many programs fit on an SM).
- ``layout``: the seed's pool layout ``(num_blocks, block_size, 2, H_kv, D)`` against a
  head-major one ``(num_blocks, 2, H_kv, block_size, D)`` (each head's tokens of a block
  contiguous), the same data through strided views.
- ``settle``: 128x1k timed right after the 64x64k case of the full benchmark, after 1 s idle,
  and again: the transient that ``bench_attention.SETTLE_S`` waits out.
- ``merge``: batch 1 under graph replay with the merge launched with 1, 2 or 4 warps, and
  skipped (the split kernel alone).
- ``order``: the benchmark's physical blocks in random order against the same pool read in
  order (each sequence's blocks consecutive), with a read-only pass over the pool
  (``pool.sum()``, contiguous) and cuDNN on contiguous K/V for scale.
- ``splits``: forced split counts against the planned one at batch 4-16 (events) and at
  batch 1 (graph replay).

    python -m benchmarks.experiments.decode_experiments \
        --parts tiles,layout,settle,merge,order,splits --out DIR
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from benchmarks.bench_attention import (DecodeCase, DecodeInputs, check_and_time, make_inputs,
                                        ours_launch, sdpa_on_contiguous)
from benchmarks.common import (Ceilings, print_table, start_gpu_run, time_graph_us, time_us,
                               write_csv)
from mini_paged_attn.ops import decode_kernel, decode_merge
from mini_paged_attn.ops.attention.decode_plan import DecodeTiles


def kernel_stats(seen: set) -> str:
    """Shared memory / registers / spills of the decode kernels compiled since the last call."""
    out = []
    for caches in decode_kernel._paged_decode_kernel.device_caches.values():
        for k in caches[0].values():
            if id(k) not in seen:
                seen.add(id(k))
                out.append(f"smem {k.metadata.shared // 1024}K regs {k.n_regs} "
                           f"spills {k.n_spills}")
    return "; ".join(out)


def free():
    """Return the previous shape's memory before allocating the next."""
    gc.collect()
    torch.cuda.empty_cache()


def batch1_graph_cases(rows: list, column: str):
    """Batch 1 at 4k, 16k and 64k: yields ``(case, sets)``, input sets for graph replay
    (>= 256 MB together, so replays miss L2), after appending cuDNN SDPA's graph time over
    them (the target's yardstick) as a row with ``column="sdpa_cudnn"``."""
    for c in (4096, 16384, 65536):
        case = DecodeCase(1, c)
        sets = [make_inputs(case, seed=10 + i)
                for i in range(max(2, min(32, (256 << 20) // case.kv_bytes + 1)))]
        cudnn = [sdpa_on_contiguous(x, case, "sdpa_cudnn", "gqa") for x in sets]
        rows.append({"case": case.label, column: "sdpa_cudnn",
                     "graph_us": time_graph_us(cudnn)})
        yield case, sets
        del sets, cudnn
        free()


UNSPLIT = {128: [(64, 4, 3), (128, 4, 3), (128, 4, 2), (128, 8, 3), (256, 4, 2), (256, 4, 3)],
           64: [(128, 4, 3), (256, 4, 3), (256, 4, 2), (256, 8, 2), (64, 4, 3)],
           256: [(32, 4, 3), (64, 4, 3), (64, 4, 2), (128, 4, 2), (128, 8, 2)]}
SPLIT = [(32, 4, 5), (128, 4, 3), (128, 4, 5), (64, 4, 3), (128, 4, 2), (128, 8, 2)]


def tiles(rows: list, copy: float) -> None:
    """Tile sweeps (see the module docstring); appends rows."""
    seen: set = set()
    cases = [DecodeCase(b, c) for b, c in ((32, 1024), (64, 1024), (128, 1024), (256, 1024),
                                            (32, 4096), (64, 4096), (256, 4096), (32, 16384),
                                            (32, 65536))]
    cases += [DecodeCase(b, c, head_size=d) for d in (64, 256)
              for b, c in ((64, 4096), (32, 4096), (32, 16384))]
    cases += [DecodeCase(b, c, block_size=bs) for bs in (1, 2, 4, 8, 32, 64, 128, 256)
              for b, c in ((64, 4096), (32, 16384))]
    for case in cases:
        x = make_inputs(case, seed=3)
        for t in UNSPLIT[case.head_size] if case.block_size == 16 else UNSPLIT[128][:4]:
            us = time_us(ours_launch(x, DecodeTiles(*t), 1))
            rows.append(dict(case=case.label, tiles=str(t), splits=1, us=us,
                             pct_copy=case.pct_of_copy(us, copy), kernel=kernel_stats(seen)))
        del x
        free()
    for b, c in ((8, 16384), (8, 65536), (4, 16384), (2, 16384)):
        case = DecodeCase(b, c)
        x = make_inputs(case, seed=3)
        for t in SPLIT:
            us = time_us(ours_launch(x, DecodeTiles(*t)))
            rows.append(dict(case=case.label, tiles=str(t), splits="planned", us=us,
                             pct_copy=case.pct_of_copy(us, copy), kernel=kernel_stats(seen)))
        del x
        free()
    for case, sets in batch1_graph_cases(rows, "tiles"):
        for t in SPLIT:
            for s in (None, 16, 32):
                g = time_graph_us([ours_launch(x, DecodeTiles(*t), s) for x in sets])
                rows.append(dict(case=case.label, tiles=str(t), splits=s or "planned",
                                 graph_us=g, kernel=kernel_stats(seen)))


def head_major(x: DecodeInputs) -> DecodeInputs:
    """The same K/V in a pool ``(num_blocks, 2, H_kv, block_size, D)``, as strided
    ``[num_blocks, block_size, H_kv, D]`` views."""
    pool = torch.stack([x.key_cache, x.value_cache], dim=1)      # [nb, 2, bs, H, D]
    pool = pool.permute(0, 1, 3, 2, 4).contiguous()              # [nb, 2, H, bs, D]
    return DecodeInputs(x.query, pool[:, 0].permute(0, 2, 1, 3), pool[:, 1].permute(0, 2, 1, 3),
                        x.block_tables, x.context_lens, x.workspace, x.out)


def layout(rows: list, copy: float) -> None:
    """Seed layout against head-major, planned tiles and 64-token tiles; appends rows."""
    for b, c in ((32, 4096), (64, 4096), (128, 1024), (32, 16384), (8, 16384), (8, 65536)):
        case = DecodeCase(b, c)
        x = make_inputs(case, seed=3)
        hm = head_major(x)
        for name, inputs in (("seed layout", x), ("head-major", hm)):
            for t in (None, (64, 4, 3)):
                us = time_us(ours_launch(inputs, DecodeTiles(*t) if t else None))
                rows.append(dict(case=case.label, layout=name, tiles=str(t or "planned"),
                                 us=us, pct_copy=case.pct_of_copy(us, copy)))
        del x, hm
        free()


def settle(rows: list, copy: float) -> None:
    """128x1k before, right after and 1 s after the full benchmark's 64x64k case."""
    case = DecodeCase(128, 1024)
    x = make_inputs(case, seed=16)

    def measure(what):
        us = time_us(ours_launch(x))
        rows.append(dict(case=case.label, when=what, us=us, pct_copy=case.pct_of_copy(us, copy)))
    measure("before")
    check_and_time(DecodeCase(64, 65536), Ceilings(copy, 0.0), False, seed=15)
    time.sleep(1.0)
    measure("after the 64x64k case and 1 s idle")
    check_and_time(DecodeCase(64, 65536), Ceilings(copy, 0.0), False, seed=15)
    measure("right after the 64x64k case")
    measure("right after the 64x64k case, timed again")


def merge(rows: list, copy: float) -> None:
    """Batch-1 graph times with the merge kernel's launch options overridden."""
    real = decode_merge._merge_splits_kernel

    class Patched:
        """Stands in for the merge kernel: launches it with overridden options, or skips it."""
        def __init__(self, **over):
            self.over = over

        def __getitem__(self, grid):
            if self.over.get("skip"):
                return lambda *a, **k: None
            return lambda *a, **k: real[grid](*a, **{**k, **self.over})
    # (A programmatic dependent launch, the merge waiting in-kernel, was 0.5 us slower than a
    # plain one: experiments/results/decode_experiments_h100/merge.csv, run before the switch.)
    variants = {"1 warp (default)": None, "2 warps": Patched(num_warps=2),
                "4 warps": Patched(num_warps=4),
                "no merge (split kernel alone)": Patched(skip=True)}
    for case, sets in batch1_graph_cases(rows, "variant"):
        fns = [ours_launch(x) for x in sets]
        for name, patch in variants.items():
            decode_merge._merge_splits_kernel = patch or real
            try:
                rows.append(dict(case=case.label, variant=name, graph_us=time_graph_us(fns)))
            finally:
                decode_merge._merge_splits_kernel = real


def order(rows: list, copy: float) -> None:
    """Physical blocks in random order (the benchmark's) against in order (block i of a
    sequence right after block i-1), with a read-only pass over the pool for scale."""
    for b, c in ((32, 4096), (32, 16384), (64, 4096), (128, 1024), (8, 65536), (32, 65536),
                 (1, 65536)):
        case = DecodeCase(b, c)
        x = make_inputs(case, seed=3)
        pool = x.key_cache.as_strided((x.key_cache.numel() * 2,), (1,))
        us = time_us(lambda p=pool: p.sum(dtype=torch.float32))
        rows.append(dict(case=case.label, order="-", impl="pool.sum()", us=us,
                         pct_copy=case.pct_of_copy(us, copy)))
        inorder = DecodeInputs(x.query, x.key_cache, x.value_cache,
                               torch.arange(x.block_tables.numel(), dtype=torch.int32,
                                            device="cuda").view_as(x.block_tables),
                               x.context_lens, x.workspace, x.out)
        for name, inputs in (("random", x), ("in order", inorder)):
            us = time_us(ours_launch(inputs))
            rows.append(dict(case=case.label, order=name, impl="ours", us=us,
                             pct_copy=case.pct_of_copy(us, copy)))
        us = min(time_us(sdpa_on_contiguous(x, case, "sdpa_cudnn", form))
                 for form in ("rows", "gqa"))
        rows.append(dict(case=case.label, order="contiguous", impl="sdpa_cudnn", us=us,
                         pct_copy=case.pct_of_copy(us, copy)))
        del x, inorder, pool
        free()


def splits(rows: list, copy: float) -> None:
    """Split counts 2-8 against the planned one at small batches, split tiles and 128-token
    tiles (random physical order)."""
    for b, c in ((4, 16384), (8, 16384), (16, 16384), (4, 65536), (8, 65536), (16, 65536)):
        case = DecodeCase(b, c)
        x = make_inputs(case, seed=3)
        for t in ((32, 4, 5), (128, 4, 3)):
            for s in (None, 2, 3, 4, 5, 6, 8):
                us = time_us(ours_launch(x, DecodeTiles(*t), s))
                rows.append(dict(case=case.label, tiles=str(t), splits=s or "planned", us=us,
                                 pct_copy=case.pct_of_copy(us, copy)))
        del x
        free()
    for case, sets in batch1_graph_cases(rows, "tiles"):
        for s in (None, 33, 40, 48, 64):
            g = time_graph_us([ours_launch(x, None, s) for x in sets])
            rows.append(dict(case=case.label, tiles="planned", splits=s or "planned",
                             graph_us=g))


PARTS = {"tiles": tiles, "layout": layout, "settle": settle, "merge": merge, "order": order,
         "splits": splits}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--parts", default=",".join(PARTS))
    args = p.parse_args()
    copy = start_gpu_run(args.out, "benchmarks.experiments.decode_experiments").copy_gbps
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s", flush=True)
    for name in args.parts.split(","):
        rows: list[dict] = []
        PARTS[name](rows, copy)
        write_csv(args.out / f"{name}.csv", rows)
        print_table(rows, list(dict.fromkeys(k for r in rows for k in r)))
        print(flush=True)


if __name__ == "__main__":
    main()
