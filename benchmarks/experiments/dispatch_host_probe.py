"""The Python cost of a repeated ``paged_decode`` call, measured on CPU (no GPU needed).

A repeated call takes the prepared-launch fast path (:mod:`mini_paged_attn.ops.launch`): the
call key, the cache lookup, the output (and workspace) allocation and the direct launches.
Here the launches are faked so that path runs on CPU tensors:

- ``PreparedLaunch`` is built without launching anything, is always ``ready``, and its
  launcher is a C builtin that takes any arguments and does nothing (``"".format``), so the
  Python work of binding pointers stays in the measurement;
- ``torch.Tensor.get_device`` returns 0 (through ``int``, a C call like the real one), so CPU
  tensors get call keys as CUDA tensors do;
- ``torch.cuda.is_current_stream_capturing`` (which a CPU build of torch cannot answer)
  returns False.

What the GPU run adds is missing: the driver call of each launch (~4 us), and CUDA's
``torch.empty`` (2-8 us where CPU's is ~1 us). Compare the rows of one run only (relative
numbers), then confirm on the GPU with ``python -m benchmarks.bench_host``.

    python -m benchmarks.experiments.dispatch_host_probe [--calls 10000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from contextlib import contextmanager

import torch

H_Q, H_KV, D, BS = 32, 8, 128, 16
# (num_seqs, context): the first three split over 132 SMs, 64 x 4k fills them unsplit.
SHAPES = ((1, 1024), (1, 4096), (8, 1024), (64, 4096))


def _fake_prepare(self, jit_fn, grid, args, kwargs) -> None:
    """``PreparedLaunch.__init__`` without a launch: the fields a repeat call reads."""
    from mini_paged_attn.ops import launch
    self.grid = tuple(grid) + (1,) * (3 - len(grid))
    self.ready = True
    self._bind_arguments(jit_fn, args, kwargs, launch._leading_tensors(args), ())
    self._head = (None,) * 9
    self._launch = "".format     # any positional arguments, no work, no Python frame
    self.stream = int            # int() -> stream 0, a C call like the real one


@contextmanager
def fake_cuda_launches():
    """Patch the launch machinery as the module doc says; undone on exit."""
    from mini_paged_attn.ops import dispatch, launch
    saved = (launch.PreparedLaunch.__init__, torch.Tensor.get_device,
             torch.cuda.is_current_stream_capturing)
    launch.PreparedLaunch.__init__ = _fake_prepare
    torch.Tensor.get_device = staticmethod(int)
    torch.cuda.is_current_stream_capturing = lambda: False
    try:
        yield
    finally:
        (launch.PreparedLaunch.__init__, torch.Tensor.get_device,
         torch.cuda.is_current_stream_capturing) = saved
        dispatch._DECODE_RUNS.clear()


def decode_inputs(num_seqs: int, ctx: int):
    """Query, cache views of a pool, table and lengths as ``bench_host`` makes them (bf16);
    the pool is small: nothing reads it."""
    gen = torch.Generator().manual_seed(0)
    blocks = num_seqs * (ctx // BS)
    pool = torch.zeros(64, BS, 2, H_KV, D, dtype=torch.bfloat16)
    table = torch.randint(0, 64, (num_seqs, blocks // num_seqs), generator=gen,
                          dtype=torch.int32)
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32)
    query = torch.randn(num_seqs, H_Q, D, generator=gen).to(torch.bfloat16)
    return query, pool[:, :, 0], pool[:, :, 1], table, lens


def us_per_call(fn, calls: int) -> float:
    for _ in range(min(calls, 500)):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def profile(fn, calls: int, title: str, rows: int = 25) -> str:
    prof = cProfile.Profile()
    prof.runcall(lambda: [fn() for _ in range(calls)])
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(rows)
    return f"---- {title}\n{s.getvalue()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10000, help="calls per timing")
    parser.add_argument("--profile", action="store_true", help="cProfile each shape too")
    args = parser.parse_args()
    from mini_paged_attn.ops import dispatch, paged_decode
    from mini_paged_attn.ops.decode import workspace_size
    with fake_cuda_launches():
        print(f"{'shape':>10} {'variant':>22} {'runs':>16} {'us/call':>8}")
        for num_seqs, ctx in SHAPES:
            inputs = decode_inputs(num_seqs, ctx)
            out = torch.empty_like(inputs[0])
            ws = torch.empty(workspace_size(num_seqs, H_Q, D), dtype=torch.float32)
            variants = {
                "plain": lambda: paged_decode(*inputs, backend="triton"),
                "out=": lambda: paged_decode(*inputs, backend="triton", out=out),
                "out= workspace=": lambda: paged_decode(*inputs, backend="triton", out=out,
                                                        workspace=ws),
            }
            for name, fn in variants.items():
                dispatch._DECODE_RUNS.clear()
                fn()
                run = next(iter(dispatch._DECODE_RUNS._entries.values()))
                launches = "1 launch" if run.merge is None else "2 launches"
                if run.workspace_numel:
                    launches += " (fused)" if run.merge is None else ""
                shape = f"{num_seqs}x{ctx // 1024}k"
                print(f"{shape:>10} {name:>22} {launches:>16} "
                      f"{us_per_call(fn, args.calls):8.2f}", flush=True)
                if args.profile:
                    print(profile(fn, args.calls, f"{shape} {name}"), flush=True)


if __name__ == "__main__":
    main()
