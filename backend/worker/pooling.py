"""Embeddings from final hidden states: the pooling rule (sentence-transformers files, else settings) and the pooling
itself over packed sequences (docs/architecture.md, "Embeddings")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tritium.backend.config import EMBEDDING_POOLINGS

POOLING_TYPES = EMBEDDING_POOLINGS
# vLLM's defaults for a decoder LLM run as an embedding model: the last token's state, L2-normalised
DEFAULT_POOLING = "last"
DEFAULT_NORMALIZE = True
ST_POOLING_MODES = {  # sentence-transformers' 1_Pooling/config.json flags -> our pooling
    "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last",
}
ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens")
ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str = DEFAULT_POOLING  # one of POOLING_TYPES
    normalize: bool = DEFAULT_NORMALIZE  # L2 normalisation of each vector
    source: str = "default"  # where it came from: "default", "settings" or the sentence-transformers file

    def __post_init__(self) -> None:
        check_pooling(self.pooling)
        if not isinstance(self.normalize, bool):
            raise ValueError(f"embedding_normalize must be true or false, got {self.normalize!r}")


def check_pooling(pooling: object) -> None:
    """Raises ValueError naming `embedding_pooling` and the known types unless `pooling` is one of them."""
    if pooling not in POOLING_TYPES:
        raise ValueError(f"embedding_pooling must be one of {', '.join(map(repr, POOLING_TYPES))}, got {pooling!r}")


def read_sentence_transformers(model_path: Path) -> PoolingConfig | None:
    """The pooling `modules.json` and its Pooling module's config.json (`1_Pooling/config.json`) declare; None when
    the folder has no modules.json. Raises ValueError naming the file and the mode it cannot pool with."""
    modules_file = model_path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} must hold a list of modules")
    types = [m.get("type") for m in modules if isinstance(m, dict)]
    normalize = ST_NORMALIZE in types
    folder = next((m.get("path", "") for m in modules if isinstance(m, dict) and m.get("type") == ST_POOLING), None)
    if folder is None:
        return None
    config_file = model_path / folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{modules_file} names a Pooling module in {folder!r}, which has no config.json")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    chosen = [ST_POOLING_MODES[k] for k in ST_POOLING_MODES if config.get(k)]
    unsupported = [k for k in ST_UNSUPPORTED_MODES if config.get(k)]
    if unsupported or len(chosen) != 1:
        names = unsupported or [k for k in ST_POOLING_MODES if config.get(k)] or ["none"]
        raise ValueError(f"{config_file}: pooling mode {', '.join(names)} is not supported; tritium pools with "
                         f"exactly one of {', '.join(ST_POOLING_MODES)}")
    return PoolingConfig(chosen[0], normalize, source=str(config_file))


def pooling_config(model_path: Path, pooling: str | None = None, normalize: bool | None = None) -> PoolingConfig:
    """The model folder's sentence-transformers files when present, else the settings (`embedding_pooling`,
    `embedding_normalize`), else vLLM's defaults for decoder models ("last", normalised). Settings given explicitly
    override the files. Raises ValueError naming an unknown pooling."""
    if pooling is not None:
        check_pooling(pooling)
    found = read_sentence_transformers(model_path)
    if found is not None and pooling is None and normalize is None:
        return found
    base = found or PoolingConfig()
    return PoolingConfig(pooling if pooling is not None else base.pooling,
                         normalize if normalize is not None else base.normalize, source="settings")


def pool(hidden: torch.Tensor, lengths: list[int], pooling: str) -> torch.Tensor:
    """`[len(lengths), hidden]` fp32 vectors of the packed `hidden` `[sum(lengths), hidden]` (sequence i's rows
    follow sequence i - 1's): its last row, its first row, or the mean of its rows."""
    check_pooling(pooling)
    if any(n < 1 for n in lengths):
        raise ValueError("every pooled sequence needs at least one token")
    ends = torch.tensor(lengths, device=hidden.device).cumsum(0)
    if pooling == "last":
        return hidden.index_select(0, ends - 1).float()
    if pooling == "cls":
        return hidden.index_select(0, ends - torch.tensor(lengths, device=hidden.device)).float()
    segments = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device),
                                       torch.tensor(lengths, device=hidden.device))
    sums = torch.zeros(len(lengths), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, segments, hidden.float())
    return sums / torch.tensor(lengths, dtype=torch.float32, device=hidden.device)[:, None]


def normalize_rows(vectors: torch.Tensor) -> torch.Tensor:
    """Each row divided by its L2 norm (as torch.nn.functional.normalize: a zero row stays zero)."""
    return torch.nn.functional.normalize(vectors, p=2.0, dim=-1)


def pooled(hidden: torch.Tensor, lengths: list[int], config: PoolingConfig) -> torch.Tensor:
    vectors = pool(hidden, lengths, config.pooling)
    return normalize_rows(vectors) if config.normalize else vectors
