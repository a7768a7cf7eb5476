"""Decode over an fp8 cache (GPU): tile configs, and V converted by ``.to`` or by the opaque
``e4m3_to_fp16`` (``FP8_V_ASM``), in one process.

Converted by ``.to``, the compiler reads V from shared memory a byte at a time straight into
the PV dot's operand layout (256 ``LDS.U8`` per thread and 128-token tile, see
``decode_compile_check``); the opaque conversion reads 16-byte rows and transposes the fp16
tile with ``ldmatrix``. Each row times one tile config (block_n / warps / stages) at the
shapes of ``bench_fp8`` (32 query / 8 KV heads, head_size 128, block_size 16, blocks in random
order, bf16 queries) with L2 flushed: % of copy bandwidth over the bytes read (K/V at one byte),
and the largest difference from the planned launch with ``.to``.

    python -m benchmarks.experiments.fp8_decode_tiles [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.bench_attention import DecodeCase, make_inputs
from benchmarks.common import environment, start_gpu_run, time_us
from mini_paged_attn.ops import decode as decode_module
from mini_paged_attn.ops.checks import check_paged_decode_args
from mini_paged_attn.ops.explain import DecodeTiles
from mini_paged_attn.ops.kv_quant import FP8_DTYPE

# (batch, context, splits: None = planned)
SHAPES = ((64, 4096, None), (256, 4096, None), (128, 16384, None), (32, 65536, None),
          (32, 65536, 4), (8, 65536, None), (1, 16384, None))
TILES = (None, (128, 2, 3), (64, 2, 6), (64, 2, 8), (64, 2, 4), (64, 1, 4), (64, 1, 6),
         (32, 2, 8), (128, 4, 3))


@contextmanager
def v_conversion(opaque: bool):
    """Launches prepared inside take ``FP8_V_ASM=opaque`` whatever the plan says."""
    real = decode_module.PreparedLaunch

    def prepared(kernel, grid, args, constexprs, **kw):
        if "FP8_V_ASM" in constexprs:
            constexprs = {**constexprs, "FP8_V_ASM": opaque and constexprs["FP16_DOTS"]}
        return real(kernel, grid, args, constexprs, **kw)
    decode_module.PreparedLaunch = prepared
    try:
        yield
    finally:
        decode_module.PreparedLaunch = real


def run_case(batch: int, context: int, splits, copy_gbps: float) -> list[dict]:
    case = DecodeCase(batch, context)
    x = make_inputs(case, seed=batch + context)
    kc, vc = x.key_cache.to(FP8_DTYPE), x.value_cache.to(FP8_DTYPE)
    args = (x.query, kc, vc, x.block_tables, x.context_lens)
    shapes = check_paged_decode_args(*args, None, x.out)
    nbytes = (case.kv_bytes // 2 + 2 * x.query.numel() * 2 + x.block_tables.numel() * 4)
    rows, ref = [], None
    label = f"{batch}x{context}" + (f"/{splits}" if splits else "")
    for opaque in (False, True):
        for tiles in TILES:
            forced = DecodeTiles(*tiles) if tiles else None
            out = torch.empty_like(x.query)
            with v_conversion(opaque):
                def call(out=out, forced=forced):
                    decode_module.triton_paged_decode(*args, shapes, out=out, lse=None,
                                                      workspace=x.workspace, tiles=forced,
                                                      num_splits=splits)
                try:
                    call()
                    us = time_us(call)
                except Exception as exc:  # a config the compiler refuses
                    rows.append({"shape": label, "opaque": opaque,
                                 "tiles": tiles, "error": str(exc).splitlines()[0][:80]})
                    continue
            if ref is None:
                ref = out.float()
            rows.append({"shape": label, "opaque": opaque, "tiles": tiles, "us": us,
                         "pct_copy": 100 * nbytes / (us * 1e-6) / 1e9 / copy_gbps,
                         "max_diff": float((out.float() - ref).abs().max())})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    ceilings = start_gpu_run(args.out, "benchmarks.experiments.fp8_decode_tiles")
    env = environment()
    rows = []
    for batch, context, splits in SHAPES:
        rows += run_case(batch, context, splits, ceilings.copy_gbps)
        torch.cuda.empty_cache()
    (args.out / "fp8_decode_tiles.json").write_text(json.dumps(
        {"env": env, "copy_gbps": ceilings.copy_gbps, "rows": rows}, indent=1))
    print(f"\n{env['device']}; copy {ceilings.copy_gbps:.0f} GB/s; % of copy over fp8 bytes "
          "(us at 1x16k)")
    shapes = [f"{b}x{c}" + (f"/{n}" if n else "") for b, c, n in SHAPES]
    print(f"{'V':7}{'tiles':14}" + "".join(f"{s:>11}" for s in shapes))
    for opaque in (False, True):
        for tiles in TILES:
            cells = []
            for s in shapes:
                r = next((r for r in rows if r["shape"] == s and r["opaque"] == opaque
                          and r["tiles"] == tiles), {})
                if "us" not in r:
                    cells.append(f"{'err':>11}")
                elif s.startswith("1x"):
                    cells.append(f"{r['us']:9.1f}us")
                else:
                    cells.append(f"{r['pct_copy']:11.1f}")
            name = "/".join(map(str, tiles)) if tiles else "planned"
            print(f"{'asm' if opaque else '.to':7}{name:14}" + "".join(cells))
    print("max |diff| vs planned .to:", max((r.get("max_diff", 0) for r in rows), default=0))


if __name__ == "__main__":
    main()
