"""Where the host time of a repeated ``paged_decode`` call goes (GPU experiment).

``bench_host`` reports 27-30 us per repeated decode call; ``dispatch_host_probe`` puts the
Python part at 7-8 us on a CPU. This times, on the GPU's host and in one run, the call and each
piece of its repeat path alone (back-to-back, host time only): the call key, the capture
query, the output allocation, the prepared run, the bare launcher, and two floors (a torch
elementwise op on a tiny tensor, an empty Triton kernel launched directly).

    python -m benchmarks.experiments.host_breakdown
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def host_us(fn) -> float:
    from benchmarks.bench_host import host_and_eager_us
    return host_and_eager_us(fn)[0]


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    from benchmarks.bench_host import paged_inputs
    from mini_paged_attn.ops import dispatch, paged_decode
    from mini_paged_attn.ops.launch import PreparedLaunch

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for num_seqs, ctx in ((1, 4096), (64, 4096)):
        args, _ = paged_inputs(num_seqs, ctx, gen)
        query = args[0]
        out = torch.empty_like(query)
        paged_decode(*args)
        paged_decode(*args, out=out)
        key = dispatch._call_key((*args, None, None, None, None, None),
                                 (None, False, "auto", None, -1, -1, 0.0))
        runs = list(dispatch._DECODE_RUNS._entries.values())
        run = runs[-1]
        q, kc, vc, table, lens = args
        tensors = (q, kc, vc, None, None, table, lens, out, None, None, None)
        name = f"{num_seqs}x{ctx // 1024}k"
        rows += [
            (name, "paged_decode(*args)", host_us(lambda: paged_decode(*args))),
            (name, "paged_decode(*args, out=out)", host_us(lambda: paged_decode(*args, out=out))),
            (name, "_call_key", host_us(lambda: dispatch._call_key(
                (*args, None, None, None, None, None), (None, False, "auto", None, -1, -1, 0.0)))),
            (name, "is_current_stream_capturing", host_us(torch.cuda.is_current_stream_capturing)),
            (name, "torch.empty_like(query)", host_us(lambda: torch.empty_like(query))),
            (name, "run(...) (prepared, checks)", host_us(lambda: run(*tensors[:3], None, None,
                                                                       table, lens, out, None,
                                                                       None, None))),
            (name, "run.decode.stream()", host_us(run.decode.stream)),
        ]
        assert key is not None
    x = torch.zeros(1024, device="cuda")
    _empty_kernel[(1,)](x, 1024, BLOCK=1024)
    prepared = PreparedLaunch(_empty_kernel, (1,), (x, 1024), {"BLOCK": 1024})
    ptr = x.data_ptr()
    s = prepared.stream()
    rows += [
        ("floor", "x.add_(1) (torch, 4 KB)", host_us(lambda: x.add_(1))),
        ("floor", "empty kernel, jit[grid](...)", host_us(lambda: _empty_kernel[(1,)](
            x, 1024, BLOCK=1024))),
        ("floor", "empty kernel, prepared(...)", host_us(lambda: prepared((x,)))),
        ("floor", "empty kernel, launch_pointers", host_us(
            lambda: prepared.launch_pointers((ptr,), s))),
    ]
    print(f"{'case':8} {'what':36} {'host us':>8}")
    for case, what, us in rows:
        print(f"{case:8} {what:36} {us:8.2f}")


if __name__ == "__main__":
    main()
