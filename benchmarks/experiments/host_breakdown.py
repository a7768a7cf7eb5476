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


WIDE_INTS = 40


@triton.jit
def _wide_kernel(x_ptr, n, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14,
                 a15, a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29,
                 a30, a31, a32, a33, a34, a35, a36, a37, a38, a39, BLOCK: tl.constexpr):
    # The empty kernel with 40 more int arguments (the decode kernel takes 25 ints, 3
    # floats and 14 pointers): what the launcher's per-argument parsing costs.
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + a0 + a39, mask=offs < n)


def _ctypes_launch(prepared, ptr: int, ints: tuple[int, ...]):
    """A launch of ``prepared``'s compiled kernel through ``cuLaunchKernel`` called with
    ctypes: the driver call without Triton's launcher (the floor a launcher could reach).
    Returns a callable taking the pointer argument."""
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")
    fn = cuda.cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int
    values = [ctypes.c_uint64(ptr)] + [ctypes.c_int32(i) for i in ints] + [
        ctypes.c_uint64(0), ctypes.c_uint64(0)]      # global and profile scratch
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    function, metadata = prepared._head[0], prepared._head[5]
    num_warps, _, shared = metadata
    stream = prepared.stream()
    first = values[0]

    def call(p: int) -> None:
        first.value = p
        if fn(function, 1, 1, 1, 32 * num_warps, 1, 1, shared, stream, params, None):
            raise RuntimeError("cuLaunchKernel failed")
    return call


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
            (name, "query.device", host_us(lambda: query.device)),
            (name, "query.get_device()", host_us(query.get_device)),
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
        ("floor", "empty kernel, launch_checked", host_us(
            lambda: prepared.launch_checked((ptr,), s))),
    ]
    # The launcher alone, its arguments built once: the decode kernel (1 x 4k, fused merge),
    # the empty kernel, the empty kernel with 40 more ints, and the driver call via ctypes.
    args, _ = paged_inputs(1, 4096, gen)
    dispatch._DECODE_RUNS.clear()
    paged_decode(*args)
    run = list(dispatch._DECODE_RUNS._entries.values())[-1]
    decode = run.decode
    launched = []
    saved = decode._launch
    decode._launch = lambda *a: launched.append(a)
    run(*args[:3], None, None, *args[3:], torch.empty_like(args[0]), None, None)
    decode._launch = saved
    full = launched[0]
    wide_args = (x, 1024, *range(3, 3 + WIDE_INTS))
    _wide_kernel[(1,)](*wide_args, BLOCK=1024)
    wide = PreparedLaunch(_wide_kernel, (1,), wide_args, {"BLOCK": 1024})
    wide_full = (1, 1, 1, s, *wide._head, ptr, *wide._tail)
    empty_full = (1, 1, 1, s, *prepared._head, ptr, *prepared._tail)
    empty_ctypes = _ctypes_launch(prepared, ptr, (1024,))
    wide_ctypes = _ctypes_launch(wide, ptr, (1024, *range(3, 3 + WIDE_INTS)))
    torch.cuda.synchronize()
    rows += [
        ("launcher", f"decode kernel ({len(full)} arguments)", host_us(lambda: saved(*full))),
        ("launcher", f"empty kernel ({len(empty_full)} arguments)",
         host_us(lambda: prepared._launch(*empty_full))),
        ("launcher", f"empty + 40 ints ({len(wide_full)} arguments)",
         host_us(lambda: wide._launch(*wide_full))),
        ("ctypes", "empty kernel, cuLaunchKernel", host_us(lambda: empty_ctypes(ptr))),
        ("ctypes", "empty + 40 ints, cuLaunchKernel", host_us(lambda: wide_ctypes(ptr))),
    ]
    torch.cuda.synchronize()
    print(f"{'case':8} {'what':36} {'host us':>8}")
    for case, what, us in rows:
        print(f"{case:8} {what:36} {us:8.2f}")


if __name__ == "__main__":
    main()
