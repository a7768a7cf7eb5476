"""Persistent prefill on Hopper: does looping each program over many query tiles, so the
pipeliner can start the next tile's K/V loads under this one's last (``flatten``), close the
gap to cuDNN at causal 4x4k and 1x16k? (GPU only.)

A persistent copy of ``prefill_hopper``'s stripped-down kernel (contiguous K/V through host
tensor descriptors, equal-length causal sequences, GQA heads packed into 128-row tiles):
``NUM_PROGS`` programs take work items round-robin, each item one (sequence, KV head, query
tile), heaviest tile first. Switches: ``flatten`` on the persistent loop (Triton's
nested-loop fusion, then one software pipeline across items), ``split`` (an unmasked K/V loop
and a masked one, as the library kernel has, or one loop that masks every tile: the fusion
wants one inner loop), the item order, two programs a SM, and ``warp_specialize`` on the
persistent loop; beside them the non-persistent stripped-down kernel at 4 and 8 warps, with and
without ``warp_specialize`` (Triton 3.6 runs its Hopper warp specialization only on 4-warp
kernels; at 8 warps the switch is ignored). Each variant is checked against the library kernel
and timed beside it and cuDNN SDPA, in one process; the compiled kernels' registers, spills
and whether they came out warp-specialized are listed. Rows and what they showed:
``experiments/results/prefill_persistent_h100.txt`` and docs/performance-notes.md.

    python -m benchmarks.experiments.prefill_persistent
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend

from benchmarks.bench_prefill import CASES, HKV, contiguous_kv, paged_batch, sdpa_tflops
from benchmarks.common import environment, start_gpu_run, time_us
from benchmarks.experiments.prefill_hopper import (D, GROUP, Variant, _step, launcher,
                                                   library_contiguous, library_output)
from mini_paged_attn.ops.prefill_plan import PrefillConfig


@triton.jit
def _persistent(q_ptr, out_ptr, k_desc, v_desc, q_len, kv_len, qk_scale, stride_qt, stride_qh,
                num_items, n_tiles, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                STAGES: tl.constexpr, NUM_PROGS: tl.constexpr, FLAT: tl.constexpr,
                SPLIT: tl.constexpr, TILE_MAJOR: tl.constexpr, WS: tl.constexpr):
    TOK: tl.constexpr = BLOCK_M // GROUP
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q_offset = kv_len - q_len
    for item in tl.range(tl.program_id(0), num_items, NUM_PROGS, flatten=FLAT,
                         warp_specialize=WS):
        if TILE_MAJOR:   # every (sequence, KV head) at one tile, heaviest tile first
            tile = n_tiles - 1 - item // (num_items // n_tiles)
            seq_head = item % (num_items // n_tiles)
        else:            # the library's order: sequence, KV head, tile (heaviest first)
            seq_head = item // n_tiles
            tile = n_tiles - 1 - item % n_tiles
        seq = seq_head // NUM_KV_HEADS
        kvh = seq_head % NUM_KV_HEADS
        tok = tile * TOK + rows // GROUP                   # [BLOCK_M]
        head = kvh * GROUP + rows % GROUP                  # [BLOCK_M]
        q_rows = (seq * q_len + tok).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
                    + offs_d[None, :])                     # [BLOCK_M, D]
        last_visible = q_offset + tok                      # [BLOCK_M]
        kv_end = tl.minimum(q_offset + tile * TOK + TOK, kv_len)
        row0 = seq * kv_len
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        if SPLIT:
            unmasked_end = (q_offset + tile * TOK + 1) // BLOCK_N * BLOCK_N
            for start_n in tl.range(0, unmasked_end, BLOCK_N, num_stages=STAGES):
                acc, l_i, m_i = _step(acc, l_i, m_i, q, start_n, last_visible, qk_scale,
                                      k_desc, v_desc, q_ptr, q_ptr, q_ptr, row0, kvh, offs_n,
                                      offs_d, 0, 0, 1, BLOCK_N, 16, D, False)
            for start_n in tl.range(unmasked_end, kv_end, BLOCK_N, num_stages=STAGES):
                acc, l_i, m_i = _step(acc, l_i, m_i, q, start_n, last_visible, qk_scale,
                                      k_desc, v_desc, q_ptr, q_ptr, q_ptr, row0, kvh, offs_n,
                                      offs_d, 0, 0, 1, BLOCK_N, 16, D, True)
        else:
            # Every tile masked: tile 0 always holds key 0, which every row sees, so no
            # row's maximum stays -inf.
            for start_n in tl.range(0, kv_end, BLOCK_N, num_stages=STAGES):
                acc, l_i, m_i = _step(acc, l_i, m_i, q, start_n, last_visible, qk_scale,
                                      k_desc, v_desc, q_ptr, q_ptr, q_ptr, row0, kvh, offs_n,
                                      offs_d, 0, 0, 1, BLOCK_N, 16, D, True)
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class Persistent:
    flat: bool
    split: bool
    tile_major: bool = False
    ws: bool = False
    progs_per_sm: int = 1
    stages: int = 3
    warps: int = 8

    @property
    def name(self) -> str:
        return ("persistent" + " flat" * self.flat + " split" * self.split
                + " tile-major" * self.tile_major + " ws" * self.ws
                + f" x{self.progs_per_sm}" * (self.progs_per_sm != 1)
                + f" s{self.stages}" * (self.stages != 3) + f" w{self.warps}" * (self.warps != 8))


VARIANTS = [Persistent(False, True), Persistent(False, False), Persistent(True, False),
            Persistent(True, True), Persistent(True, False, tile_major=True),
            Persistent(False, True, progs_per_sm=2),
            Persistent(False, True, ws=True, warps=4), Persistent(False, False, ws=True, warps=4),
            Persistent(False, True, warps=4), Persistent(False, True, ws=True, warps=4, stages=2)]
# The stripped-down kernel, one program a tile, with Hopper's warp specialization: Triton
# 3.6 applies it only to 4-warp kernels (then one producer and two consumer warp groups).
STRIPPED = [Variant("tma"), Variant("tma", warps=4), Variant("tma", warps=4, ws=True),
            Variant("tma", warps=4, ws=True, stages=2),
            Variant("tma", block_n=64, warps=4, ws=True)]


def persistent_launcher(p: Persistent, batch, contiguous):
    from triton.tools.tensor_descriptor import TensorDescriptor
    q, _, _, _, _, ctx = batch
    b = len(ctx)
    q_len, kv_len = q.shape[0] // b, int(ctx[0])
    k, v = contiguous[:2]
    k_desc = TensorDescriptor.from_tensor(k.reshape(-1, HKV * D), [128, D])
    v_desc = TensorDescriptor.from_tensor(v.reshape(-1, HKV * D), [128, D])
    out = torch.empty_like(q)
    n_tiles = triton.cdiv(q_len, 128 // GROUP)
    num_items = n_tiles * b * HKV
    progs = torch.cuda.get_device_properties(0).multi_processor_count * p.progs_per_sm

    def run():
        _persistent[(progs,)](q, out, k_desc, v_desc, q_len, kv_len, D ** -0.5 * 1.4426950408889634,
                              q.stride(0), q.stride(1), num_items, n_tiles, NUM_KV_HEADS=HKV,
                              GROUP=GROUP, D=D, BLOCK_M=128, BLOCK_N=128, STAGES=p.stages,
                              NUM_PROGS=progs, FLAT=p.flat, SPLIT=p.split,
                              TILE_MAJOR=p.tile_major, WS=p.ws, num_warps=p.warps)
        return out
    return run


def report_specialization() -> None:
    """Whether each compiled kernel came out warp-specialized, and its registers / spills."""
    from benchmarks.experiments.prefill_hopper import _prefill
    for fn in (_prefill, _persistent):
        for cache in fn.device_caches.values():
            for key, kernel in cache[0].items():
                ttgir = kernel.asm.get("ttgir", "")
                print(f"{fn.__name__}: warps {kernel.metadata.num_warps} "
                      f"stages {kernel.metadata.num_stages} "
                      f"warp_specialize op {'ttg.warp_specialize' in ttgir} "
                      f"regs {getattr(kernel, 'n_regs', '?')} "
                      f"spills {getattr(kernel, 'n_spills', '?')}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    start_gpu_run(args.out, "prefill_persistent")
    env = environment()
    print(f"{env['device']} torch {env['torch']} triton {env['triton']} {env['date']}")
    table = []
    for case in (c for c in CASES if c.name in ("causal 1x4k", "causal 4x4k", "causal 1x16k")):
        batch = paged_batch(case)
        contiguous = contiguous_kv(batch)
        expect = library_output(batch).float()
        fns = {"library (contiguous, tma)": library_contiguous(
                   batch, contiguous, PrefillConfig(128, 128, 8, 3, tma=True))}
        for p in STRIPPED + VARIANTS:
            name = f"stripped {p.name}" if isinstance(p, Variant) else p.name
            try:
                fn = (launcher(p, batch, contiguous) if isinstance(p, Variant)
                      else persistent_launcher(p, batch, contiguous))
                got = fn().float()
                err = ((got - expect).norm() / expect.norm()).item()
                if not err < 1e-2:
                    print(f"{case.name} {name}: wrong output, rel err {err:.2e}")
                    continue
                fns[name] = fn
            except Exception as exc:  # a variant the compiler refuses
                print(f"{case.name} {name}: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:120]}", flush=True)
        times: dict[str, list[float]] = {name: [] for name in fns}
        cudnn = []
        for _ in range(args.rounds):   # alternate, so drift hits every variant alike
            cudnn.append(sdpa_tflops(case, SDPBackend.CUDNN_ATTENTION))
            for name, fn in fns.items():
                times[name].append(case.flops / time_us(fn) / 1e6)
        best_cudnn = max(cudnn)
        for name, rates in times.items():
            table.append((case.name, name, max(rates), max(rates) / best_cudnn))
        table.append((case.name, "cuDNN SDPA", best_cudnn, 1.0))
        print(f"{case.name} done", flush=True)
    report_specialization()
    print(f"\n{'case':14} {'variant':40} {'TFLOP/s':>8} {'/cuDNN':>7}")
    for case, name, tflops, rel in table:
        print(f"{case:14} {name:40} {tflops:8.0f} {rel:7.2f}")


if __name__ == "__main__":
    main()
