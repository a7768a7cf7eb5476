"""Per-step model inputs, built once per step with numpy from preallocated (pinned) buffers.

The KV cache keeps one host block-table row per running sequence and copies only the entries
that changed (new blocks, a copy-on-write, a fresh admission), so a decode step costs a few
attribute reads per sequence plus a handful of vectorised numpy operations and one copy per
array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...cache.block_table import BlockTable
from ...core.args import cdiv
from ...core.cascade import CascadePlan, CascadeRule, plan_cascade
from ...core.scheduler import SchedulerOutput
from ...models.cascade_metadata import CascadeMetadata
from .cascade_inputs import (CASCADE_ARRAYS, CascadePad, cascade_metadata,
                             cascade_region_sizes, fill_cascade, shapes_of)
from .tp_messages import STEP_ARRAYS


# Elements each staging region starts at a multiple of (256 bytes for int32).
REGION_ALIGN = 64
TABLE_WIDTH_MULTIPLE = 16


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes a CUDA engine rounds up to: powers of two up to 16, then steps of 16, 32
    past 128, capped at ``max_batch`` (padding wastes at most a few rows of a memory-bound
    step). The decode graphs are captured at these sizes, and the LM head runs on this many
    rows (see :class:`InputBuilder`)."""
    sizes = [1, 2, 4, 8, 16]
    b = 16
    while b < max_batch:
        b += 16 if b < 128 else 32
        sizes.append(b)
    return sorted({min(s, max_batch) for s in sizes})


def smallest_bucket(buckets: list[int], n: int) -> int | None:
    """The smallest of ``buckets`` (ascending) that holds ``n``, or None when none does."""
    return next((b for b in buckets if b >= n), None)


def padded_rows(buckets: list[int] | None, n: int) -> int:
    """The rows the LM head runs on for ``n`` sample rows: the smallest of ``buckets``
    holding ``n``; ``n`` itself without buckets, for 0 rows, or past the largest bucket."""
    if buckets is None or n == 0:
        return n
    return smallest_bucket(buckets, n) or n


class StagingBuffer:
    """A 1-D host buffer (pinned on CUDA) with a device twin; on CPU the two are one tensor."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=on_cuda)
        self.np = self.host.numpy()
        self.device = torch.zeros(size, dtype=dtype, device=device) if on_cuda else self.host
        self._copy = on_cuda

    def upload(self, start: int, stop: int) -> torch.Tensor:
        """Copy host[start:stop] to the device (asynchronously); return the device view."""
        if self._copy and stop > start:
            self.device[start:stop].copy_(self.host[start:stop], non_blocking=True)
        return self.device[start:stop]


@dataclass
class StepInputs:
    """Device views for one step (see AttentionMetadata for the attention fields).

    ``input_ids``, ``positions``, ``slot_mapping``: int64 ``[num_tokens]``;
    ``cu_seqlens_q``: int32 ``[num_seqs + 1]``; ``context_lens``: int32 ``[num_seqs]``;
    ``block_tables``: int32 ``[num_seqs, width]`` (width: the batch's most blocks, rounded up
    to a multiple of 16);
    ``num_sample_rows``: the rows that sample (a request about to fork counts n times; a
    sequence that verifies k proposals, k + 1 times: all its rows, after the others');
    ``logit_rows``: the rows the LM head runs on, ``num_sample_rows`` rounded up to the
    builder's bucket (the rows past ``num_sample_rows`` are padding; 0 when nothing samples);
    ``sample_rows``: int64 ``[logit_rows]``, the hidden rows to run the LM head on (a request
    about to fork repeats its row n times; the padding repeats row 0), None when they are
    simply ``0 .. logit_rows - 1``;
    ``no_prefix``: every sequence's new tokens are all its tokens (nothing cached before them);
    ``seq_order``: int32 ``[num_seqs]`` (padding included), the rows by context length, longest
    first, for the decode kernel's grid (``ops.paged_decode``'s ``seq_order``; on a cascade
    step, by suffix length); None unless the builder orders decode steps and this is one;
    ``cascade``: the step's shared-prefix groups (``ops.cascade_attention``'s tensors), or None
    when it attends plainly.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    num_sample_rows: int
    logit_rows: int
    sample_rows: torch.Tensor | None
    # Input tokens still on the device (asynchronous scheduling), see TokenFill.
    fill: TokenFill | None = None
    no_prefix: bool = False
    seq_order: torch.Tensor | None = None
    cascade: CascadeMetadata | None = None


@dataclass(frozen=True)
class TokenFill:
    """Input tokens that the previous step sampled and the host does not know yet: token
    ``dst[j]`` of this step is row ``src[j]`` of the previous step's sampled ids. ``dst`` and
    ``src`` are int64 ``[count]`` device views, or both None when they are ``0 .. count - 1``
    (a steady decode batch)."""

    count: int
    dst: torch.Tensor | None
    src: torch.Tensor | None

    def apply(self, input_ids: torch.Tensor, sampled: torch.Tensor) -> None:
        """Write the tokens into ``input_ids`` (int64, on the device) from the previous step's
        ``sampled`` ids (int64 ``[num_sample_rows]``), in stream order: no host sync."""
        if self.dst is None:
            input_ids[:self.count].copy_(sampled[:self.count])
        else:
            input_ids.index_copy_(0, self.dst, sampled.index_select(0, self.src))


def table_width(max_blocks_per_seq: int) -> int:
    """Block-table width for the engine: rounded up to a multiple of 16 (see InputBuilder)."""
    return cdiv(max_blocks_per_seq, TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE


def dummy_inputs(q_lens: list[int], width: int, device: torch.device, *,
                 no_prefix: bool = True, ordered: bool = False) -> StepInputs:
    """Inputs of a made-up step, for profiling and warm-up: sequence ``i`` computes its first
    ``q_lens[i]`` tokens (all ``>= 1``; token id 0), writes nothing (slot -1) and reads block 0
    only (every table entry is 0; ``width`` columns, as the engine's steps have). Nothing
    samples. ``no_prefix=False`` marks the step as if some sequence had cached tokens, so a
    prefill attends through the block tables (the path of chunks and prefix-cache hits).
    ``ordered``: with a ``seq_order`` (the rows in order), as an ordering builder's decode
    steps have."""
    assert q_lens and min(q_lens) >= 1, q_lens
    num_tokens = sum(q_lens)
    lens = torch.tensor(q_lens, dtype=torch.int32)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=cu[1:])
    return StepInputs(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.cat([torch.arange(q) for q in q_lens]).to(device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        cu_seqlens_q=cu.to(device), context_lens=lens.to(device),
        block_tables=torch.zeros(len(q_lens), width, dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens), num_sample_rows=0, logit_rows=0, sample_rows=None,
        no_prefix=no_prefix,
        seq_order=(torch.arange(len(q_lens), dtype=torch.int32, device=device)
                   if ordered else None))


class InputBuilder:
    """Owns the staging buffers of the step inputs; reads the block-table rows of the KV cache.

    Args:
        tables: the KV cache's :class:`~mini_paged_attn.cache.block_table.BlockTable` (one row
            per running sequence, ``table_width(...)`` wide).
        max_num_seqs, max_num_tokens: the most sequences and tokens a step holds.
        block_size: tokens per block.
        device: where the inputs go.
        order_decode: give decode-only steps a ``seq_order`` (the Triton decode kernel takes
            its sequences longest first; the torch reference has no use for it).
        logit_buckets: row counts the LM head's rows are rounded up to (ascending, the last
            ``>= max_num_seqs``), or None to run it on the sample rows as they are. cuBLAS
            picks a GEMM kernel by the row count, and the first launch of a kernel CUDA has
            not loaded yet waits for the device to drain: an engine that steps ahead of the
            device loses the overlap at every new count (the first rounds of a new batch
            size). A fixed set of counts is loaded once, at warm-up.
        cascade_rule: when a step's sequences sharing prefix blocks attend over them once
            (:meth:`plan_cascade`); None: never (no staging regions for it either).
        speculative: steps may verify proposals (``SchedulerOutput.spec_token_ids``): every
            position of such a sequence is a sample row, so there are up to
            ``max_num_tokens`` of them, not ``max_num_seqs``.
    """

    def __init__(self, tables: BlockTable, *, max_num_seqs: int, max_num_tokens: int,
                 block_size: int, device: torch.device, order_decode: bool = False,
                 logit_buckets: list[int] | None = None,
                 cascade_rule: CascadeRule | None = None, speculative: bool = False) -> None:
        assert logit_buckets is None or logit_buckets[-1] >= max_num_seqs, logit_buckets
        self.max_num_seqs = max_num_seqs
        self.order_decode = order_decode
        self.logit_buckets = logit_buckets
        self.max_num_tokens = max_num_tokens
        self.block_size = block_size
        self.cascade_rule = cascade_rule
        # Block-table widths are multiples of 16 and every region starts 256-byte aligned:
        # Triton specialises kernels on integer arguments divisible by 16 and on pointer
        # alignment, so steps of any shape reuse the kernels compiled at warm-up.
        self.tables = tables
        self.max_blocks_per_seq = w = tables.width
        assert w % TABLE_WIDTH_MULTIPLE == 0 and tables.num_rows >= max_num_seqs, tables
        s, t = max_num_seqs, max_num_tokens
        # A prefill graph's step is two sequences (the prompt and its padding), even when
        # max_num_seqs is 1.
        s2 = max(s, 2)
        self._i64_regions = _layout({"input_ids": t, "positions": t, "slot_mapping": t,
                                     "sample_rows": max(s, t) if speculative else s,
                                     "fill": 2 * s})
        self._i32_regions = _layout({"cu_seqlens_q": s2 + 1, "context_lens": s2,
                                     "seq_order": s, "block_tables": s2 * w,
                                     **cascade_region_sizes(s, t, w, cascade_rule is not None)})
        self.i64 = StagingBuffer(self._i64_regions["end"], torch.int64, device)
        self.i32 = StagingBuffer(self._i32_regions["end"], torch.int32, device)
        # Recorded after each step's uploads. The copies read the pinned host buffers when the
        # stream reaches them, and a step that samples nothing (a prompt chunk) ends without a
        # host sync, so the next build waits on this before overwriting the host buffers.
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def logit_rows(self, num_sample_rows: int) -> int:
        """The rows the LM head runs on for ``num_sample_rows`` sample rows (see
        ``logit_buckets``)."""
        return padded_rows(self.logit_buckets, num_sample_rows)

    # ---- regions (device views at fixed offsets: CUDA graphs read them in place) ----------------
    def region(self, name: str, n: int) -> torch.Tensor:
        """The first ``n`` elements of a staging region on the device, a view at a fixed
        address: int64 for input_ids / positions / slot_mapping / sample_rows, int32 for
        cu_seqlens_q / context_lens / seq_order / block_tables (flattened
        ``[num_seqs * width]``)."""
        if name in self._i64_regions:
            start = self._i64_regions[name]
            return self.i64.device[start:start + n]
        start = self._i32_regions[name]
        return self.i32.device[start:start + n]

    def host_arrays(self, step: StepInputs) -> dict[str, np.ndarray]:
        """Copies of the host arrays ``step`` was uploaded from (see ``StepMessage.arrays``):
        what another tensor-parallel rank needs to rebuild it with :meth:`load`."""
        sizes = {name: getattr(step, name).numel() for name in STEP_ARRAYS}
        if step.sample_rows is not None:
            sizes["sample_rows"] = step.logit_rows
        if step.seq_order is not None:
            sizes["seq_order"] = step.seq_order.numel()
        if step.cascade is not None:
            sizes.update((name, t.numel()) for name, t in
                         zip(CASCADE_ARRAYS, vars(step.cascade).values()))
        return {name: self._host(name, n).copy() for name, n in sizes.items()}

    def load(self, arrays: dict[str, np.ndarray], *, table_width: int, max_seqlen_q: int,
             num_sample_rows: int, no_prefix: bool = False) -> StepInputs:
        """Write ``arrays`` (from :meth:`host_arrays` on rank 0) into this builder's staging
        regions and upload them: the same step, with device views at this builder's fixed
        addresses (so a captured CUDA graph reads them in place)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        views = {}
        for name, values in arrays.items():
            self._host(name, len(values))[:] = values
            buffer, regions = ((self.i64, self._i64_regions) if name in self._i64_regions
                               else (self.i32, self._i32_regions))
            views[name] = buffer.upload(regions[name], regions[name] + len(values))
        num_seqs = len(arrays["block_tables"]) // table_width if table_width else 0
        shapes = shapes_of(arrays)
        inputs = StepInputs(
            input_ids=views["input_ids"], positions=views["positions"],
            slot_mapping=views["slot_mapping"], cu_seqlens_q=views["cu_seqlens_q"],
            context_lens=views["context_lens"],
            block_tables=views["block_tables"].view(num_seqs, table_width),
            max_seqlen_q=max_seqlen_q, num_sample_rows=num_sample_rows,
            logit_rows=self.logit_rows(num_sample_rows), sample_rows=views.get("sample_rows"),
            no_prefix=no_prefix,
            seq_order=views.get("seq_order"),
            cascade=(cascade_metadata({name: views[name].view(shape)
                                       for name, shape in shapes.items()})
                     if shapes else None))
        if self._uploaded is not None:
            self._uploaded.record()
        return inputs

    def _host(self, name: str, n: int) -> np.ndarray:
        """The first ``n`` elements of a staging region on the host (numpy view)."""
        if name in self._i64_regions:
            start = self._i64_regions[name]
            return self.i64.np[start:start + n]
        start = self._i32_regions[name]
        return self.i32.np[start:start + n]

    def plan_cascade(self, out: SchedulerOutput, max_groups: int | None = None
                     ) -> CascadePlan | None:
        """The step's shared-prefix groups that pass the builder's rule (see
        ``core.cascade``), at most ``max_groups`` of them, or None: no rule, nothing cached
        before the step, or no group passes. Host work only (tens of microseconds for a full
        batch)."""
        if self.cascade_rule is None or out.num_seqs < self.cascade_rule.min_group_size:
            return None
        seqs = out.seqs
        computed = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int64, len(seqs))
        plan = plan_cascade(self.tables.host, computed,
                            computed + np.asarray(out.num_new_tokens, dtype=np.int64),
                            self.block_size, self.cascade_rule, self.tables.rows_for(seqs),
                            max_groups=max_groups)
        return plan if plan.uses_cascade else None

    def build(self, out: SchedulerOutput, pad_to: int | None = None,
              pending: dict[int, int] | None = None,
              pad_prompt_to: int | None = None, paged_prompt: bool = False,
              cascade: CascadePlan | None = None,
              cascade_pad: CascadePad | None = None) -> StepInputs:
        """Fill and upload the inputs of ``out``. ``pad_to`` (decode-only steps): pad the batch
        to this many sequences (slot -1, context length 0) for a captured CUDA graph.
        ``pending``: ``seq_id -> row`` of the previous step's sampled ids, for sequences whose
        input token is still a placeholder (always their one token this step): the inputs'
        :class:`TokenFill`. ``pad_prompt_to`` (a step of one sequence, for a prefill graph,
        see :mod:`mini_paged_attn.engine.worker.prefill_graphs`): the regions also hold rows ``num_tokens ..
        pad_prompt_to - 1`` as a second sequence (token 0, position 0, slot -1) of
        ``pad_prompt_to - num_tokens`` new tokens; the views returned are the step's own.
        ``paged_prompt`` (with ``pad_prompt_to``, for a graph that reads the cache through the
        block tables): both block-table rows are ``max_blocks_per_seq`` wide and the
        padding's row is the prompt's, so the padding attends over the prompt's first
        ``pad_prompt_to - num_tokens`` positions (see :mod:`mini_paged_attn.engine.worker.prefill_graphs` for what they
        hold). ``cascade``: :meth:`plan_cascade`'s plan for ``out``: the inputs'
        :class:`CascadeMetadata`, shaped for a decode graph's ``cascade_pad`` when ``pad_to``
        is set (``cascade_inputs.CascadePad``)."""
        assert cascade is None or pad_prompt_to is None, "a prompt graph holds the plain path"
        assert cascade is None or (pad_to is None) == (cascade_pad is None), cascade_pad
        seqs = out.seqs
        n = len(seqs)
        num_tokens = out.num_batched_tokens
        bs = self.block_size
        rows = self.tables.rows_for(seqs)
        table = self.tables.host
        q_lens = np.asarray(out.num_new_tokens, dtype=np.int64)
        computed = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int64, n)
        r64, r32 = self._i64_regions, self._i32_regions
        ids_at, pos_at, slots_at = r64["input_ids"], r64["positions"], r64["slot_mapping"]
        cu_at, ctx_at, bt_at = r32["cu_seqlens_q"], r32["context_lens"], r32["block_tables"]
        i64, i32 = self.i64.np, self.i32.np
        if self._uploaded is not None:
            self._uploaded.synchronize()     # the previous step's copies have read the buffers
        spec = out.spec_token_ids
        if out.decode_only:
            # One token each; not always the last one (a 1-token prompt chunk, a recompute).
            i64[ids_at:ids_at + n] = [seq.token_ids[seq.num_computed_tokens] for seq in seqs]
        else:
            flat: list[int] = []
            if spec:     # a sequence's proposals follow its token
                for i, (seq, c, q) in enumerate(zip(seqs, computed.tolist(), out.num_new_tokens)):
                    flat += seq.token_ids[c:c + q]
                    flat += spec.get(i, ())
            else:
                for seq, c, q in zip(seqs, computed.tolist(), out.num_new_tokens):
                    flat += seq.token_ids[c:c + q]
            i64[ids_at:ids_at + num_tokens] = flat
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(computed - cu[:-1], q_lens)
        context_lens = computed + q_lens
        slots = (table[np.repeat(rows, q_lens), positions // bs].astype(np.int64) * bs
                 + positions % bs)
        needed = max(cdiv(int(context_lens.max()), bs), 1) if n else 1
        width = min(table_width(needed), self.max_blocks_per_seq)
        if paged_prompt:
            assert pad_prompt_to is not None, "paged_prompt pads a prompt"
            width = self.max_blocks_per_seq

        padded = n if pad_to is None else pad_to
        m = num_tokens if pad_to is None else pad_to
        i64[pos_at:pos_at + num_tokens] = positions
        i64[slots_at:slots_at + num_tokens] = slots
        i32[cu_at:cu_at + n + 1] = cu
        i32[ctx_at:ctx_at + n] = context_lens
        if padded > n:
            i64[ids_at + n:ids_at + padded] = 0
            i64[pos_at + n:pos_at + padded] = 0
            i64[slots_at + n:slots_at + padded] = -1       # padding writes nothing
            # A query row each (a decode step's shape, as the cascade op checks it).
            i32[cu_at + n + 1:cu_at + padded + 1] = np.arange(num_tokens + 1,
                                                              num_tokens + 1 + padded - n)
            i32[ctx_at + n:ctx_at + padded] = 0            # and reads nothing
        if pad_prompt_to is not None:
            assert n == 1 and not out.decode_only and pad_prompt_to >= num_tokens, pad_prompt_to
            m = pad_prompt_to
            i64[ids_at + num_tokens:ids_at + m] = 0
            i64[pos_at + num_tokens:pos_at + m] = 0
            i64[slots_at + num_tokens:slots_at + m] = -1    # the padding writes nothing
            i32[cu_at + 2] = m
            i32[ctx_at + 1] = m - num_tokens                # over its own rows, or (paged) the
                                                             # prompt's first positions
        # Entries past a sequence's blocks are stale; the kernels never read them.
        i32[bt_at:bt_at + n * width].reshape(n, width)[:] = table[rows, :width]
        table_rows = n + int(paged_prompt)
        if paged_prompt:
            i32[bt_at + width:bt_at + 2 * width] = i32[bt_at:bt_at + width]
        staged = None
        if cascade is not None:
            staged = fill_cascade(self._host, cascade, table, rows, context_lens, q_lens, cu,
                                  lambda blocks: min(table_width(blocks), self.max_blocks_per_seq),
                                  pad=cascade_pad)
        seq_order = None
        if self.order_decode and out.decode_only:
            order_at = r32["seq_order"]
            # Longest first (of what each row reads alone); the padding rows (nothing to
            # read) last.
            own = (context_lens if staged is None
                   else self._host("cascade_suffix_lens", n))
            i32[order_at:order_at + n] = np.argsort(-own, kind="stable")
            i32[order_at + n:order_at + padded] = np.arange(n, padded)
            seq_order = self.i32.upload(order_at, order_at + padded)

        # Rows to sample from: the last token of each sequence that samples, k times for k
        # samples; then every row of the sequences that verify proposals (in batch order);
        # then padding up to the LM head's rows.
        num_samples = out.num_samples
        sample_rows = None
        num_sample_rows = sum(num_samples)
        verify_rows = (np.concatenate([np.arange(cu[i], cu[i + 1]) for i in sorted(spec)])
                       if spec else None)
        num_plain = num_sample_rows
        if verify_rows is not None:
            num_sample_rows += len(verify_rows)
        logit_rows = self.logit_rows(num_sample_rows)
        if not (out.decode_only and num_sample_rows == n and logit_rows <= m):
            at = r64["sample_rows"]
            i64[at:at + num_plain] = np.repeat(cu[1:] - 1, num_samples)
            if verify_rows is not None:
                i64[at + num_plain:at + num_sample_rows] = verify_rows
            i64[at + num_sample_rows:at + logit_rows] = 0
            sample_rows = self.i64.upload(at, at + logit_rows)

        fill = self._fill(seqs, cu, pending) if pending else None
        padded_prompt = int(pad_prompt_to is not None)     # the padding's sequence entry
        inputs = StepInputs(
            fill=fill,
            input_ids=self.i64.upload(ids_at, ids_at + m),
            positions=self.i64.upload(pos_at, pos_at + m),
            slot_mapping=self.i64.upload(slots_at, slots_at + m),
            cu_seqlens_q=self.i32.upload(cu_at, cu_at + padded + 1 + padded_prompt),
            context_lens=self.i32.upload(ctx_at, ctx_at + padded + padded_prompt),
            block_tables=self.i32.upload(bt_at, bt_at + table_rows * width).view(
                table_rows, width)[:n],
            max_seqlen_q=int(q_lens.max()) if n else 0,
            num_sample_rows=num_sample_rows, logit_rows=logit_rows, sample_rows=sample_rows,
            no_prefix=n > 0 and not computed.any(), seq_order=seq_order,
            cascade=None if staged is None else self._upload_cascade(staged))
        if pad_prompt_to is not None:       # the graph reads the padding; the step is its own
            inputs.input_ids, inputs.positions, inputs.slot_mapping = (
                t[:num_tokens] for t in (inputs.input_ids, inputs.positions,
                                         inputs.slot_mapping))
            inputs.cu_seqlens_q, inputs.context_lens = (inputs.cu_seqlens_q[:2],
                                                        inputs.context_lens[:1])
        if self._uploaded is not None:
            self._uploaded.record()
        return inputs

    def _upload_cascade(self, shapes: dict[str, tuple[int, ...]]) -> CascadeMetadata:
        """Upload the cascade regions :func:`fill_cascade` wrote (``name -> shape``)."""
        views = {}
        for name, shape in shapes.items():
            at = self._i32_regions[name]
            views[name] = self.i32.upload(at, at + int(np.prod(shape))).view(shape)
        return cascade_metadata(views)

    def _fill(self, seqs, cu: np.ndarray, pending: dict[int, int]) -> TokenFill | None:
        dst, src = [], []
        for i, seq in enumerate(seqs):
            row = pending.get(seq.seq_id)
            if row is not None:
                dst.append(int(cu[i + 1]) - 1)
                src.append(row)
        count = len(dst)
        if not count:
            return None
        if dst[-1] == count - 1 and src == dst:    # rows 0 .. count - 1 in order, both sides
            return TokenFill(count, None, None)
        at = self._i64_regions["fill"]
        self.i64.np[at:at + 2 * count] = dst + src
        both = self.i64.upload(at, at + 2 * count)
        return TokenFill(count, both[:count], both[count:])


def _layout(sizes: dict[str, int]) -> dict[str, int]:
    """Start offset of each region (elements), each a multiple of REGION_ALIGN; "end": total."""
    offsets, at = {}, 0
    for name, size in sizes.items():
        offsets[name] = at
        at = cdiv(at + size, REGION_ALIGN) * REGION_ALIGN
    offsets["end"] = at
    return offsets


__all__ = ["InputBuilder", "StagingBuffer", "StepInputs", "TokenFill", "batch_buckets",
           "dummy_inputs", "padded_rows", "smallest_bucket", "table_width"]
