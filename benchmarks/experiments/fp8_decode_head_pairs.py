"""fp8 decode with several KV heads a program (GPU): do longer programs close the fp8 kernel's
gap at the engine's shapes?

Over an fp8 cache a program reads half the bytes a 16-bit one does for the same tokens, so
its fixed work (the first loads, the query, the output) weighs twice as much: at workload
(a)'s contexts of 100..2048 tokens the planned fp8 launch reads 75-80% of copy bandwidth
where bf16 reads 97-99%. Here one program serves ``HEADS`` adjacent KV heads of a sequence:
their K (and V) rows lie side by side in the cache, so a tile is one load of ``[BLOCK_N,
HEADS * head_size]``, and one dot serves all heads with a block-diagonal query (row ``r`` of
head ``h`` holds its query in columns ``h * head_size ..`` and zeros elsewhere); P @ V gives
every row all heads' columns, of which it keeps its own. Unsplit, no scales, no variants:
a stripped-down kernel, checked against ``paged_decode`` and timed beside its planned launch
and the library kernel with forced tiles and splits on the same batches, L2 flushed, % of
copy bandwidth over the fp8 bytes read. What it showed (docs/performance-notes.md, "fp8
decode in longest-first order"): several heads a program do not pay, but the library's
unsplit launch beat its planned 2 splits at 128 and 256 sequences taken longest first.

    python -m benchmarks.experiments.fp8_decode_head_pairs
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.common import environment, start_gpu_run, time_us
from benchmarks.experiments.decode_engine_shapes import D, HKV, make_batch
from mini_paged_attn.ops import paged_decode
from mini_paged_attn.ops.checks import check_paged_decode_args
from mini_paged_attn.ops.decode import triton_paged_decode
from mini_paged_attn.ops.attention.decode_plan import DecodeTiles
from mini_paged_attn.ops.kv_quant import FP8_DTYPE


@triton.jit
def _heads_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, order_ptr, out_ptr, scale_log2,
                  stride_q_seq, stride_q_head, stride_kb, stride_kt, stride_vb, stride_vt,
                  stride_bt, stride_o_seq, stride_o_head,
                  GROUP: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    HD: tl.constexpr = HEADS * D
    first = tl.program_id(0) * HEADS                 # first KV head of the program
    seq = tl.load(order_ptr + tl.program_id(1))
    ctx = tl.load(lens_ptr + seq)
    rows = tl.arange(0, BLOCK_H)                     # [BLOCK_H] (head, group member) rows
    cols = tl.arange(0, HD)                          # [HD] (head, dim) columns
    row_head = rows // GROUP
    row_valid = rows < HEADS * GROUP
    own = row_valid[:, None] & ((cols // D)[None, :] == row_head[:, None])  # [BLOCK_H, HD]
    q_heads = first * GROUP + rows
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_seq + q_heads[:, None] * stride_q_head
                + (cols % D)[None, :], mask=own, other=0.0).to(tl.float16)  # block-diagonal
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + first * D
    v_base = v_ptr + first * D
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HD], tl.float32)
    for tile in range(0, tl.cdiv(ctx, BLOCK_N)):
        tokens = tile * BLOCK_N + tl.arange(0, BLOCK_N)                  # [BLOCK_N]
        valid = tokens < ctx
        blocks = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        k_rows = blocks * stride_kb + (tokens % BLOCK_SIZE) * stride_kt
        v_rows = blocks * stride_vb + (tokens % BLOCK_SIZE) * stride_vt
        k = tl.load(k_base + k_rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_base + v_rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float16))) * scale_log2           # [BLOCK_H, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_seq + q_heads[:, None] * stride_o_head
             + (cols % D)[None, :], out.to(out_ptr.dtype.element_ty), mask=own)


def heads_launcher(query, kc, vc, tables, lens, order, heads, block_n, warps, stages):
    batch, hq, _ = query.shape
    group = hq // HKV
    out = torch.empty_like(query)
    block_h = max(16, triton.next_power_of_2(heads * group))
    assert kc.stride(2) == D and vc.stride(2) == D, "heads side by side"

    def run():
        _heads_kernel[(HKV // heads, batch)](
            query, kc, vc, tables, lens, order, out, D ** -0.5 * 1.4426950408889634,
            query.stride(0), query.stride(1), kc.stride(0), kc.stride(1), vc.stride(0),
            vc.stride(1), tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, HEADS=heads, D=D, BLOCK_H=block_h, BLOCK_N=block_n,
            BLOCK_SIZE=kc.shape[1], num_warps=warps, num_stages=stages)
        return out
    return run


CASES = (("64 x ~1k", 64, 16, (100, 2048), 128), ("128 x ~1k", 128, 16, (100, 2048), 128),
         ("256 x ~1k", 256, 16, (100, 2048), 128), ("64 x 4k g4", 64, 32, (4096, 4096), 256),
         ("256 x 4k g4", 256, 32, (4096, 4096), 256))
CONFIGS = ([(1, n, w, s) for n, w, s in ((128, 2, 3), (64, 2, 3), (64, 2, 2), (64, 2, 4),
                                          (64, 1, 3), (32, 2, 3), (32, 1, 3), (128, 4, 2))]
           + [(2, n, w, s) for n, w, s in ((64, 4, 3), (32, 4, 3), (32, 2, 3))]
           + [(4, 32, 4, 3)])
# The library's own kernel with forced tiles and splits, on the same batches.
LIBRARY = [((128, 2, 3), 1), ((128, 2, 3), 2), ((64, 2, 3), 1), ((64, 2, 3), 2),
           ((64, 2, 6), 1), ((64, 2, 2), 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="fewer configs")
    args = parser.parse_args()
    ceilings = start_gpu_run(args.out, "fp8_decode_head_pairs")
    env = environment()
    table = {}
    configs = CONFIGS[:2] if args.quick else CONFIGS
    for label, batch, hq, lens_range, width in CASES:
        query, kc, vc, tables, lens, nbytes = make_batch(batch, hq, lens_range, width,
                                                         FP8_DTYPE, seed=batch,
                                                         longest_first=True)
        order = torch.arange(batch, dtype=torch.int32, device="cuda")
        expect = paged_decode(query, kc, vc, tables, lens).float()

        def planned():
            return paged_decode(query, kc, vc, tables, lens, seq_order=order)
        table[(label, "library, planned")] = (100 * nbytes / time_us(planned) / 1e3
                                              / ceilings.copy_gbps)
        shapes = check_paged_decode_args(query, kc, vc, tables, lens, None, None)
        for tiles, splits in LIBRARY:
            out = torch.empty_like(query)

            def forced(out=out, tiles=tiles, splits=splits):
                triton_paged_decode(query, kc, vc, tables, lens, shapes, out=out, lse=None,
                                    tiles=DecodeTiles(*tiles), num_splits=splits,
                                    fused_merge=True, seq_order=order)
            forced()
            name = f"library, {'/'.join(map(str, tiles))}, {splits} split{'s' * (splits > 1)}"
            table[(label, name)] = 100 * nbytes / time_us(forced) / 1e3 / ceilings.copy_gbps
        for heads, block_n, warps, stages in configs:
            name = f"{heads} head{'s' if heads > 1 else ''} a program, {block_n}/{warps}/{stages}"
            try:
                fn = heads_launcher(query, kc, vc, tables, lens, order, heads, block_n, warps,
                                    stages)
                got = fn().float()
                err = ((got - expect).norm() / expect.norm()).item()
                if not err < 1e-2:
                    print(f"{label} {name}: wrong, rel err {err:.2e}", flush=True)
                    continue
                table[(label, name)] = 100 * nbytes / time_us(fn) / 1e3 / ceilings.copy_gbps
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses
                print(f"{label} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}",
                      flush=True)
        print(f"{label} done", flush=True)
        del kc, vc
        torch.cuda.empty_cache()
    labels = [c[0] for c in CASES]
    print(f"\n{env['device']} torch {env['torch']} triton {env['triton']} {env['date']}; copy "
          f"{ceilings.copy_gbps:.0f} GB/s; % of copy over the fp8 bytes read, longest first")
    print(f"{'variant':34}" + "".join(f"{b:>13}" for b in labels))
    for name in dict.fromkeys(n for _, n in table):
        print(f"{name:34}" + "".join(f"{table[(b, name)]:13.1f}" if (b, name) in table
                                     else f"{'-':>13}" for b in labels))


if __name__ == "__main__":
    main()
