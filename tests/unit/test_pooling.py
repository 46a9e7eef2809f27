"""Pooling functions, the sentence-transformers files, embedding batches and the refusals by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tritium.backend.config import EngineConfig
from tritium.backend.core.embed_batches import embedding_batches
from tritium.backend.worker.pooling import PoolingConfig, normalize_rows, pool, pooling_config


def test_pool_over_packed_sequences() -> None:
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # sequences of 1, 3, 2 rows
    lengths = [1, 3, 2]
    assert pool(hidden, lengths, "last").tolist() == [[0, 1], [6, 7], [10, 11]]
    assert pool(hidden, lengths, "cls").tolist() == [[0, 1], [2, 3], [8, 9]]
    assert pool(hidden, lengths, "mean").tolist() == [[0, 1], [4, 5], [9, 10]]
    normed = normalize_rows(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    torch.testing.assert_close(normed, torch.tensor([[0.6, 0.8], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="embedding_pooling must be one of 'last', 'mean', 'cls', got 'max'"):
        pool(hidden, lengths, "max")


def _st_folder(tmp_path: Path, modes: dict[str, bool], normalize: bool) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8} | modes))
    return tmp_path


@pytest.mark.parametrize(("flag", "pooling"), [("pooling_mode_cls_token", "cls"),
                                               ("pooling_mode_mean_tokens", "mean"),
                                               ("pooling_mode_lasttoken", "last")])
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_transformers_files(tmp_path: Path, flag: str, pooling: str, normalize: bool) -> None:
    folder = _st_folder(tmp_path, {flag: True}, normalize)
    found = pooling_config(folder)
    assert (found.pooling, found.normalize) == (pooling, normalize)
    assert found.source.endswith("1_Pooling/config.json")
    # settings given explicitly win over the files
    assert pooling_config(folder, "cls", None) == PoolingConfig("cls", normalize, source="settings")


def test_settings_and_defaults(tmp_path: Path) -> None:
    assert pooling_config(tmp_path) == PoolingConfig("last", True, source="settings")  # vLLM's defaults
    assert pooling_config(tmp_path, "mean", False) == PoolingConfig("mean", False, source="settings")


def test_refusals_by_name(tmp_path: Path) -> None:
    folder = _st_folder(tmp_path, {"pooling_mode_max_tokens": True}, False)
    with pytest.raises(ValueError, match="pooling mode pooling_mode_max_tokens is not supported"):
        pooling_config(folder)
    with pytest.raises(ValueError, match="embedding_pooling must be one of"):
        pooling_config(tmp_path, "weightedmean")
    with pytest.raises(ValueError, match="embedding_pooling must be one of 'last', 'mean', 'cls'"):
        EngineConfig(embedding_pooling="max")
    with pytest.raises(ValueError, match="embedding_normalize must be true or false"):
        EngineConfig(embedding_normalize="yes")  # type: ignore[arg-type]


def test_embedding_batches() -> None:
    # 8-token budget, 2 sequences, blocks of 4
    assert embedding_batches([3, 4, 20, 1, 1, 1], 8, 2, 4, 100) == [[0, 1], [2], [3, 4], [5]]
    assert embedding_batches([4, 4, 4], 100, 8, 4, 2) == [[0, 1], [2]]  # two free blocks a pass
    with pytest.raises(ValueError, match=r"input 1 \(9 tokens\) needs 3 KV blocks; 2 are free"):
        embedding_batches([1, 9], 100, 8, 4, 2)
    assert embedding_batches([], 8, 2, 4, 10) == []
