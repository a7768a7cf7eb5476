"""Does Triton 3.6's Hopper warp specialization compile an attention forward at all? (GPU
only.)

Triton 3.6 runs its Hopper warp-specialization pass only on kernels of 4 warps (one producer
and two consumer warp groups), and the packed-GQA kernels of ``prefill_hopper`` /
``prefill_persistent`` crash it (``NVGPUWarpSpecialization``: a dominance assertion). This
probe tries the simplest forward there is, in the form of Triton's own tutorial: one query
head per program, Q / K / V / O all through host tensor descriptors, an off-diagonal loop and
a diagonal loop (causal) or one loop (not causal), with and without ``warp_specialize``, and
reports whether the compiled kernel holds a ``ttg.warp_specialize`` op, its rate and its
error against cuDNN SDPA.

    python -m benchmarks.experiments.prefill_ws_probe
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import environment, start_gpu_run, time_us

HQ, HKV, D = 32, 8, 128


@triton.jit
def _band(acc, l_i, m_i, q, k_desc, v_desc, kv_row, kv_col, lo, hi, offs_m, qk_scale,
          BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = k_desc.load([kv_row + start_n, kv_col])          # [BLOCK_N, D]
        s = tl.dot(q, k.T)                                    # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = offs_m[:, None] >= (start_n + offs_n[None, :])
            s = s * qk_scale + tl.where(visible, 0, -1.0e6)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            s -= m_new[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            s = s * qk_scale - m_new[:, None]
        p = tl.math.exp2(s)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = v_desc.load([kv_row + start_n, kv_col])          # [BLOCK_N, D]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd(q_desc, k_desc, v_desc, o_desc, seq_len, qk_scale, HQ: tl.constexpr,
         GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         CAUSAL: tl.constexpr, WS: tl.constexpr):
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)      # heaviest first
    seq = tl.program_id(1) // HQ
    head = tl.program_id(1) % HQ
    q_row = seq * seq_len + start_m * BLOCK_M
    kv_row = seq * seq_len
    kv_col = (head // GROUP) * D
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    q = q_desc.load([q_row, head * D])                        # [BLOCK_M, D]
    if CAUSAL:
        acc, l_i, m_i = _band(acc, l_i, m_i, q, k_desc, v_desc, kv_row, kv_col, 0,
                              start_m * BLOCK_M, offs_m, qk_scale, BLOCK_N, False, WS)
        acc, l_i, m_i = _band(acc, l_i, m_i, q, k_desc, v_desc, kv_row, kv_col,
                              start_m * BLOCK_M, (start_m + 1) * BLOCK_M, offs_m, qk_scale,
                              BLOCK_N, True, WS)
    else:
        acc, l_i, m_i = _band(acc, l_i, m_i, q, k_desc, v_desc, kv_row, kv_col, 0, seq_len,
                              offs_m, qk_scale, BLOCK_N, False, WS)
    acc = acc / l_i[:, None]
    o_desc.store([q_row, head * D], acc.to(tl.bfloat16))


def run_case(batch: int, seq_len: int, causal: bool, warps: int, ws: bool, stages: int,
             block_n: int = 128):
    from triton.tools.tensor_descriptor import TensorDescriptor
    torch.manual_seed(0)
    q = torch.randn(batch * seq_len, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch * seq_len, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch * seq_len, HKV, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    descs = [TensorDescriptor.from_tensor(t.view(t.shape[0], -1), [rows, D])
             for t, rows in ((q, 128), (k, block_n), (v, block_n), (out, 128))]
    grid = (seq_len // 128, batch * HQ)
    compiled = []

    def fn():
        compiled.append(_fwd[grid](*descs, seq_len, D ** -0.5 * 1.4426950408889634, HQ=HQ,
                                   GROUP=HQ // HKV, D=D, BLOCK_M=128, BLOCK_N=block_n,
                                   CAUSAL=causal, WS=ws, num_warps=warps, num_stages=stages))
    fn()
    kernel = compiled[0]
    specialized = "ttg.warp_specialize" in kernel.asm.get("ttgir", "")
    qs = q.view(batch, seq_len, HQ, D).transpose(1, 2)
    ks = k.view(batch, seq_len, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    vs = v.view(batch, seq_len, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        def ref():
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        expect = ref().transpose(1, 2).reshape_as(out)
        t_cudnn = time_us(ref)
    err = ((out.float() - expect.float()).norm() / expect.float().norm()).item()
    flops = 4 * batch * HQ * seq_len * seq_len * D / (2 if causal else 1)
    t = time_us(fn)
    return specialized, flops / t / 1e6, flops / t_cudnn / 1e6, err, kernel.n_spills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    start_gpu_run(args.out, "prefill_ws_probe")
    env = environment()
    print(f"{env['device']} torch {env['torch']} triton {env['triton']} {env['date']}")
    print(f"{'case':22} {'warps':>5} {'ws':>5} {'st':>3} {'bn':>4} {'specialized':>11} "
          f"{'TFLOP/s':>8} {'cuDNN':>6} {'ratio':>6} {'err':>8} {'spills':>6}")
    for batch, seq_len, causal in ((1, 4096, False), (4, 4096, True), (1, 16384, True)):
        for warps, ws, stages, block_n in ((8, False, 3, 128), (4, False, 3, 128),
                                           (4, True, 2, 128), (4, True, 3, 128),
                                           (4, True, 2, 64), (4, True, 3, 64)):
            name = f"{'causal' if causal else 'full'} {batch}x{seq_len // 1024}k"
            try:
                spec, ours, cudnn, err, spills = run_case(batch, seq_len, causal, warps, ws,
                                                          stages, block_n)
                print(f"{name:22} {warps:5} {str(ws):>5} {stages:3} {block_n:4} {str(spec):>11} "
                      f"{ours:8.0f} {cudnn:6.0f} {ours / cudnn:6.2f} {err:8.1e} {spills:6}",
                      flush=True)
            except Exception as exc:  # a variant the compiler refuses
                print(f"{name:22} {warps:5} {str(ws):>5} {stages:3} {block_n:4} "
                      f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}", flush=True)


if __name__ == "__main__":
    main()
