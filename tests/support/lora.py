"""PEFT LoRA adapters for the tiny checkpoints (random, non-trivial: B is not zero), and the same adapter merged
into a copy of the checkpoint (W += scaling * B @ A) for transformers to serve as the reference."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from tritium.backend.model_config import ModelConfig
from tritium.client.bench.lora import peft_key, write_random_adapter

# A model small enough to build by hand (unit tests): 2 layers, hidden 16, 4 heads of 4 (2 KV heads).
SMALL_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False)


def key(layer: int, module: str, which: str) -> str:
    """The PEFT name of a LoRA weight (`which`: "A" or "B")."""
    return peft_key(layer, module, which)


def write_adapter(dest: Path, cfg: ModelConfig, rank: int, targets: tuple[str, ...], seed: int, alpha: float = 16.0,
                  use_rslora: bool = False, std: float = 0.15, **config: object) -> Path:
    """A PEFT adapter folder for a model of `cfg`: random A and B (normal, `std`) for `targets` in every layer;
    extra `config` entries go into adapter_config.json as they are (the package's writer, which `tritium bench
    lora` uses too). Returns `dest`."""
    return write_random_adapter(dest, cfg, rank, targets, seed, alpha, use_rslora, std, **config)


def merge_adapter(model: Path, adapter: Path, dest: Path) -> Path:
    """A copy of the single-file checkpoint `model` with `adapter` merged into its weights in fp32. Returns `dest`."""
    shutil.copytree(model, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(str(model / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    rank = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    for name, a in lora.items():
        if ".lora_A." not in name:
            continue
        b = lora[name.replace(".lora_A.", ".lora_B.")]
        target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        w = weights[target]
        weights[target] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest
