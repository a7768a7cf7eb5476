"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket.

A decode step of a small model is dominated by kernel launch overhead (hundreds of launches of
microsecond kernels); replaying a captured graph issues them all at once. The graphs read their
inputs in place from the fixed device regions :class:`~.input_batch.InputBuilder` uploads into,
and a static block table; a batch of ``n`` sequences replays the smallest bucket ``>= n`` with
the extra rows padded (slot -1: nothing written; context length 0: nothing read).
"""

from __future__ import annotations

import logging
import time

import torch

from ..models.attention import AttentionMetadata
from .input_batch import InputBuilder, StepInputs

logger = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: powers of two up to 16, then steps of 16, 32 past 128, capped at
    ``max_batch`` (padding wastes at most a few rows of a memory-bound step)."""
    sizes = [1, 2, 4, 8, 16]
    b = 16
    while b < max_batch:
        b += 16 if b < 128 else 32
        sizes.append(b)
    return sorted({min(s, max_batch) for s in sizes})


class DecodeGraphs:
    """Captured decode forwards of ``model``, keyed by batch size.

    Args:
        model: the CausalLM; ``forward(input_ids, positions, kv_caches, meta) -> hidden``.
        kv_caches: the per-layer (key_cache, value_cache) views the graphs read and write.
        inputs: the input builder whose device regions are the graphs' inputs.
        max_batch: the largest bucket (``max_num_seqs``).
        backend: the attention backend ("triton" on CUDA).
        decode_workspace: float32 split-KV scratch shared by all graphs, or None.
    """

    def __init__(self, model, kv_caches, inputs: InputBuilder, *, max_batch: int, backend: str,
                 decode_workspace: torch.Tensor | None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.inputs = inputs
        self.backend = backend
        self.workspace = decode_workspace
        self.buckets = graph_buckets(max_batch)
        device = model.device
        self.block_tables = torch.zeros(max_batch, inputs.max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _step(self, b: int) -> StepInputs:
        """The inputs of a ``b``-sequence decode step, read in place from the fixed regions."""
        inputs = self.inputs
        return StepInputs(
            input_ids=inputs.region("input_ids", b), positions=inputs.region("positions", b),
            slot_mapping=inputs.region("slot_mapping", b),
            cu_seqlens_q=inputs.region("cu_seqlens_q", b + 1),
            context_lens=inputs.region("context_lens", b),
            block_tables=self.block_tables[:b], max_seqlen_q=1,
            num_sample_rows=b, sample_rows=None)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        inputs, top = self.inputs, self.buckets[-1]
        # Inputs of an empty batch: every row is padding.
        inputs.region("input_ids", top).zero_()
        inputs.region("positions", top).zero_()
        inputs.region("slot_mapping", top).fill_(-1)
        inputs.region("context_lens", top).zero_()
        inputs.region("cu_seqlens_q", top + 1).zero_()
        pool = None
        for b in reversed(self.buckets):        # largest first: later graphs reuse its pool
            step = self._step(b)
            ids, pos = step.input_ids, step.positions
            meta = AttentionMetadata.for_step(step, decode_only=True, backend=self.backend,
                                              decode_workspace=self.workspace)
            self.model(ids, pos, self.kv_caches, meta)     # warm-up: compiles the kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, pos, self.kv_caches, meta)
            pool = graph.pool() if pool is None else pool
            self._graphs[b] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.buckets), self.buckets, time.perf_counter() - start)

    def replay(self, n: int, block_tables: torch.Tensor) -> torch.Tensor:
        """Run the captured forward for ``n`` sequences whose inputs were built with
        ``pad_to=bucket_for(n)``; ``block_tables`` is the step's int32 ``[n, width]`` table.
        Returns the hidden states ``[n, hidden_size]`` (a view of the graph's output)."""
        b = self.bucket_for(n)
        graph, hidden = self._graphs[b]
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        graph.replay()
        return hidden[:n]


__all__ = ["DecodeGraphs", "graph_buckets"]
