"""Host time of a repeated ``flash_attn_varlen_func`` call, piece by piece, for a Triton-kernel
batch (no tensor descriptors) and Hopper-kernel batches (four descriptors) (GPU).

Per piece, back-to-back host time only (median of 7 runs of 2000 calls): the whole call, the
call key, the output's allocation, the prepared launch (pointers and launch), the arguments
it builds for one launch (``_tail_for``: each descriptor's expansion), and the bare launcher
with those arguments built beforehand. Run it on two checkouts to compare launch paths.

    python -m benchmarks.experiments.host_descriptor_probe
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mini_paged_attn.ops import flash_attn_varlen_func, varlen
from mini_paged_attn.ops.varlen import _call_key

H_Q, H_KV, D = 32, 8, 128
CASES = {"4x64": [64] * 4, "2x128": [128] * 2, "1x256": [256]}


def per_call_us(fn, n: int = 2000, repeats: int = 7) -> float:
    for _ in range(100):
        fn()
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - start) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def case_row(name: str, lens: list[int], q, k, v) -> dict:
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    total = sum(lens)
    q, k, v = q[:total], k[:total], v[:total]

    def call():
        return flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    varlen._CONTIGUOUS_RUNS.clear()
    call()
    (launch,) = varlen._CONTIGUOUS_RUNS._entries.values()
    out = torch.empty_like(q)
    args = (q, k, v, k, k, out, out, cu, cu, cu, q)
    ptrs = tuple(a.data_ptr() for a in args)
    stream = launch.stream()
    tail = launch._tail_for(ptrs)
    return dict(case=name, descriptors=len(launch._descriptors), call=per_call_us(call),
                key=per_call_us(lambda: _call_key((q, k, v, cu, cu, None), (True, None, "auto"))),
                empty=per_call_us(lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device)),
                prepared=per_call_us(lambda: launch(args)),
                tail_for=per_call_us(lambda: launch._tail_for(ptrs)),
                bare=per_call_us(lambda: launch._launch(*launch.grid, stream, *launch._head,
                                                        *ptrs, *tail)))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(512, H_Q, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(512, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    rows = [case_row(name, lens, q, k, v) for name, lens in CASES.items()]
    x = torch.zeros(1024, device="cuda")
    print(f"yardstick (torch add_ on 4 KB) {per_call_us(lambda: x.add_(1)):.1f} us")
    for row in rows:
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()))


if __name__ == "__main__":
    main()
