"""Per-step model inputs, built once per step with numpy from preallocated (pinned) buffers.

The runner keeps one host block-table row per running sequence and copies only the entries that
changed (new blocks, a copy-on-write, a fresh admission), so a decode step costs a few attribute
reads per sequence plus a handful of vectorised numpy operations and one copy per array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.scheduler import SchedulerOutput


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
    ``block_tables``: int32 ``[num_seqs, width]`` (width = the batch's most blocks);
    ``sample_rows``: int64 ``[num_sample_rows]``, the hidden rows to sample from (a request
    about to fork repeats its row n times), None when they are simply ``0 .. num_seqs - 1``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    num_sample_rows: int
    sample_rows: torch.Tensor | None


class InputBuilder:
    """Owns the persistent host block table and the staging buffers of the step inputs."""

    def __init__(self, *, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        s, t, w = max_num_seqs, max_num_tokens, max_blocks_per_seq
        # int64 regions: input ids, positions, slots (t each), sample rows (s).
        self.i64 = StagingBuffer(3 * t + s, torch.int64, device)
        # int32 regions: cu_seqlens (s + 1), context lens (s), block tables (s * w).
        self.i32 = StagingBuffer(2 * s + 1 + s * w, torch.int32, device)
        self.table = np.zeros((s, w), dtype=np.int32)      # one row per running sequence
        self._rows: dict[int, int] = {}
        self._free_rows = list(range(s - 1, -1, -1))

    # ---- regions (device views at fixed offsets: CUDA graphs read them in place) ----------------
    def region(self, name: str, n: int) -> torch.Tensor:
        t, s = self.max_num_tokens, self.max_num_seqs
        start = {"input_ids": 0, "positions": t, "slot_mapping": 2 * t}.get(name)
        if start is not None:
            return self.i64.device[start:start + n]
        start = {"cu_seqlens_q": 0, "context_lens": s + 1}[name]
        return self.i32.device[start:start + n]

    def release(self, seq_id: int) -> None:
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)

    def _rows_of(self, seqs) -> np.ndarray:
        """Table row of each sequence, copying block ids the table does not have yet."""
        rows = self._rows
        table = self.table
        out = []
        for seq in seqs:
            row = rows.get(seq.seq_id)
            start = seq.blocks_changed_from
            if row is None:
                row = rows[seq.seq_id] = self._free_rows.pop()
                start = 0
            blocks = seq.block_ids
            if start < len(blocks):
                table[row, start:len(blocks)] = blocks[start:]
                seq.blocks_changed_from = len(blocks)
            out.append(row)
        return np.asarray(out, dtype=np.int64)

    def build(self, out: SchedulerOutput, pad_to: int | None = None) -> StepInputs:
        """Fill and upload the inputs of ``out``. ``pad_to`` (decode-only steps): pad the batch
        to this many sequences (slot -1, context length 0) for a captured CUDA graph."""
        seqs = out.seqs
        n = len(seqs)
        num_tokens = out.num_batched_tokens
        t, s, bs = self.max_num_tokens, self.max_num_seqs, self.block_size
        rows = self._rows_of(seqs)
        q_lens = np.asarray(out.num_new_tokens, dtype=np.int64)
        computed = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int64, n)
        i64 = self.i64.np
        if out.decode_only:
            # One token each; not always the last one (a 1-token prompt chunk, a recompute).
            i64[:n] = [seq.token_ids[seq.num_computed_tokens] for seq in seqs]
        else:
            flat: list[int] = []
            for seq, c, q in zip(seqs, computed.tolist(), out.num_new_tokens):
                flat += seq.token_ids[c:c + q]
            i64[:num_tokens] = flat
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(computed - cu[:-1], q_lens)
        context_lens = computed + q_lens
        slots = (self.table[np.repeat(rows, q_lens), positions // bs].astype(np.int64) * bs
                 + positions % bs)
        width = max(1, -(-int(context_lens.max()) // bs)) if n else 1

        padded = n if pad_to is None else pad_to
        m = num_tokens if pad_to is None else pad_to
        i64[t:t + num_tokens] = positions
        i64[2 * t:2 * t + num_tokens] = slots
        i32 = self.i32.np
        i32[:n + 1] = cu
        i32[s + 1:s + 1 + n] = context_lens
        if padded > n:
            i64[n:padded] = 0                        # input ids of padding rows
            i64[t + n:t + padded] = 0
            i64[2 * t + n:2 * t + padded] = -1       # padding writes nothing
            i32[n + 1:padded + 1] = num_tokens
            i32[s + 1 + n:s + 1 + padded] = 0        # and reads nothing
        bt_start = 2 * s + 1
        i32[bt_start:bt_start + n * width].reshape(n, width)[:] = self.table[rows, :width]

        # Rows to sample from: the last token of each sequence that samples, k times for k samples.
        num_samples = out.num_samples
        sample_rows = None
        num_sample_rows = sum(num_samples)
        if not (out.decode_only and num_sample_rows == n):
            picks = np.repeat(cu[1:] - 1, num_samples)
            i64[3 * t:3 * t + num_sample_rows] = picks
            sample_rows = self.i64.upload(3 * t, 3 * t + num_sample_rows)

        return StepInputs(
            input_ids=self.i64.upload(0, m), positions=self.i64.upload(t, t + m),
            slot_mapping=self.i64.upload(2 * t, 2 * t + m),
            cu_seqlens_q=self.i32.upload(0, padded + 1),
            context_lens=self.i32.upload(s + 1, s + 1 + padded),
            block_tables=self.i32.upload(bt_start, bt_start + n * width).view(n, width),
            max_seqlen_q=int(q_lens.max()) if n else 0,
            num_sample_rows=num_sample_rows, sample_rows=sample_rows)


__all__ = ["InputBuilder", "StagingBuffer", "StepInputs"]
