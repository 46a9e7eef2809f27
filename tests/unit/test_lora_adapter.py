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
    ({"layer_replication": [[0, 2]]}, "layer_replication is not supported"),
    ({"alora_invocation_tokens": [5]}, "alora_invocation_tokens (activated LoRA) is not supported"),
    ({"target_modules": "lm_head"}, "target_modules 'lm_head' matches none of this model's modules"),
    ({"target_modules": "(q_proj"}, "target_modules '(q_proj' is not a valid regular expression"),
    ({"target_modules": ".*q_proj", "layers_to_transform": 0}, "cannot be used with a target_modules string"),
    ({"layers_pattern": "layers"}, "layers_pattern needs layers_to_transform"),
    ({"layers_to_transform": 0, "layers_pattern": "h"}, "layers_pattern 'h' matches no layer list of this model"),
    ({"layers_to_transform": [0, 2]}, "layers_to_transform names layer(s) 2; the model has 2 layers"),
    ({"layers_to_transform": "0"}, "layers_to_transform must be an integer or a list of integers"),
    ({"exclude_modules": ["self_attn.q_proj"]}, "the config leaves out every module of this model"),
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


def test_a_config_without_lora_alpha_takes_the_peft_default_of_8(tmp_path: Path) -> None:
    for rank, rslora in ((4, False), (16, True)):
        folder = write_adapter(tmp_path / f"r{rank}", CONFIG, rank, ("q_proj",), seed=0, use_rslora=rslora)
        config = json.loads((folder / "adapter_config.json").read_text())
        del config["lora_alpha"]
        (folder / "adapter_config.json").write_text(json.dumps(config))
        assert load(folder).scaling == 2.0  # 8 / 4, and 8 / sqrt(16) with rslora: not the rank over itself


QV = {(layer, m) for layer in (0, 1) for m in ("q_proj", "v_proj")}
LAYER_1 = {(1, "q_proj"), (1, "v_proj")}


@pytest.mark.parametrize(("change", "chosen", "reason"), [
    ({"layers_to_transform": 0}, {(0, "q_proj"), (0, "v_proj")}, "not in layers_to_transform (0)"),
    ({"layers_to_transform": [1]}, LAYER_1, "not in layers_to_transform ([1])"),
    ({"layers_to_transform": 1, "layers_pattern": ["h", "layers"]}, LAYER_1, "not in layers_to_transform (1)"),
    ({"layers_to_transform": [0, 1], "layers_pattern": "model.layers"}, QV, ""),
    ({"target_modules": None, "layers_to_transform": 1}, LAYER_1, "not in layers_to_transform (1)"),
    ({"layers_to_transform": []}, QV, ""),  # PEFT: an empty list leaves no layer out
    ({"target_modules": ["self_attn.q_proj", "model.layers.1.self_attn.v_proj"]}, QV - {(0, "v_proj")},
     "not in target_modules"),
    ({"exclude_modules": ["model.layers.0.self_attn.v_proj"]}, QV - {(0, "v_proj")}, "in exclude_modules"),
    ({"target_modules": r"model\.layers\.\d+\.self_attn\.[qv]_proj"}, QV, ""),
    ({"target_modules": r".*\.1\.self_attn\.(q|v)_proj"}, LAYER_1, "not matched by target_modules"),
    ({"target_modules": "all-linear", "exclude_modules": r".*\.0\..*"}, LAYER_1, "in exclude_modules"),
])
def test_target_modules_and_layers_choose_modules_as_in_peft(tmp_path: Path, change: dict[str, object],
                                                             chosen: set[tuple[int, str]], reason: str) -> None:
    """Weights for exactly the chosen modules load; a tensor for a module the config leaves out is refused,
    saying that it is in the weights and why the config leaves its module out."""
    folder = write_adapter(tmp_path / "a", CONFIG, 8, ("q_proj", "v_proj"), seed=0)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    path = folder / "adapter_model.safetensors"
    every = load_file(str(path))
    save_file({key(layer, m, ab): every[key(layer, m, ab)] for layer, m in chosen for ab in "AB"}, str(path))
    assert set(load(folder).weights) == chosen
    if chosen == QV:
        return
    save_file(every, str(path))
    refused = f"is present in the weights but its module .* is {re.escape(reason)}$"
    with pytest.raises(LoraAdapterError, match=refused) as error:
        load(folder)
    named = re.search(r"its module model\.layers\.(\d)\.self_attn\.(\w+) is", str(error.value))
    assert named is not None and (int(named[1]), named[2]) not in chosen
