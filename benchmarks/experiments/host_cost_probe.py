"""Where the host time of one eager paged-decode call goes (GPU): cProfile of a repeated call
(prepared launch) and of a first call (checks, plan, JIT launch), and the pieces timed alone.

    python -m benchmarks.experiments.host_cost_probe
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from benchmarks.bench_host import paged_inputs
from mini_paged_attn.ops import dispatch, paged_decode


def host_us(fn, n=500):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def profile(fn, n, title):
    prof = cProfile.Profile()
    prof.runcall(lambda: [fn() for _ in range(n)])
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    print(f"---- {title}\n{s.getvalue()}", flush=True)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    args, _ = paged_inputs(1, 4096, gen)
    q = args[0]
    call = lambda: paged_decode(*args)  # noqa: E731
    call()
    run = next(iter(dispatch._DECODE_RUNS._entries.values()))
    ws = torch.empty(run.workspace_numel, dtype=torch.float32, device="cuda")
    out = torch.empty_like(q)
    pieces = {
        "paged_decode (repeat)": call,
        "paged_decode out= workspace= (repeat)": lambda: paged_decode(*args, out=out,
                                                                      workspace=ws),
        "call key": lambda: dispatch._call_key(args + (None, None, None, None),
                                               (None, False, "auto", None)),
        "one tensor's key fields": lambda: (q.dtype, q.device, q.shape, q.stride()),
        "DecodeRun(out, ws given)": lambda: run(*args[:3], None, None, *args[3:], out, None, ws),
        "DecodeRun(ws alloc)": lambda: run(*args[:3], None, None, *args[3:], out, None, None),
        "empty_like(q)": lambda: torch.empty_like(q),
        "empty(ws)": lambda: torch.empty(run.workspace_numel, dtype=torch.float32,
                                         device="cuda"),
        "data_ptr x7": lambda: [a.data_ptr() for a in args + (out, ws)],
    }
    for name, fn in pieces.items():
        print(f"{name:40s} {host_us(fn):7.2f} us", flush=True)
    profile(call, 500, "repeat call")
    profile(lambda: (dispatch._DECODE_RUNS.clear(), call()), 200, "first call")


if __name__ == "__main__":
    main()
