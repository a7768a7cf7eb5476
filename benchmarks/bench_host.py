"""Host time per eager call of the paged ops, against torch SDPA called the same way (GPU).

A user's Python loop (or an eager engine step, once per layer) calls an op back to back; when
the GPU work is small the host's time per call is what the loop sees. For each shape:

- ``host us``: host clock over N calls, stopped before the sync (the launch queue absorbs the
  GPU work, so this is the op's Python + launch cost);
- ``eager us``: the same N calls with the sync, divided by N (max of host and GPU time);
- both are medians of 7 runs, the runs of all shapes interleaved (a host's speed drifts for
  seconds at a time: measured one shape after another, one shape took it whole);
- ``first call us``: host time of a call whose shape was not seen before (checks, plan and a
  launch through the Triton JIT), with the op's launch cache emptied before each call;
- the peers: cuDNN and flash SDPA on contiguous K/V (the backend chosen once, outside the loop);
- a yardstick row, ``x.add_(1)`` on 1024 floats: torch's own cheapest launch on this host, so
  runs on hosts of different speed compare by ratio.

Run: ``python -m benchmarks.bench_host [--out DIR]``; 32 query / 8 KV heads, head_size 128,
bf16, cache blocks of 16 tokens in shuffled order.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import start_gpu_run
from mini_paged_attn.ops import (dispatch, flash_attn_varlen_func, paged_decode, paged_prefill,
                                 store_kv, varlen)

H_Q, H_KV, D, BS = 32, 8, 128, 16
DECODE_SHAPES = ((1, 1024), (1, 4096), (8, 1024), (1, 16384), (64, 4096))


def _timed_run(fn, n: int) -> tuple[float, float]:
    """(host us per call, eager us per call) of one run of ``n`` back-to-back calls."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) / n * 1e6, (done - start) / n * 1e6


def host_and_eager_us(fn, n: int = 500, warmup: int = 50, repeats: int = 7
                      ) -> tuple[float, float]:
    """(host us per call, eager us per call) over ``n`` back-to-back calls, the medians of
    ``repeats`` runs."""
    return interleaved_us([fn], n, warmup, repeats)[0]


def interleaved_us(fns: list, n: int = 500, warmup: int = 50, repeats: int = 7
                   ) -> list[tuple[float, float]]:
    """:func:`host_and_eager_us` of each of ``fns``, their runs interleaved: a host's speed
    drifts by tens of percent for seconds at a time, which then spreads over every case
    instead of landing on one."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    runs = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, runs):
            times.append(_timed_run(fn, n))
    return [(statistics.median(h for h, _ in times), statistics.median(e for _, e in times))
            for times in runs]


def first_call_us(fn, clear, n: int = 100) -> float:
    """Host us of a call that plans (the op's launch cache emptied before each)."""
    fn()
    total = 0.0
    for _ in range(n):
        clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    return total / n * 1e6


def _clear_cache(name: str, module=dispatch):
    """Empties the op's launch cache (a no-op for a version of the ops without one)."""
    cache = getattr(module, name, None)
    return cache.clear if cache is not None else (lambda: None)


def paged_inputs(num_seqs: int, ctx: int, gen: torch.Generator):
    """Query ``[num_seqs, H_Q, D]``, cache views of a shuffled pool, table, lengths; and the
    same K/V gathered contiguous ``[num_seqs, H_KV, ctx, D]`` for SDPA."""
    blocks = num_seqs * (ctx // BS)
    pool = torch.randn(blocks + 8, BS, 2, H_KV, D, device="cuda", generator=gen,
                       dtype=torch.bfloat16)
    table = torch.randperm(blocks + 8, device="cuda", generator=gen)[:blocks]
    table = table.view(num_seqs, ctx // BS).to(torch.int32)
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    query = torch.randn(num_seqs, H_Q, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    gathered = pool[table.long()].reshape(num_seqs, ctx, 2, H_KV, D)
    k = gathered[:, :, 0].transpose(1, 2).contiguous()
    v = gathered[:, :, 1].transpose(1, 2).contiguous()
    return (query, pool[:, :, 0], pool[:, :, 1], table, lens), (query.unsqueeze(2), k, v)


def sdpa_us(q, k, v, backend) -> float:
    with sdpa_kernel(backend):
        return host_and_eager_us(lambda: F.scaled_dot_product_attention(q, k, v,
                                                                         enable_gqa=True))[1]


def decode_rows(gen) -> list[tuple[dict, object]]:
    """Per decode shape: its row (first call and the SDPA peers timed) and the call to time."""
    rows = []
    for num_seqs, ctx in DECODE_SHAPES:
        args, (q, k, v) = paged_inputs(num_seqs, ctx, gen)
        call = (lambda a: lambda: paged_decode(*a))(args)
        first = first_call_us(call, _clear_cache("_DECODE_RUNS"))
        cudnn = sdpa_us(q, k, v, SDPBackend.CUDNN_ATTENTION)
        flash = sdpa_us(q, k, v, SDPBackend.FLASH_ATTENTION)
        rows.append((dict(op="paged_decode", shape=f"{num_seqs}x{ctx // 1024}k",
                          first_call_us=first, cudnn_eager_us=cudnn, flash_eager_us=flash),
                     call))
    return rows


def prefill_and_store_rows(gen) -> list[tuple[dict, object]]:
    """A mixed engine-like step (4 chunks of 64 tokens on 1k contexts), and store_kv of one
    decode step's K/V (8 tokens); as :func:`decode_rows`."""
    args, _ = paged_inputs(4, 1024, gen)
    _, kc, vc, table, lens = args
    query = torch.randn(256, H_Q, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    cu = torch.arange(0, 257, 64, dtype=torch.int32, device="cuda")

    def prefill():
        return paged_prefill(query, kc, vc, table, cu, lens)
    k = torch.randn(8, H_KV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    slots = torch.arange(8, device="cuda") * BS

    def store():
        return store_kv(k, k, kc, vc, slots)
    # Four whole 64-token prompts over their own K/V, as an engine step of fresh prompts calls
    # it (the Triton kernel).
    new_k, new_v = (torch.randn(256, H_KV, D, device="cuda", generator=gen,
                                dtype=torch.bfloat16) for _ in range(2))

    def prompts():
        return flash_attn_varlen_func(query, new_k, new_v, cu, cu, 64, 64, causal=True)
    # One 256-token prompt: on an H100 / H200 the Hopper kernel (Gluon, four tensor
    # descriptors).
    cu2 = torch.tensor([0, 256], dtype=torch.int32, device="cuda")

    def long_prompts():
        return flash_attn_varlen_func(query, new_k, new_v, cu2, cu2, 256, 256, causal=True)
    return [(dict(op="paged_prefill", shape="4x64 on 1k",
                  first_call_us=first_call_us(prefill, _clear_cache("_PREFILL_RUNS"))), prefill),
            (dict(op="flash_attn_varlen_func", shape="4x64 prompts",
                  first_call_us=first_call_us(prompts, _clear_cache("_CONTIGUOUS_RUNS",
                                                                    varlen))), prompts),
            (dict(op="flash_attn_varlen_func", shape="1x256 prompt",
                  first_call_us=first_call_us(long_prompts, _clear_cache("_CONTIGUOUS_RUNS",
                                                                         varlen))),
             long_prompts),
            (dict(op="store_kv", shape="8 tokens",
                  first_call_us=first_call_us(store, _clear_cache("_STORE_RUNS"))), store)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out"),
                        help="directory for host.json")
    args = parser.parse_args()
    start_gpu_run(args.out, "benchmarks.bench_host")
    gen = torch.Generator(device="cuda").manual_seed(0)
    # A yardstick for the host: torch's own cheapest launch, timed in the same runs.
    small = torch.zeros(1024, device="cuda")
    floor = (dict(op="torch add_ (yardstick)", shape="4 KB"), lambda: small.add_(1))
    cases = decode_rows(gen) + prefill_and_store_rows(gen) + [floor]
    rows = [row for row, _ in cases]
    for row, (host, eager) in zip(rows, interleaved_us([call for _, call in cases])):
        row.update(host_us=host, eager_us=eager)
        if "cudnn_eager_us" in row:
            row["vs_cudnn"] = eager / row["cudnn_eager_us"]
    cols = ("op", "shape", "host_us", "eager_us", "first_call_us", "cudnn_eager_us",
            "flash_eager_us", "vs_cudnn")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r.get(c), float) else
                                str(r.get(c, "")) for c in cols) + " |")
    (args.out / "host.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
