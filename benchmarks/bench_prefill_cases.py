"""Prefill benchmark cases of issue 4 (GPU): the Triton paged prefill against torch SDPA.

bf16, 32 query heads / 8 KV heads, head_size 128, block_size 16, shuffled block tables:
  - causal whole prompts 1x4k, 4x4k, 1x16k;
  - chunked prefill: 512 new tokens on an 8k cached prefix, x 8 sequences;
  - a mixed batch (60 decodes at 4k context, then 4 prompts of 1k) in one launch, against the
    same work as separate calls (prefill kernel on the prompts + paged decode on the decodes).
TFLOP/s count causal FLOPs as half of the square (``4 * Hq * D * (q * prefix + q^2 / 2)``).
torch SDPA runs on contiguous K/V (``[B, H, L, D]``) with the flash and cuDNN backends in the
same run; a large bf16 matmul gives the ceiling.

    PYTHONPATH=. python3 benchmarks/bench_prefill_cases.py [--sweep] [--csv out.csv]

``bench_attention.py --part prefill`` calls :func:`run_prefill_cases`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (Ceilings, environment, measure_ceilings, print_table,  # noqa: E402
                    time_us, write_csv)

from mini_paged_attn.ops.checks import check_paged_decode_args, check_paged_prefill_args  # noqa: E402
from mini_paged_attn.ops.prefill import triton_paged_prefill  # noqa: E402
from mini_paged_attn.ops.prefill_plan import PrefillConfig  # noqa: E402

HQ, HKV, D, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"  # a module constant so the case builders can be smoke-tested on CPU
COLUMNS = ["case", "config", "us", "tflops", "flash_tflops", "cudnn_tflops", "vs_flash",
           "vs_cudnn", "pct_matmul", "note"]
SWEEP = [PrefillConfig(128, 128, 8, 3),
         PrefillConfig(128, 64, 4, 3), PrefillConfig(128, 64, 8, 4),
         PrefillConfig(128, 128, 8, 2), PrefillConfig(64, 64, 4, 3)]


@dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]

    @property
    def pairs(self) -> float:
        """Visible (query, key) pairs, the causal triangle counted as half the square."""
        return sum(q * p + q * q / 2 for q, p in zip(self.q_lens, self.prefix_lens))

    @property
    def flops(self) -> float:
        return 4.0 * HQ * D * self.pairs


CASES = [
    Case("causal 1x4k", (4096,), (0,)),
    Case("causal 4x4k", (4096,) * 4, (0,) * 4),
    Case("causal 1x16k", (16384,), (0,)),
    Case("chunk 512 on 8k x8", (512,) * 8, (8192,) * 8),
]
MIXED = Case("mixed 60 dec@4k + 4x1k", (1,) * 60 + (1024,) * 4, (4095,) * 60 + (0,) * 4)


def paged_batch(case: Case, seed: int = 0):
    """Query, caches (random, shuffled blocks), tables, cu_seqlens_q, context_lens on cuda."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    ctx = torch.tensor([q + p for q, p in zip(case.q_lens, case.prefix_lens)])
    nblk = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = int(nblk.sum())
    perm = torch.randperm(num_blocks, device=DEVICE, generator=gen).to(torch.int32)
    tables = torch.zeros(len(ctx), int(nblk.max()), dtype=torch.int32, device=DEVICE)
    start = 0
    for i, n in enumerate(nblk.tolist()):
        tables[i, :n] = perm[start:start + n]
        start += n
    shape = (num_blocks, BLOCK_SIZE, HKV, D)
    kc = torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=gen)
    vc = torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=gen)
    cu = torch.zeros(len(ctx) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(case.q_lens), 0)
    q = torch.randn(int(cu[-1]), HQ, D, device=DEVICE, dtype=DTYPE, generator=gen)
    return q, kc, vc, tables, cu.to(DEVICE), ctx.to(torch.int32).to(DEVICE)


def prefill_fn(batch, config: PrefillConfig | None):
    q, kc, vc, tables, cu, ctx = batch
    out = torch.empty_like(q)
    shapes = check_paged_prefill_args(q, kc, vc, tables, cu, ctx, None, out)
    return lambda: triton_paged_prefill(q, kc, vc, tables, cu, ctx, shapes, causal=True,
                                        out=out, lse=None, config=config)


def sdpa_tflops(case: Case, backend) -> float | None:
    """torch SDPA on contiguous [B, H, L, D] K/V (bottom-right causal), or None if the backend
    refuses the case."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    if len(set(case.q_lens)) != 1 or len(set(case.prefix_lens)) != 1:
        return None
    b, lq, lk = len(case.q_lens), case.q_lens[0], case.q_lens[0] + case.prefix_lens[0]
    q = torch.randn(b, HQ, lq, D, device=DEVICE, dtype=DTYPE)
    k = torch.randn(b, HKV, lk, D, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    kwargs = {"is_causal": True} if lq == lk else {"attn_mask": causal_lower_right(lq, lk)}
    try:
        with sdpa_kernel(backend):
            fn = lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
            fn()
            return case.flops / (time_us(fn) * 1e-6) / 1e12
    except (RuntimeError, ValueError, NotImplementedError):
        return None


def decode_fn(batch):
    """The decode rows of a batch as one paged_decode (Triton) call."""
    from mini_paged_attn.ops.decode import triton_paged_decode
    q, kc, vc, tables, ctx = batch
    out = torch.empty_like(q)
    shapes = check_paged_decode_args(q, kc, vc, tables, ctx, None, out)
    return lambda: triton_paged_decode(q, kc, vc, tables, ctx, shapes, out=out, lse=None)


def mixed_rows(config: PrefillConfig | None) -> list[dict]:
    batch = paged_batch(MIXED)
    q, kc, vc, tables, cu, ctx = batch
    n_dec = MIXED.q_lens.count(1)
    one = prefill_fn(batch, config)
    prompts = (q[n_dec:], kc, vc, tables[n_dec:], (cu[n_dec:] - n_dec).contiguous(), ctx[n_dec:])
    pre = prefill_fn(prompts, config)
    dec = decode_fn((q[:n_dec], kc, vc, tables[:n_dec], ctx[:n_dec]))
    t_one, t_pre, t_dec = time_us(one), time_us(pre), time_us(dec)
    t_sep = time_us(lambda: (pre(), dec()))
    name = lambda c: f"{c.block_m}x{c.block_n}/w{c.num_warps}/s{c.num_stages}" if c else "default"  # noqa: E731
    return [{"case": MIXED.name + " (one launch)", "config": name(config), "us": t_one,
             "tflops": MIXED.flops / (t_one * 1e-6) / 1e12,
             "note": f"separate {t_sep:.0f} us (prefill {t_pre:.0f} + decode {t_dec:.0f}); "
                     f"speed-up {t_sep / t_one:.2f}x"}]


def run_prefill_cases(ceilings: Ceilings, configs=(None,), with_sdpa: bool = True) -> list[dict]:
    """Time every case (per config); rows for :func:`common.print_table` with COLUMNS."""
    from torch.nn.attention import SDPBackend
    rows = []
    for case in CASES:
        batch = paged_batch(case)
        flash = sdpa_tflops(case, SDPBackend.FLASH_ATTENTION) if with_sdpa else None
        cudnn = sdpa_tflops(case, SDPBackend.CUDNN_ATTENTION) if with_sdpa else None
        for config in configs:
            t = time_us(prefill_fn(batch, config))
            tflops = case.flops / (t * 1e-6) / 1e12
            rows.append({
                "case": case.name, "us": t, "tflops": tflops, "flash_tflops": flash,
                "cudnn_tflops": cudnn,
                "config": (f"{config.block_m}x{config.block_n}/w{config.num_warps}"
                           f"/s{config.num_stages}" if config else "default"),
                "vs_flash": tflops / flash if flash else None,
                "vs_cudnn": tflops / cudnn if cudnn else None,
                "pct_matmul": 100 * tflops / ceilings.matmul_tflops,
            })
        del batch
    whole = {r["config"]: r["tflops"] for r in rows if r["case"] == "causal 4x4k"}
    for r in rows:
        if r["case"].startswith("chunk"):
            r["note"] = f"{100 * r['tflops'] / whole[r['config']]:.0f}% of causal 4x4k"
    for config in configs:
        rows += mixed_rows(config)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="try several tile configs")
    parser.add_argument("--csv", type=Path, help="write the rows here")
    args = parser.parse_args()
    for k, v in environment().items():
        print(f"{k}: {v}")
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s, bf16 matmul "
          f"{ceilings.matmul_tflops:.0f} TFLOP/s")
    rows = run_prefill_cases(ceilings, configs=[None, *SWEEP] if args.sweep else [None])
    if args.csv:
        write_csv(args.csv, rows)
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
