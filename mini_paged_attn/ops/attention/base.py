"""What an attention backend is: the attention it is asked for, what it declares it supports,
the engine's limits it sizes its memory by, and the interface the ops and the engine call.

A backend is an immutable object chosen once (:func:`~.select.select_backend` at engine start,
:func:`~.select.backend_for_call` once per op call for library users). Per-call tiling and
kernel thresholds stay inside the backend; the caller never reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache.fp8 import FP8_DTYPE, is_fp8
from ...core.args import arg_error, check_bool, positive_int
from ..checks import FLOAT_DTYPES


@dataclass(frozen=True)
class AttentionSpec:
    """The attention a model (or one call) needs.

    device: where the tensors live. dtype: the queries' (fp16 / bf16 / fp32). kv_dtype: the
    cache's, ``dtype`` or ``torch.float8_e4m3fn``. head_size: of one head. block_size: tokens
    per cache block. window, softcap, sinks: whether some layer uses a sliding window, a
    logit soft-cap, attention sinks (:mod:`mini_paged_attn.ops.variants`).
    """

    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    head_size: int
    block_size: int = 16
    window: bool = False
    softcap: bool = False
    sinks: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.device, torch.device):
            raise arg_error("device", "a torch.device", type(self.device).__name__)
        if self.dtype not in FLOAT_DTYPES:
            raise arg_error("dtype", " or ".join(map(str, FLOAT_DTYPES)), str(self.dtype))
        if self.kv_dtype not in (self.dtype, FP8_DTYPE):
            raise arg_error("kv_dtype", f"{self.dtype} (the queries') or {FP8_DTYPE}",
                            str(self.kv_dtype))
        positive_int("head_size", self.head_size)
        positive_int("block_size", self.block_size)
        for name in ("window", "softcap", "sinks"):
            check_bool(name, getattr(self, name))

    @property
    def fp8_kv(self) -> bool:
        return is_fp8(self.kv_dtype)


@dataclass(frozen=True)
class Capabilities:
    """What a backend runs, as it declares it. ``None`` in a field means "any".

    device_types: ``torch.device.type`` values. compute_capability: the one CUDA generation
    the backend's kernels are built for (e.g. ``(9, 0)``). dtypes: query dtypes.
    head_sizes / max_head_size: head sizes taken. window, softcap, sinks, fp8_kv: the
    variants taken.
    """

    device_types: tuple[str, ...] | None = None
    compute_capability: tuple[int, int] | None = None
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    head_sizes: tuple[int, ...] | None = None
    max_head_size: int | None = None
    window: bool = True
    softcap: bool = True
    sinks: bool = True
    fp8_kv: bool = True

    def refusal(self, spec: AttentionSpec) -> str | None:
        """Why ``spec`` does not fit, in words; None where it does. Reads the device's
        compute capability (a CUDA query) only when the rest fits."""
        if self.device_types is not None and spec.device.type not in self.device_types:
            return f"runs on {'/'.join(self.device_types)} devices, not {spec.device.type}"
        if spec.dtype not in self.dtypes:
            return f"takes {'/'.join(map(str, self.dtypes))} queries, not {spec.dtype}"
        if self.head_sizes is not None and spec.head_size not in self.head_sizes:
            return f"takes head sizes {list(self.head_sizes)}, not {spec.head_size}"
        if self.max_head_size is not None and spec.head_size > self.max_head_size:
            return f"takes head sizes up to {self.max_head_size}, not {spec.head_size}"
        for name in ("window", "softcap", "sinks", "fp8_kv"):
            if getattr(spec, name) and not getattr(self, name):
                return f"has no {name.replace('_', ' ')} support"
        if self.compute_capability is not None:
            got = torch.cuda.get_device_capability(spec.device)
            if got != self.compute_capability:
                want = "sm_%d%d" % self.compute_capability
                return f"needs a {want} GPU, not sm_{got[0]}{got[1]}"
        return None


@dataclass(frozen=True)
class AttentionLimits:
    """The engine's bounds, by which a backend sizes its workspaces and warm-up batches.

    max_num_seqs: sequences a step. max_num_batched_tokens: tokens a step. max_model_len:
    tokens a sequence. table_width: block-table columns. num_q_heads, num_kv_heads: this
    rank's heads. spec: the attention itself.
    """

    spec: AttentionSpec
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    table_width: int
    num_q_heads: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "table_width",
                     "num_q_heads", "num_kv_heads"):
            positive_int(name, getattr(self, name))


@dataclass(frozen=True)
class WarmupBatch:
    """One made-up step of the warm-up: ``num_seqs`` sequences of ``q_len`` new tokens each,
    over no cached prefix (``no_prefix``: new K/V read as they are) or through the block
    tables."""

    num_seqs: int
    q_len: int
    no_prefix: bool = True


class AttentionBackend:
    """An attention implementation the engine and the ops call.

    ``name`` names the backend; ``op_backend`` is what the ops' ``backend=`` argument takes
    for it ("torch" or "triton"), passed along with every step. Subclasses define
    :attr:`capabilities`, :meth:`decode`, :meth:`prefill`, :meth:`varlen` and
    :meth:`store_kv`; :attr:`call_capabilities` where one op call needs less than a model.
    """

    name: str = ""
    op_backend: str = ""
    capabilities: Capabilities = Capabilities()
    # What one public op call needs of its device and shapes; a model (``capabilities``)
    # also needs every op its steps launch, decode's bounds included.
    call_capabilities: Capabilities = Capabilities()

    def refusal(self, spec: AttentionSpec) -> str | None:
        """Why this backend cannot run ``spec``; None where it can."""
        return self.capabilities.refusal(spec)

    def call_refusal(self, spec: AttentionSpec) -> str | None:
        """Why this backend cannot run one op call of ``spec`` (its device, dtype and head
        size); None where it can. Asked by :func:`~.select.backend_for_call`, so a refused
        call fails before it writes anything."""
        return self.call_capabilities.refusal(spec)

    def check_store_slots(self, slot_mapping: torch.Tensor, num_slots: int) -> None:
        """Check the values of ``store_kv``'s slot_mapping (int32 / int64 ``[num_tokens]``)
        against the pool's ``num_slots``, where the backend reads them; the kernels do not
        (a host sync), so by default nothing is read."""

    def check_varlen_lengths(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                             total_q: int, total_k: int | None, max_seqlen_q: int,
                             max_seqlen_k: int) -> None:
        """Check the values of ``flash_attn_varlen_func``'s int32 ``[num_seqs + 1]``
        cumulative lengths against ``total_q`` query rows and ``total_k`` key rows (None:
        paged K/V, ``cu_seqlens_k`` ends where it ends) and the max_seqlen bounds, where the
        backend reads them; the kernels do not (a host sync), so by default nothing is read."""

    def decode_workspace(self, limits: AttentionLimits) -> torch.Tensor | None:
        """A persistent float32 scratch the engine passes to every decode call (its size is
        the backend's to know), or None where the backend takes none."""
        return None

    def workspace_bytes(self, limits: AttentionLimits) -> int:
        """Bytes a step's calls may allocate on their own beyond what a profiled step shows,
        which the engine leaves free when it sizes the KV pool."""
        return 0

    def warmup_shapes(self, limits: AttentionLimits) -> list[WarmupBatch]:
        """The made-up steps that compile and load every kernel variant steps within
        ``limits`` can launch (so no request waits for a compile)."""
        return []

    def __repr__(self) -> str:
        return f"<attention backend {self.name!r}>"


def outputs(query: torch.Tensor, out: torch.Tensor | None, return_lse: bool, rows: int,
            num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out`` (or a new ``query``-like tensor) and, with ``return_lse``, a float32
    ``[rows, num_q_heads]`` lse."""
    if out is None:
        out = torch.empty_like(query)
    lse = (torch.empty(rows, num_q_heads, dtype=torch.float32, device=query.device)
           if return_lse else None)
    return out, lse


__all__ = ["AttentionBackend", "AttentionLimits", "AttentionSpec", "Capabilities",
           "WarmupBatch", "outputs"]
