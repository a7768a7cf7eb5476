"""Decode over an fp8 cache (GPU): tile configs, and the kernel's ways of turning V into fp16
(``FP8_V``), in one process.

Converted by ``.to`` (``cast``), the compiler reads V from shared memory a byte at a time
straight into the PV dot's operand layout (256 ``LDS.U8`` per thread and 128-token tile, see
``decode_compile_check``); ``pairs`` reads V as int16 pairs of dims, which ``ldmatrix.trans``
brings into the dot's layout, and converts them there. Each row times one tile config (block_n / warps / stages) at the
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
from mini_paged_attn.ops import decode_tiles
from mini_paged_attn.ops.checks import check_paged_decode_args
from mini_paged_attn.ops.attention.decode_plan import DecodeTiles, plan_decode
from mini_paged_attn.ops.kv_quant import FP8_DTYPE

# (batch, context, splits: None = planned)
SHAPES = [(64, 4096, None), (256, 4096, None), (128, 16384, None), (32, 65536, None),
          (32, 65536, 4), (8, 65536, None), (1, 16384, None)]
TILES = (None, (128, 2, 3), (64, 2, 6), (64, 2, 8), (64, 2, 4), (64, 1, 4), (64, 1, 6),
         (32, 2, 8), (128, 4, 3))


CONVERSIONS = ("cast", "pairs")


@contextmanager
def v_conversion(mode: str):
    """Launches prepared inside take ``FP8_V=mode`` whatever the plan says."""
    real = decode_module.PreparedLaunch

    def prepared(kernel, grid, args, constexprs, **kw):
        if "FP8_V" in constexprs and constexprs["FP16_DOTS"]:
            constexprs = {**constexprs, "FP8_V": mode}
        return real(kernel, grid, args, constexprs, **kw)
    decode_module.PreparedLaunch = prepared
    try:
        yield
    finally:
        decode_module.PreparedLaunch = real


def resources(kernel) -> dict:
    """A compiled kernel's registers a thread and shared memory a program."""
    return {"registers": kernel.n_regs, "shared_kb": round(kernel.metadata.shared / 1024, 1)}


def run_case(batch: int, context: int, splits, copy_gbps: float, conversions, tile_list
             ) -> list[dict]:
    case = DecodeCase(batch, context)
    x = make_inputs(case, seed=batch + context)
    kc, vc = x.key_cache.to(FP8_DTYPE), x.value_cache.to(FP8_DTYPE)
    args = (x.query, kc, vc, x.block_tables, x.context_lens)
    shapes = check_paged_decode_args(*args, None, x.out)
    nbytes = (case.kv_bytes // 2 + 2 * x.query.numel() * 2 + x.block_tables.numel() * 4)
    rows, ref = [], None
    label = f"{batch}x{context}" + (f"/{splits}" if splits else "")
    for mode in conversions:
        for tiles in tile_list:
            forced = DecodeTiles(*tiles) if tiles else None
            out = torch.empty_like(x.query)
            with v_conversion(mode):
                def call(out=out, forced=forced):
                    return decode_module.triton_paged_decode(
                        *args, shapes, out=out, lse=None, workspace=x.workspace, tiles=forced,
                        num_splits=splits)
                try:
                    run = call()
                    us = time_us(call)
                except Exception as exc:  # a config the compiler refuses
                    rows.append({"shape": label, "conversion": mode,
                                 "tiles": tiles, "error": str(exc).splitlines()[0][:80]})
                    continue
            if ref is None:
                ref = out.float()
            rows.append({"shape": label, "conversion": mode, "tiles": tiles, "us": us,
                         "pct_copy": 100 * nbytes / (us * 1e-6) / 1e9 / copy_gbps,
                         "max_diff": float((out.float() - ref).abs().max()),
                         **resources(run.decode.kernel)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--conversions", nargs="+", choices=CONVERSIONS, default=CONVERSIONS)
    parser.add_argument("--tiles", nargs="+", default=None, metavar="N/W/S[/R]",
                        help="tile configs (block_n/warps/stages[/maxnreg], or 'planned'); "
                             "default all")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="BxC[/S]",
                        help="batch x context [/ forced splits]; default the bench_fp8 set")
    parser.add_argument("--fp8-tiles", default=None, metavar="N/W/S[/R]",
                        help="plan fp8 launches with these tiles instead of FP8_TILES and "
                             "its occupancy variants")
    args = parser.parse_args()
    if args.shapes:
        SHAPES[:] = [(int(b), int(c.split("/")[0]),
                      int(c.split("/")[1]) if "/" in c else None)
                     for b, c in (shape.split("x") for shape in args.shapes)]
    if args.fp8_tiles:
        # The plan's fp8 tiles, and its only occupancy choice.
        tiles = DecodeTiles(*(int(v) for v in args.fp8_tiles.split("/")))
        decode_tiles.FP8_TILES, decode_tiles.FP8_OCCUPANCY = tiles, ((tiles, 4),)
        plan_decode.cache_clear()
    tile_list = TILES if args.tiles is None else tuple(
        None if t == "planned" else tuple(int(v) for v in t.split("/")) for t in args.tiles)
    ceilings = start_gpu_run(args.out, "benchmarks.experiments.fp8_decode_tiles")
    env = environment()
    rows = []
    for batch, context, splits in SHAPES:
        rows += run_case(batch, context, splits, ceilings.copy_gbps, args.conversions,
                         tile_list)
        torch.cuda.empty_cache()
    (args.out / "fp8_decode_tiles.json").write_text(json.dumps(
        {"env": env, "copy_gbps": ceilings.copy_gbps, "rows": rows}, indent=1))
    print(f"\n{env['device']}; copy {ceilings.copy_gbps:.0f} GB/s; % of copy over fp8 bytes "
          "(us at 1x16k)")
    shapes = [f"{b}x{c}" + (f"/{n}" if n else "") for b, c, n in SHAPES]
    print(f"{'V':7}{'tiles':14}" + "".join(f"{s:>11}" for s in shapes))
    for mode in args.conversions:
        for tiles in tile_list:
            cells = []
            for s in shapes:
                r = next((r for r in rows if r["shape"] == s and r["conversion"] == mode
                          and r["tiles"] == tiles), {})
                if "us" not in r:
                    cells.append(f"{'err':>11}")
                elif s.startswith("1x"):
                    cells.append(f"{r['us']:9.1f}us")
                else:
                    cells.append(f"{r['pct_copy']:11.1f}")
            name = "/".join(map(str, tiles)) if tiles else "planned"
            used = next((r for r in rows if r["conversion"] == mode and r["tiles"] == tiles
                         and "registers" in r), {})
            print(f"{mode:7}{name:14}" + "".join(cells)
                  + f"   {used.get('registers', '?')} regs, {used.get('shared_kb', '?')} KB")
    print(f"max |diff| vs the first row ({args.conversions[0]}):",
          max((r.get("max_diff", 0) for r in rows), default=0))


if __name__ == "__main__":
    main()
