"""Cascade attention benchmark: decode of requests that share a prefix, cascade against plain.

Each case is ``groups`` groups of ``per_group`` requests; a group's requests share a prefix of
``prefix`` tokens and own ``suffix`` tokens each (the new one included); bf16, 32 query / 8 KV
heads, head size 128, blocks of 16 in random physical order, one decode step. For each case:

- ``plain_us``: ``paged_decode`` over each request's whole table (prefix blocks + its own),
  GPU microseconds per call (CUDA events, L2 flushed, the host given a head start:
  ``benchmarks.common.time_us``);
- ``cascade_us``: ``cascade_attention`` of the same step (one non-causal prefill over the
  prefixes, a decode over the suffixes, the merge), timed alike; ``speedup`` = plain / cascade;
- ``plain_eager_us`` / ``cascade_eager_us``: wall microseconds per call of a Python loop of
  calls with no sync between them (the host's launch path counts: cascade is several ops);
- ``max_abs_err``: cascade against plain on the same inputs, before timing; ``check`` is
  FAIL (and an error is logged) past a few units in the last place of the dtype.

The target: cascade at least 3x faster than plain at 256 requests sharing a 4k prefix with
256 own tokens each. ``--smoke`` runs tiny shapes with the torch backend on the CPU (wall-clock
timings, only to show the tool runs). From the repository root::

    python -m benchmarks.bench_cascade --out /tmp/bench_cascade
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.cli import add_log_level, add_output_arguments, parse_and_log, replot_if_asked

logger = logging.getLogger("benchmarks.bench_cascade")

COLUMNS = ["case", "plain_us", "cascade_us", "speedup", "plain_eager_us", "cascade_eager_us",
           "eager_speedup", "max_abs_err", "check"]
# Largest |cascade - plain| taken as equal: a few units in the last place of outputs below 1.
TOLERANCE = {"bfloat16": 3e-2, "float16": 4e-3, "float32": 1e-5}
TARGET_CASE, TARGET_SPEEDUP = "256 x 4k/256", 3.0


@dataclass(frozen=True)
class Shape:
    """The model's attention shape and the run's device, dtype and backend."""

    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    device: str = "cuda"
    backend: str = "triton"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class Case:
    name: str
    groups: int
    per_group: int
    prefix: int
    suffix: int

    @property
    def requests(self) -> int:
        return self.groups * self.per_group


GPU_SHAPE = Shape()
GPU_CASES = [Case("256 x 4k/256", 1, 256, 4096, 256), Case("64 x 4k/256", 1, 64, 4096, 256),
             Case("256 x 1k/256", 1, 256, 1024, 256), Case("32 x 16k/512", 1, 32, 16384, 512),
             Case("256 x 2k/128", 1, 256, 2048, 128),
             Case("no share: 256 groups of 1, 4k/256", 256, 1, 4096, 256)]
SMOKE_SHAPE = Shape(4, 2, 16, 4, "float32", "cpu", "torch")
SMOKE_CASES = [Case("8 x 12/5", 1, 8, 12, 5), Case("2 groups of 3, 8/3", 2, 3, 8, 3),
               Case("no share: 4 groups of 1, 8/2", 4, 1, 8, 2)]


@dataclass
class Inputs:
    """One step's tensors: the cascade arguments and the plain tables over the same pool."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    cascade: dict
    plain_tables: torch.Tensor
    plain_lens: torch.Tensor
    workspace: torch.Tensor | None


def make_inputs(case: Case, shape: Shape, seed: int = 0) -> Inputs:
    """A pool holding each group's prefix blocks once and each request's own blocks, all in
    random physical order. A prefix is whole blocks, so a request's plain table is its group's
    prefix blocks followed by its own: both calls read the same pool."""
    bs = shape.block_size
    if case.prefix % bs:
        raise ValueError(f"prefix: expected a multiple of block_size={bs}, got {case.prefix}")
    dev, dtype = torch.device(shape.device), shape.torch_dtype
    g = torch.Generator(device=dev).manual_seed(seed)
    prefix_blocks, suffix_blocks = case.prefix // bs, -(-case.suffix // bs)
    num_blocks = case.groups * prefix_blocks + case.requests * suffix_blocks
    pool = torch.randn((num_blocks, bs, 2, shape.num_kv_heads, shape.head_size), generator=g,
                       device=dev, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g, device=dev).to(torch.int32)
    prefix_tables = perm[:case.groups * prefix_blocks].view(case.groups, prefix_blocks)
    suffix_tables = perm[case.groups * prefix_blocks:].view(case.requests, suffix_blocks)
    group_of = torch.arange(case.requests, device=dev) // case.per_group
    plain_tables = torch.cat([prefix_tables[group_of], suffix_tables], dim=1).contiguous()
    query = torch.randn((case.requests, shape.num_q_heads, shape.head_size), generator=g,
                        device=dev, dtype=dtype)
    rows = torch.arange(case.requests, dtype=torch.int32, device=dev)
    full = lambda n, v: torch.full((n,), v, dtype=torch.int32, device=dev)  # noqa: E731
    cascade = dict(
        cu_seqlens_q=torch.arange(case.requests + 1, dtype=torch.int32, device=dev),
        prefix_block_tables=prefix_tables.contiguous(), prefix_lens=full(case.groups, case.prefix),
        cu_group_tokens=torch.arange(0, case.requests + 1, case.per_group, dtype=torch.int32,
                                     device=dev),
        group_tokens=rows, suffix_block_tables=suffix_tables.contiguous(),
        suffix_lens=full(case.requests, case.suffix), decode_only=True)
    workspace = None
    if shape.backend == "triton":
        from mini_paged_attn.ops.decode import workspace_size
        workspace = torch.empty(workspace_size(case.requests, shape.num_q_heads,
                                               shape.head_size), dtype=torch.float32, device=dev)
    return Inputs(query, pool[:, :, 0], pool[:, :, 1], cascade, plain_tables,
                  full(case.requests, case.prefix + case.suffix), workspace)


def calls(x: Inputs, backend: str):
    """``(plain, cascade)``: zero-argument calls of one decode step each, into fixed outputs."""
    from mini_paged_attn.ops import cascade_attention, paged_decode
    plain_out, cascade_out = torch.empty_like(x.query), torch.empty_like(x.query)

    def plain():
        return paged_decode(x.query, x.key_cache, x.value_cache, x.plain_tables, x.plain_lens,
                            out=plain_out, workspace=x.workspace, backend=backend)

    def cascade():
        return cascade_attention(x.query, x.key_cache, x.value_cache, out=cascade_out,
                                 workspace=x.workspace, backend=backend, **x.cascade)
    return plain, cascade


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def eager_us(fn, device: str, calls_: int) -> float:
    """Wall microseconds per call of ``calls_`` back-to-back calls, one sync at the end."""
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls_):
        fn()
    _sync(device)
    return 1e6 * (time.perf_counter() - start) / calls_


def case_row(case: Case, shape: Shape, eager_calls: int) -> dict:
    """One case: the correctness check, then the timings."""
    x = make_inputs(case, shape)
    plain, cascade = calls(x, shape.backend)
    err = (cascade().float() - plain().float()).abs().max().item()
    check = "PASS" if err <= TOLERANCE[shape.dtype] else "FAIL"
    if check == "FAIL":
        logger.error("%s: cascade differs from plain by %.3g (tolerance %g)", case.name, err,
                     TOLERANCE[shape.dtype])
    if shape.device == "cuda":
        from benchmarks.common import time_us
        plain_us, cascade_us = time_us(plain), time_us(cascade)
    else:  # the smoke run: no CUDA events, wall clock of a few calls
        plain_us, cascade_us = eager_us(plain, "cpu", 3), eager_us(cascade, "cpu", 3)
    plain_eager = eager_us(plain, shape.device, eager_calls)
    cascade_eager = eager_us(cascade, shape.device, eager_calls)
    row = {"case": case.name, **asdict(case), "plain_us": plain_us, "cascade_us": cascade_us,
           "speedup": plain_us / cascade_us, "plain_eager_us": plain_eager,
           "cascade_eager_us": cascade_eager, "eager_speedup": plain_eager / cascade_eager,
           "max_abs_err": err, "check": check}
    logger.info("%s", row)
    return row


def target_line(rows: list[dict]) -> str | None:
    """PASS / FAIL of the speedup target, or None when its case did not run."""
    row = next((r for r in rows if r["case"] == TARGET_CASE), None)
    if row is None:
        return None
    ok = row["speedup"] >= TARGET_SPEEDUP
    return (f"{'PASS' if ok else 'FAIL'}  cascade >= {TARGET_SPEEDUP:.0f}x plain at "
            f"{TARGET_CASE}: {row['speedup']:.2f}x ({row['cascade_us']:.1f} vs "
            f"{row['plain_us']:.1f} us)")


def plot(path: Path, results: dict) -> None:
    """Bars: us per decode step, plain against cascade, per case (log scale)."""
    from benchmarks.plots import plot_bars
    rows = results["rows"]
    plot_bars(path, [r["case"] for r in rows],
              {"plain paged_decode": [r["plain_us"] for r in rows],
               "cascade_attention": [r["cascade_us"] for r in rows]},
              title=results.get("title", "decode step, us per call"), ylabel="us per call",
              log=True, annotate=True)


def _display(rows: list[dict]) -> list[dict]:
    """Rows for the tables: the error in exponent notation (the tables round to 0.1)."""
    return [dict(r, max_abs_err=f"{r['max_abs_err']:.1e}") for r in rows]


def write_outputs(out: Path, results: dict) -> None:
    """``cascade.json`` (for ``--replot``), ``cascade.csv``, ``cascade.md``, ``cascade.png``."""
    from benchmarks.common import markdown_table, write_csv
    out.mkdir(parents=True, exist_ok=True)
    (out / "cascade.json").write_text(json.dumps(results, indent=1, default=str))
    write_csv(out / "cascade.csv", results["rows"])
    lines = [f"# {results['title']}", "", ", ".join(f"{k} {v}" for k, v in
                                                     results["env"].items()), "",
             markdown_table(_display(results["rows"]), COLUMNS)]
    if results.get("target"):
        lines += ["", results["target"]]
    (out / "cascade.md").write_text("\n".join(lines) + "\n")
    try:
        plot(out / "cascade.png", results)
    except ModuleNotFoundError:
        logger.warning("no plot: matplotlib is not installed (pip install -e .[bench])")


def run(args: argparse.Namespace) -> int:
    from benchmarks.common import print_table
    if replot_if_asked(args, plot):
        return 0
    shape, cases = (SMOKE_SHAPE, SMOKE_CASES) if args.smoke else (GPU_SHAPE, GPU_CASES)
    if args.cases:
        cases = [c for c in cases if any(s in c.name for s in args.cases)]
    if shape.device == "cuda":
        from benchmarks.common import environment, start_gpu_run
        start_gpu_run(args.out or ".", "bench_cascade")
        env = environment()
    else:
        env = {"device": "cpu", "torch": torch.__version__}
    rows = [case_row(c, shape, args.eager_calls) for c in cases]
    results = {"env": env, "shape": asdict(shape), "rows": rows, "target": target_line(rows),
               "title": f"cascade_attention vs paged_decode, {shape.dtype}, "
                        f"{shape.num_q_heads} q / {shape.num_kv_heads} kv heads, "
                        f"d {shape.head_size}, block {shape.block_size}"}
    print(", ".join(f"{k} {v}" for k, v in env.items()))
    print_table(_display(rows), COLUMNS)
    if results["target"]:
        print(results["target"])
    if args.out:
        write_outputs(Path(args.out), results)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Cases (GPU): " + "; ".join(c.name for c in GPU_CASES))
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, torch backend, on the CPU: checks the tool runs "
                             "(timings meaningless)")
    parser.add_argument("--cases", nargs="+", default=None, metavar="TEXT",
                        help="run only the cases whose name contains one of these texts "
                             "(default: all)")
    parser.add_argument("--eager-calls", type=int, default=50,
                        help="calls in each back-to-back eager loop (default 50)")
    add_output_arguments(parser, "directory for cascade.json, .csv, .md and .png")
    add_log_level(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(parse_and_log(build_parser(), argv))


if __name__ == "__main__":
    sys.exit(main())
