"""Owns the model and the KV cache; turns a scheduled step into one packed forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritium.backend.attention import AttentionBackend, AttentionMetadata
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


def _block_table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(tables), width)


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
        decodes = [s for s in batch if s.num_new_tokens == 1]
        prefills = [s for s in batch if s.num_new_tokens != 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}
        cu_seqlens = [0]
        for s in decodes + prefills:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            pos = range(start, end)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            last_row[id(s)] = len(input_ids) - 1
            if s.num_new_tokens != 1:
                cu_seqlens.append(cu_seqlens[-1] + s.num_new_tokens)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=len(decodes),
            decode_block_tables=_block_table_tensor([s.seq.block_table for s in decodes], dev),
            decode_seq_lens=torch.tensor(
                [s.seq.num_computed_tokens + 1 for s in decodes], dtype=torch.int32, device=dev
            ),
            prefill_block_tables=_block_table_tensor([s.seq.block_table for s in prefills], dev),
            prefill_cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=dev),
            prefill_seq_lens=torch.tensor(
                [s.seq.num_computed_tokens + s.num_new_tokens for s in prefills], dtype=torch.int32, device=dev
            ),
            prefill_max_query_len=max((s.num_new_tokens for s in prefills), default=0),
        )
        rows = [last_row[id(s)] for s in batch if s.samples]
        return PreparedBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
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
