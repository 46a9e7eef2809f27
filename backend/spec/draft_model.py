"""A greedy draft model on the target's block tables (docs/architecture.md, "Speculative decoding")."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from tritium.backend.layers.attention import AttentionBackend, AttentionMetadata
from tritium.backend.model_config import ModelConfig
from tritium.backend.models.loader import checkpoint_numel, load_model
from tritium.backend.models.registry import resolve_model


def tokenizer_digest(folder: Path) -> str | None:
    path = folder / "tokenizer.json"
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest() if path.is_file() else None


def draft_footprint(folder: str, dtype: torch.dtype, block_size: int) -> tuple[int, int]:
    """(weight bytes, KV bytes per block) of the draft model in `folder`, for the target's memory plan."""
    path = resolve_model(folder)
    return checkpoint_numel(path) * dtype.itemsize, ModelConfig.from_folder(path).kv_bytes_per_block(block_size, dtype)


class DraftModel:
    """Raises ValueError naming `speculative_config.model` when its vocabulary or tokenizer differs from the
    target's (ModelFolderError when it cannot load)."""

    def __init__(self, folder: str, target_path: Path, target: ModelConfig, dtype: torch.dtype,
                 device: torch.device, max_model_len: int, num_blocks: int, block_size: int,
                 backend: AttentionBackend) -> None:
        path = resolve_model(folder)
        config = ModelConfig.from_folder(path)
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model {folder!r} has a vocabulary of {config.vocab_size} tokens; "
                             f"the target model's has {target.vocab_size}: a draft model needs the same tokenizer")
        if tokenizer_digest(path) != tokenizer_digest(target_path):
            raise ValueError(f"speculative_config.model {folder!r}: its tokenizer.json differs from the target "
                             "model's; a draft model needs the same tokenizer")
        self.model = load_model(path, dtype, device, max_model_len, backend=backend)
        self.block_size = block_size
        self.device = device
        self.width = -(-max_model_len // block_size)
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(config.num_hidden_layers)]
        # Per request: the leading positions its KV holds, and how far the last drafts took it.
        self.seen: dict[str, int] = {}
        self.reach: dict[str, int] = {}

    def forget(self, request_id: str) -> None:
        """Its blocks, and the KV in them, are gone."""
        self.seen.pop(request_id, None)
        self.reach.pop(request_id, None)

    def accepted(self, request_id: str, accepted: int) -> None:
        """Verification kept the first `accepted` drafts: their KV (all but the last draft's) stays valid."""
        if request_id in self.seen:
            self.seen[request_id] = min(self.reach[request_id], self.seen[request_id] + accepted)

    @torch.inference_mode()
    def propose(self, request_id: str, tokens: list[int], table: list[int], k: int) -> list[int]:
        """`k` greedy drafts after `tokens`; `table` must cover `len(tokens) + k - 1` positions."""
        seen = min(self.seen.get(request_id, 0), len(tokens) - 1)
        run = tokens[seen:]
        positions = list(range(seen, len(tokens)))
        drafts: list[int] = []
        for _ in range(k):
            logits = self._forward(table, run, positions)
            token = int(logits.argmax())
            drafts.append(token)
            run, positions = [token], [positions[-1] + 1]
        self.seen[request_id] = len(tokens)
        self.reach[request_id] = len(tokens) + k - 1  # it ran every draft but the last
        return drafts

    def _forward(self, table: list[int], ids: list[int], positions: list[int]) -> torch.Tensor:
        """The logits after the last of `ids` at `positions` (one prefill chunk; K/V written to their slots)."""
        bs = self.block_size
        device = self.device
        end = positions[-1] + 1
        row = torch.zeros(1, self.width, dtype=torch.int32)
        row[0, : len(table)] = torch.tensor(table, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([table[p // bs] * bs + p % bs for p in positions], dtype=torch.int32,
                                      device=device),
            num_decode_tokens=0,
            decode_block_tables=torch.zeros(0, self.width, dtype=torch.int32, device=device),
            decode_seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
            prefill_block_tables=row[:, : -(-end // bs)].to(device),
            prefill_cu_seqlens_q=torch.tensor([0, len(ids)], dtype=torch.int32, device=device),
            prefill_seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
            prefill_max_query_len=len(ids),
        )
        hidden = self.model(torch.tensor(ids, dtype=torch.int32, device=device),
                            torch.tensor(positions, dtype=torch.int32, device=device), self.kv_caches, meta)
        return self.model.compute_logits(hidden[-1:])[0]
