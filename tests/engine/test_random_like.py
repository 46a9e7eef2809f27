"""`write_random_like`: a random-weights checkpoint with a source's config and tokenizer and the shapes asked,
which transformers and tritium's loader read as the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tritium.backend.models.random_checkpoint import LLAMA_8B_LIKE, write_random_like


@pytest.fixture
def source(tmp_path: Path) -> Path:
    folder = tmp_path / "source"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 30, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
              "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "generation_config.json").write_text("{}")
    return folder


def shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def test_the_shape_asked_with_the_source_config_and_tokenizer(tmp_path: Path, source: Path) -> None:
    wide = {**LLAMA_8B_LIKE, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
    dest = write_random_like(tmp_path / "wide", source, dtype=torch.bfloat16, **wide)
    config = json.loads((dest / "config.json").read_text())
    assert {k: config[k] for k in wide} == wide
    assert config["rope_theta"] == 100000.0 and config["vocab_size"] == 96 and config["torch_dtype"] == "bfloat16"
    assert config["num_attention_heads"] // config["num_key_value_heads"] == 4 and config["head_dim"] == 128
    got = shapes(dest)
    assert got["model.layers.1.self_attn.q_proj.weight"] == (32 * 128, 256)
    assert got["model.layers.1.self_attn.k_proj.weight"] == (8 * 128, 256)
    assert got["model.layers.0.mlp.down_proj.weight"] == (256, 512)
    assert got["model.embed_tokens.weight"] == (96, 256) and "lm_head.weight" not in got  # tied, as the source
    assert "model.layers.2.mlp.up_proj.weight" not in got
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                      "tokenizer.json"]
    with safe_open(str(dest / "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert q.dtype == torch.bfloat16 and 0.8 < float(q.float().std()) * 256**0.5 < 1.2  # std 1/sqrt(fan-in)


def test_transformers_reads_the_source_shape(tmp_path: Path, source: Path) -> None:
    from transformers import AutoModelForCausalLM

    dest = write_random_like(tmp_path / "same", source, dtype=torch.float32, num_hidden_layers=2,
                             tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(dest)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_an_unknown_field_is_refused(tmp_path: Path, source: Path) -> None:
    with pytest.raises(ValueError, match="not a shape field"):
        write_random_like(tmp_path / "x", source, vocab_size=10)
