"""Checkpoint features: the ones the model code implements match transformers, the others are refused at
load with an error naming them (in-process and through a real tritonserver), never loaded silently wrong."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tritium.backend import LLM, SamplingParams
from tritium.backend.model_config import ModelConfig, ModelFolderError
from tritium.client.triton.repository import write_model

from support.checkpoints import save_tiny
from support.hf_reference import hf_greedy
from support.serving import http_generate, start_serve


def edit_config(folder: Path, **changes: Any) -> Path:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return folder


def edit_weights(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def copy_of(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


@pytest.mark.parametrize("overrides,message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "proportional"}}, "rope_scaling type 'proportional'"),
], ids=["hidden_act", "rope proportional"])
def test_unsupported_config_features_are_named(tmp_path: Path, default_model_path: Path, overrides: dict,
                                               message: str) -> None:
    path = save_tiny("llama", tmp_path / "m", default_model_path, **overrides)
    with pytest.raises(ModelFolderError, match=f"unsupported checkpoint feature.*{message}"):
        LLM(str(path))


@pytest.mark.parametrize("changes,message", [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, r"quantization_config \(gptq\)"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0"),
], ids=["quantized", "partial rotary", "softcapping"])
def test_unsupported_config_keys_are_named(tmp_path: Path, tiny_llama_path: Path, changes: dict, message: str) -> None:
    folder = edit_config(copy_of(tiny_llama_path, tmp_path / "m"), **changes)
    with pytest.raises(ModelFolderError, match=message):
        LLM(str(folder))


def test_tensors_the_model_would_ignore_are_refused(tmp_path: Path, tiny_llama_path: Path) -> None:
    def add_qk_norm(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)

    folder = edit_weights(copy_of(tiny_llama_path, tmp_path / "m"), add_qk_norm)
    with pytest.raises(ModelFolderError, match=r"does not use \(model\.layers\.0\.self_attn\.q_norm\.weight\)"):
        LLM(str(folder))


def test_biases_the_config_does_not_announce_are_refused(tmp_path: Path, default_model_path: Path) -> None:
    path = save_tiny("llama", tmp_path / "m", default_model_path, attention_bias=True)
    edit_config(path, attention_bias=False)
    with pytest.raises(ModelFolderError, match=r"does not use \(layers\.0\.qkv_proj\.bias"):
        LLM(str(path))


def _randomize_biases(tensors: dict[str, torch.Tensor]) -> None:
    gen = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(t.shape, generator=gen) * 0.5


def test_llama_attention_and_mlp_bias_match_transformers(make_llm: Callable[..., LLM], tmp_path: Path,
                                                         default_model_path: Path) -> None:
    path = save_tiny("llama", tmp_path / "m", default_model_path, attention_bias=True, mlp_bias=True)
    names = load_file(path / "model.safetensors").keys()
    assert {"model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.down_proj.bias"} <= set(names)
    edit_weights(path, _randomize_biases)  # transformers initializes biases to zero: they would prove nothing
    llm = make_llm(str(path), kv_cache_bytes=8 << 20)
    prompts = [llm.tokenizer.encode("Biases everywhere, in every projection " * 3), [5, 6, 7]]
    expected = hf_greedy(path, prompts, 12)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))] == expected


def test_a_sliding_window_attends_to_the_last_window_keys(make_llm: Callable[..., LLM], tmp_path: Path,
                                                          default_model_path: Path) -> None:
    """Mistral's window, for real: prompts and generations past it, chunked prefill included, token for token as
    transformers computes them; the context stays the model's own."""
    path = edit_config(save_tiny("mistral", tmp_path / "m", default_model_path), sliding_window=16)
    llm = make_llm(str(path), kv_cache_bytes=8 << 20, max_num_batched_tokens=24, max_num_seqs=4)
    assert llm.engine.max_model_len == ModelConfig.from_folder(path).max_position_embeddings > 16
    prompts = [llm.tokenizer.encode("A window slides over the keys of a long prompt " * 4), [5, 6, 7]]
    expected = hf_greedy(path, prompts, 24)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))] == expected


def test_triton_backend_refuses_a_head_size_its_kernels_cannot_run(make_llm: Callable[..., LLM], tmp_path: Path,
                                                                   default_model_path: Path) -> None:
    path = save_tiny("llama", tmp_path / "m", default_model_path, hidden_size=96)  # 4 heads of 24
    with pytest.raises(ModelFolderError, match="head_dim 24 is not supported by the triton attention backend"):
        LLM(str(path), kv_cache_bytes=8 << 20, attention_backend="triton")
    llm = make_llm(str(path), kv_cache_bytes=8 << 20, attention_backend="torch")  # the torch one runs it
    prompt = [llm.tokenizer.encode("Twenty-four is not a power of two")]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))
    assert [o.token_ids for o in out] == hf_greedy(path, prompt, 8)


@pytest.mark.slow
def test_server_refuses_a_bad_model_with_the_reason_and_serves_the_others(tmp_path: Path, tiny_llama_path: Path,
                                                                          default_model_path: Path) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    bad_checkpoint = save_tiny("llama", tmp_path / "gelu", default_model_path, hidden_act="gelu")
    repo = tmp_path / "repo"
    versions = {"tritium": {"model": str(tiny_llama_path), "kv_cache_bytes": 16 << 20},
                "tritium_gelu": {"model": str(bad_checkpoint), "kv_cache_bytes": 16 << 20},
                "tritium_small_kv": {"model": str(tiny_llama_path), "kv_cache_bytes": 10 * 2 * 3 * 2 * 16 * 4 * 16}}
    for name, settings in versions.items():
        write_model(repo, settings, name=name)
    served = start_serve(f"--model-repository={repo}", "--model-control=explicit", "--load-model=tritium")
    try:
        client = httpclient.InferenceServerClient(served.http.removeprefix("http://"))
        with pytest.raises(InferenceServerException, match="hidden_act 'gelu'"):
            client.load_model("tritium_gelu")
        with pytest.raises(InferenceServerException, match="max_model_len 1024 tokens = 64 blocks"):
            client.load_model("tritium_small_kv")
        assert not client.is_model_ready("tritium_gelu") and not client.is_model_ready("tritium_small_kv")
        assert client.is_model_ready("tritium")
        resp = http_generate(served.http, {"text_input": "Hello", "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["text_output"].startswith("Hello"), resp.text
    finally:
        served.stop()
