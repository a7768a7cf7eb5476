"""Linear projections: ``x @ W^T + b``, optionally with SwiGLU's ``silu(gate) * up`` fused in.

:func:`linear` checks its arguments, then runs ``F.linear`` (the torch reference, and cuBLAS
on CUDA) or the Triton kernel of :mod:`.projection_triton`. ``backend="auto"`` takes the Triton
kernel for CUDA fp16/bf16 inputs of at most :data:`MAX_TRITON_ROWS` rows, a decode step's
sizes: launched as a programmatic dependent, like the decoder's other kernels, it starts
while the kernel before it ends, so a decoder layer's chain of kernels runs faster than with
cuBLAS between them (docs/performance-notes.md, "Projections at decode sizes"). It does so on
sm_90+ only, where dependent launches exist (without them cuBLAS was as fast), and not while
autograd records (the kernel has no backward). Larger inputs (most prompt steps) go to
cuBLAS, whose GEMMs are the faster ones there. ``"triton"`` runs the kernel at any size on
any device (tests, comparisons).

Split-K (the reduction over K shared by several programs) needs a
:class:`SplitKWorkspace`: float32 partial sums and int32 counters that start at 0 and are
left at 0. Without one, every launch is unsplit, which is slower at a few rows for
projections with few output columns (e.g. Qwen3-0.6B's ``o_proj`` / ``down_proj``). The
plan (:func:`plan_linear`) depends on the shapes only, so a CUDA graph keeps the plan it was
captured with.
"""

from __future__ import annotations

from dataclasses import dataclass

import functools

import torch
import torch.nn.functional as F

from ..core.args import arg_error, cdiv, next_pow2, positive_int
from .backend import resolve_backend
from .checks import FLOAT_DTYPES, check_last_dim_contiguous, check_tensor
from .fused import silu_and_mul, silu_and_mul_reference

MAX_TRITON_ROWS = 256
"""The most rows ``backend="auto"`` sends to the Triton kernel (the engine's largest decode
batch by default); above it cuBLAS is faster."""

ACTIVATIONS = (None, "silu")

SHARED_MEMORY_BUDGET = 200 * 1024
"""Bytes of shared memory the kernel's pipeline stages may take at most (sm_90 gives a block
227 KB); less on devices that give less (:func:`shared_memory_budget`)."""


@functools.lru_cache(maxsize=None)
def _cuda_shared_memory(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", 99 * 1024)


def shared_memory_budget(device: torch.device) -> int:
    """Bytes of shared memory a launch's pipeline may take on ``device``:
    :data:`SHARED_MEMORY_BUDGET`, or less where a block gets less (4 KB kept for Triton's own
    scratch); the interpreter (CPU) gets the full budget."""
    if device.type != "cuda":
        return SHARED_MEMORY_BUDGET
    index = device.index if device.index is not None else torch.cuda.current_device()
    return min(SHARED_MEMORY_BUDGET, _cuda_shared_memory(index) - 4096)


@dataclass(frozen=True)
class LinearPlan:
    """How the Triton kernel tiles one call.

    Attributes:
        block_n: weight rows (output columns) per program, the MMA's 64-row side.
        block_m: input rows per program (16 to 128), the MMA's narrow side.
        block_k: K columns per step of the loop.
        split_k: programs sharing one tile's reduction over K (1: unsplit).
        stages: software-pipelining depth of the K loop.
        num_warps: warps per program.
    """
    block_n: int
    block_m: int
    block_k: int
    split_k: int
    stages: int
    num_warps: int


class SplitKWorkspace:
    """Scratch of split-K launches, allocated once and shared by every call on one stream
    (the launches run one after another; each leaves its counters at 0).

    Args:
        device: where the projections run.
        partials: float32 elements for partial sums (a launch needs ``split_k *
            cdiv(out_features, block_n) * block_n * cdiv(rows, block_m) * block_m``, twice
            that gated; :func:`plan_linear` splits less where they would not fit).
        counters: int32 tickets, one per output tile of a launch.
    """

    def __init__(self, device: torch.device | str, *, partials: int = 1 << 20,
                 counters: int = 4096) -> None:
        partials = positive_int("partials", partials)
        counters = positive_int("counters", counters)
        self.partials = torch.empty(partials, dtype=torch.float32, device=device)
        self.counters = torch.zeros(counters, dtype=torch.int32, device=device)

    @property
    def device(self) -> torch.device:
        return self.counters.device


def plan_linear(rows: int, out_features: int, in_features: int, *, gated: bool = False,
                workspace: SplitKWorkspace | None = None, itemsize: int = 2,
                shared_memory: int = SHARED_MEMORY_BUDGET) -> LinearPlan:
    """The Triton kernel's tiles for ``rows x in_features -> out_features`` (tuned at
    Qwen3-0.6B's projections; docs/performance-notes.md, "Projections at decode sizes").

    Rows take the narrow side of the MMA, up to 64 a program (128 past 128 rows for wide
    layers, whose weight would otherwise be read from L2 by four row tiles). K is split only
    with a workspace, and only while a layer has few output tiles: until 64 programs share
    the weight at up to 16 rows, 32 beyond (partial sums cost more with more rows), keeping
    each split at least two steps of K. ``itemsize``: bytes per element of x and the weight;
    ``shared_memory``: bytes the pipeline's stages may take (see
    :func:`shared_memory_budget`), which bound its depth."""
    room = (None if workspace is None
            else (workspace.partials.numel(), workspace.counters.numel()))
    return _plan(rows, out_features, in_features, gated, room, itemsize, shared_memory)


@functools.lru_cache(maxsize=1024)
def _plan(rows: int, out_features: int, in_features: int, gated: bool,
          room: tuple[int, int] | None, itemsize: int, shared_memory: int) -> LinearPlan:
    """:func:`plan_linear` from sizes alone (``room``: the workspace's partials and counters,
    None without one), cached: eager steps ask again for every layer."""
    block_n, block_k = 64, min(128, max(16, next_pow2(in_features)))
    n_tiles = cdiv(out_features, block_n)
    block_m = min(max(16, next_pow2(rows)), 64)
    if rows > 128 and n_tiles >= 48:
        block_m = 128
    m_tiles = cdiv(rows, block_m)
    split = 1
    if room is not None:
        target = 64 if rows <= 16 else 32
        while (n_tiles * split < target and in_features % (2 * split * block_k) == 0
               and in_features // (2 * split) >= 2 * block_k):
            split *= 2
        per_split = n_tiles * m_tiles * block_n * block_m * (2 if gated else 1)
        while split > 1 and (split * per_split > room[0] or n_tiles * m_tiles > room[1]):
            split //= 2
    # As deep a pipeline as the shared memory holds (each stage: the weight tiles and x's).
    stage_bytes = ((2 if gated else 1) * block_n + block_m) * block_k * itemsize
    stages = 4 if block_m <= 64 else 3
    while stages > 1 and stages * stage_bytes > shared_memory:
        stages -= 1
    return LinearPlan(block_n=block_n, block_m=block_m, block_k=block_k, split_k=split,
                      stages=stages, num_warps=8 if block_m >= 128 or gated else 4)


def _auto_takes_triton(x: torch.Tensor, records_grad: bool) -> bool:
    """``backend="auto"``'s rule for a CUDA call (see the module's docstring)."""
    if x.shape[0] > MAX_TRITON_ROWS or x.dtype == torch.float32 or records_grad:
        return False
    from .pdl import pdl_supported
    return pdl_supported(x.device.index if x.device.index is not None
                         else torch.cuda.current_device())


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None) -> torch.Tensor:
    """``F.linear``; with ``activation="silu"``, ``silu(gate) * up`` of its two halves (each
    rounded to the dtype first, as ``F.linear`` then ``F.silu`` and the product do)."""
    y = F.linear(x, weight, bias)
    return y if activation is None else silu_and_mul_reference(y)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           activation: str | None = None, workspace: SplitKWorkspace | None = None,
           backend: str = "auto") -> torch.Tensor:
    """``x @ weight^T + bias``, or with ``activation="silu"`` SwiGLU's ``silu(gate) * up``.

    Args:
        x: float ``[n, in_features]``, last dim contiguous (any row stride).
        weight: ``[out_features, in_features]`` in x's dtype, last dim contiguous; with
            ``activation="silu"``, ``[2 * I, in_features]``: the gate rows, then the up rows
            (``GatedMLP``'s ``gate_up_proj``).
        bias: None or contiguous ``[weight.shape[0]]`` in x's dtype.
        activation: None, or "silu" for the gated product.
        workspace: a :class:`SplitKWorkspace` on x's device, letting the Triton kernel split
            K (see :func:`plan_linear`); None: every launch unsplit.
        backend: "auto" (the Triton kernel for CUDA fp16/bf16 with at most
            :data:`MAX_TRITON_ROWS` rows on sm_90+, outside autograd; else ``F.linear``) |
            "torch" (``F.linear``) | "triton" (the kernel at any size; it has no backward,
            so a ValueError while autograd records through x, weight or bias).

    Returns:
        ``[n, out_features]`` (``[n, I]`` gated) in x's dtype.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device, device_of="x")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if weight.shape[1] != x.shape[1]:
        raise arg_error("weight", f"[out_features, {x.shape[1]}] (x's in_features)",
                        tuple(weight.shape))
    if activation not in ACTIVATIONS:
        raise arg_error("activation", f"one of {ACTIVATIONS}", repr(activation))
    if activation is not None and weight.shape[0] % 2:
        raise arg_error("weight", "an even number of rows (gate and up halves)",
                        tuple(weight.shape))
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), device=x.device, device_of="x")
        check_last_dim_contiguous("bias", bias)
        if bias.shape[0] != weight.shape[0]:
            raise arg_error("bias", f"shape ({weight.shape[0]},)", tuple(bias.shape))
    if workspace is not None:
        if not isinstance(workspace, SplitKWorkspace):
            raise arg_error("workspace", "None or a SplitKWorkspace", type(workspace).__name__)
        if workspace.device != x.device:
            raise arg_error("workspace", f"one on {x.device} (x's device)",
                            f"one on {workspace.device}")
    chosen = resolve_backend(backend, x.device)
    records_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))
    if backend == "triton" and records_grad:
        raise arg_error("backend", "'auto' or 'torch' while autograd records (the Triton "
                        "kernel has no backward)", repr(backend))
    if chosen == "triton" and backend == "auto" and not _auto_takes_triton(x, records_grad):
        chosen = "torch"
    if chosen == "torch" or x.shape[1] == 0:
        y = F.linear(x, weight, bias)
        if activation is None:
            return y
        # The reference's arithmetic; on CUDA (a prompt's rows) one Triton launch.
        return silu_and_mul(y, backend="torch" if backend == "torch" else "auto")
    from .projection_triton import triton_linear
    gated = activation is not None
    out_features = weight.shape[0] // (2 if gated else 1)
    plan = plan_linear(x.shape[0], out_features, x.shape[1], gated=gated, workspace=workspace,
                       itemsize=x.element_size(), shared_memory=shared_memory_budget(x.device))
    split = plan.split_k > 1
    return triton_linear(x, weight, bias, gated, plan, workspace.partials if split else None,
                         workspace.counters if split else None)


__all__ = ["MAX_TRITON_ROWS", "LinearPlan", "SplitKWorkspace", "linear", "linear_reference",
           "plan_linear", "shared_memory_budget"]
