"""Model folders: conversion of the embedded default, loading variants, and clear errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tritium.backend import LLM, SamplingParams
from tritium.backend.model_config import ModelFolderError
from tritium.backend.models import gguf_convert, registry
from tritium.backend.models.loader import load_model

from support.checkpoints import save_tiny
from support.hf_reference import hf_greedy


def test_default_model_folder_is_a_complete_hf_folder(default_model_path: Path) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (default_model_path / name).is_file(), name
    config = json.loads((default_model_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    assert config["tie_word_embeddings"] is True
    assert "<|im_start|>" in json.loads((default_model_path / "tokenizer_config.json").read_text())["chat_template"]


def test_tokenizer_matches_transformers(default_model_path: Path) -> None:
    from transformers import AutoTokenizer

    from tritium.backend.tokenizer import Tokenizer

    theirs = AutoTokenizer.from_pretrained(default_model_path)
    ours = Tokenizer(default_model_path)
    for text in ["Hello world 12345", "  spaces\n\n\ttabs ünïcödé 日本語", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == theirs(text)["input_ids"]
    messages = [{"role": "user", "content": "Hi!"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                             add_generation_prompt=True)


def test_interrupted_conversion_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "convert_weights", explode)
    dest = tmp_path / "models" / "m"
    with pytest.raises(KeyboardInterrupt):
        gguf_convert.convert_gguf(registry.find_default_gguf(), dest, progress=False)
    assert not dest.exists()
    assert list((tmp_path / "models").iterdir()) == []  # the temporary folder went too


def test_models_command_lists_the_default_and_local_folders(tmp_path: Path, default_model_path: Path) -> None:
    (tmp_path / "models" / "my-finetune").mkdir(parents=True)
    shutil.copy(default_model_path / "config.json", tmp_path / "models" / "my-finetune" / "config.json")
    env = {"TRITIUM_CACHE": str(tmp_path), "PATH": str(Path(sys.executable).parent)}
    out = subprocess.run([sys.executable, "-m", "tritium.client.cli", "models"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "SmolLM2-135M-Instruct" in out and "not converted yet" in out
    assert str(tmp_path / "models" / "my-finetune") in out
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in out


@pytest.mark.slow  # a CLI subprocess loading the default model
def test_generate_command_streams_an_answer() -> None:
    cmd = [sys.executable, "-m", "tritium.client.cli", "generate", "--local", "--chat", "--temperature", "0",
           "--max-tokens", "12", "What is the capital of France?"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "Paris" in out


def test_missing_files_and_unsupported_architecture_are_named(tmp_path: Path, tiny_llama_path: Path) -> None:
    with pytest.raises(ModelFolderError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama_path, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelFolderError, match=r"no model\.safetensors"):
        LLM(str(folder))
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelFolderError, match=r"no tokenizer\.json"):
        LLM(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(folder, dtype=None, device=None)  # type: ignore[arg-type]
    (folder / "config.json").unlink()
    with pytest.raises(ModelFolderError, match=r"no config\.json"):
        load_model(folder, dtype=None, device=None)  # type: ignore[arg-type]


def test_missing_shard_is_named(tmp_path: Path, tiny_llama_sharded_path: Path) -> None:
    folder = tmp_path / "sharded"
    shutil.copytree(tiny_llama_sharded_path, folder)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelFolderError, match=f"missing weight shard {shard.name}"):
        LLM(str(folder))


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"num_key_value_heads": 1, "head_dim": 32}),
    ("mistral", {}),
])
def test_config_variants_match_transformers(make_llm: Callable[..., LLM], tmp_path: Path, default_model_path: Path,
                                            kind: str, overrides: dict) -> None:
    path = save_tiny(kind, tmp_path / "variant", default_model_path, **overrides)
    llm = make_llm(str(path), kv_cache_bytes=8 << 20)
    prompts = [llm.tokenizer.encode("A fairly long prompt about rotary embeddings " * 6), [5, 6, 7]]
    expected = hf_greedy(path, prompts, 16)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))] == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_weights_are_packed_and_give_the_same_logits(dtype: torch.dtype, tiny_llama_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 and (where oneDNN has bf16) bf16 projections are packed once at load; logits match F.linear's."""
    from tritium.backend.layers.linear import CpuPackedLinear, cpu_packing_available
    from tritium.backend.models import loader
    from tritium.client.bench.accuracy import sequence_logits

    if not cpu_packing_available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    cpu = torch.device("cpu")
    packed = load_model(tiny_llama_path, dtype, cpu, max_positions=64)
    assert isinstance(packed.layers[0].qkv_proj, CpuPackedLinear)
    assert isinstance(packed.packed_lm_head, CpuPackedLinear)
    monkeypatch.setattr(loader, "cpu_packing_available", lambda dtype: False)
    plain = load_model(tiny_llama_path, dtype, cpu, max_positions=64)
    assert isinstance(plain.layers[0].qkv_proj, torch.nn.Linear)
    ids = list(range(100, 140))
    got, want = sequence_logits(packed, ids), sequence_logits(plain, ids)
    assert got.dtype == want.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=tol)
    assert bool((got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9)


def test_fp16_is_never_packed_on_cpu() -> None:
    from tritium.backend.layers.linear import cpu_packing_available

    assert not cpu_packing_available(torch.float16)
