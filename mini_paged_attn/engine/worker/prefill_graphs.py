"""CUDA graphs for steps of one prompt: the batch-1 time to first token.

An eager prefill step launches a few hundred kernels (a GEMM, a norm, the rotary kernel and
attention per layer...), and at batch 1 the host takes several times longer to launch them
than the GPU to run them (docs/performance-notes.md, "Figures behind the code's rules"). A step that holds one sequence replays a graph captured for the smallest bucket of
tokens (powers of two from 16) that holds its new tokens.

The padding rows form a second sequence: token 0 at position 0, slot -1 (its K/V are never
written), so every kernel sees a well-formed batch, the prompt's rows are computed exactly as
without padding, and the padding's rows are dropped. Two families of graphs:

- contiguous (a fresh prompt, nothing cached before its new tokens, over a cache in the
  model's dtype): attention over the step's new K/V as they are
  (``flash_attn_varlen_func``); the padding attends causally over its own rows
  (``cu_seqlens_q = [0, n, bucket]``) and the block tables are a placeholder;
- paged (a prompt after a prefix-cache hit, a later chunk, or any prompt over an fp8 cache):
  attention through the block tables (``paged_prefill``), both rows ``max_blocks_per_seq``
  wide; the padding's row is the prompt's, and it attends over the prompt's first
  ``bucket - n`` positions. Every entry of the row is an in-range block id (stale entries
  and a window's given-back blocks included) in a pool that starts zeroed, so the padding
  reads finite K/V; they are the prompt's own, written by the time a layer reads them,
  whenever ``bucket - n`` is at most the prompt's context (always but at the smallest
  bucket, whose padding may also read slots not written yet). Its rows are dropped either
  way. Two sequences of at most :data:`MAX_GRAPH_TOKENS` tokens never average more than
  ``ops.prefill_gather.GATHER_MIN_Q_LEN`` tokens, so neither the eager warm-up nor the
  capture copies pages: the warm-up compiles what the capture launches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ...core.scheduler import SchedulerOutput
from ...models.attention import AttentionMetadata
from ...ops.projection import SplitKWorkspace
from .input_batch import InputBuilder, smallest_bucket

logger = logging.getLogger(__name__)

MIN_BUCKET = 16
MAX_GRAPH_TOKENS = 512
"""The largest prompt step a graph serves: the graphs' activations share the decode graphs'
memory pool, which the pool sizing reserves a fixed amount for."""


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: powers of two from 16, up to :data:`MAX_GRAPH_TOKENS`, the
    last one cut to ``max_tokens`` (the most tokens a prompt step can have: the input
    regions hold no more)."""
    sizes, size = [], MIN_BUCKET
    while True:
        sizes.append(min(size, max_tokens, MAX_GRAPH_TOKENS))
        if size >= max_tokens or size >= MAX_GRAPH_TOKENS:
            return sizes
        size *= 2


@dataclass(frozen=True)
class PromptGraph:
    """Which prefill graph serves a step: its bucket of tokens, and whether it reads the
    cache through the block tables (the paged family) or the step's new K/V (contiguous)."""

    tokens: int
    paged: bool


class PrefillGraphs:
    """Captured forwards of one prompt, keyed by :class:`PromptGraph`.

    Args:
        model: the CausalLM; ``forward(input_ids, positions, kv_caches, meta) -> hidden``.
        kv_caches: the per-layer (key_cache, value_cache) views.
        inputs: the input builder whose device regions are the graphs' inputs.
        max_tokens: the most tokens a prompt step holds (``max_num_batched_tokens``, at most
            ``max_model_len``).
        backend: the attention backend ("triton" on CUDA).
        contiguous: capture the contiguous family too (fresh prompts over a cache in the
            model's dtype); else fresh prompts take the paged family.
        linear_workspace: the projections' split-K scratch (``ops.linear``), or None.
    """

    def __init__(self, model, kv_caches, inputs: InputBuilder, *, max_tokens: int,
                 backend: str, contiguous: bool = True,
                 linear_workspace: SplitKWorkspace | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.inputs = inputs
        self.backend = backend
        self.contiguous = contiguous
        self.linear_workspace = linear_workspace
        self.buckets = prefill_buckets(max_tokens)
        # Never read (whole prompts attend without the block tables); a meta needs one.
        self._tables = torch.zeros(2, 1, dtype=torch.int32, device=model.device)
        self._graphs: dict[PromptGraph, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket_for(self, out: SchedulerOutput) -> PromptGraph | None:
        """The graph that serves ``out``: one sequence, not a decode step, at most the
        largest bucket of new tokens; contiguous when nothing is cached before them (and
        that family is captured), else paged. None for any other step."""
        if out.decode_only or out.num_seqs != 1:
            return None
        n = out.num_batched_tokens
        bucket = smallest_bucket(self.buckets, n)
        if bucket is None:
            return None
        return PromptGraph(bucket, bool(out.seqs[0].num_computed_tokens) or not self.contiguous)

    def _meta(self, key: PromptGraph) -> AttentionMetadata:
        """The metadata the graph of ``key`` reads in place (the regions' first entries)."""
        inputs, bucket = self.inputs, key.tokens
        tables = self._tables
        if key.paged:
            width = inputs.max_blocks_per_seq
            tables = inputs.region("block_tables", 2 * width).view(2, width)
        return AttentionMetadata(
            slot_mapping=inputs.region("slot_mapping", bucket),
            cu_seqlens_q=inputs.region("cu_seqlens_q", 3),
            context_lens=inputs.region("context_lens", 2), block_tables=tables,
            max_seqlen_q=bucket, decode_only=False, no_prefix=not key.paged,
            backend=self.backend, linear_workspace=self.linear_workspace)

    def keys(self) -> list[PromptGraph]:
        """The graphs to capture, largest bucket first."""
        families = (False, True) if self.contiguous else (True,)
        return [PromptGraph(b, paged) for b in reversed(self.buckets) for paged in families]

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every graph, largest bucket first, into the memory pool ``pool`` (the
        decode graphs' one, or a new pool when None)."""
        start = time.perf_counter()
        inputs = self.inputs
        width = inputs.max_blocks_per_seq
        for key in self.keys():
            # A prompt of half the bucket and the padding's sequence: the layout of a replay
            # (positions below the bucket, which is at most max_tokens); the paged family
            # reads block 0 (nothing is written: every slot is -1).
            bucket = key.tokens
            n = bucket // 2
            inputs.region("input_ids", bucket).zero_()
            inputs.region("positions", bucket).copy_(
                torch.cat([torch.arange(n), torch.zeros(bucket - n, dtype=torch.int64)]))
            inputs.region("slot_mapping", bucket).fill_(-1)
            inputs.region("cu_seqlens_q", 3).copy_(torch.tensor([0, n, bucket]))
            inputs.region("context_lens", 2).copy_(torch.tensor([n, bucket - n]))
            if key.paged:
                inputs.region("block_tables", 2 * width).zero_()
            ids, pos = inputs.region("input_ids", bucket), inputs.region("positions", bucket)
            meta = self._meta(key)
            self.model(ids, pos, self.kv_caches, meta)     # warm-up: compiles the kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, pos, self.kv_caches, meta)
            pool = graph.pool() if pool is None else pool
            graph.replay()      # the first replay uploads the graph: not in a request's time
            self._graphs[key] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured %d prefill CUDA graphs (up to %d tokens) in %.1f s",
                    len(self._graphs), max(self.buckets, default=0),
                    time.perf_counter() - start)

    def release(self) -> None:
        """Wait for the device, then destroy the captured graphs (replay cannot run after)."""
        if self._graphs:
            torch.cuda.synchronize()
            self._graphs.clear()        # a graph is destroyed with its last reference

    def replay(self, key: PromptGraph, num_tokens: int) -> torch.Tensor:
        """Run the graph of ``key`` on the inputs built with ``pad_prompt_to=key.tokens,
        paged_prompt=key.paged``. Returns the prompt's hidden states ``[num_tokens,
        hidden_size]`` (a view of the graph's output)."""
        graph, hidden = self._graphs[key]
        graph.replay()
        return hidden[:num_tokens]


__all__ = ["MAX_GRAPH_TOKENS", "PrefillGraphs", "PromptGraph", "prefill_buckets"]
