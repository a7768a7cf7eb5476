"""Paged attention benchmark (GPU): our Triton kernels against torch's attention, one process.

Decode part: bf16, 32 query heads / 8 KV heads, head_size 128, block_size 16,
physical blocks in random order, the manager's seed-layout pool ``(num_blocks, block_size, 2,
H_kv, D)``; batch {1, 8, 32, 64, 128, 256} x context {1k, 4k, 16k, 64k} (skipping more than
``--max-tokens`` tokens), plus head_size 64 and block_size 1 and 128 at batch 64 x 4k.
Each shape is checked for correctness first, then timed (``common.time_us``: median of CUDA
events, L2 flushed by a read-only pass and the host given a head start, so the GPU's time is
measured, not the host's launch path nor the write-back of a flush's dirty lines):

  ours          paged_decode (Triton, heuristic num_splits, preallocated workspace)
  ours_s1       the same with num_splits=1 (batch <= 8 only: what splitting buys)
  torch_ref     the torch reference backend (small shapes only)
  sdpa_flash / sdpa_cudnn / sdpa_efficient
                torch SDPA with that backend on contiguous (non-paged) K/V of the same lengths;
                the group's query heads ride as GQA rows (q ``[B, H_kv, group, D]``), so K/V is
                read once per KV head, as in our kernel
  gather_sdpa   gather the paged K/V into contiguous tensors, then SDPA (default backend)
  flex          flex_attention (compiled) on contiguous K/V, a few shapes (``--flex``)

Reported: microseconds, GB/s of K+V read, and % of the device-to-device copy bandwidth (bytes
read + written) measured at the start of the run. Small shapes are also timed under CUDA-graph
replay (``do_bench_cudagraph``, rotating over input sets larger than L2), as the engine runs them.
Writes ``decode.csv``, ``decode.png`` and ``decode.md`` (the table for BENCHMARKS.md) to --out.

The prefill part lives in ``bench_prefill.py`` (``run_prefill(args, ceilings, env, out_dir)``);
host time per eager call is ``bench_host.py``'s. From the repository root:

    python -m benchmarks.bench_attention --part decode --out /tmp/bench
    python -m benchmarks.bench_attention --replot benchmarks/results/decode_h100.csv --out DIR
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import (Ceilings, environment, markdown_table, print_table, read_csv,
                               start_gpu_run, time_graph_us, time_us, write_csv)
from benchmarks.plots import plot_lines
from mini_paged_attn.ops import paged_decode
from mini_paged_attn.ops.checks import check_paged_decode_args
from mini_paged_attn.ops.decode import triton_paged_decode, workspace_size
from mini_paged_attn.ops.attention.decode_plan import MAX_SPLITS, DecodeTiles, explain_decode

SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                 "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
SETTLE_S = 0.5                       # idle before each case (see check_and_time)
GRAPH_MAX_TOKENS = 64 * 1024         # shapes up to this many tokens are also graph-timed
ROTATE_BYTES = 256 << 20             # graph timing rotates over >= this many bytes of inputs


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    context: int
    head_size: int = 128
    block_size: int = 16
    num_q_heads: int = 32
    num_kv_heads: int = 8
    dtype: torch.dtype = torch.bfloat16

    @property
    def tokens(self) -> int:
        return self.batch * self.context

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the step must read."""
        return 2 * self.tokens * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def label(self) -> str:
        """``BxC Dd bsN``: the shape's row label in the experiment tables."""
        return f"{self.batch}x{self.context} D{self.head_size} bs{self.block_size}"

    def pct_of_copy(self, us: float, copy_gbps: float) -> float:
        """Reading the K/V in ``us`` microseconds, as a percentage of the copy bandwidth."""
        return 100 * self.kv_bytes / (us * 1e-6) / 1e9 / copy_gbps


@dataclass
class DecodeInputs:
    query: torch.Tensor; key_cache: torch.Tensor; value_cache: torch.Tensor
    block_tables: torch.Tensor; context_lens: torch.Tensor; workspace: torch.Tensor
    out: torch.Tensor

    @property
    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_tables,
                self.context_lens)


def make_inputs(case: DecodeCase, seed: int) -> DecodeInputs:
    """A seed-layout pool with exactly the blocks the batch needs, in random physical order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = -(-case.context // case.block_size)
    num_blocks = case.batch * blocks_per_seq
    pool = torch.randn((num_blocks, case.block_size, 2, case.num_kv_heads, case.head_size),
                       generator=g, device="cuda", dtype=case.dtype)
    tables = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
    tables = tables.view(case.batch, blocks_per_seq)
    lens = torch.full((case.batch,), case.context, dtype=torch.int32, device="cuda")
    query = torch.randn((case.batch, case.num_q_heads, case.head_size), generator=g,
                        device="cuda", dtype=case.dtype)
    ws = torch.empty(workspace_size(case.batch, case.num_q_heads, case.head_size, MAX_SPLITS),
                     dtype=torch.float32, device="cuda")
    return DecodeInputs(query, pool[:, :, 0], pool[:, :, 1], tables, lens, ws,
                        torch.empty_like(query))


def gather_contiguous(x: DecodeInputs, cache: torch.Tensor, case: DecodeCase) -> torch.Tensor:
    """``[B, H_kv, context, D]`` contiguous K or V, gathered through the block table."""
    blocks = cache[x.block_tables.long()]            # [B, blocks, block_size, H_kv, D]
    flat = blocks.reshape(case.batch, -1, case.num_kv_heads, case.head_size)[:, :case.context]
    return flat.transpose(1, 2)


def sdpa_decode(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                form: str = "rows") -> torch.Tensor:
    """Decode through SDPA on contiguous K/V ``[B, H_kv, L, D]``, in one of two forms:

    rows: the group's query heads as query rows, q ``[B, H_kv, group, D]`` (K/V read once);
    gqa:  q ``[B, H_q, 1, D]`` with ``enable_gqa=True``.
    """
    b, hq, d = query.shape
    if form == "rows":
        q = query.view(b, k.shape[1], hq // k.shape[1], d)
        return F.scaled_dot_product_attention(q, k, v).reshape(b, hq, d)
    q = query.view(b, hq, 1, d)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).reshape(b, hq, d)


def sdpa_on_contiguous(x: DecodeInputs, case: DecodeCase, backend: str, form: str):
    """A call of SDPA ``backend`` (a key of SDPA_BACKENDS) in ``form`` (see sdpa_decode) on
    contiguous copies of ``x``'s paged K/V, made once, here."""
    k = gather_contiguous(x, x.key_cache, case).contiguous()
    v = gather_contiguous(x, x.value_cache, case).contiguous()

    def run():
        with sdpa_kernel(SDPA_BACKENDS[backend]):
            return sdpa_decode(x.query, k, v, form)
    return run


def ours(x: DecodeInputs, **kw):
    return lambda: paged_decode(*x.args, out=x.out, workspace=x.workspace, **kw)


def ours_launch(x: DecodeInputs, tiles: DecodeTiles | None = None, splits: int | None = None):
    """Our kernel launched directly (``triton_paged_decode``: arguments checked once, here),
    with forced tiles and split count (None: planned). For sweeps."""
    shapes = check_paged_decode_args(*x.args, None, x.out)
    return lambda: triton_paged_decode(*x.args, shapes, out=x.out, lse=None,
                                       workspace=x.workspace, tiles=tiles, num_splits=splits)


def implementations(case: DecodeCase, x: DecodeInputs, k: torch.Tensor, v: torch.Tensor,
                    flex: bool) -> dict:
    impls = {"ours": ours(x)}
    if case.batch <= 8:
        impls["ours_s1"] = ours(x, num_splits=1)
    if case.tokens <= 64 * 1024:
        impls["torch_ref"] = lambda: paged_decode(*x.args, backend="torch")
    for name, backend in SDPA_BACKENDS.items():
        for form in ("rows", "gqa"):
            def run(backend=backend, form=form):
                with sdpa_kernel(backend):
                    return sdpa_decode(x.query, k, v, form)
            impls[f"{name}[{form}]"] = run
    impls["gather_sdpa"] = lambda: sdpa_decode(
        x.query, gather_contiguous(x, x.key_cache, case), gather_contiguous(x, x.value_cache, case))
    if flex:
        from torch.nn.attention.flex_attention import flex_attention
        compiled = torch.compile(flex_attention, dynamic=False)
        b, hq, d = x.query.shape

        def run_flex():
            q = x.query.view(b, case.num_kv_heads, hq // case.num_kv_heads, d)
            return compiled(q, k, v).reshape(b, hq, d)
        impls["flex"] = run_flex
    return impls


def check_and_time(case: DecodeCase, ceilings: Ceilings, flex: bool, seed: int) -> list[dict]:
    x = make_inputs(case, seed)
    k = gather_contiguous(x, x.key_cache, case).contiguous()
    v = gather_contiguous(x, x.value_cache, case).contiguous()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        expected = sdpa_decode(x.query, k, v).float()
    rows = []
    plan = explain_decode(case.batch, case.num_q_heads, case.num_kv_heads, case.head_size,
                          case.context, case.block_size, case.dtype)
    # Right after the previous, heavy case the GPU ran the next ~0.1 s some 15% slower (power
    # management; 128x1k after 64x64k: 216 instead of 186 us), which charged the first
    # implementation timed, always ours. Start every case from a GPU idle for a moment.
    torch.cuda.synchronize()
    time.sleep(SETTLE_S)
    for name, fn in implementations(case, x, k, v, flex).items():
        row = dict(impl=name, batch=case.batch, context=case.context,
                   head_size=case.head_size, block_size=case.block_size,
                   splits=plan.num_splits if name == "ours" else None)
        try:
            got = fn()
            err = (got.float() - expected).abs().max().item()
            if not err < 3e-2:
                raise AssertionError(f"max abs error {err:.3g} vs flash SDPA")
            row["max_err"] = err
            row["us"] = time_us(fn)
            row["gbps"] = case.kv_bytes / (row["us"] * 1e-6) / 1e9
            row["pct_copy"] = case.pct_of_copy(row["us"], ceilings.copy_gbps)
        except Exception as e:  # noqa: BLE001  a peer that does not run is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            if name.startswith("ours"):
                raise
        rows.append(row)
    rows = _best_form(rows)
    if case.tokens <= GRAPH_MAX_TOKENS:
        _graph_times(case, rows, seed, flex=False)
    del x, k, v, expected
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def _best_form(rows: list[dict]) -> list[dict]:
    """Keep, for each SDPA backend, the faster of its two forms (``form`` records which)."""
    out, best = [], {}
    for r in rows:
        name, _, form = r["impl"].partition("[")
        if not form:
            out.append(r)
            continue
        r = dict(r, impl=name, form=form.rstrip("]"))
        if name not in best:
            best[name] = r
            out.append(r)
        elif r.get("us") is not None and (best[name].get("us") is None
                                          or r["us"] < best[name]["us"]):
            out[out.index(best[name])] = best[name] = r
    return out


def _graph_times(case: DecodeCase, rows: list[dict], seed: int, flex: bool) -> None:
    """Time ours / fastest SDPA / gather_sdpa under graph replay over rotating input sets."""
    sets = max(1, min(32, math.ceil(ROTATE_BYTES / case.kv_bytes)))
    inputs = [make_inputs(case, seed + 1000 + i) for i in range(sets)]
    contig = [(gather_contiguous(x, x.key_cache, case).contiguous(),
               gather_contiguous(x, x.value_cache, case).contiguous()) for x in inputs]
    by_name = {r["impl"]: r for r in rows}
    sdpa_ok = [n for n in SDPA_BACKENDS if by_name.get(n, {}).get("us") is not None]
    best_sdpa = min(sdpa_ok, key=lambda n: by_name[n]["us"]) if sdpa_ok else None
    for name in ["ours", best_sdpa, "gather_sdpa"]:
        if name is None:
            continue
        key = f"{name}[{by_name[name]['form']}]" if "form" in by_name[name] else name
        fns = [implementations(case, x, k, v, flex)[key] for x, (k, v) in zip(inputs, contig)]
        try:
            by_name[name]["graph_us"] = time_graph_us(fns)
        except Exception as e:  # noqa: BLE001
            by_name[name]["graph_error"] = f"{type(e).__name__}: {str(e)[:80]}"


def decode_cases(max_tokens: int, quick: bool) -> list[DecodeCase]:
    batches = (1, 8, 64, 256) if quick else (1, 8, 32, 64, 128, 256)
    contexts = (4096, 16384) if quick else (1024, 4096, 16384, 65536)
    cases = [DecodeCase(b, c) for b in batches for c in contexts if b * c <= max_tokens]
    cases += [DecodeCase(64, 4096, head_size=64), DecodeCase(64, 4096, block_size=1),
              DecodeCase(64, 4096, block_size=128)]
    return cases


def evaluate_targets(rows: list[dict]) -> list[str]:
    """The decode targets, each with PASS/FAIL and the numbers behind it."""
    def get(impl, **key):
        for r in rows:
            if r["impl"] == impl and all(r[k] == v for k, v in key.items()):
                return r
        return {}
    main = [r for r in rows if r["impl"] == "ours" and r["head_size"] == 128
            and r["block_size"] == 16]
    out = []
    big = [r for r in main if r["batch"] * r["context"] >= 128 * 1024]
    worst = min(big, key=lambda r: r["pct_copy"], default=None)
    if worst:
        out.append(f"{'PASS' if worst['pct_copy'] >= 100 else 'FAIL'}  >=100% of copy bw at "
                   f">=128k tokens: worst {worst['pct_copy']:.0f}% (batch {worst['batch']} x "
                   f"{worst['context']}); all: " + ", ".join(
                       f"{r['batch']}x{r['context'] // 1024}k {r['pct_copy']:.0f}%" for r in big))
    for ctx in (4096, 16384, 65536):
        r = get("ours", batch=1, context=ctx, head_size=128, block_size=16)
        sd = [get(n, batch=1, context=ctx, head_size=128, block_size=16) for n in SDPA_BACKENDS]
        sd = [s for s in sd if s.get("us") is not None]
        if r and sd:
            best = min(sd, key=lambda s: s["us"])
            out.append(f"{'PASS' if r['us'] <= best['us'] else 'FAIL'}  batch 1 x {ctx}: ours "
                       f"{r['us']:.1f} us vs fastest SDPA {best['impl']}[{best.get('form')}] "
                       f"{best['us']:.1f} us (events, L2 flushed)")
            if r.get("graph_us") and best.get("graph_us"):
                ok = r["graph_us"] <= best["graph_us"]
                out.append(f"{'PASS' if ok else 'FAIL'}  batch 1 x {ctx} under CUDA graphs: ours "
                           f"{r['graph_us']:.1f} us vs {best['impl']} {best['graph_us']:.1f} us")
    slower = []
    for r in [r for r in rows if r["impl"] == "ours"]:
        key = dict(batch=r["batch"], context=r["context"], head_size=r["head_size"],
                   block_size=r["block_size"])
        for peer in ("gather_sdpa", "sdpa_flash"):
            p = get(peer, **key)
            if p.get("us") is not None and not r["us"] < p["us"]:
                slower.append(f"{peer} at {r['batch']}x{r['context']} D{r['head_size']} "
                              f"bs{r['block_size']}")
    out.append(f"{'PASS' if not slower else 'FAIL'}  faster than gather_sdpa and sdpa_flash at "
               f"every shape" + (": slower vs " + "; ".join(slower) if slower else ""))
    b1 = get("ours", batch=64, context=4096, head_size=128, block_size=1)
    b16 = get("ours", batch=64, context=4096, head_size=128, block_size=16)
    if b1 and b16:
        ratio = b1["us"] / b16["us"]
        out.append(f"{'PASS' if ratio <= 2 else 'FAIL'}  block_size 1 within 2x of 16: "
                   f"{b1['us']:.1f} vs {b16['us']:.1f} us ({ratio:.2f}x)")
    return out


def run_decode(args, ceilings: Ceilings, env: dict, out_dir: Path) -> None:
    rows = []
    cases = list(enumerate(decode_cases(args.max_tokens, args.quick)))
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [(i, c) for i, c in cases if f"{c.batch}x{c.context}" in wanted]
        if not cases:
            sys.exit(f"--cases: no decode shape matches {args.cases!r} (BxC, e.g. 64x4096)")
    for i, case in cases:
        flex = args.flex and (case.batch, case.context) in {(1, 4096), (64, 4096)} \
            and case.head_size == 128 and case.block_size == 16
        rows += check_and_time(case, ceilings, flex, seed=i)
        ours_row = next(r for r in rows[::-1] if r["impl"] == "ours")
        print(f"  batch {case.batch:>3} ctx {case.context:>6} D {case.head_size} bs "
              f"{case.block_size:>3}: ours {ours_row['us']:8.1f} us "
              f"{ours_row['pct_copy']:5.0f}% of copy ({ours_row['splits']} splits)", flush=True)
    columns = ["impl", "form", "batch", "context", "head_size", "block_size", "splits", "us",
               "graph_us", "gbps", "pct_copy", "max_err"]
    header = (f"device {env['device']}, torch {env['torch']}, triton {env['triton']}, CUDA "
              f"{env['cuda']}, {env['date']}; copy {ceilings.copy_gbps:.0f} GB/s (read+write), "
              f"bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    write_csv(out_dir / "decode.csv", rows)
    (out_dir / "decode.header.txt").write_text(header + "\n")
    wide, targets = report_decode(rows, header, ceilings.copy_gbps, out_dir)
    errors = [r for r in rows if "error" in r]
    print("\nPeers that did not run:", {f"{r['impl']}": r["error"] for r in errors} or "none")
    print(header)
    print_table(rows, columns)
    print()
    print_table(wide, list(wide[0]))
    print("\n".join(targets))


def report_decode(rows: list[dict], header: str, copy_gbps: float,
                  out_dir: Path) -> tuple[list[dict], list[str]]:
    """Write decode.png and decode.md from the rows; return the wide table and the targets."""
    ok = [r for r in rows if r.get("us") is not None and r["head_size"] == 128
          and r["block_size"] == 16]
    plot_lines(out_dir / "decode.png", ok, panel="batch", x="context", y="gbps", line="impl",
               title="paged decode, bf16, 32/8 heads, D 128, bs 16 - "
                     + header.split(", torch")[0],
               xlabel="context (tokens)", ylabel="GB/s of K+V read",
               hline=copy_gbps, hline_label="copy bandwidth (r+w)")
    wide = _wide_table(rows)
    targets = evaluate_targets(rows)
    (out_dir / "decode.md").write_text(
        header + "\n\n" + markdown_table(wide, list(wide[0])) + "\n\nTargets:\n"
        + "\n".join(f"- {t}" for t in targets) + "\n")
    return wide, targets


def _wide_table(rows: list[dict]) -> list[dict]:
    """One line per shape: microseconds per implementation, ours' % of copy, graph times."""
    shapes = list(dict.fromkeys((r["batch"], r["context"], r["head_size"], r["block_size"])
                                for r in rows))
    names = list(dict.fromkeys(r["impl"] for r in rows))
    graphed = [n for n in names if any("graph_us" in r for r in rows if r["impl"] == n)]
    table = []
    for b, c, d, bs in shapes:
        sub = {r["impl"]: r for r in rows if (r["batch"], r["context"], r["head_size"],
                                              r["block_size"]) == (b, c, d, bs)}
        line = {"batch": b, "ctx": c, "D": d, "bs": bs,
                "splits": sub["ours"].get("splits"),
                "ours %copy": sub["ours"].get("pct_copy")}
        for n in names:
            line[f"{n} us"] = sub.get(n, {}).get("us")
        for n in graphed:
            line[f"{n} graph us"] = sub.get(n, {}).get("graph_us")
        table.append(line)
    cols = list(dict.fromkeys(k for line in table for k in line))
    return [{k: line.get(k) for k in cols} for line in table]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("decode", "prefill", "all"), default="all",
                   help="which kernels to time: decode, prefill or all (default all)")
    p.add_argument("--out", default="bench_out", help="directory for CSV, PNG and markdown")
    p.add_argument("--max-tokens", type=int, default=4 << 20,
                   help="skip decode shapes with more batch x context tokens")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--cases", metavar="BxC,...",
                   help="only these decode shapes, e.g. 64x4096,1x65536, with their head_size / "
                        "block_size variants (seeds as in a full run)")
    p.add_argument("--flex", action="store_true", help="also time flex_attention (compiles)")
    p.add_argument("--replot", metavar="CSV",
                   help="rebuild decode.png / decode.md in --out from a decode.csv, then exit "
                        "(no GPU needed; the header comes from NAME.header.txt beside it)")
    args = p.parse_args(argv)
    if args.replot:
        csv_path = Path(args.replot)
        rows = read_csv(csv_path)
        header_path = csv_path.with_suffix(".header.txt")
        header = header_path.read_text().strip() if header_path.exists() else str(csv_path)
        copy_gbps = next(r["gbps"] / r["pct_copy"] * 100 for r in rows if r.get("pct_copy"))
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        for t in report_decode(rows, header, copy_gbps, out_dir)[1]:
            print(t)
        return
    # A backend that cannot take a form says so on every call; the table reports what ran.
    warnings.filterwarnings("ignore", message=".*(kernel not used|runtime disabled|same "
                            "num_heads|Memory efficient|Flash attention|cuDNN).*")
    out_dir = Path(args.out)
    ceilings = start_gpu_run(out_dir, "benchmarks.bench_attention")
    env = environment()
    print(f"{env}\nceilings: copy {ceilings.copy_gbps:.0f} GB/s (read+write), "
          f"bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s", flush=True)
    if args.part in ("decode", "all"):
        run_decode(args, ceilings, env, out_dir)
    if args.part in ("prefill", "all"):
        from benchmarks.bench_prefill import run_prefill
        run_prefill(args, ceilings, env, out_dir)


if __name__ == "__main__":
    main()
