"""Time from ``mini-paged-attn serve MODEL`` to the first ``/health`` that answers 200.

A random-weight checkpoint of one of ``bench_engine``'s shapes (Qwen3-0.6B by default) is saved
like any Hugging Face directory, then ``serve`` is started on it ``--repeats`` times, each a new
process: the first start may compile Triton kernels that later starts find in Triton's cache
(``~/.triton/cache``), so both are reported. Each start's own account of where the time went
(the load's INFO line: which phase took how long) is printed beside it.

    python -m benchmarks.bench_startup                       # GPU: qwen3-0.6b, 3 starts
    python -m benchmarks.bench_startup --shape qwen2.5-0.5b --serve-args --enforce-eager
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.hostile_mix import HOST, free_port

POLL_S = 0.05


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def time_start(model: Path, serve_args: list[str], timeout_s: float, log: Path) -> dict:
    """Start ``serve`` on ``model``; seconds until ``/health`` answers, and its load line."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = [sys.executable, "-m", "mini_paged_attn.cli", "--log-level", "INFO", "serve", str(model),
           "--port", str(port),
           "--disable-log-requests", *serve_args]
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            while not healthy(url):
                if proc.poll() is not None:
                    raise RuntimeError(f"serve exited with {proc.returncode}: see {log}")
                if time.perf_counter() - start > timeout_s:
                    raise RuntimeError(f"serve did not answer /health in {timeout_s} s: see {log}")
                time.sleep(POLL_S)
            seconds = time.perf_counter() - start
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    # serve's line for an engine process, LLM's for an engine on a thread of the server.
    loaded = [line.strip() for line in log.read_text().splitlines()
              if " loaded: " in line or " loaded in " in line]
    return {"seconds": round(seconds, 2), "load": loaded[-1] if loaded else ""}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-0.6b", help="a shape of benchmarks.bench_engine")
    p.add_argument("--model", help="a model directory instead of a random checkpoint")
    p.add_argument("--repeats", type=int, default=3, help="starts, each a new process")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="give up on a start after this many seconds")
    p.add_argument("--out", help="directory for the logs and results.json")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest of the line goes to serve")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_startup_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model)
    else:
        from benchmarks.bench_engine import random_model_dir
        model = random_model_dir(args.shape, Path(tempfile.mkdtemp(prefix="startup_model_")))
    rows = []
    for i in range(args.repeats):
        row = {"start": i + 1, **time_start(model, args.serve_args, args.timeout_s,
                                             out / f"serve_{i + 1}.log")}
        rows.append(row)
        print(f"start {row['start']}: /health 200 after {row['seconds']:.2f} s  {row['load']}",
              flush=True)
    (out / "results.json").write_text(json.dumps({"model": str(model), "shape": args.shape,
                                                  "serve_args": args.serve_args, "starts": rows},
                                                 indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
