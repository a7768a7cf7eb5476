"""Probe: paged decode reading K/V through TMA tensor descriptors (one cache block per load).

A 4-D descriptor over the seed-layout K (or V) view ``[num_blocks, block_size, H_kv, D]``
loads box ``[1, BLOCK_N, 1, D_pad]`` at (physical block, token offset, kv head, 0): the copy
engine does the address arithmetic and zero-fills columns past ``D``. The tile is at most one
cache block. The sequence's partial last tile is loaded with masked pointer loads (unused
slots may hold NaN, and a box cannot be masked by row).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _update(q, k, v, token_valid, m_i, l_i, acc, scale_log2,
            MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        s = tl.where(token_valid[None, :], s, float("-inf"))   # [BLOCK_H, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def tma_decode_kernel(
    query_ptr, k_desc, v_desc, key_cache_ptr, value_cache_ptr, block_tables_ptr,
    context_lens_ptr, out_ptr, lse_ptr, scale_log2,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_token, stride_k_head,
    stride_v_block, stride_v_token, stride_v_head,
    stride_bt_seq,
    stride_o_seq, stride_o_head, stride_o_split, stride_o_dim,
    stride_lse_seq, stride_lse_head,
    GROUP_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT_KV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    num_splits = tl.num_programs(1)

    context_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    num_full = context_len // BLOCK_N

    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    row_valid = rows < GROUP_SIZE
    dim_valid = dims < HEAD_SIZE
    heads = kv_head * GROUP_SIZE + rows
    q = tl.load(query_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head
                + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_SIZE_PADDED], tl.float32)
    all_valid = tl.full([BLOCK_N], 1, tl.int1)
    for tile in range(tile_begin, tl.minimum(tile_end, num_full)):
        start = tile * BLOCK_N
        block = tl.load(table_row + start // BLOCK_SIZE)
        k = k_desc.load([block, start % BLOCK_SIZE, kv_head, 0]).reshape(BLOCK_N, HEAD_SIZE_PADDED)
        v = v_desc.load([block, start % BLOCK_SIZE, kv_head, 0]).reshape(BLOCK_N, HEAD_SIZE_PADDED)
        m_i, l_i, acc = _update(q, k, v, all_valid, m_i, l_i, acc, scale_log2,
                                False, DOT_PRECISION)
    if (num_full >= tile_begin) & (num_full < tile_end):
        # The partial last tile: masked pointer loads (its unused slots may hold NaN).
        tokens = num_full * BLOCK_N + tl.arange(0, BLOCK_N)
        token_valid = tokens < context_len
        block = tl.load(table_row + (num_full * BLOCK_N) // BLOCK_SIZE).to(tl.int64)
        offs = (tokens % BLOCK_SIZE)
        kv_valid = token_valid[:, None] & dim_valid[None, :]
        k = tl.load(key_cache_ptr + kv_head.to(tl.int64) * stride_k_head
                    + block * stride_k_block + offs[:, None] * stride_k_token + dims[None, :],
                    mask=kv_valid, other=0.0)
        v = tl.load(value_cache_ptr + kv_head.to(tl.int64) * stride_v_head
                    + block * stride_v_block + offs[:, None] * stride_v_token + dims[None, :],
                    mask=kv_valid, other=0.0)
        m_i, l_i, acc = _update(q, k, v, token_valid, m_i, l_i, acc, scale_log2,
                                True, DOT_PRECISION)

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_ptrs = (out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head
              + dims[None, :] * stride_o_dim)
    lse_ptrs = lse_ptr + seq.to(tl.int64) * stride_lse_seq + heads * stride_lse_head
    o_valid = row_valid[:, None] & dim_valid[None, :]
    if SPLIT_KV:
        tl.store(o_ptrs + split * stride_o_split, o, mask=o_valid)
        tl.store(lse_ptrs + split, lse, mask=row_valid)
    else:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_valid)


def tma_decode(query, key_cache, value_cache, block_tables, context_lens, out, workspace,
               *, block_n: int, num_warps: int, num_stages: int, num_splits: int) -> None:
    """Launch the probe kernel (and the package's merge when ``num_splits > 1``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    from mini_paged_attn.ops.decode import LOG2E, _merge_splits_kernel

    n, hq, d = query.shape
    _, bs, hkv, _ = key_cache.shape
    dp = max(16, triton.next_power_of_2(d))
    block = [1, min(block_n, bs), 1, dp]
    kd = TensorDescriptor(key_cache, list(key_cache.shape), list(key_cache.stride()), block)
    vd = TensorDescriptor(value_cache, list(value_cache.shape), list(value_cache.stride()), block)
    g = hq // hkv
    meta = dict(GROUP_SIZE=g, HEAD_SIZE=d, HEAD_SIZE_PADDED=dp, BLOCK_H=max(16, triton.next_power_of_2(g)),
                BLOCK_N=min(block_n, bs), BLOCK_SIZE=bs,
                DOT_PRECISION="ieee" if query.dtype.itemsize == 4 else "tf32",
                num_warps=num_warps, num_stages=num_stages)
    ks, vs, qs, os_ = key_cache.stride(), value_cache.stride(), query.stride(), out.stride()
    scale_log2 = d ** -0.5 * LOG2E
    grid = (hkv, num_splits, n)
    if num_splits == 1:
        tma_decode_kernel[grid](query, kd, vd, key_cache, value_cache, block_tables, context_lens,
                                out, out, scale_log2, qs[0], qs[1], ks[0], ks[1], ks[2],
                                vs[0], vs[1], vs[2], block_tables.stride(0),
                                os_[0], os_[1], 0, os_[2], 0, 0, SPLIT_KV=False, **meta)
        return
    part_out = workspace
    part_lse = workspace[n * hq * num_splits * d:]
    po = (hq * num_splits * d, num_splits * d, d)
    pl = (hq * num_splits, num_splits)
    tma_decode_kernel[grid](query, kd, vd, key_cache, value_cache, block_tables, context_lens,
                            part_out, part_lse, scale_log2, qs[0], qs[1], ks[0], ks[1], ks[2],
                            vs[0], vs[1], vs[2], block_tables.stride(0),
                            *po, 1, *pl, SPLIT_KV=True, **meta)
    _merge_splits_kernel[(hq, n)](part_out, part_lse, out, out, num_splits, *po, *pl,
                                  os_[0], os_[1], os_[2], 0, 0, HEAD_SIZE=d, HEAD_SIZE_PADDED=dp,
                                  SPLIT_TILE=min(32, max(16, triton.next_power_of_2(num_splits))),
                                  WRITE_LSE=False, num_warps=1)


def main() -> None:
    """Check and time TMA variants against the planned kernel (GPU), one table."""
    import argparse
    import gc
    import sys
    import time
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_attention import DecodeCase, make_inputs, ours_launch, sdpa_on_contiguous
    from common import measure_ceilings, print_table, time_graph_us, time_us, write_csv
    from mini_paged_attn.ops import explain_decode

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--variants", default="16:4:4,16:4:8,16:2:8,16:4:12,16:2:12,16:1:8")
    p.add_argument("--cases", default="32x4096,32x16384,64x4096,128x1024,256x1024,8x16384,"
                                      "8x65536,32x65536")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    copy = measure_ceilings().copy_gbps
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s", flush=True)
    variants = [tuple(map(int, v.split(":"))) for v in args.variants.split(",")]
    rows = []
    for spec in args.cases.split(","):
        b, c = map(int, spec.split("x"))
        case = DecodeCase(b, c)
        x = make_inputs(case, seed=5)
        plan = explain_decode(b, 32, 8, 128, c, 16, torch.bfloat16)
        ref_fn = ours_launch(x)
        ref_fn()
        ref = x.out.float().clone()
        torch.cuda.synchronize()
        time.sleep(0.5)
        us = time_us(ref_fn)
        rows.append(dict(case=spec, impl="ours", splits=plan.num_splits, us=us,
                         pct=case.pct_of_copy(us, copy), err=0.0))
        split_opts = [plan.num_splits] if b > 1 else [plan.num_splits, 64]
        for bn, w, s in variants:
            for splits in split_opts:
                def fn(bn=bn, w=w, s=s, splits=splits, x=x):
                    tma_decode(*x.args, x.out, x.workspace, block_n=bn, num_warps=w,
                               num_stages=s, num_splits=splits)
                try:
                    x.out.fill_(float("nan"))
                    fn()
                    err = (x.out.float() - ref).abs().max().item()
                    us = time_us(fn)
                    rows.append(dict(case=spec, impl=f"tma {bn},{w},{s}", splits=splits, us=us,
                                     pct=case.pct_of_copy(us, copy), err=err))
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(case=spec, impl=f"tma {bn},{w},{s}", splits=splits,
                                     error=f"{type(e).__name__}: {str(e)[:100]}"))
                print(rows[-1], flush=True)
        if b == 1:
            sets = [make_inputs(case, seed=10 + i)
                    for i in range(max(2, min(32, (256 << 20) // case.kv_bytes + 1)))]
            g = time_graph_us([sdpa_on_contiguous(y, case, "sdpa_cudnn", "gqa") for y in sets])
            rows.append(dict(case=spec, impl="cudnn graph", graph_us=g))
            g = time_graph_us([ours_launch(y) for y in sets])
            rows.append(dict(case=spec, impl="ours graph", graph_us=g))
            for bn, w, s in variants:
                for splits in split_opts:
                    fns = [lambda y=y, bn=bn, w=w, s=s, splits=splits: tma_decode(
                        *y.args, y.out, y.workspace, block_n=bn, num_warps=w, num_stages=s,
                        num_splits=splits) for y in sets]
                    rows.append(dict(case=spec, impl=f"tma {bn},{w},{s} graph", splits=splits,
                                     graph_us=time_graph_us(fns)))
            del sets
        del x
        gc.collect()
        torch.cuda.empty_cache()
    write_csv(args.out / "tma_probe.csv", rows)
    print_table(rows, list(dict.fromkeys(k for r in rows for k in r)))


if __name__ == "__main__":
    main()
