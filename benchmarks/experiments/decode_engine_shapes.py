"""Decode at the engine's shapes (GPU): workload (a)'s batches over bf16 and fp8 caches, the
planned launch against forced tiles and splits.

Qwen3-0.6B attention (16 query / 8 KV heads, head_size 128), 16-token blocks in random order,
block tables 256 blocks wide (max_model_len 4096, as the engine's graphs are captured), context
lengths uniform in 100..2048 (seeded), the engine's float32 workspace (split launches then
merge in a second kernel); then two of bench_fp8's shapes (32 query heads, 4k contexts) to
check a rule against. Each row: % of the copy bandwidth over the bytes the batch reads
(its K/V at the cache's width, the queries and outputs), L2 flushed before each call.
``--longest-first`` adds rows where the batch is ordered by context length, longest first: the
grid's last axis is the sequence, so the longest programs start first and the short ones fill
the tail.

    python -m benchmarks.experiments.decode_engine_shapes [--sweep] [--longest-first] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks.common import environment, start_gpu_run, time_us
from mini_paged_attn.ops import decode as decode_module
from mini_paged_attn.ops.checks import check_paged_decode_args
from mini_paged_attn.ops.decode import workspace_size
from mini_paged_attn.ops.attention.decode_plan import DecodeTiles, num_sms_of, plan_decode
from mini_paged_attn.ops.kv_quant import FP8_DTYPE

HKV, D, BLOCK = 8, 128, 16
# (label, batch, query heads, context lengths low..high, table width in blocks): the engine's
# batches of workload (a), then two of bench_fp8's shapes (32 query heads, 4k contexts).
CASES = (("32 x ~1k", 32, 16, (100, 2048), 256), ("128 x ~1k", 128, 16, (100, 2048), 256),
         ("256 x ~1k", 256, 16, (100, 2048), 256), ("64 x 4k g4", 64, 32, (4096, 4096), 256),
         ("256 x 4k g4", 256, 32, (4096, 4096), 256))
VARIANTS = (None, (None, 1), (None, 2), (None, 4), (None, 8), ((128, 2, 3), None),
            ((64, 2, 6), None),
            ((64, 2, 6), 1), ((128, 2, 3), 1), ((128, 4, 3), 1), ((64, 4, 4), 1),
            ((32, 2, 8), 1))
FP8_SWEEP = tuple((tiles, splits) for tiles in (
    (128, 2, 2), (128, 2, 3), (128, 4, 2), (64, 2, 3), (64, 2, 4), (64, 2, 6), (64, 4, 3),
    (32, 2, 4), (32, 2, 6), (32, 1, 4), (64, 1, 4)) for splits in (1, 2))
BF16_SWEEP = tuple((tiles, splits) for tiles in (
    (128, 4, 2), (128, 8, 2), (128, 8, 3), (64, 4, 3), (64, 4, 4), (64, 4, 6), (64, 2, 4),
    (64, 2, 6), (32, 2, 6), (32, 4, 6), (64, 8, 4)) for splits in (1, 2))


def make_batch(batch: int, hq: int, lens_range: tuple[int, int], width: int,
               kv_dtype: torch.dtype, seed: int, longest_first: bool = False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.randint(lens_range[0], lens_range[1] + 1, (batch,), generator=g, device="cuda",
                         dtype=torch.int32)
    if longest_first:
        lens = lens.sort(descending=True).values
    blocks = (lens + BLOCK - 1) // BLOCK
    num_blocks = int(blocks.sum())
    pool = torch.randn((num_blocks, BLOCK, 2, HKV, D), generator=g, device="cuda",
                       dtype=torch.bfloat16).to(kv_dtype)
    order = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
    tables = torch.zeros((batch, width), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks.tolist()):
        tables[i, :n] = order[start:start + n]
        start += n
    query = torch.randn((batch, hq, D), generator=g, device="cuda", dtype=torch.bfloat16)
    nbytes = int(lens.sum()) * HKV * D * 2 * pool.element_size() + 2 * query.numel() * 2
    return query, pool[:, :, 0], pool[:, :, 1], tables, lens, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--sweep", action="store_true", help="also a grid of tiles x splits")
    parser.add_argument("--longest-first", action="store_true",
                        help="also the planned launches over batches ordered longest first")
    parser.add_argument("--width", type=int, default=None,
                        help="block tables this many blocks wide for workload (a)'s batches "
                             "(default 256; the engine replays the narrowest power of two "
                             "holding the batch's blocks, 128 for contexts up to 2048)")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="workload (a)'s batch sizes (default 32 128 256)")
    args = parser.parse_args()
    ceilings = start_gpu_run(args.out, "benchmarks.experiments.decode_engine_shapes")
    cases = CASES
    if args.batches:
        cases = tuple((f"{b} x ~1k", b, 16, (100, 2048), 256) for b in args.batches) + CASES[3:]
    if args.width:
        cases = tuple(c[:4] + (args.width,) if c[3] == (100, 2048) else c for c in cases)
    rows = []
    for kv_dtype in (torch.bfloat16, FP8_DTYPE):
        orders = (False, True) if args.longest_first else (False,)
        for (label, batch, hq, lens_range, width), ordered in itertools.product(cases, orders):
            query, kc, vc, tables, lens, nbytes = make_batch(batch, hq, lens_range, width,
                                                             kv_dtype, seed=batch,
                                                             longest_first=ordered)
            ws = torch.empty(workspace_size(batch, hq, D, 64), dtype=torch.float32,
                             device="cuda")
            shapes = check_paged_decode_args(query, kc, vc, tables, lens, None, None)
            plan = plan_decode(batch, hq, HKV, D, width * BLOCK, BLOCK, torch.bfloat16,
                               num_sms_of(query.device), max_splits=64,
                               kv_dtype=kv_dtype if kv_dtype == FP8_DTYPE else None)
            ref = None
            sweep = FP8_SWEEP if kv_dtype == FP8_DTYPE else BF16_SWEEP
            variants = ((None, (None, 1), (None, 2), (None, 4), (None, 8)) if ordered else
                        VARIANTS + (sweep if args.sweep else ()))
            for variant in dict.fromkeys(variants):
                tiles, splits = variant if variant else (None, None)
                if kv_dtype != FP8_DTYPE and tiles is not None and variant not in sweep:
                    continue
                out = torch.empty_like(query)

                def call(out=out, tiles=tiles, splits=splits):
                    decode_module.triton_paged_decode(
                        query, kc, vc, tables, lens, shapes, out=out, lse=None, workspace=ws,
                        tiles=DecodeTiles(*tiles) if tiles else None, num_splits=splits)
                try:
                    call()
                    us = time_us(call)
                except Exception as exc:  # noqa: BLE001 - a config the compiler refuses
                    print(f"{kv_dtype} {batch} {variant}: {str(exc).splitlines()[0][:80]}")
                    continue
                ref = out.float() if ref is None else ref
                row = {"kv": str(kv_dtype).split(".")[-1], "batch": label,
                       "variant": ("planned" if variant is None else
                                   f"{'/'.join(map(str, tiles)) if tiles else 'planned tiles'}, "
                                   f"splits {splits or 'planned'}")
                       + (", longest first" if ordered else ""),
                       "us": us, "pct_copy": 100 * nbytes / (us * 1e-6) / 1e9 / ceilings.copy_gbps,
                       "max_diff": float((out.float() - ref).abs().max())}
                if variant is None and not ordered:
                    row["plan"] = (f"tiles {plan.tiles}, splits {plan.num_splits} "
                                   f"({plan.split_reason})")
                rows.append(row)
                print(json.dumps(row), flush=True)
            del kc, vc
            torch.cuda.empty_cache()
    (args.out / "decode_engine_shapes.json").write_text(json.dumps(
        {"env": environment(), "copy_gbps": ceilings.copy_gbps, "rows": rows}, indent=1))
    print(f"\n{environment()['device']}; copy {ceilings.copy_gbps:.0f} GB/s; "
          "% of copy over the bytes read")
    labels = [c[0] for c in cases]
    print(f"{'kv':10}{'variant':32}" + "".join(f"{b:>13}" for b in labels))
    for kv in ("bfloat16", "float8_e4m3fn"):
        for name in dict.fromkeys(r["variant"] for r in rows if r["kv"] == kv):
            cells = [next((f"{r['pct_copy']:13.1f}" for r in rows if r["kv"] == kv
                           and r["variant"] == name and r["batch"] == b), f"{'-':>13}")
                     for b in labels]
            print(f"{kv[:9]:10}{name:32}" + "".join(cells))
    for r in rows:
        if "plan" in r:
            print(r["kv"], r["batch"], r["plan"])


if __name__ == "__main__":
    main()
