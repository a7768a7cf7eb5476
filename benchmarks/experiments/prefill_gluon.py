"""Causal prefill in Gluon with the QK of one K/V tile overlapping the softmax of the last.

Plain Triton 3.6 waits for every ``wgmma`` right after issuing it (``wgmma.wait_group 0`` after
both dots of the attention loop, checked in the PTX of a stripped-down loop compiled for
sm_90), and its Hopper warp specialization does not compile on these kernels (see
docs/performance-notes.md, "Persistent programs and Hopper warp specialization"). So the
tensor cores idle while a program computes its softmax. Gluon issues and waits for the
``wgmma`` groups by hand, which allows FlashAttention-3's overlap within one warp group
(its "intra-warpgroup pipelining"), iteration ``j``:

    issue S_j = Q K_j^T                       (async)
    issue O += P_{j-1} V_{j-1}                (async, P from registers)
    wait until one group is left              -> S_j is done, the PV may still run
    softmax of S_j -> P_j, m_j, l_j, alpha_j  (CUDA cores, under the PV)
    wait for the PV; O *= alpha_j
    refill the finished tile's K/V slot by TMA

Stripped down to the benchmark's case: equal-length causal sequences (a multiple of 128),
bf16, head size 128, GQA by head index, K/V tiles by TMA into a ring of ``STAGES`` slots.
``OVERLAP=False`` runs the same kernel in the usual order (each dot waited for at once) as
its own baseline. ``PRODUCER=True`` moves the K/V loads to a loader warp of their own (Gluon
warp specialization, FlashAttention-3's producer): the compute warps then hand a finished
slot back through an mbarrier instead of refilling it between their own dots. The run
checks every variant against torch SDPA and times it beside the library's contiguous path
(``flash_attn_varlen_func``) and cuDNN / flash SDPA in one process.

    python -m benchmarks.experiments.prefill_gluon --compile-only  # any machine: sm_90 AOT
    for v in wait2 overlap2 overlap3 producer2 producer3; do       # GPU (sm_90): each variant
        timeout 120 python -m benchmarks.experiments.prefill_gluon --check $v
    done                                                           # alone first (a hang
    python -m benchmarks.experiments.prefill_gluon --rounds 3      # costs one process)

It did not pay: at best 0.82-0.87x cuDNN, under the Triton kernel's 0.88-0.98x (rows in
``results/prefill_gluon_h100.txt``). Its two warp groups run in step, so both compute their
softmax while the tensor cores idle; the library's Hopper kernel (``ops/prefill_hopper.py``)
gives each warp group a partition of its own and alternates their dots (ping-pong), and the
"library contiguous" row of this run is that kernel now.
"""

from __future__ import annotations

import argparse
import re

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

LOG2E = 1.4426950408889634
SHAPES = ((1, 4096), (4, 4096), (1, 16384))      # (sequences, tokens each), causal
H_Q, H_KV, D = 32, 8, 128


@gluon.jit
def _softmax_tile(s, m_i, l_i, qk_scale, q_start, k_start, MASKED: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr,
                  p_layout: gl.constexpr):
    """One tile's online softmax: ``s`` float32 [BLOCK_M, BLOCK_N] (scores before scaling,
    ``layout``: the QK accumulator's); ``m_i`` / ``l_i`` float32 [BLOCK_M] (row max in log2
    units, row sum). Returns (p, m_new, l_new, alpha): p bf16 [BLOCK_M, BLOCK_N] in
    ``p_layout`` (the PV dot's register operand), converted here so that no float32 copy
    stays live beside the dots in flight."""
    if MASKED:      # the diagonal tile: key position <= query position
        rows = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))  # [BLOCK_M]
        cols = k_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))  # [BLOCK_N]
        s = gl.where(cols[None, :] <= rows[:, None], s, -float("inf"))
    # The scale is positive: the row max of the raw scores, scaled, is the scaled max, and
    # scale-and-subtract is one FFMA per score.
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])                        # [BLOCK_M, BLOCK_N]
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return gl.convert_layout(p.to(gl.bfloat16), p_layout), m_new, l_new, alpha


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, bar, row, col, pred):
    """Start the TMA copies of one K and one V tile into a ring slot, both on ``bar``."""
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [row, col], bar, k_smem, pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row, col], bar, v_smem, pred=pred)


@gluon.jit
def _consume(q_smem, k_smem, v_smem, ready, empty, q_bar, o_desc, k_desc, v_desc, q_row, q_col,
             kv_row0, kv_col, q_start, n_tiles, qk_scale, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
             OVERLAP: gl.constexpr, PRODUCER: gl.constexpr, num_warps: gl.constexpr):
    """The attention loop of one query tile and its output's store. Tile ``t``'s K/V are in
    ring slot ``t % STAGES``, signalled on ``ready``; a finished slot is handed back by
    arriving on ``empty`` (a producer partition refills it) or refilled here."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)

    # Tile 0: its scores alone.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)),
                      gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    if n_tiles == 1:
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, q_start, 0, True,
                                           BLOCK_M, BLOCK_N, s_layout, p_layout)
    else:
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, q_start, 0, False,
                                           BLOCK_M, BLOCK_N, s_layout, p_layout)

    for j in range(1, n_tiles):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        p_op = p
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        # The last tile's scores are dead: their registers take this tile's (use_acc=False
        # ignores them), so no zero tile stays live through the loop.
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s, use_acc=False,
                          is_async=True)
        if OVERLAP:
            acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))        # the QK; the PV may still run
        else:
            s = warpgroup_mma_wait(0, deps=(s,))
            acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        if j == n_tiles - 1:
            p, m_new, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, q_start, j * BLOCK_N,
                                                 True, BLOCK_M, BLOCK_N, s_layout,
                                                 p_layout)
        else:
            p, m_new, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, q_start, j * BLOCK_N,
                                                 False, BLOCK_M, BLOCK_N, s_layout,
                                                 p_layout)
        if OVERLAP:
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        acc = acc * gl.convert_layout(alpha, o_row_layout)[:, None]
        m_i = m_new
        # Tile j - 1 is done (its PV waited for): its slot takes tile j - 1 + STAGES.
        if PRODUCER:
            gl.thread_barrier()         # both warp groups' PV of the slot are done
            mbarrier.arrive(empty.index(prev), count=1)
        else:
            nxt = j - 1 + STAGES
            _load_kv(k_desc, v_desc, k_smem.index(prev), v_smem.index(prev),
                     ready.index(prev), kv_row0 + nxt * BLOCK_N, kv_col, nxt < n_tiles)

    last = (n_tiles - 1) % STAGES
    p_op = p
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    # The barriers are not invalidated: their memory is not reused, and the other warp group
    # may still be polling the last tile's (already completed) phase.

    out = acc / gl.convert_layout(l_i, o_row_layout)[:, None]        # [BLOCK_M, HEAD_D]
    q_smem.store(out.to(o_desc.dtype))          # Q's tile is no longer read: reuse it
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, q_col], q_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _produce(k_desc, v_desc, k_smem, v_smem, ready, empty, kv_row0, kv_col, n_tiles,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The loader partition (one warp): every K/V tile into its ring slot once the slot's
    last tile is done (an mbarrier starts with its phase 1 complete: the first round waits
    for nothing)."""
    for t in range(n_tiles):
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
        _load_kv(k_desc, v_desc, k_smem.index(slot), v_smem.index(slot), ready.index(slot),
                 kv_row0 + t * BLOCK_N, kv_col, True)


@gluon.jit
def _attn_fwd(q_desc, k_desc, v_desc, o_desc, seq_len, qk_scale,
              NUM_Q_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
              OVERLAP: gl.constexpr, PRODUCER: gl.constexpr, num_warps: gl.constexpr):
    """One program: one query tile of one head of one sequence, heaviest tiles first.

    q_desc / o_desc: over ``[num_seqs * seq_len, NUM_Q_HEADS * HEAD_D]`` bf16, block
    [BLOCK_M, HEAD_D]; k_desc / v_desc: over ``[num_seqs * seq_len, num_kv_heads * HEAD_D]``,
    block [BLOCK_N, HEAD_D]. ``seq_len`` a multiple of BLOCK_M; BLOCK_M == BLOCK_N, so a
    query tile's last K/V tile is its diagonal one. ``PRODUCER``: K/V loads from a loader
    warp of their own (Gluon warp specialization) instead of the compute warps' refills."""
    gl.static_assert(BLOCK_M == BLOCK_N)
    num_m = seq_len // BLOCK_M
    pid = gl.program_id(0)
    m_tile = num_m - 1 - pid % num_m
    head = (pid // num_m) % NUM_Q_HEADS
    seq = pid // (num_m * NUM_Q_HEADS)
    q_start = m_tile * BLOCK_M                  # position in the sequence
    q_row = seq * seq_len + q_start
    kv_row0 = seq * seq_len
    q_col = head * HEAD_D
    kv_col = (head // GROUP) * HEAD_D
    n_tiles = m_tile + 1

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(q_bar, count=1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem)
    if PRODUCER:
        gl.warp_specialize([
            (_consume, (q_smem, k_smem, v_smem, ready, empty, q_bar, o_desc, k_desc, v_desc,
                        q_row, q_col, kv_row0, kv_col, q_start, n_tiles, qk_scale, BLOCK_M,
                        BLOCK_N, HEAD_D, STAGES, OVERLAP, PRODUCER, num_warps)),
            (_produce, (k_desc, v_desc, k_smem, v_smem, ready, empty, kv_row0, kv_col,
                        n_tiles, BLOCK_N, STAGES)),
        ], [1], [24])
    else:
        for i in gl.static_range(STAGES):       # every slot starts filled
            _load_kv(k_desc, v_desc, k_smem.index(i), v_smem.index(i), ready.index(i),
                     kv_row0 + i * BLOCK_N, kv_col, i < n_tiles)
        _consume(q_smem, k_smem, v_smem, ready, empty, q_bar, o_desc, k_desc, v_desc, q_row,
                 q_col, kv_row0, kv_col, q_start, n_tiles, qk_scale, BLOCK_M, BLOCK_N,
                 HEAD_D, STAGES, OVERLAP, PRODUCER, num_warps)


def _layout():
    return gl.NVMMASharedLayout.get_default_for([128, D], gl.bfloat16)


# name: (label, options of gluon_attention)
VARIANTS = {
    "wait2": ("gluon, waits at once, 2 stages", dict(overlap=False, stages=2)),
    "overlap2": ("gluon, overlap, 2 stages", dict(overlap=True, stages=2)),
    "overlap3": ("gluon, overlap, 3 stages", dict(overlap=True, stages=3)),
    "producer2": ("gluon, overlap, loader warp, 2 stages",
                  dict(overlap=True, stages=2, producer=True)),
    "producer3": ("gluon, overlap, loader warp, 3 stages",
                  dict(overlap=True, stages=3, producer=True)),
}
NUM_WARPS = 8
PRODUCER_MAXNREG = 168
"""With a loader warp the CTA has 12 warps (a warp group of its own), and 168 x 12 x 32
registers fit the SM's 65,536; the loader's 24 a thread leave 240 to the compute warps."""


def launch_options(producer: bool) -> dict:
    return dict(num_warps=NUM_WARPS, **(dict(maxnreg=PRODUCER_MAXNREG) if producer else {}))


def gluon_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int,
                    *, overlap: bool = True, stages: int = 2, producer: bool = False,
                    block: int = 128) -> torch.Tensor:
    """Causal attention of ``num_seqs`` equal-length sequences.

    q: bf16 ``[num_seqs * seq_len, H_Q, D]``; k, v: bf16 ``[num_seqs * seq_len, H_KV, D]``.
    Returns bf16 ``[num_seqs * seq_len, H_Q, D]``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    total, num_q_heads, head = q.shape
    seq_len = total // num_seqs
    assert seq_len % block == 0 and head == D
    out = torch.empty_like(q)
    layout = gl.NVMMASharedLayout.get_default_for([block, head], gl.bfloat16)

    def desc(t):
        flat = t.view(t.shape[0], -1)
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [block, head],
                                layout)
    grid = (num_seqs * num_q_heads * (seq_len // block),)
    _attn_fwd[grid](desc(q), desc(k), desc(v), desc(out), seq_len,
                    head ** -0.5 * LOG2E, num_q_heads, num_q_heads // k.shape[1], block, block,
                    head, stages, overlap, producer, **launch_options(producer))
    return out


def compile_only() -> None:
    """Compile each variant for sm_90 here (no GPU): registers, spills, and the order of the
    wgmma issues and waits in the PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from benchmarks.experiments.decode_compile_check import resource_usage
    desc = f"tensordesc<bf16[128, {D}],{_layout()!r}>"
    signature = dict(q_desc=desc, k_desc=desc, v_desc=desc, o_desc=desc, seq_len="i32",
                     qk_scale="fp32")
    names = list(_attn_fwd.arg_names)
    for name, (_, opts) in VARIANTS.items():
        producer = opts.get("producer", False)
        constexprs = dict(NUM_Q_HEADS=H_Q, GROUP=H_Q // H_KV, BLOCK_M=128, BLOCK_N=128,
                          HEAD_D=D, STAGES=opts["stages"], OVERLAP=opts["overlap"],
                          PRODUCER=producer, num_warps=NUM_WARPS)
        sig = {n: signature.get(n, "constexpr") for n in names}
        src = GluonASTSource(_attn_fwd, sig, {(names.index(k),): v
                                              for k, v in constexprs.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=launch_options(producer))
        ptx = kernel.asm["ptx"]
        seq = ["W" + m.group(1) if m.group(1) is not None else "M" for m in re.finditer(
            r"wgmma\.wait_group\.sync\.aligned\s+(\d+)|wgmma\.mma_async", ptx)]
        runs = []
        for x in seq:
            if runs and runs[-1][0] == x:
                runs[-1][1] += 1
            else:
                runs.append([x, 1])
        order = " ".join(f"{x}x{n}" if n > 1 else x for x, n in runs)
        print(f"{name:9}: {resource_usage(kernel)} shared={kernel.metadata.shared} "
              f"warps={kernel.metadata.num_warps}  wgmma order: {order}", flush=True)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int):
    """``[num_seqs * seq_len, heads, D]`` inputs as SDPA's contiguous ``[num_seqs, H_Q,
    seq_len, D]``, K/V heads repeated for GQA."""
    def dense(t, repeat):
        return (t.view(num_seqs, -1, t.shape[1], D).transpose(1, 2)
                .repeat_interleave(repeat, dim=1).contiguous())
    return dense(q, 1), dense(k, H_Q // H_KV), dense(v, H_Q // H_KV)


def _sdpa(backend, dense) -> torch.Tensor:
    """Causal SDPA with ``backend`` over ``_dense``'s tensors: ``[num_seqs, H_Q, seq_len, D]``
    (timed as it is; ``_tokens`` gives the kernels' layout)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(*dense, is_causal=True)


def _tokens(out: torch.Tensor) -> torch.Tensor:
    """``[tokens, H_Q, D]`` of an output, SDPA's ``[num_seqs, H_Q, seq_len, D]`` included."""
    return out if out.dim() == 3 else out.transpose(1, 2).reshape(-1, H_Q, D)


def check(variant: str) -> None:
    """One Gluon variant on causal 1 x 4k against SDPA (flash): its largest error."""
    from torch.nn.attention import SDPBackend
    name, opts = VARIANTS[variant]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4096, h, D, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h in (H_Q, H_KV, H_KV))
    out = gluon_attention(q, k, v, 1, **opts)
    torch.cuda.synchronize()
    ref = _tokens(_sdpa(SDPBackend.FLASH_ATTENTION, _dense(q, k, v, 1)))
    err = (out.float() - ref.float()).abs().max().item()
    print(f"check {variant} ({name}): max error {err:.3g} against SDPA flash", flush=True)


def run_gpu(rounds: int, names: list[str]) -> None:
    from torch.nn.attention import SDPBackend

    from benchmarks.common import environment, time_us
    from mini_paged_attn.ops import flash_attn_varlen_func
    env = environment()
    print(f"{env['device']} torch {env['torch']} triton {env['triton']} {env['date']}")
    variants = dict(VARIANTS[n] for n in names)
    rows = []
    for num_seqs, seq_len in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        total = num_seqs * seq_len
        q = torch.randn(total, H_Q, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(total, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(total, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        cu = torch.arange(0, total + 1, seq_len, dtype=torch.int32, device="cuda")
        dense = _dense(q, k, v, num_seqs)
        ref = _tokens(_sdpa(SDPBackend.FLASH_ATTENTION, dense))
        flops = 4 * num_seqs * H_Q * D * seq_len * seq_len / 2
        fns = {"library contiguous (flash_attn_varlen_func)": lambda: flash_attn_varlen_func(
            q, k, v, cu, cu, seq_len, seq_len, causal=True)}
        for name, opts in variants.items():
            fns[name] = (lambda o=opts: gluon_attention(q, k, v, num_seqs, **o))
        fns["SDPA cuDNN"] = lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, dense)
        fns["SDPA flash"] = lambda: _sdpa(SDPBackend.FLASH_ATTENTION, dense)
        errors = {name: (_tokens(fn()).float() - ref.float()).abs().max().item()
                  for name, fn in fns.items()}
        best = {name: float("inf") for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                best[name] = min(best[name], time_us(fn))
        cudnn = flops / best["SDPA cuDNN"] / 1e6
        for name in fns:
            tflops = flops / best[name] / 1e6
            rows.append((f"{num_seqs}x{seq_len // 1024}k", name, tflops, tflops / cudnn,
                         errors[name]))
            print(f"{rows[-1][0]:>6} {name:44} {tflops:7.1f} TFLOP/s {tflops / cudnn:5.2f}x "
                  f"cuDNN  max err {errors[name]:.3g}", flush=True)
    print("\ncase   variant                                      TFLOP/s  x cuDNN")
    for case, name, tflops, ratio, _ in rows:
        print(f"{case:>6} {name:44} {tflops:7.1f} {ratio:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for sm_90 without a GPU and report registers")
    parser.add_argument("--rounds", type=int, default=3, help="alternated timing rounds")
    parser.add_argument("--check", choices=sorted(VARIANTS),
                        help="only check one Gluon variant's output on causal 1 x 4k")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated Gluon variants to time (default: all)")
    args = parser.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}, expected some of {sorted(VARIANTS)}")
    if args.compile_only:
        compile_only()
    elif args.check:
        check(args.check)
    else:
        run_gpu(args.rounds, names)


if __name__ == "__main__":
    main()
