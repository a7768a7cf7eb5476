"""Prefill benchmark (GPU): the Triton paged prefill against torch SDPA.

bf16, 32 query heads / 8 KV heads, head_size 128, block_size 16, shuffled block tables:
  - causal whole prompts 1x4k, 4x4k, 1x16k;
  - chunked prefill: 512 new tokens on an 8k cached prefix, x 8 sequences;
  - a mixed batch (60 decodes at 4k context, then 4 prompts of 1k) in one launch, against the
    same work as separate calls (prefill kernel on the prompts + paged decode on the decodes).
TFLOP/s count causal FLOPs as half of the square (``4 * Hq * D * (q * prefix + q^2 / 2)``).
torch SDPA runs on contiguous K/V (``[B, H, L, D]``) with the flash and cuDNN backends in the
same run; a large bf16 matmul gives the ceiling.

    python -m benchmarks.bench_prefill [--sweep] [--out DIR]
    python -m benchmarks.bench_attention --part prefill --out DIR   # the same, no --sweep

Writes prefill.csv, prefill.png and prefill.md (table + targets) to the output directory.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import (Ceilings, environment, markdown_table, print_table,
                               start_gpu_run, time_us, write_csv)
from benchmarks.plots import plot_bars
from mini_paged_attn.ops.checks import check_paged_decode_args, check_paged_prefill_args
from mini_paged_attn.ops.prefill import triton_paged_prefill
from mini_paged_attn.ops.prefill_plan import PrefillConfig

HQ, HKV, D, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"  # a module constant so the case builders can be smoke-tested on CPU
CONTIGUOUS = ", contiguous K/V"
COLUMNS = ["case", "config", "us", "tflops", "flash_tflops", "cudnn_tflops", "vs_flash",
           "vs_cudnn", "pct_matmul", "note"]
SWEEP = [PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 64, 4, 3),
         PrefillConfig(64, 64, 4, 3)]


@dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    head_size: int = D

    @property
    def pairs(self) -> float:
        """Visible (query, key) pairs, the causal triangle counted as half the square."""
        return sum(q * p + q * q / 2 for q, p in zip(self.q_lens, self.prefix_lens))

    @property
    def flops(self) -> float:
        return 4.0 * HQ * self.head_size * self.pairs


CASES = [
    Case("causal 1x4k", (4096,), (0,)),
    Case("causal 4x4k", (4096,) * 4, (0,) * 4),
    Case("causal 1x16k", (16384,), (0,)),
    Case("chunk 512 on 8k x8", (512,) * 8, (8192,) * 8),
]
# Other head sizes, with the tile configs worth trying for them (--sweep only).
HEAD_SIZE_SWEEP = {
    Case("causal 4x4k d64", (4096,) * 4, (0,) * 4, 64): [
        PrefillConfig(128, 64, 4, 3), PrefillConfig(128, 128, 4, 3)],
    Case("causal 4x4k d256", (4096,) * 4, (0,) * 4, 256): [
        PrefillConfig(128, 64, 8, 2), PrefillConfig(64, 32, 4, 3), PrefillConfig(64, 64, 8, 2)],
}
MIXED = [Case("mixed 60 dec@4k + 4x1k", (1,) * 60 + (1024,) * 4, (4095,) * 60 + (0,) * 4),
         Case("mixed 4x1k + 60 dec@4k", (1024,) * 4 + (1,) * 60, (0,) * 4 + (4095,) * 60)]


def paged_batch(case: Case, seed: int = 0, block_size: int = BLOCK_SIZE):
    """Query, caches (random, shuffled blocks), tables, cu_seqlens_q, context_lens on cuda."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    ctx = torch.tensor([q + p for q, p in zip(case.q_lens, case.prefix_lens)])
    nblk = (ctx + block_size - 1) // block_size
    num_blocks = int(nblk.sum())
    perm = torch.randperm(num_blocks, device=DEVICE, generator=gen).to(torch.int32)
    tables = torch.zeros(len(ctx), int(nblk.max()), dtype=torch.int32, device=DEVICE)
    start = 0
    for i, n in enumerate(nblk.tolist()):
        tables[i, :n] = perm[start:start + n]
        start += n
    shape = (num_blocks, block_size, HKV, case.head_size)
    kc = torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=gen)
    vc = torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=gen)
    cu = torch.zeros(len(ctx) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(case.q_lens), 0)
    q = torch.randn(int(cu[-1]), HQ, case.head_size, device=DEVICE, dtype=DTYPE, generator=gen)
    return q, kc, vc, tables, cu.to(DEVICE), ctx.to(torch.int32).to(DEVICE)


def prefill_fn(batch, config: PrefillConfig | None, gather: bool | None = None):
    """The paged prefill of ``batch`` as its repeats run (the launches prepared once, as the
    public call's later calls run them); ``gather`` as ``triton_paged_prefill``'s."""
    q, kc, vc, tables, cu, ctx = batch
    out = torch.empty_like(q)
    shapes = check_paged_prefill_args(q, kc, vc, tables, cu, ctx, None, out)

    def first():
        return triton_paged_prefill(q, kc, vc, tables, cu, ctx, shapes, causal=True, out=out,
                                    lse=None, config=config, gather=gather)
    run = first()
    if run is None:     # nothing to repeat (an empty batch, or no compiled kernel)
        return first
    args = (q, kc, vc, kc, kc, out, out, tables, cu, ctx, q)
    return lambda: run(args)


def contiguous_kv(batch):
    """A paged batch's K/V gathered into contiguous ``[total_k, Hkv, D]`` tensors
    (``flash_attn_varlen_func``'s layout; the engine's layout for whole prompts), with their
    int32 ``cu_seqlens_k``."""
    q, kc, vc, tables, cu, ctx = batch
    page = kc.shape[1]
    rows = [tables[i, torch.arange(int(n), device=DEVICE) // page].long() * page
            + torch.arange(int(n), device=DEVICE) % page for i, n in enumerate(ctx.tolist())]
    rows = torch.cat(rows)
    cu_k = torch.zeros(len(ctx) + 1, dtype=torch.int32, device=DEVICE)
    cu_k[1:] = torch.cumsum(ctx, 0)
    return kc.flatten(0, 1)[rows].contiguous(), vc.flatten(0, 1)[rows].contiguous(), cu_k


def contiguous_fn(batch):
    """The same attention over :func:`contiguous_kv`'s K/V."""
    from mini_paged_attn.ops import flash_attn_varlen_func
    q, _, _, _, cu, ctx = batch
    k, v, cu_k = contiguous_kv(batch)
    max_q, max_k = int((cu[1:] - cu[:-1]).max()), int(ctx.max())
    # The public call: its repeats launch what the first call prepared (host time ~20 us).
    return lambda: flash_attn_varlen_func(q, k, v, cu, cu_k, max_q, max_k, causal=True)


def sdpa_tflops(case: Case, backend) -> float | None:
    """torch SDPA on contiguous [B, H, L, D] K/V (bottom-right causal), or None if the backend
    refuses the case."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    if len(set(case.q_lens)) != 1 or len(set(case.prefix_lens)) != 1:
        return None
    b, lq, lk = len(case.q_lens), case.q_lens[0], case.q_lens[0] + case.prefix_lens[0]
    q = torch.randn(b, HQ, lq, case.head_size, device=DEVICE, dtype=DTYPE)
    k = torch.randn(b, HKV, lk, case.head_size, device=DEVICE, dtype=DTYPE)
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


def config_name(config: PrefillConfig | None) -> str:
    if config is None:
        return "default"
    return f"{config.block_m}x{config.block_n}/w{config.num_warps}/s{config.num_stages}"


def seq_range(case: Case, batch, a: int, b: int):
    """Sequences a..b-1 of a paged batch as a batch of their own (same caches)."""
    q, kc, vc, tables, cu, ctx = batch
    qa, qb = sum(case.q_lens[:a]), sum(case.q_lens[:b])
    return q[qa:qb], kc, vc, tables[a:b], (cu[a:b + 1] - qa).contiguous(), ctx[a:b]


def mixed_rows(case: Case, config: PrefillConfig | None) -> list[dict]:
    """One launch over the whole mixed batch against prefill on its prompts + paged_decode on
    its decode rows (decode rows are the sequences with q_len 1, at one end of the batch)."""
    batch = paged_batch(case)
    n = len(case.q_lens)
    n_dec = case.q_lens.count(1)
    dec_first = case.q_lens[0] == 1
    if dec_first:
        dec_range, pre_range = (0, n_dec), (n_dec, n)
    else:
        dec_range, pre_range = (n - n_dec, n), (0, n - n_dec)
    decodes = seq_range(case, batch, *dec_range)
    one = prefill_fn(batch, config)
    pre = prefill_fn(seq_range(case, batch, *pre_range), config)
    ours_dec = prefill_fn(decodes, config)
    q, kc, vc, tables, _, ctx = decodes
    dec = decode_fn((q, kc, vc, tables, ctx))
    t_one, t_pre, t_dec, t_ours_dec = time_us(one), time_us(pre), time_us(dec), time_us(ours_dec)
    t_sep = time_us(lambda: (pre(), dec()))
    return [{"case": case.name + " (one launch)", "config": config_name(config), "us": t_one,
             "tflops": case.flops / (t_one * 1e-6) / 1e12, "speedup": t_sep / t_one,
             "note": f"separate {t_sep:.0f} us (prefill {t_pre:.0f} + paged_decode {t_dec:.0f});"
                     f" speed-up {t_sep / t_one:.2f}x; this kernel on the decode rows alone "
                     f"{t_ours_dec:.0f} us"}]


def case_rows(case: Case, configs, ceilings: Ceilings, with_sdpa: bool) -> list[dict]:
    from torch.nn.attention import SDPBackend
    batch = paged_batch(case)
    flash = sdpa_tflops(case, SDPBackend.FLASH_ATTENTION) if with_sdpa else None
    cudnn = sdpa_tflops(case, SDPBackend.CUDNN_ATTENTION) if with_sdpa else None
    rows = []
    for config in configs:
        row = {"case": case.name, "config": config_name(config), "flash_tflops": flash,
               "cudnn_tflops": cudnn}
        try:
            t = time_us(prefill_fn(batch, config))
        except Exception as exc:  # a sweep config that does not fit (shared memory)
            rows.append({**row, "note": f"{type(exc).__name__}: {str(exc)[:60]}"})
            continue
        rows.append({**row, **rates(case, t, flash, cudnn, ceilings)})
    if with_sdpa and case.head_size == D:
        t = time_us(contiguous_fn(batch))
        rows.append({"case": case.name + CONTIGUOUS, "config": "default", "flash_tflops": flash,
                     "cudnn_tflops": cudnn, **rates(case, t, flash, cudnn, ceilings)})
    return rows


def rates(case: Case, t: float, flash, cudnn, ceilings: Ceilings) -> dict:
    tflops = case.flops / (t * 1e-6) / 1e12
    return {"us": t, "tflops": tflops, "vs_flash": tflops / flash if flash else None,
            "vs_cudnn": tflops / cudnn if cudnn else None,
            "pct_matmul": 100 * tflops / ceilings.matmul_tflops}


def run_prefill_cases(ceilings: Ceilings, configs=(None,), with_sdpa: bool = True,
                      head_size_sweep: bool = False) -> list[dict]:
    """Time every case (per config; None = the kernel's own choice); rows for
    :func:`common.print_table` with COLUMNS. ``head_size_sweep``: more configs at head sizes
    64 and 256 (their cases run with the default config anyway)."""
    rows = []
    for case in CASES:
        rows += case_rows(case, configs, ceilings, with_sdpa)
    whole = {r["config"]: r.get("tflops") for r in rows if r["case"] == "causal 4x4k"}
    for r in rows:
        if r["case"].startswith("chunk") and r.get("tflops") and whole.get(r["config"]):
            r["note"] = f"{100 * r['tflops'] / whole[r['config']]:.0f}% of causal 4x4k"
    for case, extra in HEAD_SIZE_SWEEP.items():
        rows += case_rows(case, [None, *extra] if head_size_sweep else [None], ceilings,
                          with_sdpa)
    # The default picks 64 x 64 tiles for this decode-heavy batch; 128 x 128 for comparison.
    mixed_configs = list(dict.fromkeys([*configs, PrefillConfig(128, 128, 8, 3)]))
    for config in mixed_configs:
        rows += mixed_rows(MIXED[0], config)
    rows += mixed_rows(MIXED[1], configs[0])  # the other order of the same batch
    return rows


def evaluate_targets(rows: list[dict]) -> list[str]:
    """The prefill targets, each with the numbers behind it (default config rows)."""
    default = {r["case"]: r for r in rows if r["config"] == "default" and r.get("us")}
    out = []
    for name in ("causal 1x4k", "causal 4x4k", "causal 1x16k"):
        for layout in ("", CONTIGUOUS):
            r = default.get(name + layout)
            if r and r.get("cudnn_tflops"):
                ok = r["tflops"] >= 0.9 * r["cudnn_tflops"]
                out.append(f"{'HOLDS' if ok else 'MISSED'}: {name + layout} {r['tflops']:.0f} "
                           f"TFLOP/s >= 0.9x SDPA cuDNN {r['cudnn_tflops']:.0f} "
                           f"({r['tflops'] / r['cudnn_tflops']:.2f}x; flash "
                           f"{r['flash_tflops'] or 0:.0f})")
    chunk = default.get(CASES[3].name)
    for whole_name in ("causal 4x4k", "causal 4x4k" + CONTIGUOUS):
        whole = default.get(whole_name)
        if chunk and whole:
            pct = 100 * chunk["tflops"] / whole["tflops"]
            out.append(f"{'HOLDS' if pct >= 95 else 'MISSED'}: chunked prefill (paged) "
                       f"{chunk['tflops']:.0f} TFLOP/s = {pct:.0f}% of whole-prompt "
                       f"{whole_name} (same total size), target 95%")
    for case in MIXED:
        r = default.get(case.name + " (one launch)")
        if r:
            out.append(f"{'HOLDS' if r['speedup'] > 1 else 'MISSED'}: {case.name} in one launch "
                       f"{r['us']:.0f} us, {r['speedup']:.2f}x faster than separate calls")
    return out


def plot_prefill(path: Path, rows: list[dict], title: str, ceiling: float) -> None:
    """TFLOP/s per case: ours on paged K/V and on contiguous K/V (default config), SDPA flash
    and cuDNN on contiguous K/V."""
    sel = [r for r in rows if r["config"] == "default" and r.get("flash_tflops")
           and not r["case"].endswith(CONTIGUOUS)]
    contiguous = {r["case"][:-len(CONTIGUOUS)]: r["tflops"] for r in rows
                  if r["case"].endswith(CONTIGUOUS) and r.get("tflops")}
    series = {"ours, paged K/V": [r["tflops"] for r in sel],
              "ours, contiguous K/V": [contiguous.get(r["case"]) for r in sel],
              "SDPA flash": [r["flash_tflops"] for r in sel],
              "SDPA cuDNN": [r["cudnn_tflops"] for r in sel]}
    plot_bars(path, [r["case"] for r in sel], series, title=title, ylabel="TFLOP/s",
              hline=ceiling, hline_label="bf16 matmul")


def run_prefill(args, ceilings: Ceilings, env: dict, out_dir: Path) -> None:
    """The prefill part of ``bench_attention``: prefill.csv, prefill.png, prefill.md."""
    sweep = getattr(args, "sweep", False)
    rows = run_prefill_cases(ceilings, configs=[None, *SWEEP] if sweep else [None],
                             head_size_sweep=sweep)
    targets = evaluate_targets(rows)
    header = (f"device {env['device']}, torch {env['torch']}, triton {env['triton']}, "
              f"{env['date']}; bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    write_csv(out_dir / "prefill.csv", rows)
    plot_prefill(out_dir / "prefill.png", rows, f"prefill, bf16, 32/8 heads, bs 16 - "
              f"{env['device']}", ceilings.matmul_tflops)
    (out_dir / "prefill.md").write_text(header + "\n\n" + markdown_table(rows, COLUMNS)
                                        + "\n\nTargets:\n" + "\n".join(f"- {t}" for t in targets)
                                        + "\n")
    print(header)
    print_table(rows, COLUMNS)
    print("\n".join(targets))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="try several tile configs")
    parser.add_argument("--out", type=Path, default=Path("bench_out"),
                        help="directory for prefill.csv, prefill.png and prefill.md")
    args = parser.parse_args()
    ceilings = start_gpu_run(args.out, "benchmarks.bench_prefill")
    run_prefill(args, ceilings, environment(), args.out)


if __name__ == "__main__":
    main()
