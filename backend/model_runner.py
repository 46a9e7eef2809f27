"""Owns the model and the KV cache; turns a scheduled step into one packed forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritium.backend.attention import AttentionBackend, AttentionMetadata, StepLayout
from tritium.backend.models.llama import LlamaForCausalLM
from tritium.backend.scheduler import ScheduledSequence


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # row of each sampling sequence's last token, in scheduled order


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        c = model.config
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(c.num_hidden_layers)
        ]

    def prepare(self, batch: list[ScheduledSequence]) -> PreparedBatch:
        """Pack the step: decode rows (one new token) first, then prefill chunks."""
        bs = self.block_size
        layout = StepLayout()
        slots = layout.slot_mapping
        input_ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}  # id(scheduled) -> its last packed row
        for s in batch:  # decode rows: one token at position num_computed_tokens
            if s.num_new_tokens != 1:
                continue
            seq = s.seq
            pos = seq.num_computed_tokens
            last_row[id(s)] = len(input_ids)
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            layout.decode_block_tables.append(seq.block_table)
            layout.decode_seq_lens.append(pos + 1)
        for s in batch:
            if s.num_new_tokens == 1:
                continue
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            last_row[id(s)] = len(input_ids) - 1
            layout.prefill_block_tables.append(table)
            layout.prefill_query_lens.append(s.num_new_tokens)
            layout.prefill_seq_lens.append(end)
        dev = self.device
        rows = [last_row[id(s)] for s in batch if s.samples]
        return PreparedBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=self.backend.build_metadata(layout, dev),
            logit_rows=torch.tensor(rows, dtype=torch.long, device=dev),
        )

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSequence]) -> torch.Tensor:
        """fp32 logits on the CPU, one row per sequence that samples this step (scheduled order)."""
        prepared = self.prepare(batch)
        hidden = self.model(prepared.input_ids, prepared.positions, self.kv_caches, prepared.meta, self.backend)
        if prepared.logit_rows.numel() == 0:
            return torch.empty(0, self.model.config.vocab_size)
        logits = self.model.compute_logits(hidden[prepared.logit_rows])
        return logits.cpu()
