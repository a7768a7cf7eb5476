"""Paged decode's split rule before and after counting split programs 4 a SM, against cuDNN SDPA.

For each shape: cuDNN SDPA on contiguous K/V, our kernel with the split count the old rule
chose (FlashAttention's heuristic on 2 programs a SM, then ``balance_splits``), the planned
launch (today's rule, :data:`~mini_paged_attn.ops.attention.decode_plan.SPLIT_PROGRAMS_PER_SM`),
and the planned split count with 64-token tiles in 4 stages. Each launch is checked against
flash SDPA, then timed with CUDA events, L2 flushed (:func:`benchmarks.common.time_us`).

    python -m benchmarks.experiments.decode_split_rule --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.bench_attention import (DecodeCase, gather_contiguous, make_inputs, ours_launch,
                                        sdpa_decode)
from benchmarks.common import print_table, start_gpu_run, time_us
from mini_paged_attn.core.args import cdiv
from mini_paged_attn.ops import explain_decode
from mini_paged_attn.ops.attention.decode_plan import PROGRAMS_PER_SM, balance_splits
from mini_paged_attn.ops.decode_tiles import DecodeTiles
from mini_paged_attn.ops.heuristics import num_splits_heuristic

CASES = ("1x1024,1x2048,1x4096,1x16384,1x32768,1x65536,2x4096,2x16384,2x65536,4x4096,4x16384,"
         "4x65536,8x4096,8x8192,8x16384,8x65536,16x4096,16x8192,16x16384,24x8192,32x4096,"
         "1x16384/64,8x16384/64,1x65536/bs1,8x16384/bs128")
N64 = DecodeTiles(block_n=64, num_warps=4, num_stages=4)


def old_splits(case: DecodeCase, block_n: int, num_sms: int) -> int:
    units, slots = case.batch * case.num_kv_heads, num_sms * PROGRAMS_PER_SM
    n_tiles = cdiv(case.context, block_n)
    cap = min(128, n_tiles)
    s = num_splits_heuristic(units, slots, n_tiles, cap)
    return balance_splits(s, units, slots, n_tiles, cap) if s > 1 else 1


def parse(spec: str) -> DecodeCase:
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


def run_case(case: DecodeCase, num_sms: int) -> dict:
    x, k, v, expected, plan = case_inputs(case)
    old = old_splits(case, plan.tiles.block_n, num_sms) if plan.num_splits > 1 else 1
    row = dict(case=case.label, old_splits=old, new_splits=plan.num_splits)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        row["cudnn_us"] = time_us(lambda: sdpa_decode(x.query, k, v, "gqa"))
    for name, fn in (("old_us", ours_launch(x, splits=old)), ("new_us", ours_launch(x)),
                     ("new_n64_us", ours_launch(x, tiles=N64, splits=plan.num_splits))):
        fn()
        err = (x.out.float() - expected).abs().max().item()
        row[name] = time_us(fn) if err < 3e-2 else float("nan")
    for name in ("old_us", "new_us", "new_n64_us"):
        row[name.replace("_us", "/cudnn")] = round(row["cudnn_us"] / row[name], 3)
        row[name] = round(row[name], 1)
    row["cudnn_us"] = round(row["cudnn_us"], 1)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="decode_split_rule", help="directory for the JSON rows")
    p.add_argument("--cases", default=CASES,
                   help="BxC[/HEAD_SIZE|/bsBLOCK],... (bf16, 32 q / 8 kv heads)")
    args = p.parse_args(argv)
    ceilings = start_gpu_run(args.out, "decode_split_rule")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [run_case(parse(spec), num_sms) for spec in args.cases.split(",")]
    print(f"copy {ceilings.copy_gbps:.0f} GB/s")
    print_table(rows, ["case", "old_splits", "new_splits", "cudnn_us", "old_us", "new_us",
                       "new_n64_us", "old/cudnn", "new/cudnn", "new_n64/cudnn"])
    (Path(args.out) / "decode_split_rule.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
