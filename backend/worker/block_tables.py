"""Block tables as rows of one device tensor, sent incrementally (docs/architecture.md, "The engine step"). The
last row stays zero for padding rows; a sequence whose `block_table` is a new list gets its row rewritten."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritium.backend.core.sequence import Sequence


@dataclass
class _Row:
    index: int
    table: list[int]  # the sequence's block_table list object whose first `written` entries the row holds
    written: int = 0


class DeviceBlockTables:
    def __init__(self, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.width = max_blocks_per_seq
        self.padding_row = max_seqs
        self.tensor = torch.zeros((max_seqs + 1, max_blocks_per_seq), dtype=torch.int32, device=device)
        self._free = list(range(max_seqs - 1, -1, -1))
        self._rows: dict[str, _Row] = {}
        self.update_index: list[int] = []  # flat positions in `tensor`, pending for this step
        self.update_value: list[int] = []

    def request_ids(self) -> set[str]:
        return set(self._rows)

    def row(self, seq: Sequence) -> int:
        """`seq`'s row (assigned on first use), its new block ids queued; RuntimeError when no row is free."""
        row = self._rows.get(seq.request_id)
        if row is None:
            if not self._free:
                raise RuntimeError("more scheduled sequences than block-table rows (max_num_seqs)")
            row = self._rows[seq.request_id] = _Row(self._free.pop(), seq.block_table)
        table = seq.block_table
        if row.table is not table:
            row.table, row.written = table, 0
        if row.written < len(table):
            base = row.index * self.width
            self.update_index.extend(range(base + row.written, base + len(table)))
            self.update_value.extend(table[row.written :])
            row.written = len(table)
        return row.index

    def release(self, request_id: str) -> None:
        """Free a request's row (unknown ids: ignored)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row.index)

    def take_updates(self) -> tuple[list[int], list[int]]:
        """(flat indexes, block ids) queued since the last call."""
        updates = self.update_index, self.update_value
        self.update_index, self.update_value = [], []
        return updates

    def apply(self, index: torch.Tensor, value: torch.Tensor) -> None:
        if index.numel():
            self.tensor.view(-1).index_put_((index,), value)
