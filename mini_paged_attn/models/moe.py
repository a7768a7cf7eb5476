"""The sparse mixture-of-experts feed-forward: router, stacked expert weights, checkpoint names.

A :class:`SparseMoeBlock` replaces ``GatedMLP`` in the sparse layers of Qwen3-MoE, Mixtral and
gpt-oss (``moe_decoder.MoeDecoderLayer``). Its router is replicated on every rank; under
tensor parallelism each rank holds a slice of *every* expert's intermediate dim (w13 column
parallel, w2 row parallel), so each rank runs all of the step's routed pairs on its slice and
the partial outputs are all-reduced, as ``GatedMLP`` does.

Checkpoint layouts (``{p}`` is ``model.layers.{i}.``):

- Qwen3-MoE: ``{p}mlp.gate.weight`` ``[E, H]``; ``{p}mlp.experts.{e}.gate_proj/up_proj.weight``
  ``[I, H]``, ``down_proj.weight`` ``[H, I]`` (what transformers 5.x ``save_pretrained``
  writes too: it splits its fused experts back into these names).
- Mixtral: the same under ``{p}block_sparse_moe.``, experts ``w1`` (gate), ``w3`` (up),
  ``w2`` (down).
- gpt-oss: ``{p}mlp.router.weight/bias``; fused ``{p}mlp.experts.gate_up_proj`` ``[E, H, 2I]``
  (gate and up columns interleaved) with ``gate_up_proj_bias`` ``[E, 2I]``, ``down_proj``
  ``[E, I, H]`` with ``down_proj_bias`` ``[E, H]``: copied through transposed views of ours,
  the interleaved order kept (the kernel reads it as is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.group import TPGroup
from ..ops.moe import fused_moe
from ..ops.projection import SplitKWorkspace
from .checkpoint import Shard
from .moe_config import MoeConfig


# ---- routing ------------------------------------------------------------------------------------

def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the ``top_k`` largest (Qwen3-MoE, Mixtral).

    Args:
        logits: ``[T, E]`` router logits, any float dtype.
        renormalize: divide the kept probabilities by their sum (Mixtral; Qwen3-MoE's
            ``norm_topk_prob``).

    Returns:
        ``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])``, largest first.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``top_k`` largest logits, softmax over those alone (gpt-oss).

    Args:
        logits: ``[T, E]`` router logits (the router's bias included), any float dtype.

    Returns:
        ``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])``, largest first.
    """
    values, ids = logits.topk(top_k, dim=-1)
    return torch.softmax(values.float(), dim=-1), ids.to(torch.int32)


def route(logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k experts and weights of ``moe``'s router for ``[T, E]`` logits."""
    if moe.router == "topk_softmax":
        return topk_softmax(logits, moe.top_k)
    return softmax_topk(logits, moe.top_k, moe.renormalize)


# ---- the block ----------------------------------------------------------------------------------

def expert_shard(moe: MoeConfig, tp: TPGroup) -> tuple[int, int]:
    """``(start, size)``: this rank's slice of every expert's intermediate dim.

    Raises:
        ValueError: the world size does not divide the expert intermediate size.
    """
    n = tp.world_size
    if moe.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size: expected a divisor of the expert "
                         f"intermediate size {moe.intermediate_size}, got {n}")
    size = moe.intermediate_size // n
    return tp.rank * size, size


class SparseMoeBlock(nn.Module):
    """Router + ``num_experts`` gated MLPs, each token through its top-k.

    Parameters (``I`` this rank's share of the expert intermediate size):
        router: ``nn.Linear(H, E)`` (bias for gpt-oss), replicated.
        w13: ``[E, 2I, H]``, gate then up rows (gpt-oss: interleaved, see
            :class:`~mini_paged_attn.ops.moe.MoeActivation`).
        w2: ``[E, H, I]``.
        w13_bias ``[E, 2I]``, w2_bias ``[E, H]`` (gpt-oss only; w2_bias whole on every rank,
            added on rank 0 only so the all-reduce counts it once).
    """

    def __init__(self, hidden_size: int, moe: MoeConfig, *, dtype: torch.dtype, device=None,
                 tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp = tp or TPGroup.single(device or "cpu")
        self.moe = moe
        self.inter_start, inter = expert_shard(moe, tp)
        e, h = moe.num_experts, hidden_size
        self.router = nn.Linear(h, e, bias=moe.router_bias, dtype=dtype, device=device)
        factory = dict(dtype=dtype, device=device)
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, h, **factory))
        self.w2 = nn.Parameter(torch.empty(e, h, inter, **factory))
        bias = moe.expert_bias
        self.w13_bias = nn.Parameter(torch.zeros(e, 2 * inter, **factory)) if bias else None
        self.w2_bias = nn.Parameter(torch.zeros(e, h, **factory)) if bias else None
        if self.w13.device.type != "meta":       # models built for tests (the loader overwrites)
            nn.init.normal_(self.w13, std=h ** -0.5)
            nn.init.normal_(self.w2, std=(inter * tp.world_size) ** -0.5)

    def forward(self, x: torch.Tensor, *, backend: str = "auto",
                workspace: SplitKWorkspace | None = None) -> torch.Tensor:
        """x: ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``, same dtype.
        ``workspace`` (a dense MLP's split-K scratch) is not used: the experts run
        ``ops.fused_moe``."""
        weights, ids = route(F.linear(x, self.router.weight, self.router.bias), self.moe)
        w2_bias = self.w2_bias if self.tp.rank == 0 else None
        out = fused_moe(x, self.w13, self.w2, weights, ids, activation=self.moe.activation,
                        w13_bias=self.w13_bias, w2_bias=w2_bias, backend=backend)
        return self.tp.all_reduce(out) if self.tp.world_size > 1 else out

    def checkpoint_shards(self, prefix: str) -> dict[str, Shard]:
        """Checkpoint tensor name -> ``(rows, part)`` for this layer's block (``prefix``:
        ``model.layers.{i}.``), ``part`` None when the whole tensor is copied."""
        sharded = self.tp.world_size > 1
        start, inter = self.inter_start, self.w2.shape[2]
        names = self.moe.expert_names
        if names is None:
            return self._fused_shards(f"{prefix}mlp.", sharded, start, inter)
        module, router, gate, up, down = (names.module, names.router, names.gate, names.up,
                                          names.down)
        rows = (slice(start, start + inter),) if sharded else None
        cols = (slice(None), slice(start, start + inter)) if sharded else None
        shards: dict[str, Shard] = {f"{prefix}{module}.{router}.weight": (self.router.weight, None)}
        for e in range(self.moe.num_experts):
            base = f"{prefix}{module}.experts.{e}."
            shards[f"{base}{gate}.weight"] = (self.w13[e, :inter], rows)
            shards[f"{base}{up}.weight"] = (self.w13[e, inter:], rows)
            shards[f"{base}{down}.weight"] = (self.w2[e], cols)
        return shards

    def _fused_shards(self, base: str, sharded: bool, start: int, inter: int) -> dict[str, Shard]:
        # gpt-oss stores x @ W (the transpose of ours); a rank's interleaved gate/up columns
        # j in [start, start + inter) are the contiguous checkpoint columns 2 * j, 2 * j + 1.
        pair_cols = slice(2 * start, 2 * (start + inter))
        every = slice(None)

        def part(*index: slice) -> tuple[slice, ...] | None:
            return index if sharded else None

        return {
            f"{base}router.weight": (self.router.weight, None),
            f"{base}router.bias": (self.router.bias, None),
            f"{base}experts.gate_up_proj": (self.w13.transpose(1, 2),
                                            part(every, every, pair_cols)),
            f"{base}experts.gate_up_proj_bias": (self.w13_bias, part(every, pair_cols)),
            f"{base}experts.down_proj": (self.w2.transpose(1, 2),
                                         part(every, slice(start, start + inter))),
            f"{base}experts.down_proj_bias": (self.w2_bias, None),
        }


__all__ = ["SparseMoeBlock", "expert_shard", "route", "softmax_topk", "topk_softmax"]
