"""PEFT adapters: what loads (scaling, rslora, content hash) and what is refused, with a message naming why."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tritium.backend.lora.adapter import LoraAdapter, LoraAdapterError, load_adapter

from support.lora import SMALL_CONFIG as CONFIG
from support.lora import key, write_adapter


def load(folder: Path, max_rank: int = 16) -> LoraAdapter:
    return load_adapter("a", folder, CONFIG, max_rank, torch.float32)


def test_loads_weights_scaling_and_hash(tmp_path: Path) -> None:
    adapter = load(write_adapter(tmp_path / "a", CONFIG, 8, ("q_proj", "down_proj"), seed=0, alpha=16))
    assert adapter.rank == 8 and adapter.scaling == 2.0
    assert set(adapter.weights) == {(layer, m) for layer in range(2) for m in ("q_proj", "down_proj")}
    a, b = adapter.weights[(1, "down_proj")]
    assert a.shape == (8, 32) and b.shape == (16, 8)
    rs = load(write_adapter(tmp_path / "rs", CONFIG, 16, ("v_proj",), seed=0, alpha=8, use_rslora=True))
    assert rs.scaling == 2.0  # 8 / sqrt(16)
    same = load(write_adapter(tmp_path / "same", CONFIG, 8, ("q_proj", "down_proj"), seed=0, alpha=16))
    other = load(write_adapter(tmp_path / "other", CONFIG, 8, ("q_proj", "down_proj"), seed=1, alpha=16))
    assert same.content_hash == adapter.content_hash != other.content_hash
    rescaled = load(write_adapter(tmp_path / "alpha", CONFIG, 8, ("q_proj", "down_proj"), seed=0, alpha=32))
    assert rescaled.content_hash != adapter.content_hash


@pytest.mark.parametrize(("change", "message"), [
    ({"r": 32}, "rank 32 exceeds max_lora_rank 16"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "unknown target module(s) embed_tokens"),
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias 'all' is not supported"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"r": 0}, "r must be an integer >= 1"),
])
def test_bad_configs_are_refused_naming_the_problem(tmp_path: Path, change: dict[str, object], message: str) -> None:
    folder = write_adapter(tmp_path / "a", CONFIG, 8, ("q_proj",), seed=0)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(LoraAdapterError, match=re.escape(message)):
        load(folder)


def test_bad_weights_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", CONFIG, 8, ("k_proj",), seed=0)
    path = folder / "adapter_model.safetensors"
    good = load_file(str(path))
    name = key(0, "k_proj", "B")
    save_file({**good, name: torch.zeros(16, 8)}, str(path))  # k_proj's output is 2 heads x 4 = 8, not 16
    with pytest.raises(LoraAdapterError, match=rf"{name} has shape \[16, 8\]; this model and rank 8 need \[8, 8\]"):
        load(folder)
    save_file({k: v for k, v in good.items() if k != name}, str(path))
    with pytest.raises(LoraAdapterError, match="layer 0 k_proj has no lora_B weight"):
        load(folder)
    save_file({**good, key(5, "k_proj", "A"): good[key(0, "k_proj", "A")].clone()}, str(path))
    with pytest.raises(LoraAdapterError, match="names layer 5; the model has 2 layers"):
        load(folder)
    save_file({**good, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 16)}, str(path))
    with pytest.raises(LoraAdapterError, match=re.escape("lm_head.lora_A.weight is not a LoRA weight")):
        load(folder)
    broken = good[name].clone()
    broken[3, 1] = float("nan")  # 0 * NaN in a batch's padding would reach other requests' rows
    save_file({**good, name: broken}, str(path))
    with pytest.raises(LoraAdapterError, match=rf"{re.escape(name)} holds NaN or infinite values"):
        load(folder)
    path.unlink()
    with pytest.raises(LoraAdapterError, match=re.escape("no adapter_model.safetensors")):
        load(folder)
    with pytest.raises(LoraAdapterError, match="is not a folder"):
        load(tmp_path / "missing")
