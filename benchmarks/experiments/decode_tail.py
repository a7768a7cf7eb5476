"""Decode at workload (a)'s tail (GPU): the few sequences left once most requests finished,
each of 1000..2000 tokens, longest first as the engine orders them, over bf16 and fp8 caches;
the planned launch against forced splits and bf16 tiles.

Qwen3-0.6B attention (16 query / 8 KV heads, head_size 128), 16-token blocks in random order,
128-block tables (the engine's narrowest graph width holding 2k tokens). Each row: % of the
copy bandwidth over the bytes the batch reads (see ``decode_engine_shapes``).

    python -m benchmarks.experiments.decode_tail [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import environment, start_gpu_run, time_us
from benchmarks.experiments.decode_engine_shapes import BLOCK, D, HKV, make_batch
from mini_paged_attn.ops import decode as decode_module
from mini_paged_attn.ops.checks import check_paged_decode_args
from mini_paged_attn.ops.decode import workspace_size
from mini_paged_attn.ops.attention.decode_plan import DecodeTiles, num_sms_of, plan_decode
from mini_paged_attn.ops.kv_quant import FP8_DTYPE

HQ, WIDTH, LENS = 16, 128, (1000, 2000)
BATCHES = (8, 16, 24, 32, 48, 64, 96)
SPLITS = tuple((None, s) for s in (1, 2, 3, 4, 6, 8))
BF16_TILES = tuple((tiles, s) for tiles in ((64, 4, 3), (64, 2, 4)) for s in (1, 2, 4)) + (
    ((128, 8, 3), 1), ((128, 8, 3), 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    ceilings = start_gpu_run(args.out, "benchmarks.experiments.decode_tail")
    rows = []
    for kv_dtype in (torch.bfloat16, FP8_DTYPE):
        kv = "fp8" if kv_dtype == FP8_DTYPE else "bf16"
        for batch in BATCHES:
            query, kc, vc, tables, lens, nbytes = make_batch(batch, HQ, LENS, WIDTH, kv_dtype,
                                                             seed=batch, longest_first=True)
            order = torch.arange(batch, dtype=torch.int32, device="cuda")
            ws = torch.empty(workspace_size(batch, HQ, D, 64), dtype=torch.float32,
                             device="cuda")
            shapes = check_paged_decode_args(query, kc, vc, tables, lens, None, None)
            plan = plan_decode(batch, HQ, HKV, D, WIDTH * BLOCK, BLOCK, torch.bfloat16,
                               num_sms_of(query.device), max_splits=64, ordered=True,
                               kv_dtype=kv_dtype if kv == "fp8" else None)
            for variant in (None,) + SPLITS + (BF16_TILES if kv == "bf16" else ()):
                tiles, splits = variant or (None, None)
                out = torch.empty_like(query)

                def call(out=out, tiles=tiles, splits=splits):
                    decode_module.triton_paged_decode(
                        query, kc, vc, tables, lens, shapes, out=out, lse=None, workspace=ws,
                        tiles=DecodeTiles(*tiles) if tiles else None, num_splits=splits,
                        seq_order=order)
                call()
                us = time_us(call)
                name = ("planned" if variant is None else
                        f"{'/'.join(map(str, tiles)) if tiles else 'planned tiles'}, "
                        f"{splits} split{'s' if splits > 1 else ''}")
                rows.append({"kv": kv, "batch": batch, "variant": name, "us": us,
                             "pct_copy": 100 * nbytes / (us * 1e-6) / 1e9 / ceilings.copy_gbps,
                             **({"plan": f"{plan.tiles}, {plan.num_splits} splits"}
                                if variant is None else {})})
    (args.out / "decode_tail.json").write_text(json.dumps(
        {"env": environment(), "copy_gbps": ceilings.copy_gbps, "rows": rows}, indent=1))
    print(f"\n{environment()['device']}; copy {ceilings.copy_gbps:.0f} GB/s; % of copy over "
          f"the bytes read, contexts {LENS[0]}..{LENS[1]} longest first")
    for kv in ("bf16", "fp8"):
        print(f"{kv:28}" + "".join(f"{b:>7}" for b in BATCHES))
        for name in dict.fromkeys(r["variant"] for r in rows if r["kv"] == kv):
            cells = {r["batch"]: r["pct_copy"] for r in rows
                     if r["kv"] == kv and r["variant"] == name}
            print(f"{name:28}" + "".join(f"{cells[b]:7.1f}" for b in BATCHES))
        for r in rows:
            if r["kv"] == kv and "plan" in r:
                print(f"  {r['batch']}: {r['plan']}")


if __name__ == "__main__":
    main()
