"""CUDA graphs for decode-only steps: captured forwards per batch-size bucket.

A decode step of a small model is dominated by kernel launch overhead (hundreds of launches of
microsecond kernels); replaying a captured graph issues them all at once. The graphs read their
inputs in place from the fixed device regions :class:`~mini_paged_attn.engine.worker.input_batch.InputBuilder` uploads into,
and a static block table; a batch of ``n`` sequences replays the smallest bucket ``>= n`` with
the extra rows padded (slot -1: nothing written; context length 0: nothing read).

Where the engine uses cascade attention (sequences sharing prefix blocks, ``core.cascade``),
each bucket that can hold a group also has graphs of the cascade path, whose cascade arrays
have fixed shapes (``cascade_inputs.CascadePad``: a few group slots, every row in one of
them, the prefix tables full width, the suffix tables as wide as the plain graphs' tables).

The decode op plans its launch from the block table's width, the bound on the context lengths
it can see. A bucket is captured over the full table and, where the op would plan differently
(small batches' split heuristic counts the tiles; an fp8 cache splits short sequences, see
``ops.attention.decode_plan``), over narrower leading views of it (powers of two of blocks): a step replays
the narrowest view that holds its blocks.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from ...models.attention import Attention, AttentionMetadata
from ...models.cascade_metadata import CascadeMetadata
from ...ops.projection import SplitKWorkspace
from .cascade_inputs import GRAPH_GROUPS, CascadePad, cascade_metadata
from .input_batch import InputBuilder, StepInputs, batch_buckets, smallest_bucket

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """Captured decode forwards of ``model``, keyed by (batch-size bucket, table width, whether
    the step uses cascade attention; its suffix tables' width then).

    Args:
        model: the CausalLM; ``forward(input_ids, positions, kv_caches, meta) -> hidden``.
        kv_caches: the per-layer (key_cache, value_cache) views the graphs read and write.
        inputs: the input builder whose device regions are the graphs' inputs.
        max_batch: the largest bucket (``max_num_seqs``).
        backend: the attention backend ("triton" on CUDA).
        decode_workspace: float32 split-KV scratch shared by all graphs, or None.
        linear_workspace: the projections' split-K scratch (``ops.linear``), or None.
    """

    def __init__(self, model, kv_caches, inputs: InputBuilder, *, max_batch: int, backend: str,
                 decode_workspace: torch.Tensor | None,
                 linear_workspace: SplitKWorkspace | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.inputs = inputs
        self.backend = backend
        self.workspace = decode_workspace
        self.linear_workspace = linear_workspace
        self.buckets = batch_buckets(max_batch)
        device = model.device
        self.block_tables = torch.zeros(max_batch, inputs.max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        # What the decode launches are planned from, besides the batch and the table width.
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        self._num_q_heads = layers[0].num_q_heads
        self._windows = sorted({m.window_size for m in layers})
        # Per bucket, the table widths (blocks) captured, narrowest first.
        self.widths = {b: self._widths(b) for b in self.buckets}
        # Per bucket that can hold a group (the input builder has a cascade rule), the shapes
        # of its cascade graphs' arrays.
        rule = inputs.cascade_rule
        self.cascade_pads = {
            b: CascadePad(b, GRAPH_GROUPS + 1, inputs.max_blocks_per_seq, tuple(self.widths[b]))
            for b in self.buckets if rule is not None and b >= rule.min_group_size}
        self._graphs: dict[tuple[int, int, bool],
                           tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None    # the graphs' memory pool, once captured (other graphs may share it)

    def _widths(self, b: int) -> list[int]:
        """The table widths to capture bucket ``b`` over: the full width, then each power of
        two below it (down to 16 blocks) whose decode plans differ from the next wider one
        kept."""
        full = self.inputs.max_blocks_per_seq
        kept = [full]
        if self.backend != "triton":    # only the Triton decode plans from the width
            return kept
        width = 1 << ((full - 1).bit_length() - 1)
        plans = self._plans(b, full)
        while width >= 16:
            narrower = self._plans(b, width)
            if narrower != plans:
                kept.append(width)
                plans = narrower
            width //= 2
        return kept[::-1]

    def _plans(self, b: int, width: int) -> tuple:
        """The (tiles, splits) of the model's decode launches for ``b`` sequences and a
        ``width``-block table (one per distinct attention window)."""
        from ...ops.decode import workspace_size
        from ...ops.attention.decode_plan import explain_decode
        key_cache = self.kv_caches[0][0]
        block_size, num_kv_heads, head_size = key_cache.shape[1:]
        max_splits = None
        if self.workspace is not None:
            max_splits = max(1, self.workspace.numel()
                             // workspace_size(b, self._num_q_heads, head_size, 1))
        plans = (explain_decode(b, self._num_q_heads, num_kv_heads, head_size,
                                width * block_size, block_size, self.model.dtype,
                                key_cache.device, window_size=w, kv_cache_dtype=key_cache.dtype,
                                max_splits=max_splits, ordered=self.inputs.order_decode)
                 for w in self._windows)
        return tuple((p.tiles, p.num_splits) for p in plans)

    def bucket_for(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def cascade_pad(self, b: int) -> CascadePad | None:
        """The cascade arrays' shapes of bucket ``b``'s graphs, or None: it has none."""
        return self.cascade_pads.get(b)

    def _step(self, b: int, width: int, cascade: bool = False) -> StepInputs:
        """The inputs of a ``b``-sequence decode step, read in place from the fixed regions,
        with the leading ``width`` blocks of the table (``cascade``: the full table, and
        cascade arrays over ``width``-block suffixes)."""
        inputs = self.inputs
        meta = None
        if cascade:
            meta = cascade_metadata({
                name: inputs.region(name, math.prod(shape)).view(shape)
                for name, shape in self.cascade_pads[b].shapes(width).items()})
            width = inputs.max_blocks_per_seq
        return StepInputs(
            input_ids=inputs.region("input_ids", b), positions=inputs.region("positions", b),
            slot_mapping=inputs.region("slot_mapping", b),
            cu_seqlens_q=inputs.region("cu_seqlens_q", b + 1),
            context_lens=inputs.region("context_lens", b),
            block_tables=self.block_tables[:b, :width], max_seqlen_q=1,
            num_sample_rows=b, logit_rows=b, sample_rows=None,
            seq_order=inputs.region("seq_order", b) if inputs.order_decode else None,
            cascade=meta)

    def _empty_cascade(self, b: int) -> None:
        """Cascade arrays of an empty ``b``-row batch: every row in the first group, whose
        prefix has no tokens; no suffix tokens either."""
        inputs, pad = self.inputs, self.cascade_pads[b]
        for name in ("cascade_prefix_tables", "cascade_prefix_lens", "cascade_suffix_tables",
                     "cascade_suffix_lens"):
            inputs.region(name, math.prod(pad.shapes(pad.suffix_widths[-1])[name])).zero_()
        cu = inputs.region("cascade_cu_group_tokens", pad.num_groups + 1)
        cu.fill_(b)
        cu[0] = 0
        inputs.region("cascade_group_tokens", b).copy_(torch.arange(b, dtype=torch.int32))

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
        # Any permutation of every bucket's rows: the steps write theirs before each replay.
        inputs.region("seq_order", top).copy_(torch.arange(top, dtype=torch.int32))
        pool = self.pool
        for b in reversed(self.buckets):        # largest first: later graphs reuse its pool
            if b in self.cascade_pads:
                self._empty_cascade(b)
            for width in reversed(self.widths[b]):
                for cascade in (False, True) if b in self.cascade_pads else (False,):
                    pool = self._capture(b, width, cascade, pool)
        self.pool = pool
        torch.cuda.synchronize()
        num_cascade = sum(key[2] for key in self._graphs)
        logger.info("captured %d decode CUDA graphs (batch sizes %s; %d over narrower tables, "
                    "%d of cascade attention) in %.1f s", len(self._graphs), self.buckets,
                    len(self._graphs) - len(self.buckets) - num_cascade, num_cascade,
                    time.perf_counter() - start)

    def _capture(self, b: int, width: int, cascade: bool, pool):
        """Capture the graph of key ``(b, width, cascade)`` into ``pool`` (None: a new one);
        return the pool."""
        step = self._step(b, width, cascade)
        ids, pos = step.input_ids, step.positions
        meta = AttentionMetadata.for_step(step, decode_only=True, backend=self.backend,
                                          decode_workspace=self.workspace,
                                          linear_workspace=self.linear_workspace)
        self.model(ids, pos, self.kv_caches, meta)     # warm-up: compiles the kernels
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self.model(ids, pos, self.kv_caches, meta)
        graph.replay()  # an empty batch; the first replay uploads the graph
        self._graphs[b, width, cascade] = (graph, hidden)
        return graph.pool() if pool is None else pool

    def release(self) -> None:
        """Wait for the device, then destroy the captured graphs (replay cannot run after)."""
        if self._graphs:
            torch.cuda.synchronize()
            self._graphs.clear()        # a graph is destroyed with its last reference

    def key_for(self, n: int, width: int, cascade: CascadeMetadata | None = None
                ) -> tuple[int, int, bool]:
        """The graph that serves ``n`` sequences over a ``width``-block table (and
        ``cascade``'s arrays, which the input builder shaped for one of the bucket's graphs)."""
        b = self.bucket_for(n)
        if cascade is not None:
            return (b, cascade.suffix_block_tables.shape[1], True)
        return (b, next(w for w in self.widths[b] if w >= width), False)

    def replay(self, n: int, block_tables: torch.Tensor,
               cascade: CascadeMetadata | None = None) -> torch.Tensor:
        """Run the captured forward for ``n`` sequences whose inputs were built with
        ``pad_to=bucket_for(n)`` (and ``cascade_pad=cascade_pad(bucket_for(n))`` when the
        step has ``cascade``, its metadata); ``block_tables`` is the step's int32
        ``[n, width]`` table. Returns the hidden states ``[bucket_for(n), hidden_size]`` (the
        graph's output; rows ``n ..`` are the padding's, finite and meaningless)."""
        width = block_tables.shape[1]
        graph, hidden = self._graphs[self.key_for(n, width, cascade)]
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        graph.replay()
        return hidden


__all__ = ["DecodeGraphs"]
