"""BlockTable: the block-table rows of the sequences that use a paged pool.

Row ``r`` lists one sequence's physical blocks in logical order (int32). The rows live on the
host (numpy), where the engine reads them to build each step's compact table, and are mirrored
into a device tensor on :meth:`BlockTable.sync`, which is what the seed API hands the kernels.
Entries past a sequence's last block are stale and never read. Under a sliding window the
entries of the blocks a sequence gave back hold ``core.sliding_window.PAD_BLOCK_ID`` (in range,
and never read either: they lie left of every later query's window).

Rows are bound to sequence ids: the seed API binds row ``seq_id`` (its ids are
``0 .. num_rows - 1``); the engine, whose ids only grow, takes any free row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch


class BlockTable:
    """Host block-table rows bound to sequence ids, with a device mirror.

    Args:
        num_rows: sequences that can hold a row at once.
        width: blocks per row (``max_blocks_per_seq``).
        device: where the mirror lives.
    """

    def __init__(self, num_rows: int, width: int, device: torch.device) -> None:
        self.host = np.zeros((num_rows, width), dtype=np.int32)
        self.device = torch.zeros((num_rows, width), dtype=torch.int32, device=device)
        self._rows: dict[int, int] = {}          # seq_id -> row
        self._taken: set[int] = set()            # rows bound now
        self._free_rows = list(range(num_rows - 1, -1, -1))   # popped from the end: row 0 first
        self._dirty: set[int] = set()

    @property
    def num_rows(self) -> int:
        return self.host.shape[0]

    @property
    def width(self) -> int:
        return self.host.shape[1]

    @property
    def num_bound(self) -> int:
        """Rows bound to a sequence now."""
        return len(self._rows)

    def row_of(self, seq_id: int) -> int | None:
        return self._rows.get(seq_id)

    def is_free(self, row: int) -> bool:
        return row not in self._taken

    def bind(self, seq_id: int, row: int | None = None) -> int:
        """Bind a free row to ``seq_id`` (``row`` None: any free row) and return it."""
        assert seq_id not in self._rows, f"sequence {seq_id} already holds a row"
        if row is None:
            row = self._free_rows.pop()
        else:
            assert row not in self._taken, f"row {row} is bound already"
            self._free_rows.remove(row)
        self._rows[seq_id] = row
        self._taken.add(row)
        return row

    def release(self, seq_id: int) -> None:
        """Give the sequence's row back; an id without a row (released already) is a no-op."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._taken.discard(row)
            self._free_rows.append(row)

    def set_blocks(self, row: int, start: int, block_ids: Sequence[int]) -> None:
        """``row[start:len(block_ids)] = block_ids[start:]`` (the rest of the row is kept)."""
        if start < len(block_ids):
            self.host[row, start:len(block_ids)] = block_ids[start:]
            self._dirty.add(row)

    def clear(self, row: int) -> None:
        self.host[row] = 0
        self._dirty.add(row)

    def rows_for(self, seqs: Iterable) -> np.ndarray:
        """Row of each engine sequence (binding a row on first sight), copying the block ids
        its row does not have yet (from ``seq.blocks_changed_from``).

        Args:
            seqs: :class:`~mini_paged_attn.core.request.Sequence` objects.

        Returns:
            int64 ``[len(seqs)]`` row indices into :attr:`host`.
        """
        rows, host = self._rows, self.host
        out = []
        for seq in seqs:
            row = rows.get(seq.seq_id)
            start = seq.blocks_changed_from
            if row is None:
                row = self.bind(seq.seq_id)
                start = 0
            blocks = seq.block_ids
            if start < len(blocks):
                host[row, start:len(blocks)] = blocks[start:]
                seq.blocks_changed_from = len(blocks)
                self._dirty.add(row)
            out.append(row)
        return np.asarray(out, dtype=np.int64)

    def sync(self) -> torch.Tensor:
        """Copy the rows changed since the last sync to the device mirror; return it."""
        if self._dirty:
            rows = sorted(self._dirty)
            self._dirty.clear()
            index = torch.tensor(rows, dtype=torch.int64)
            self.device[index.to(self.device.device)] = torch.from_numpy(
                self.host[rows]).to(self.device.device)
        return self.device


__all__ = ["BlockTable"]
