"""The attention layer over the paged KV cache, and the per-step metadata every layer shares.

One step's tokens are flattened (``[num_tokens, ...]``, no batch dim, no padding): sequence ``i``
owns rows ``cu_seqlens_q[i] .. cu_seqlens_q[i+1]``, which are the *last* tokens of its
``context_lens[i]`` tokens. Each layer writes the new tokens' K/V into its cache (from the
rotary kernel, ``ops.apply_rotary(..., store=KVWrite(...))``; :func:`paged_attention` with
``ops.store_kv``) and attends with ``ops.paged_decode`` (one new token per sequence) or
``ops.paged_prefill`` (any mix of prompts, prompt chunks, prefix-cache hits and decodes), or, when
no sequence has cached tokens before the step's (whole prompts), ``ops.flash_attn_varlen_func``
over the new K/V themselves (FlashInfer's ragged prefill: contiguous tiles, no block table).
A step whose metadata carries ``cascade`` (sequences sharing prefix blocks, see ``core.cascade``)
attends with ``ops.cascade_attention`` in its layers without a sliding window (the op has none);
windowed layers of the same step take the plain path over the full block tables.
Nothing here reads a device tensor on the host, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..ops.cascade import cascade_attention
from ..ops.dispatch import BACKENDS, paged_decode, paged_prefill, store_kv
from ..ops.varlen import flash_attn_varlen_func
from ..distributed.group import TPGroup
from ..distributed.sharding import ShardLayout
from ..core.args import check_bool
from ..ops.fused import KVWrite, apply_rotary
from ..ops.projection import SplitKWorkspace, linear
from ..ops.checks import check_seq_order
from ..ops.variants import check_softcap, check_window
from .cascade_metadata import CascadeMetadata
from .config import ModelConfig
from .layers import RMSNorm
from .parallel_layers import RowParallelLinear, projection_backend

KVCache = tuple[torch.Tensor, torch.Tensor]   # (key_cache, value_cache) of one layer


class StepArrays(Protocol):
    """The attention inputs of one step as the engine builds them (its ``StepInputs``); see
    :class:`AttentionMetadata` for their shapes and dtypes."""

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    no_prefix: bool
    seq_order: torch.Tensor | None
    cascade: CascadeMetadata | None


@dataclass
class AttentionMetadata:
    """Per-step attention inputs: built once per step by the engine's model runner, shared by all layers.

    Attributes:
        slot_mapping: int64 ``[num_tokens]``: cache slot (``block * block_size + offset``) of each
            new token's K/V; ``-1`` skips the token (e.g. CUDA-graph padding).
        cu_seqlens_q: int32 ``[num_seqs + 1]``: new tokens per sequence, cumulative from 0.
        context_lens: int32 ``[num_seqs]``: tokens in the cache per sequence after this step's
            writes (the new ones included).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``, last dim contiguous.
        max_seqlen_q: host int, the most new tokens of one sequence this step.
        decode_only: every sequence has exactly one new token -> ``ops.paged_decode``
            (``num_tokens == num_seqs``); else ``ops.paged_prefill``.
        no_prefix: host bool, no sequence has cached tokens before this step's new ones
            (whole prompts): a prefill step then attends over the new K/V as they are
            (``ops.flash_attn_varlen_func``, contiguous tiles) instead of reading them back
            through the block tables. Only when the cache is in the query's dtype.
        backend: "auto" | "torch" | "triton", passed to the ops.
        num_splits: triton decode only: a fixed split-KV count; None lets the op's heuristic
            choose (from shapes only, the table width included, never from the lengths, so a
            captured CUDA graph keeps the plan it was captured with). The engine leaves it None.
        decode_workspace: triton decode only: float32 scratch for split-KV partials so the
            launch allocates nothing (see ``ops.decode.workspace_size``).
        seq_order: decode only: None or int32 ``[num_seqs]``, a permutation of the rows (the
            longest contexts first), the order the decode kernel's grid takes them in
            (``ops.paged_decode``'s ``seq_order``); results do not depend on it.
        linear_workspace: None or the split-K scratch of the layers' projections
            (``ops.linear``), shared by every step on the engine's stream.
        cascade: None or the step's shared-prefix groups (:class:`CascadeMetadata`, its
            ``suffix_*`` rows are this step's sequences): the layers without a sliding
            window attend with ``ops.cascade_attention``. Its ``suffix_lens`` order the
            decode grid then, so ``seq_order`` (if any) sorts those.
    """
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    decode_only: bool
    no_prefix: bool = False
    backend: str = "auto"
    num_splits: int | None = None
    decode_workspace: torch.Tensor | None = None
    seq_order: torch.Tensor | None = None
    linear_workspace: SplitKWorkspace | None = None
    cascade: CascadeMetadata | None = None

    def __post_init__(self):
        # Shapes and dtypes only: reading values would sync the host with the device.
        specs = (("slot_mapping", (torch.int64, torch.int32), 1),
                 ("cu_seqlens_q", (torch.int32,), 1), ("context_lens", (torch.int32,), 1),
                 ("block_tables", (torch.int32,), 2))
        for name, dtypes, ndim in specs:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.dim() != ndim:
                got = (f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise ValueError(f"{name}: expected a {ndim}-D tensor of dtype "
                                 f"{' or '.join(map(str, dtypes))}, got {got}")
        num_seqs = self.context_lens.shape[0]
        if self.cu_seqlens_q.shape[0] != num_seqs + 1 or self.block_tables.shape[0] != num_seqs:
            raise ValueError(f"cu_seqlens_q / block_tables: expected {num_seqs + 1} entries / "
                             f"{num_seqs} rows (num_seqs = len(context_lens)), got "
                             f"{tuple(self.cu_seqlens_q.shape)} / {tuple(self.block_tables.shape)}")
        if not isinstance(self.max_seqlen_q, int) or self.max_seqlen_q < 0:
            raise ValueError(f"max_seqlen_q: expected a host int >= 0, got {self.max_seqlen_q!r}")
        if self.decode_only and (self.max_seqlen_q > 1 or self.slot_mapping.shape[0] != num_seqs):
            raise ValueError("decode_only: expected one new token per sequence (num_tokens == "
                             f"num_seqs == {num_seqs}, max_seqlen_q 1), got num_tokens="
                             f"{self.slot_mapping.shape[0]}, max_seqlen_q={self.max_seqlen_q}")
        if self.seq_order is not None:
            if not self.decode_only:
                raise ValueError("seq_order: expected None for a step that is not decode_only, "
                                 "got a tensor")
            check_seq_order(self.seq_order, num_seqs, self.context_lens.device)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")
        check_bool("no_prefix", self.no_prefix)
        if self.linear_workspace is not None and not isinstance(self.linear_workspace,
                                                                SplitKWorkspace):
            raise ValueError("linear_workspace: expected None or an ops.SplitKWorkspace, "
                             f"got {type(self.linear_workspace).__name__}")
        if self.cascade is not None:
            if not isinstance(self.cascade, CascadeMetadata):
                raise ValueError("cascade: expected None or a CascadeMetadata, got "
                                 f"{type(self.cascade).__name__}")
            if self.cascade.suffix_lens.shape[0] != num_seqs:
                raise ValueError(f"cascade.suffix_lens: expected {num_seqs} entries "
                                 f"(num_seqs), got {self.cascade.suffix_lens.shape[0]}")

    @classmethod
    def for_step(cls, step: StepArrays, *, decode_only: bool, backend: str,
                 decode_workspace: torch.Tensor | None = None,
                 linear_workspace: SplitKWorkspace | None = None) -> AttentionMetadata:
        """The metadata of a step whose arrays ``step`` holds. ``decode_workspace`` is passed
        on for a decode-only step only (prefill does not use it)."""
        return cls(slot_mapping=step.slot_mapping, cu_seqlens_q=step.cu_seqlens_q,
                   context_lens=step.context_lens, block_tables=step.block_tables,
                   max_seqlen_q=step.max_seqlen_q, decode_only=decode_only,
                   no_prefix=step.no_prefix, backend=backend,
                   decode_workspace=decode_workspace if decode_only else None,
                   seq_order=step.seq_order if decode_only else None,
                   linear_workspace=linear_workspace, cascade=step.cascade)

    @property
    def projection_args(self) -> dict:
        """``ops.linear``'s ``backend`` and ``workspace`` for this step's projections."""
        return dict(backend=projection_backend(self.backend), workspace=self.linear_workspace)

    @property
    def decode_launch_args(self) -> dict:
        """``ops.paged_decode``'s ``num_splits``, ``workspace`` and ``seq_order`` for a decode
        step, those that are set."""
        args = dict(num_splits=self.num_splits, workspace=self.decode_workspace,
                    seq_order=self.seq_order)
        return {name: value for name, value in args.items() if value is not None}

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                    meta: AttentionMetadata, scale: float, *,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Store the new K/V in the cache, then attend over each sequence's cached K/V.

    Args:
        q: ``[num_tokens, num_q_heads, head_size]``, last dim contiguous.
        k, v: ``[num_tokens, num_kv_heads, head_size]`` in q's dtype (any strides).
        kv_cache: (key_cache, value_cache), each ``[num_blocks, block_size, num_kv_heads,
            head_size]``, in q's dtype or fp8 (e4m3, stored and read with scale 1.0).
        window_size, softcap, sinks: the layer's attention variant (FlashAttention's sliding
            window, logit soft-capping, float32 ``[num_q_heads]`` sink logits), passed to the
            ops unchanged. One step's metadata serves windowed and full layers alike: the decode
            op plans each call's split-KV launch for the layer's window (its tiles, not the
            table's), capped by the splits ``meta.decode_workspace`` holds, so windowed and
            full layers share one workspace and a CUDA graph captures both plans.

    Returns:
        ``[num_tokens, num_q_heads, head_size]`` in q's dtype.
    """
    store_kv(k, v, *kv_cache, meta.slot_mapping, backend=meta.backend)
    return attend(q, k, v, kv_cache, meta, scale, window_size=window_size, softcap=softcap,
                  sinks=sinks)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
           meta: AttentionMetadata, scale: float, *, window_size: tuple[int, int] = (-1, -1),
           softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`paged_attention` for a step whose new K/V are already in the cache (written by
    ``ops.apply_rotary(..., store=...)``); same arguments and result. ``k`` and ``v`` are read
    only by whole prompts that attend over their new K/V directly (``meta.no_prefix``)."""
    key_cache, value_cache = kv_cache
    if meta.cascade is not None and window_size == (-1, -1):
        return _cascade(q, kv_cache, meta, scale, softcap, sinks)
    if meta.decode_only:
        return paged_decode(q, key_cache, value_cache, meta.block_tables, meta.context_lens,
                            scale=scale, backend=meta.backend, window_size=window_size,
                            softcap=softcap, sinks=sinks, **meta.decode_launch_args)
    if meta.no_prefix and key_cache.dtype == q.dtype:
        cu = meta.cu_seqlens_q
        return flash_attn_varlen_func(q, k, v, cu, cu, meta.max_seqlen_q, meta.max_seqlen_q,
                                      softmax_scale=scale, causal=True, window_size=window_size,
                                      softcap=softcap, sinks=sinks, backend=meta.backend)
    return paged_prefill(q, key_cache, value_cache, meta.block_tables, meta.cu_seqlens_q,
                         meta.context_lens, scale=scale, backend=meta.backend,
                         max_seqlen_q=meta.max_seqlen_q, window_size=window_size,
                         softcap=softcap, sinks=sinks)


def _cascade(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float,
             softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """:func:`attend` over ``meta.cascade``'s shared prefixes and suffixes (same result)."""
    triton_args = meta.decode_launch_args if meta.decode_only else {}
    return cascade_attention(q, *kv_cache, meta.cu_seqlens_q, decode_only=meta.decode_only,
                             scale=scale, backend=meta.backend, softcap=softcap, sinks=sinks,
                             **meta.cascade.op_args(), **triton_args)


class Attention(nn.Module):
    """Self-attention of one decoder layer: fused qkv projection, (q/k RMSNorm), rope, paged attention, o_proj.

    ``qkv_proj.weight`` is ``[(num_q_heads + 2 * num_kv_heads) * head_size, hidden_size]``: the
    q rows, then k, then v (the loader fills them from q_proj / k_proj / v_proj). Under tensor
    parallelism the head counts are this rank's (``layout``): qkv_proj is column parallel by
    heads, o_proj row parallel (all-reduced), and the KV cache holds this rank's KV heads.

    ``window_size`` / ``softcap``: the layer's sliding window and logit soft-cap (see
    ``ops.variants``; validated here). ``sinks=True`` adds ``self.sinks``, a float32
    ``[num_q_heads]`` parameter of this rank's heads (checkpoint name ``self_attn.sinks``).
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype,
                 device: torch.device | str | None = None, tp: TPGroup | None = None,
                 layout: ShardLayout | None = None, window_size: tuple[int, int] = (-1, -1),
                 softcap: float = 0.0, sinks: bool = False):
        super().__init__()
        self.window_size = check_window(window_size)
        self.softcap = check_softcap(softcap)
        check_bool("sinks", sinks)
        tp = tp or TPGroup.single(device or "cpu")
        layout = layout or ShardLayout.of(config)
        self.num_q_heads = layout.num_q_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_size = hs = config.head_size
        self.scale = config.head_size ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size,
                                  (self.num_q_heads + 2 * self.num_kv_heads) * hs,
                                  bias=config.qkv_bias, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, bias=config.o_bias,
                                        tp=tp, dtype=dtype, device=device)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_size, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(config.head_size, config.rms_norm_eps, dtype=dtype, device=device)
        else:
            self.q_norm = self.k_norm = None
        # Sink logits stay float32 whatever the model's dtype (the kernels read them so).
        self.sinks = (nn.Parameter(torch.zeros(self.num_q_heads, dtype=torch.float32,
                                               device=device), requires_grad=False)
                      if sinks else None)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """hidden: ``[num_tokens, hidden_size]``; positions: int64 ``[num_tokens]``;
        cos_sin_cache: ``RotaryEmbedding.cos_sin_cache`` ``[max_positions, head_size]``
        -> ``[num_tokens, hidden_size]``, hidden's dtype."""
        num_tokens = hidden.shape[0]
        q, k, v = self.project_qkv(hidden, meta)
        # Qwen3's per-head q/k norms run inside the rotary kernel (on the strided qkv views).
        qk_norm = (None if self.q_norm is None else
                   (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps))
        # The rotary kernel also writes the new K/V into the cache (one launch fewer).
        q, k = apply_rotary(q, k, positions, cos_sin_cache, qk_norm=qk_norm, backend=meta.backend,
                            store=KVWrite(v, *kv_cache, meta.slot_mapping))
        out = attend(q, k, v, kv_cache, meta, self.scale, window_size=self.window_size,
                     softcap=self.softcap, sinks=self.sinks)
        return self.o_proj(out.view(num_tokens, self.num_q_heads * self.head_size),
                           **meta.projection_args)

    def project_qkv(self, hidden: torch.Tensor, meta: AttentionMetadata
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden ``[num_tokens, hidden_size]`` -> views (q, k, v) of the fused projection,
        ``[num_tokens, heads, head_size]`` each (this rank's heads)."""
        qkv = linear(hidden, self.qkv_proj.weight, self.qkv_proj.bias, **meta.projection_args)
        qkv = qkv.view(hidden.shape[0], self.num_q_heads + 2 * self.num_kv_heads,
                       self.head_size)
        return qkv.split([self.num_q_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
