"""Prefill on Hopper: how far Triton 3.6 gets with tensor-descriptor (TMA) loads and warp
specialization, on contiguous and paged K/V (GPU only).

A stripped-down causal prefill kernel (equal-length sequences, bf16, GQA heads packed into the
query tile as in ``ops/prefill_kernel.py``) with switches for how K/V tiles are loaded:

- ``ptr``: contiguous ``[T, Hkv, D]`` K/V, pointer loads (cp.async when pipelined);
- ``tma``: contiguous K/V through a host tensor descriptor over ``[T, Hkv * D]``;
- ``paged-ptr``: the paged cache, a per-token block-table lookup and pointer loads (what the
  library kernel does);
- ``paged-tma``: the paged cache through one descriptor over ``[num_blocks * page, Hkv * D]``,
  one load per page; pages smaller than the K/V tile are stitched with ``tl.join``;

and ``warp_specialize`` on the unmasked K/V loop; beside them, the library kernel in its
configs (``LIBRARY``, contiguous ones through tensor descriptors). Every variant is checked
against the library kernel and timed against cuDNN / flash SDPA in the same process; the
variants tried, their numbers and what they showed are in docs/performance-notes.md.

    python -m benchmarks.experiments.prefill_hopper [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.bench_prefill import (CASES, HKV, HQ, config_name, contiguous_kv, paged_batch,
                                      prefill_fn, sdpa_tflops)
from benchmarks.common import environment, measure_ceilings, time_us
from mini_paged_attn.ops import prefill_plan
from mini_paged_attn.ops.prefill_plan import PrefillConfig

D = 128
GROUP = HQ // HKV
MODES = {"ptr": 0, "tma": 1, "paged-ptr": 2, "paged-tma": 3, "tma-dev": 4}


@triton.jit
def _cat_rows(a, b):
    """Rows of ``a`` then rows of ``b`` ([R, D] + [R, D] -> [2R, D])."""
    R: tl.constexpr = a.shape[0]
    C: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * R, C))


@triton.jit
def _load_page(desc, table_row, pos, col, PAGE: tl.constexpr):
    block = tl.load(table_row + pos // PAGE)
    return desc.load([block * PAGE + pos % PAGE, col])  # [min(PAGE, BLOCK_N), D]


@triton.jit
def _load_tile(desc, ptr, table_row, row0, start_n, kvh, offs_n, offs_d,
               stride_b, stride_t, MODE: tl.constexpr, BLOCK_N: tl.constexpr,
               PAGE: tl.constexpr, D: tl.constexpr):
    if MODE == 0:
        rows = (row0 + start_n + offs_n).to(tl.int64)
        return tl.load(ptr + rows[:, None] * stride_t + kvh * D + offs_d[None, :])
    elif MODE == 1:
        return desc.load([row0 + start_n, kvh * D])
    elif MODE == 4:
        return desc.load([start_n, 0])
    elif MODE == 2:
        pos = start_n + offs_n
        blocks = tl.load(table_row + pos // PAGE).to(tl.int64)
        rows = blocks * stride_b + (pos % PAGE) * stride_t
        return tl.load(ptr + rows[:, None] + kvh * D + offs_d[None, :])
    else:
        if PAGE >= BLOCK_N:
            return _load_page(desc, table_row, start_n, kvh * D, PAGE)
        else:
            tl.static_assert((BLOCK_N == 2 * PAGE) or (BLOCK_N == 4 * PAGE) or (BLOCK_N == 8 * PAGE))
            t0 = _cat_rows(_load_page(desc, table_row, start_n, kvh * D, PAGE),
                           _load_page(desc, table_row, start_n + PAGE, kvh * D, PAGE))
            if BLOCK_N // PAGE >= 4:
                t1 = _cat_rows(_load_page(desc, table_row, start_n + 2 * PAGE, kvh * D, PAGE),
                               _load_page(desc, table_row, start_n + 3 * PAGE, kvh * D, PAGE))
                t0 = _cat_rows(t0, t1)
            if BLOCK_N // PAGE == 8:
                t2 = _cat_rows(_load_page(desc, table_row, start_n + 4 * PAGE, kvh * D, PAGE),
                               _load_page(desc, table_row, start_n + 5 * PAGE, kvh * D, PAGE))
                t3 = _cat_rows(_load_page(desc, table_row, start_n + 6 * PAGE, kvh * D, PAGE),
                               _load_page(desc, table_row, start_n + 7 * PAGE, kvh * D, PAGE))
                t0 = _cat_rows(t0, _cat_rows(t2, t3))
            return t0


@triton.jit
def _step(acc, l_i, m_i, q, start_n, last_visible, qk_scale, k_desc, v_desc, k_ptr, v_ptr,
          table_row, row0, kvh, offs_n, offs_d, stride_b, stride_t, MODE: tl.constexpr,
          BLOCK_N: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr):
    """Load one K/V tile (see _load_tile) and run the online softmax over it."""
    k = _load_tile(k_desc, k_ptr, table_row, row0, start_n, kvh, offs_n, offs_d,
                   stride_b, stride_t, MODE, BLOCK_N, PAGE, D)  # [BLOCK_N, D]
    v = _load_tile(v_desc, v_ptr, table_row, row0, start_n, kvh, offs_n, offs_d,
                   stride_b, stride_t, MODE, BLOCK_N, PAGE, D)
    s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] fp32
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s = tl.where(offs_n[None, :] <= last_visible[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)  # [BLOCK_M, D]
    return acc, l_i, m_new


@triton.jit
def _prefill(q_ptr, out_ptr, k_desc, v_desc, k_ptr, v_ptr, tables_ptr,
             q_len, kv_len, qk_scale, stride_qt, stride_qh, stride_b, stride_t, stride_bt,
             NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
             MODE: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr,
             HEADS_FIRST: tl.constexpr):
    TOK: tl.constexpr = BLOCK_M // GROUP
    n_tiles = tl.cdiv(q_len, TOK)
    # HEADS_FIRST: consecutive programs take the KV heads of one query tile (the library's
    # order); else the query tiles of one KV head.
    tile_axis: tl.constexpr = 1 if HEADS_FIRST else 0
    tile = n_tiles - 1 - tl.program_id(tile_axis)  # heaviest first
    seq = tl.program_id(1 - tile_axis) // NUM_KV_HEADS
    kvh = tl.program_id(1 - tile_axis) % NUM_KV_HEADS
    rows = tl.arange(0, BLOCK_M)
    tok = tile * TOK + rows // GROUP                       # [BLOCK_M]
    head = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = (seq * q_len + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :])                         # [BLOCK_M, D]
    q_offset = kv_len - q_len
    last_visible = q_offset + tok                          # [BLOCK_M]
    kv_end = tl.minimum(q_offset + tile * TOK + TOK, kv_len)
    unmasked_end = (q_offset + tile * TOK + 1) // BLOCK_N * BLOCK_N
    row0 = seq * kv_len
    table_row = tables_ptr + seq * stride_bt
    if MODE == 4:  # one descriptor per program over this sequence's rows of this KV head
        k_desc = tl.make_tensor_descriptor(k_ptr + row0.to(tl.int64) * stride_t + kvh * D,
                                           shape=[kv_len, D], strides=[stride_t, 1],
                                           block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(v_ptr + row0.to(tl.int64) * stride_t + kvh * D,
                                           shape=[kv_len, D], strides=[stride_t, 1],
                                           block_shape=[BLOCK_N, D])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in tl.range(0, unmasked_end, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        acc, l_i, m_i = _step(acc, l_i, m_i, q, start_n, last_visible, qk_scale, k_desc,
                              v_desc, k_ptr, v_ptr, table_row, row0, kvh, offs_n, offs_d,
                              stride_b, stride_t, MODE, BLOCK_N, PAGE, D, False)
    for start_n in tl.range(unmasked_end, kv_end, BLOCK_N, num_stages=STAGES):
        acc, l_i, m_i = _step(acc, l_i, m_i, q, start_n, last_visible, qk_scale, k_desc,
                              v_desc, k_ptr, v_ptr, table_row, row0, kvh, offs_n, offs_d,
                              stride_b, stride_t, MODE, BLOCK_N, PAGE, D, True)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class Variant:
    mode: str
    page: int = 16
    block_m: int = 128
    block_n: int = 128
    warps: int = 8
    stages: int = 3
    ws: bool = False
    heads_first: bool = False

    @property
    def name(self) -> str:
        ws = ("/ws" if self.ws else "") + ("/heads-first" if self.heads_first else "")
        page = f" page {self.page}" if self.page != 16 else ""
        return (f"{self.mode}{page} {self.block_m}x{self.block_n}/w{self.warps}/s{self.stages}"
                f"{ws}")


def library_output(batch) -> torch.Tensor:
    from mini_paged_attn.ops import paged_prefill
    q, kc, vc, tables, cu, ctx = batch
    return paged_prefill(q, kc, vc, tables, cu, ctx, causal=True)


def library_contiguous(batch, contiguous, config):
    """The library kernel on the gathered K/V, repeated through its prepared launch."""
    from mini_paged_attn.ops.prefill import triton_varlen_contiguous
    q, cu = batch[0], batch[4]
    k, v, cu_k = contiguous
    out = torch.empty_like(q)
    launch = triton_varlen_contiguous(q, k, v, cu, cu_k, 0, 0, causal=True, scale=D ** -0.5,
                                      out=out, config=config)
    return lambda: launch((q, k, v, k, k, out, out, cu_k, cu, cu_k, q))


def launcher(variant: Variant, batch, contiguous):
    from triton.tools.tensor_descriptor import TensorDescriptor
    q, kc, vc, tables, cu, ctx = batch
    b = len(ctx)
    q_len, kv_len = q.shape[0] // b, int(ctx[0])
    paged = variant.mode.startswith("paged")
    k, v = (kc, vc) if paged else contiguous[:2]
    page = kc.shape[1]
    k2, v2 = k.reshape(-1, HKV * D), v.reshape(-1, HKV * D)
    box = [min(page, variant.block_n) if paged else variant.block_n, D]
    k_desc, v_desc = TensorDescriptor.from_tensor(k2, box), TensorDescriptor.from_tensor(v2, box)
    out = torch.empty_like(q)
    grid = (triton.cdiv(q_len, variant.block_m // GROUP), b * HKV)
    if variant.heads_first:
        grid = grid[::-1]
    stride_b = k.stride(0) if paged else 0
    stride_t = k.stride(1) if paged else k.stride(0)

    def run():
        _prefill[grid](q, out, k_desc, v_desc, k, v, tables, q_len, kv_len,
                       D ** -0.5 * 1.4426950408889634, q.stride(0), q.stride(1),
                       stride_b, stride_t, tables.stride(0),
                       NUM_KV_HEADS=HKV, GROUP=GROUP, D=D, BLOCK_M=variant.block_m,
                       BLOCK_N=variant.block_n, PAGE=page, MODE=MODES[variant.mode],
                       WS=variant.ws, STAGES=variant.stages, HEADS_FIRST=variant.heads_first,
                       num_warps=variant.warps)
        return out
    return run


# (mode, block_n, stages); 128-row query tiles, 8 warps. The paged pointer loads lose a
# pipeline stage to the block-table load, so they are tried one and two stages deeper.
VARIANTS = [("tma", 128, 3, 16, False), ("paged-ptr", 128, 5, 16, False)]
# Library kernel configs beside its default, with its 16-row tiles for short sequences or
# without them (SMALL_ROWS 0: one instantiation of the K/V loops instead of two).
LIBRARY = [(PrefillConfig(128, 128, 8, 3, tma=True), 16)]


def variants(quick: bool) -> list[Variant]:
    chosen = VARIANTS[:1] + VARIANTS[5:6] if quick else VARIANTS
    return [Variant(mode, page, 128, bn, 8, stages, heads_first=first)
            for mode, bn, stages, page, first in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out"),
                        help="directory for prefill_hopper.json")
    parser.add_argument("--quick", action="store_true", help="two variants only")
    parser.add_argument("--cases", default="causal 1x4k,causal 4x4k,causal 1x16k,"
                        "chunk 512 on 8k x8",
                        help="comma-separated case names of bench_prefill")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # Device-side descriptors (tma-dev) live in per-program scratch memory.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    from torch.nn.attention import SDPBackend
    ceilings = measure_ceilings()
    env = environment()
    rows = []
    for case in [c for c in CASES if c.name in args.cases.split(",")]:
        batch = paged_batch(case)
        contiguous = contiguous_kv(batch)
        by_page = {16: batch}
        ref = prefill_fn(batch, None)
        ref()
        expect = library_output(batch)
        t_lib = time_us(ref)
        base = {"case": case.name,
                "cudnn": sdpa_tflops(case, SDPBackend.CUDNN_ATTENTION),
                "flash": sdpa_tflops(case, SDPBackend.FLASH_ATTENTION)}
        rows.append({**base, "variant": "library", "tflops": case.flops / t_lib / 1e6,
                     "err": 0.0})
        for config, small_rows in LIBRARY:
            prefill_plan.SMALL_ROWS = small_rows
            fn = (library_contiguous(batch, contiguous, config) if config.tma
                  else prefill_fn(batch, config))
            flags = " tma" * config.tma
            rows.append({**base, "variant": f"library {config_name(config)}{flags}",
                         "tflops": case.flops / time_us(fn) / 1e6, "err": float("nan")})
            prefill_plan.SMALL_ROWS = 16
        for variant in variants(args.quick):
            row = {**base, "variant": variant.name}
            try:
                if variant.page not in by_page:
                    by_page[variant.page] = paged_batch(case, block_size=variant.page)
                fn = launcher(variant, by_page[variant.page], contiguous)
                got = fn()
                err = ((got.float() - expect.float()).norm() / expect.float().norm()).item()
                row.update(err=err, tflops=case.flops / time_us(fn) / 1e6)
            except Exception as exc:  # a variant the compiler refuses
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    (args.out / "prefill_hopper.json").write_text(json.dumps(
        {"env": env, "ceilings": asdict(ceilings), "rows": rows}, indent=1))
    print(f"\n{env['device']} torch {env['torch']} triton {env['triton']}; "
          f"matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    print(f"{'case':22} {'variant':34} {'TFLOP/s':>8} {'/cuDNN':>7} {'err':>8}")
    for r in rows:
        if "tflops" in r:
            rel = r["tflops"] / r["cudnn"] if r.get("cudnn") else float("nan")
            print(f"{r['case']:22} {r['variant']:34} {r['tflops']:8.0f} {rel:7.2f} "
                  f"{r['err']:8.1e}")
        else:
            print(f"{r['case']:22} {r['variant']:34} {r.get('error', '')}")
    print("cuDNN / flash:", {r["case"]: (round(r["cudnn"] or 0), round(r["flash"] or 0))
                             for r in rows if r["variant"] == "library"})


if __name__ == "__main__":
    main()
