"""Every scheduled sequence's block table, kept on the device and updated incrementally.

Each sequence gets a row of a persistent `[max_num_seqs + 1, max_blocks_per_seq]` int32 tensor while it
runs; a step sends only the block ids its sequences gained since their last step (flat index, block id)
and applies them with one scatter. The last row stays all zeros: the padding rows of a batch point there.
A preempted sequence's table is a new list (the block manager frees and rebuilds it), which is how a row
knows to rewrite itself.
"""

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
        """The requests holding a row."""
        return set(self._rows)

    def row(self, seq: Sequence) -> int:
        """The row of `seq` (assigned on first use), after queueing the block ids it does not hold yet."""
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
        """Give the row of a request that finished or was preempted back (unknown ids are ignored)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row.index)

    def take_updates(self) -> tuple[list[int], list[int]]:
        """The table entries to write since the last call, as (flat indexes, block ids); forgets them."""
        updates = self.update_index, self.update_value
        self.update_index, self.update_value = [], []
        return updates

    def apply(self, index: torch.Tensor, value: torch.Tensor) -> None:
        """Scatter staged updates (int32 device tensors) into the table."""
        if index.numel():
            self.tensor.view(-1).index_put_((index,), value)
