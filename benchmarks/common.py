"""Shared benchmark infrastructure: ceilings, timing, tables and CSV (GPU only; plots are in
``benchmarks.plots``).

- :func:`start_gpu_run` (CUDA check, output directory, ceilings) and
  :func:`measure_ceilings`: the run's own device-to-device copy bandwidth (bytes read +
  written) and bf16 matmul rate, the yardsticks every result is reported against.
- :func:`time_us` (median of per-call CUDA events, L2 flushed before each call; ``flush``
  says how) and :func:`time_graph_us` (``do_bench_cudagraph``, median of replays; pass several
  input sets to rotate through so small problems are not served from L2).
- :func:`print_table`, :func:`markdown_table`, :func:`write_csv` / :func:`read_csv`.
"""

from __future__ import annotations

import csv
import datetime
import itertools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph


@dataclass(frozen=True)
class Ceilings:
    copy_gbps: float       # device-to-device copy, bytes read + written per second / 1e9
    matmul_tflops: float   # 8192^3 bf16 matmul


def environment() -> dict[str, str]:
    """Device, versions and date, for the report header."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "device": f"{props.name} ({props.multi_processor_count} SMs, "
                  f"{props.total_memory / 2**30:.0f} GiB)",
        "torch": torch.__version__, "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
        "date": datetime.date.today().isoformat(),
    }



def start_gpu_run(out: Path | str, tool: str) -> Ceilings:
    """A GPU tool's start: exit with a message naming ``tool`` unless CUDA is there, create the
    output directory ``out``, and measure the run's ceilings."""
    if not torch.cuda.is_available():
        sys.exit(f"{tool} needs a CUDA GPU")
    Path(out).mkdir(parents=True, exist_ok=True)
    return measure_ceilings()

FLUSH_BYTES = 256 << 20
HOST_LEAD_US = 200


def time_us(fn: Callable[[], object], warmup_ms: int = 10, rep_ms: int = 60,
            flush: str = "read") -> float:
    """Median microseconds of ``fn`` (CUDA events around each call, L2 flushed before each).

    Before each call (``read`` / ``none``) the GPU first spins for ``HOST_LEAD_US``, so the
    host has queued the call before the GPU gets to it: the events time the GPU's work, not
    the host's launch path (150 us for a split decode on the H100 host, more than the
    flush's 85 us).

    flush:
        ``"read"``: a read-only pass over 256 MB before each call, so ``fn`` finds nothing of
            its own in L2 and no dirty lines either.
        ``"zero"``: ``triton.testing.do_bench``'s flush, a 256 MB ``zero_()``. It leaves L2
            full of dirty lines that are written back while ``fn`` runs (on an H100, 50 MB:
            ~16 us of HBM writes charged to ``fn``).
        ``"none"``: nothing (``fn`` should rotate over inputs larger than L2 itself).
    """
    if flush == "zero":
        return 1e3 * do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    if flush not in ("read", "none"):
        raise ValueError(f"flush: expected 'read', 'zero' or 'none', got {flush!r}")
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda").normal_()
    # Cycles at 2 GHz (about the H100's and H200's top clock): a slower clock only lengthens
    # the lead.
    lead_cycles = HOST_LEAD_US * 2000

    def before():
        if lead_cycles:
            torch.cuda._sleep(lead_cycles)
        if flush == "read":
            torch.sum(buf)

    def flushed():
        before()
        fn()
    # Estimate one call, as do_bench does, to turn the ms budgets into call counts.
    fn()
    torch.cuda.synchronize()
    est = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    est[0].record()
    for _ in range(5):
        flushed()
    est[1].record()
    torch.cuda.synchronize()
    per_call_ms = max(est[0].elapsed_time(est[1]) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / per_call_ms))):
        flushed()
    n = max(5, int(rep_ms / per_call_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for start, end in zip(starts, ends):
        before()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return 1e3 * times[len(times) // 2]


def time_graph_us(fns: Sequence[Callable[[], object]], rep_ms: int = 40) -> float:
    """Median microseconds per call under CUDA-graph replay, rotating through ``fns`` (the same
    op on different input sets, so consecutive replays do not hit in L2)."""
    cycle = itertools.cycle(fns)
    return 1e3 * do_bench_cudagraph(lambda: next(cycle)(), rep=rep_ms, return_mode="median")


def measure_ceilings(copy_bytes: int = 2 << 30, matmul_n: int = 8192) -> Ceilings:
    """This run's copy bandwidth and bf16 matmul rate (random data, medians)."""
    src = torch.randn(copy_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = time_us(lambda: dst.copy_(src), rep_ms=200)
    copy_gbps = 2 * copy_bytes / (t * 1e-6) / 1e9
    src = dst = None  # free 4 GB before the matmul
    a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    t = time_us(lambda: a @ b, rep_ms=200)
    tflops = 2 * matmul_n ** 3 / (t * 1e-6) / 1e12
    return Ceilings(copy_gbps, tflops)


def _fmt(v: object) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def _cells(rows: Sequence[dict], columns: Sequence[str]) -> list[list[str]]:
    return [[_fmt(r.get(c)) for c in columns] for r in rows]


def print_table(rows: Sequence[dict], columns: Sequence[str]) -> None:
    """A fixed-width text table of ``rows`` (dicts) restricted to ``columns``."""
    cells = _cells(rows, columns)
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    lines += ["| " + " | ".join(r) + " |" for r in _cells(rows, columns)]
    return "\n".join(lines)


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    """Rows written by :func:`write_csv`, numbers parsed back (empty cells become None)."""
    def parse(v: str):
        if v == "":
            return None
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
        return v
    with open(path, newline="") as f:
        return [{k: parse(v) for k, v in r.items()} for r in csv.DictReader(f)]
