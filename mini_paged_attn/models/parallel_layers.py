"""Layers split over tensor-parallel ranks; with one rank each is plain ``nn.Linear`` /
``nn.Embedding`` arithmetic, bit for bit.

Column-parallel projections (qkv, gate/up) need no layer of their own: each rank's output
columns are a plain ``nn.Linear`` over its rows of the weight, and its output stays split (by
heads, or by intermediate columns) until a row-parallel layer sums the partial products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.group import TPGroup
from ..ops.projection import SplitKWorkspace, linear


def projection_backend(backend: str) -> str:
    """The ``ops.linear`` backend of a step run with attention backend ``backend``: "torch"
    stays "torch"; otherwise "auto", so only decode-sized inputs (at most 256 rows) take the
    Triton kernel and larger ones keep cuBLAS (``ops.linear``), whatever the attention
    kernels are."""
    return "torch" if backend == "torch" else "auto"


class RowParallelLinear(nn.Linear):
    """``y = x @ W.T + b`` where each rank holds a slice of W's input columns (o_proj,
    down_proj): the partial products are all-reduced, then the bias (replicated) is added once.

    ``weight`` is ``[out_features, in_features / world_size]``; ``bias`` ``[out_features]``.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp: TPGroup,
                 dtype: torch.dtype, device=None) -> None:
        super().__init__(in_features // tp.world_size, out_features, bias=bias, dtype=dtype,
                         device=device)
        self.tp = tp

    def forward(self, x: torch.Tensor, *, backend: str = "auto",
                workspace: SplitKWorkspace | None = None) -> torch.Tensor:
        """x: ``[num_tokens, in_features / world_size]`` -> ``[num_tokens, out_features]``;
        ``backend`` and ``workspace`` as in ``ops.linear``."""
        if self.tp.world_size == 1:
            return linear(x, self.weight, self.bias, workspace=workspace, backend=backend)
        out = self.tp.all_reduce(linear(x, self.weight, workspace=workspace, backend=backend))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Token embedding whose rows are split over the ranks (also the tied LM head's weight).

    Rank ``r`` holds rows ``vocab_start .. vocab_start + num_embeddings`` (``num_embeddings``
    rows, the tail past the vocabulary zero padding); a token another rank holds embeds to
    zeros here, and the all-reduce sums the one real row in.
    """

    def __init__(self, num_rows: int, embedding_dim: int, *, vocab_start: int, tp: TPGroup,
                 dtype: torch.dtype, device=None) -> None:
        super().__init__(num_rows, embedding_dim, dtype=dtype, device=device)
        self.vocab_start = vocab_start
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: int64 ``[num_tokens]`` -> ``[num_tokens, embedding_dim]``."""
        if self.tp.world_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                    tp: TPGroup, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """LM head over vocab-split weight rows: every rank computes its logits columns, the
    columns are gathered (every rank gets all of them; rank 0 samples).

    Args:
        hidden: ``[n, hidden_size]`` in the model dtype.
        weight: this rank's ``[ceil(vocab_size / world_size), hidden_size]`` rows.
        vocab_size: the real vocabulary (the gathered padding columns are cut off).
        dtype: of the logits: float32, or the model dtype (the matmul's own output, without
            the pass over ``[n, vocab_size]`` that widens it).

    Returns:
        ``[n, vocab_size]`` logits in ``dtype``.
    """
    logits = F.linear(hidden, weight)
    if tp.world_size > 1:
        logits = tp.all_gather_last_dim(logits)[:, :vocab_size]
    return logits.to(dtype)


__all__ = ["RowParallelLinear", "VocabParallelEmbedding", "parallel_logits", "projection_backend"]
