"""Sweep the split count and tiles of paged decode at a few shapes, against cuDNN SDPA.

The question it answers: at mid batches and long contexts (8 x 16k, 8 x 64k, 1 x 64k), which
split count and tiles read the K/V fastest, and what does the planned launch (the heuristic)
leave on the table. Every row is checked against flash SDPA before it is timed (CUDA events,
L2 flushed, :func:`benchmarks.common.time_us`).

    python -m benchmarks.experiments.decode_splits --out DIR [--cases 8x16384,8x65536]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.bench_attention import (DecodeCase, DecodeTiles, gather_contiguous, make_inputs,
                                        ours_launch, sdpa_decode)
from benchmarks.common import print_table, start_gpu_run, time_us
from mini_paged_attn.ops import explain_decode

DEFAULT_CASES = "1x65536,2x65536,4x16384,8x16384,8x65536,16x16384,4x65536,16x8192"
SPLITS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
TILES = {"planned": None,
         "n32s5": DecodeTiles(block_n=32, num_warps=4, num_stages=5),
         "n64s4": DecodeTiles(block_n=64, num_warps=4, num_stages=4),
         "n128s3": DecodeTiles(block_n=128, num_warps=4, num_stages=3),
         "n64s3w8": DecodeTiles(block_n=64, num_warps=8, num_stages=3),
         "n64s3": DecodeTiles(block_n=64, num_warps=4, num_stages=3)}


def parse(spec: str) -> DecodeCase:
    """BxC, BxC/HEAD_SIZE or BxC/bsBLOCK (bf16, 32 q / 8 kv heads)."""
    shape, _, variant = spec.partition("/")
    b, c = (int(t) for t in shape.split("x"))
    if variant.startswith("bs"):
        return DecodeCase(batch=b, context=c, block_size=int(variant[2:]))
    return DecodeCase(batch=b, context=c, head_size=int(variant) if variant else 128)


def case_inputs(case: DecodeCase):
    """``(x, k, v, expected, plan)``: the case's paged inputs, contiguous K/V copies, flash
    SDPA's output (float32) and the planned launch."""
    x = make_inputs(case, seed=0)
    k = gather_contiguous(x, x.key_cache, case).contiguous()
    v = gather_contiguous(x, x.value_cache, case).contiguous()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        expected = sdpa_decode(x.query, k, v).float()
    plan = explain_decode(case.batch, case.num_q_heads, case.num_kv_heads, case.head_size,
                          case.context, case.block_size, case.dtype)
    return x, k, v, expected, plan


def sweep(case: DecodeCase, ceil_gbps: float) -> list[dict]:
    x, k, v, expected, plan = case_inputs(case)
    rows = []
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = time_us(lambda: sdpa_decode(x.query, k, v, "gqa"))
    rows.append(dict(case=case.label, impl="cudnn", splits="", us=round(cudnn, 1),
                     pct=round(case.pct_of_copy(cudnn, ceil_gbps), 1), vs_cudnn=1.0))
    planned = time_us(ours_launch(x))
    rows.append(dict(case=case.label, impl=f"planned({plan.tiles.block_n})",
                     splits=plan.num_splits, us=round(planned, 1),
                     pct=round(case.pct_of_copy(planned, ceil_gbps), 1),
                     vs_cudnn=round(cudnn / planned, 3)))
    for name, tiles in TILES.items():
        for s in SPLITS:
            fn = ours_launch(x, tiles=tiles, splits=s)
            try:
                fn()
                err = (x.out.float() - expected).abs().max().item()
            except Exception as exc:                       # noqa: BLE001 - a sweep row
                rows.append(dict(case=case.label, impl=name, splits=s, us=None, err=str(exc)[:60]))
                continue
            if err > 3e-2:
                rows.append(dict(case=case.label, impl=name, splits=s, us=None, err=err))
                continue
            us = time_us(fn)
            rows.append(dict(case=case.label, impl=name, splits=s, us=round(us, 1),
                             pct=round(case.pct_of_copy(us, ceil_gbps), 1),
                             vs_cudnn=round(cudnn / us, 3)))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="decode_splits", help="directory for the JSON rows")
    p.add_argument("--cases", default=DEFAULT_CASES, help="BxC[/HEAD_SIZE|/bsBLOCK],... (bf16, 32 q / 8 kv heads)")
    args = p.parse_args(argv)
    out = Path(args.out)
    ceilings = start_gpu_run(out, "decode_splits")
    rows = []
    for spec in args.cases.split(","):
        case_rows = sweep(parse(spec), ceilings.copy_gbps)
        rows += case_rows
        timed = [r for r in case_rows if r.get("us")]
        best = min((r for r in timed if r["impl"] != "cudnn"), key=lambda r: r["us"])
        print_table([r for r in timed if r["impl"].startswith(("cudnn", "planned"))] + [best],
                    ["case", "impl", "splits", "us", "pct", "vs_cudnn"])
    (out / "decode_splits.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
