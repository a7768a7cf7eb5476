"""Why does decode over an fp8 cache read only ~65% of copy bandwidth? (GPU experiment)

A copy of the unsplit decode kernel with the fp8 -> 16-bit conversion as a constexpr switch:

- ``to_q``: ``k.to(q.dtype)`` (what the library does; e4m3 -> bf16 has no single instruction
  on sm90, so it goes through fp16 and fp32);
- ``fp16``: everything in fp16 (the query converted in the kernel, e4m3 -> fp16 is native);
- ``bits``: e4m3 bits placed in an fp32 word (sign, exponent, mantissa shifted), times 2^120,
  then fp32 -> bf16 (exact for normals and subnormals);
- ``bits16``: the e4m3 bits placed in a bf16 word, times 2^120 in bf16 (bf16 arithmetic keeps
  subnormals);
- ``noconv``: load the bytes and only sum them (the access pattern's ceiling, wrong output),

each over a sweep of tiles, at the bench_fp8 shapes, against bf16 (the library) and copy
bandwidth in the same run. Prints a table; ``--out`` writes JSON.

    python -m benchmarks.experiments.fp8_decode_convert --out /tmp/fp8conv
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

CONVERTS = {"to_q": 0, "fp16": 1, "bits": 2, "bits16": 3, "noconv": 4}


@triton.jit
def _kv_to(x, q_dtype: tl.constexpr, CONVERT: tl.constexpr):
    if CONVERT == 0:
        return x.to(q_dtype)
    elif CONVERT == 1:
        return x.to(tl.float16)
    elif CONVERT == 2:
        b = x.to(tl.uint8, bitcast=True).to(tl.uint32)
        w = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
        return (w.to(tl.float32, bitcast=True) * 1.329227995784916e+36).to(tl.bfloat16)
    else:
        b = x.to(tl.uint8, bitcast=True).to(tl.uint16)
        w = ((b & 0x80) << 8) | ((b & 0x7F) << 4)
        return w.to(tl.bfloat16, bitcast=True) * 1.329227995784916e+36


@triton.jit
def _decode_exp(query_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale_log2,
                s_q_seq, s_q_head, s_k_block, s_k_tok, s_k_head, s_v_block, s_v_tok, s_v_head,
                s_bt, s_o_seq, s_o_head,
                GROUP: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CONVERT: tl.constexpr):
    kv_head = tl.program_id(0)
    seq = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq)
    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, D)
    row_valid = rows < GROUP
    heads = kv_head * GROUP + rows
    q = tl.load(query_ptr + seq.to(tl.int64) * s_q_seq + heads[:, None] * s_q_head
                + dims[None, :], mask=row_valid[:, None], other=0.0)   # [BLOCK_H, D]
    if CONVERT == 1:
        q = q.to(tl.float16)
    table = tables_ptr + seq.to(tl.int64) * s_bt
    k_head = k_ptr + kv_head.to(tl.int64) * s_k_head
    v_head = v_ptr + kv_head.to(tl.int64) * s_v_head
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for tile in range(0, tl.cdiv(ctx, BLOCK_N)):
        toks = tile * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BLOCK_N]
        valid = toks < ctx
        blocks = tl.load(table + toks // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        k_rows = blocks * s_k_block + (toks % BLOCK_SIZE) * s_k_tok
        v_rows = blocks * s_v_block + (toks % BLOCK_SIZE) * s_v_tok
        k = tl.load(k_head + k_rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_head + v_rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        # k, v: [BLOCK_N, D] fp8
        if CONVERT == 4:
            kb = k.to(tl.uint8, bitcast=True).to(tl.float32)
            vb = v.to(tl.uint8, bitcast=True).to(tl.float32)
            acc += tl.sum(kb + vb, axis=0)[None, :]
        else:
            kc = _kv_to(k, q.dtype, CONVERT)
            vc = _kv_to(v, q.dtype, CONVERT)
            s = tl.dot(q, tl.trans(kc)) * scale_log2
            s = tl.where(valid[None, :], s, float("-inf"))                # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vc.dtype), vc)
            m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + seq.to(tl.int64) * s_o_seq + heads[:, None] * s_o_head + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def launch(x, kc, vc, out, convert: str, block_n: int, warps: int, stages: int):
    case_h = x.query.shape[1]
    hkv = kc.shape[2]
    group = case_h // hkv
    ks, vs = kc.stride(), vc.stride()
    grid = (hkv, 1, x.query.shape[0])
    _decode_exp[grid](x.query, kc, vc, x.block_tables, x.context_lens, out,
                      x.query.shape[-1] ** -0.5 * 1.4426950408889634,
                      x.query.stride(0), x.query.stride(1), ks[0], ks[1], ks[2],
                      vs[0], vs[1], vs[2], x.block_tables.stride(0), out.stride(0), out.stride(1),
                      GROUP=group, D=x.query.shape[-1], BLOCK_H=max(16, group), BLOCK_N=block_n,
                      BLOCK_SIZE=kc.shape[1], CONVERT=CONVERTS[convert], num_warps=warps,
                      num_stages=stages)


SPLIT_TILES = ((32, 4, 5), (64, 4, 6), (64, 2, 6), (64, 2, 8), (64, 1, 6), (32, 2, 8),
               (128, 2, 4))


def _inputs(batch: int, ctx: int):
    """A bench_attention decode case, the same K/V in an fp8 pool, the library's fp8 output
    (the reference each variant is checked against), and the bytes read besides K/V."""
    from benchmarks.bench_attention import DecodeCase, make_inputs
    from mini_paged_attn.ops import paged_decode
    from mini_paged_attn.ops.kv_quant import FP8_DTYPE

    case = DecodeCase(batch, ctx)
    x = make_inputs(case, 0)
    pool8 = torch.stack([x.key_cache, x.value_cache], dim=2).to(FP8_DTYPE)
    k8, v8 = pool8[:, :, 0], pool8[:, :, 1]
    ref = paged_decode(x.query, k8, v8, x.block_tables, x.context_lens).float()
    other = 2 * x.query.numel() * 2 + x.block_tables.numel() * 4   # query, output, table
    return case, x, k8, v8, ref, other


def split_rows(copy: float) -> list[dict]:
    """Small batches (split-KV) through the library's kernel, fp8 split tiles forced."""
    from benchmarks.common import time_us
    from mini_paged_attn.ops import paged_decode
    from mini_paged_attn.ops.checks import check_paged_decode_args
    from mini_paged_attn.ops.decode import triton_paged_decode
    from mini_paged_attn.ops.attention.decode_plan import DecodeTiles, num_sms_of, plan_decode
    from mini_paged_attn.ops.kv_quant import FP8_DTYPE

    rows = []
    for batch, ctx in ((1, 16384), (4, 16384), (8, 16384), (1, 65536), (8, 65536)):
        case, x, k8, v8, ref, other = _inputs(batch, ctx)
        label = f"{batch}x{ctx}"
        us = time_us(lambda: paged_decode(x.query, x.key_cache, x.value_cache, x.block_tables,
                                          x.context_lens, out=x.out, workspace=x.workspace))
        rows.append(dict(shape=label, variant="lib bf16", us=us,
                         pct=100 * (case.kv_bytes + other) / us / 1e3 / copy, err=0.0))
        shapes = check_paged_decode_args(x.query, k8, v8, x.block_tables, x.context_lens,
                                         None, None)
        for bn, w, st in ((0, 0, 0),) + SPLIT_TILES:
            tiles = None if bn == 0 else DecodeTiles(bn, w, st)
            plan = plan_decode(batch, case.num_q_heads, case.num_kv_heads, case.head_size,
                               ctx, case.block_size, case.dtype, num_sms_of(x.query.device),
                               tiles=tiles, kv_dtype=FP8_DTYPE)
            out = torch.empty_like(x.query)

            def call(tiles=tiles, plan=plan, out=out):
                triton_paged_decode(x.query, k8, v8, x.block_tables, x.context_lens, shapes,
                                    out=out, lse=None, workspace=x.workspace,
                                    num_splits=plan.num_splits, tiles=tiles)
            call()
            us = time_us(call)
            name = "lib fp8" if tiles is None else f"fp8 {bn}/{w}/{st}"
            rows.append(dict(shape=label, variant=f"{name} s{plan.num_splits}", us=us,
                             pct=100 * (case.kv_bytes // 2 + other) / us / 1e3 / copy,
                             err=float((out.float() - ref).abs().max())))
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    from benchmarks.common import measure_ceilings, print_table, time_us
    from mini_paged_attn.ops import paged_decode

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--part", choices=("unsplit", "split", "both"), default="both")
    args = p.parse_args(argv)
    copy = measure_ceilings().copy_gbps
    if args.part != "unsplit":
        split = split_rows(copy)
        print_table(split, ["shape", "variant", "us", "pct", "err"])
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "fp8_decode_split.json").write_text(json.dumps(split, indent=1))
        if args.part == "split":
            return
    shapes = ((64, 4096), (256, 4096), (128, 16384), (32, 65536))
    if args.quick:
        shapes = shapes[:1]
    sweep = [("fp16", bn, w, s) for bn, w, s in (
        (64, 2, 6), (64, 2, 7), (64, 2, 8), (64, 1, 6), (64, 1, 8), (32, 1, 8), (32, 2, 8),
        (128, 2, 3), (128, 4, 5))]
    rows = []
    for batch, ctx in shapes:
        case, x, k8, v8, ref, other = _inputs(batch, ctx)
        kv16 = case.kv_bytes
        us = time_us(lambda: paged_decode(x.query, x.key_cache, x.value_cache, x.block_tables,
                                          x.context_lens, out=x.out))
        rows.append(dict(shape=f"{batch}x{ctx}", variant="lib bf16", us=us,
                         pct=100 * (kv16 + other) / us / 1e3 / copy, err=0.0))
        us = time_us(lambda: paged_decode(x.query, k8, v8, x.block_tables, x.context_lens,
                                          out=x.out))
        rows.append(dict(shape=f"{batch}x{ctx}", variant="lib fp8", us=us,
                         pct=100 * (kv16 // 2 + other) / us / 1e3 / copy, err=0.0))
        for conv, bn, w, s in sweep:
            out = torch.empty_like(x.query)
            try:
                launch(x, k8, v8, out, conv, bn, w, s)
                us = time_us(lambda: launch(x, k8, v8, out, conv, bn, w, s))
            except Exception as e:  # noqa: BLE001 - an experiment: record and go on
                rows.append(dict(shape=f"{batch}x{ctx}", variant=f"{conv} {bn}/{w}/{s}",
                                 us=float("nan"), pct=float("nan"), err=str(e)[:60]))
                continue
            err = float((out.float() - ref).abs().max()) if conv != "noconv" else float("nan")
            rows.append(dict(shape=f"{batch}x{ctx}", variant=f"{conv} {bn}/{w}/{s}", us=us,
                             pct=100 * (kv16 // 2 + other) / us / 1e3 / copy, err=err))
        torch.cuda.empty_cache()
    print(f"copy bandwidth {copy:.0f} GB/s, {torch.cuda.get_device_name()}")
    print_table(rows, ["shape", "variant", "us", "pct", "err"])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_decode_convert.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
