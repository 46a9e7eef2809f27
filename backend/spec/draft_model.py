"""A greedy draft model on the target's block tables (docs/architecture.md, "Speculative decoding")."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch

from tritium.backend.layers.attention import AttentionBackend, AttentionMetadata
from tritium.backend.model_config import ModelConfig
from tritium.backend.models.kernel_shape import kernel_shape
from tritium.backend.models.loader import checkpoint_numel, load_model
from tritium.backend.models.registry import resolve_model
from tritium.kernels.warmup import warm_up as warm_up_kernels


@dataclass
class DraftRequest:
    """A request to draft for: `k` drafts after `tokens`; `table` covers `len(tokens) + k - 1` positions."""

    request_id: str
    tokens: list[int]
    table: list[int]
    k: int


@dataclass
class DraftPlan:
    """A `DraftModel.propose` call's host inputs by name, the rows drafting in each round, the longest round-0 run."""

    parts: dict[str, list[int]]
    active: list[int]
    max_query: int


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
        self.backend = backend
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
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's `k` greedy drafts after its `tokens`, in order. Every request's run since its cached KV goes
        through one forward pass, then each further draft position is one decode row of a forward pass of the
        requests still drafting; the inputs are uploaded once and the drafts fetched once."""
        if not requests:
            return []
        order = sorted(range(len(requests)), key=lambda i: -requests[i].k)  # the rows still drafting: a prefix
        rows = [requests[i] for i in order]
        fetched = self._run(self._plan(rows)).tolist()  # the one wait on the device
        out: list[list[int]] = [[] for _ in requests]
        for row, (i, req) in enumerate(zip(order, rows, strict=True)):
            out[i] = fetched[row][: req.k]
            self.seen[req.request_id] = len(req.tokens)
            self.reach[req.request_id] = len(req.tokens) + req.k - 1  # it ran every draft but the last
        return out

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Launch the draft model's kernel variants (Triton) and both kinds of round, writing no KV."""
        if self.backend.name == "triton":
            warm_up_kernels(self.backend.ops, kernel_shape(self.model, self.block_size, self.width,
                                                           self.kv_caches[0][0].dtype, self.device))
        parts = {"first_ids": [0, 0], "positions0": [0, 1], "slots0": [-1, -1], "cu0": [0, 2], "lens0": [2],
                 "last": [1], "tables": [0] * self.width, "positions1": [1], "slots1": [-1], "lens1": [2]}
        self._run(DraftPlan(parts, [1, 1], 2))

    def _run(self, plan: DraftPlan) -> torch.Tensor:
        """The drafts `[rows, rounds]` (int64, on the device; a row's columns past its `k` are zeros)."""
        staged = self._upload(plan)
        drafts = torch.zeros(plan.active[0], len(plan.active), dtype=torch.long, device=self.device)
        ids = staged["first_ids"]
        for r, active in enumerate(plan.active):
            meta = self._round_meta(staged, r, active, plan.max_query)
            hidden = self.model(ids, staged[f"positions{r}"], self.kv_caches, meta)
            last = hidden.index_select(0, staged["last"].long()) if r == 0 else hidden
            drafts[:active, r] = self.model.compute_logits(last).argmax(dim=-1)
            if r + 1 < len(plan.active):
                ids = drafts[: plan.active[r + 1], r].to(torch.int32)
        return drafts

    def _plan(self, rows: list[DraftRequest]) -> DraftPlan:
        """The host inputs of every round: round 0 runs each row's tokens since its cached KV, round r > 0 the
        rows with more than r drafts, one position each."""
        bs = self.block_size
        parts: dict[str, list[int]] = {"first_ids": [], "positions0": [], "slots0": [], "cu0": [0], "lens0": [],
                                       "last": [], "tables": []}
        for req in rows:
            seen = min(self.seen.get(req.request_id, 0), len(req.tokens) - 1)
            positions = list(range(seen, len(req.tokens)))
            parts["first_ids"] += req.tokens[seen:]
            parts["positions0"] += positions
            parts["slots0"] += [req.table[p // bs] * bs + p % bs for p in positions]
            parts["cu0"].append(parts["cu0"][-1] + len(positions))
            parts["lens0"].append(len(req.tokens))
            parts["last"].append(parts["cu0"][-1] - 1)
            parts["tables"] += req.table + [0] * (self.width - len(req.table))
        active = [len(rows)]
        for r in range(1, rows[0].k):
            drafting = [req for req in rows if req.k > r]
            active.append(len(drafting))
            positions = [len(req.tokens) - 1 + r for req in drafting]
            parts[f"positions{r}"] = positions
            parts[f"slots{r}"] = [req.table[p // bs] * bs + p % bs for req, p in zip(drafting, positions, strict=True)]
            parts[f"lens{r}"] = [p + 1 for p in positions]
        max_query = max(b - a for a, b in pairwise(parts["cu0"]))
        return DraftPlan(parts, active, max_query)

    def _upload(self, plan: DraftPlan) -> dict[str, torch.Tensor]:
        """Every part in one int32 copy to the device (from pinned memory, not waited for, on CUDA)."""
        flat = [v for values in plan.parts.values() for v in values]
        host = torch.tensor(flat, dtype=torch.int32)
        if self.device.type == "cuda":
            host = host.pin_memory()
        device = host.to(self.device, non_blocking=True)
        staged, start = {}, 0
        for name, values in plan.parts.items():
            staged[name] = device[start : start + len(values)]
            start += len(values)
        staged["tables"] = staged["tables"].view(-1, self.width)
        return staged

    def _round_meta(self, staged: dict[str, torch.Tensor], r: int, active: int, max_query: int) -> AttentionMetadata:
        """Round 0: every row a prefill row of its run; later rounds: the first `active` rows, one decode token each."""
        tables = staged["tables"][:active]
        empty = tables[:0]
        if r == 0:
            return AttentionMetadata(
                slot_mapping=staged["slots0"], num_decode_tokens=0, decode_block_tables=empty,
                decode_seq_lens=staged["lens0"][:0], prefill_block_tables=tables, prefill_cu_seqlens_q=staged["cu0"],
                prefill_seq_lens=staged["lens0"], prefill_max_query_len=max_query)
        return AttentionMetadata(
            slot_mapping=staged[f"slots{r}"], num_decode_tokens=active, decode_block_tables=tables,
            decode_seq_lens=staged[f"lens{r}"], prefill_block_tables=empty, prefill_cu_seqlens_q=staged["cu0"][:1],
            prefill_seq_lens=staged["lens0"][:0], prefill_max_query_len=0)
