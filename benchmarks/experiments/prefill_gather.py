"""Paged prefill by gathering the pages first (GPU): copy each sequence's K/V out of the
paged cache into contiguous rows, then run the contiguous kernel (tensor-descriptor loads),
against the paged kernel's block-table loads, on ``bench_prefill``'s cases.

The contiguous kernel reaches 0.9-1.0x cuDNN where the paged one reaches 0.65-0.75x; the
gather adds one read and one write of the sequences' K/V. Per case: the paged kernel, the
gather alone, the contiguous kernel alone, and gather + contiguous (this script's own copy
kernel), then the library's ``paged_prefill`` launch (which copies where
``ops.prefill_gather.should_gather`` says so), in TFLOP/s of the attention's FLOPs, with cuDNN
and flash SDPA in the same run. The gathered result is checked against the paged one.

    python -m benchmarks.experiments.prefill_gather [--out DIR]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.bench_prefill import CASES, D, paged_batch, prefill_fn, sdpa_tflops
from benchmarks.common import environment, start_gpu_run, time_us
from mini_paged_attn.ops import paged_prefill
from mini_paged_attn.ops.checks import check_paged_prefill_args
from mini_paged_attn.ops.prefill import triton_paged_prefill, triton_varlen_contiguous


@triton.jit
def _gather_pages(kc_ptr, vc_ptr, tables_ptr, ctx_ptr, cu_k_ptr, k_out_ptr, v_out_ptr,
                  stride_kb, stride_kt, stride_vb, stride_vt, stride_bt,
                  ROW: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Program (page j, sequence i) copies the i-th sequence's j-th page of K and V (all
    heads: ``ROW = num_kv_heads * head_size`` contiguous elements a token) to rows
    ``cu_k[i] + j * BLOCK_SIZE ...`` of the contiguous outputs."""
    j = tl.program_id(0)
    seq = tl.program_id(1)
    n = tl.load(ctx_ptr + seq)
    if j * BLOCK_SIZE >= n:
        return
    block = tl.load(tables_ptr + seq * stride_bt + j).to(tl.int64)
    start = tl.load(cu_k_ptr + seq).to(tl.int64)
    tok = tl.arange(0, BLOCK_SIZE)                              # [BLOCK_SIZE]
    col = tl.arange(0, ROW)                                     # [ROW]
    valid = (j * BLOCK_SIZE + tok < n)[:, None]                 # [BLOCK_SIZE, 1]
    dst = (start + j * BLOCK_SIZE + tok)[:, None] * ROW + col[None, :]  # [BLOCK_SIZE, ROW]
    k = tl.load(kc_ptr + block * stride_kb + tok[:, None] * stride_kt + col[None, :],
                mask=valid)                                     # [BLOCK_SIZE, ROW]
    tl.store(k_out_ptr + dst, k, mask=valid)
    v = tl.load(vc_ptr + block * stride_vb + tok[:, None] * stride_vt + col[None, :],
                mask=valid)                                     # [BLOCK_SIZE, ROW]
    tl.store(v_out_ptr + dst, v, mask=valid)


def gathered_fns(batch):
    """(gather, contiguous attention, both, output) over a paged batch; the gather's buffers
    are sized by the table (an upper bound known on the host)."""
    q, kc, vc, tables, cu, ctx = batch
    num_seqs, width = tables.shape
    bs, hkv, d = kc.shape[1:]
    rows = num_seqs * width * bs
    k_out = torch.empty(rows, hkv, d, dtype=kc.dtype, device=kc.device)
    v_out = torch.empty_like(k_out)
    cu_k = torch.zeros(num_seqs + 1, dtype=torch.int32, device=kc.device)
    out = torch.empty_like(q)

    def gather():
        torch.cumsum(ctx, 0, out=cu_k[1:])
        _gather_pages[(width, num_seqs)](kc, vc, tables, ctx, cu_k, k_out, v_out,
                                         kc.stride(0), kc.stride(1), vc.stride(0),
                                         vc.stride(1), tables.stride(0), ROW=hkv * d,
                                         BLOCK_SIZE=bs, num_warps=8)
    gather()
    launch = triton_varlen_contiguous(q, k_out, v_out, cu, cu_k, 0, 0, causal=True,
                                      scale=D ** -0.5, out=out)
    args = (q, k_out, v_out, k_out, k_out, out, out, cu_k, cu, cu_k, q)

    def attend():
        launch(args)

    def both():
        gather()
        attend()
    return gather, attend, both, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    ceilings = start_gpu_run(args.out, "prefill_gather")
    env = environment()
    print(f"{env['device']} torch {env['torch']} triton {env['triton']} {env['date']}; "
          f"copy {ceilings.copy_gbps:.0f} GB/s, matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    print(f"{'case':22} {'paged':>7} {'gather us':>10} {'contig':>7} {'g+c':>7} {'library':>8} "
          f"{'cudnn':>7} {'flash':>7} {'lib/cudnn':>10} {'paged/cudnn':>12} {'max diff':>9}")
    from torch.nn.attention import SDPBackend
    for case in CASES:
        batch = paged_batch(case)
        library = prefill_fn(batch, None)
        paged = prefill_fn(batch, None, gather=False)
        gather, attend, both, out = gathered_fns(batch)
        both()
        q, kc, vc, tables, cu, ctx = batch
        ref = torch.empty_like(q)     # the block-table loads' result
        shapes = check_paged_prefill_args(q, kc, vc, tables, cu, ctx, None, ref)
        triton_paged_prefill(q, kc, vc, tables, cu, ctx, shapes, causal=True, out=ref,
                             lse=None, gather=False)
        diff = max((o.float() - ref.float()).abs().max().item()
                   for o in (out, paged_prefill(*batch)))
        tf = lambda us: case.flops / (us * 1e-6) / 1e12  # noqa: E731
        t_paged, t_gather, t_attend, t_both, t_lib = (
            time_us(f) for f in (paged, gather, attend, both, library))
        cudnn = sdpa_tflops(case, SDPBackend.CUDNN_ATTENTION)
        flash = sdpa_tflops(case, SDPBackend.FLASH_ATTENTION)
        ratio = lambda x: f"{x / cudnn:.2f}" if cudnn else "-"  # noqa: E731
        print(f"{case.name:22} {tf(t_paged):7.0f} {t_gather:10.1f} {tf(t_attend):7.0f} "
              f"{tf(t_both):7.0f} {tf(t_lib):8.0f} {cudnn or 0:7.0f} {flash or 0:7.0f} "
              f"{ratio(tf(t_lib)):>10} {ratio(tf(t_paged)):>12} {diff:9.2e}", flush=True)


if __name__ == "__main__":
    main()
