"""Qwen3 and Phi-3 / Phi-4 on the Llama module, and the length-dependent rotary scalings, on tiny random checkpoints
written by transformers: greedy fp32 tokens as transformers' generate gives them, for a batch of prompts on both sides
of a sliding window or of the original context (chunked prefill, prefix-cache hits, preemption), their configs read
as transformers reads them, and what they ask for that is not implemented refused by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tritium.backend import LLM, SamplingParams
from tritium.backend.model_config import ModelConfig, ModelFolderError
from tritium.backend.models.llama import Phi3ForCausalLM, Qwen3ForCausalLM
from tritium.backend.models.loader import load_model

from support.checkpoints import save_tiny
from support.hf_reference import hf_greedy

ORIGINAL = 32  # the original context of the longrope and dynamic checkpoints
WINDOW = 8  # the sliding Qwen3's window
# 1, 14, 23 and 44 tokens: generating 20, the first two stay within ORIGINAL, the third crosses it while decoding,
# the last starts past it; all but the first are longer than WINDOW.
TEXTS = ["Hi", "The quick brown fox jumps over the lazy dog while the cat sleeps",
         "Once upon a time in a land far away, there lived a king who had three daughters and a dog named Rex",
         "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\nprint(add(2, 3), mul(4, 5))"]
GREEDY = SamplingParams(temperature=0, max_tokens=20)
CPU = torch.device("cpu")


def longrope(pairs: int) -> dict[str, Any]:
    """Phi-3's rope settings, old shape, factors far apart."""
    return {"type": "longrope", "short_factor": [1.0 + i / pairs for i in range(pairs)],
            "long_factor": [1.0 + 4 * i for i in range(pairs)]}


# name -> (save_tiny kind, overrides)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {}),
    "qwen3-sliding": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3-yarn": ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": ORIGINAL}, "attention_bias": True}),
    "phi3": ("phi3", {"sliding_window": WINDOW}),
    # Phi-4-mini's shape: head_dim 128, three quarters of it rotating (48 pairs), longrope, tied embeddings
    "phi4-mini": ("phi3", {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
                           "partial_rotary_factor": 0.75, "original_max_position_embeddings": ORIGINAL,
                           "rope_scaling": longrope(48), "tie_word_embeddings": True}),
    "llama-dynamic": ("llama", {"max_position_embeddings": ORIGINAL,
                                "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> dict[str, Path]:
    """Every checkpoint above, written once for the module."""
    return {name: save_tiny(kind, tmp_path_factory.mktemp(name), default_model_path, **overrides)
            for name, (kind, overrides) in CHECKPOINTS.items()}


def prompts_of(llm: LLM) -> list[list[int]]:
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    assert [len(p) for p in prompts] == [1, 14, 23, 44]
    return prompts


def fresh_hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """hf_greedy with a model loaded for each prompt: transformers' dynamic rotary keeps the longest length it
    saw, so one sequence's tokens would depend on the sequences before it."""
    from transformers import AutoModelForCausalLM

    out = []
    for prompt in prompts:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, temperature=None, top_p=None, top_k=None)
        out.append(tokens[0, len(prompt):].tolist())
    return out


def test_configs_read_as_transformers_reads_them(checkpoints: dict[str, Path]) -> None:
    configs = {name: ModelConfig.from_folder(path) for name, path in checkpoints.items()}
    qwen3 = configs["qwen3"]
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.attention_bias, qwen3.layer_types) == (True, 32, False, ())
    assert qwen3.head_dim * qwen3.num_attention_heads != qwen3.hidden_size
    assert configs["qwen3-sliding"].layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert configs["qwen3-sliding"].sliding_window == WINDOW
    yarn = configs["qwen3-yarn"]
    assert (yarn.attention_bias, yarn.o_proj_bias, yarn.max_position_embeddings) == (True, True, 1024)
    assert configs["phi3"].layer_types == ("sliding_attention",) * 3 and not configs["phi3"].qk_norm
    phi4 = configs["phi4-mini"]
    assert (phi4.head_dim, phi4.partial_rotary_factor, phi4.tie_word_embeddings) == (128, 0.75, True)
    assert phi4.rope_scaling is not None
    assert (phi4.rope_scaling["rope_type"], phi4.rope_scaling["original_max_position_embeddings"],
            phi4.rope_scaling["factor"]) == ("longrope", ORIGINAL, 1024 / ORIGINAL)
    assert configs["llama-dynamic"].max_position_embeddings == 2 * ORIGINAL  # dynamic NTK's reach
    assert isinstance(load_model(checkpoints["qwen3"], torch.float32, CPU, max_positions=64), Qwen3ForCausalLM)
    phi4_model = load_model(checkpoints["phi4-mini"], torch.float32, CPU, max_positions=64)
    assert isinstance(phi4_model, Phi3ForCausalLM) and phi4_model.rotary.cos_sin_cache.shape[1] == 96


@pytest.mark.batch_invariant
@pytest.mark.parametrize("name", ["qwen3", "qwen3-sliding", "qwen3-yarn"])
def test_qwen3_greedy_tokens_match_transformers_chunked_and_from_the_prefix_cache(
        name: str, checkpoints: dict[str, Path], make_llm: Callable[..., LLM]) -> None:
    path = checkpoints[name]
    llm = make_llm(str(path), kv_cache_bytes=4 << 20, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = prompts_of(llm)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    again = llm.generate([prompts[-1]], GREEDY)[0]  # its full prompt blocks are cached now
    assert again.num_cached_tokens > 0 and again.token_ids == expected[-1]


@pytest.mark.batch_invariant
@pytest.mark.parametrize("name", ["phi3", "phi4-mini"])
def test_phi3_greedy_tokens_match_transformers_chunked_and_from_the_prefix_cache(
        name: str, checkpoints: dict[str, Path], make_llm: Callable[..., LLM]) -> None:
    """phi4-mini: longrope's short factors while a sequence is within the original context, the long ones for every
    token of the fourth prompt, and for every token of the second and third once they grow past it (recomputed, as
    transformers' Phi-3 recomputes its cache there); a prefix hit reuses keys of the same factors only."""
    path = checkpoints[name]
    llm = make_llm(str(path), kv_cache_bytes=4 << 20, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = prompts_of(llm)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.scheduler.num_recomputes == (2 if name == "phi4-mini" else 0)  # 14 + 20 and 23 + 20 > 32
    again = llm.generate([prompts[-1]], GREEDY)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == expected[-1]
    head = prompts[-1][:20]  # within the original context: the long prompt's cached first block is not its own
    short = llm.generate([head], SamplingParams(temperature=0, max_tokens=4))[0]
    assert short.token_ids == hf_greedy(path, [head], 4)[0]
    assert short.num_cached_tokens == (0 if name == "phi4-mini" else 16)


@pytest.mark.batch_invariant
@pytest.mark.parametrize("name", ["qwen3-sliding", "phi4-mini", "llama-dynamic"])
def test_greedy_tokens_match_transformers_under_preemption(name: str, checkpoints: dict[str, Path],
                                                           make_llm: Callable[..., LLM]) -> None:
    """A cache of 5 blocks of 16 for four sequences needing 1 + 2 + 3 + 4 blocks: preempted ones recompute their
    prompt and tokens with the rotary rows they had."""
    path = checkpoints[name]
    blocks = 5
    per_block = ModelConfig.from_folder(path).kv_bytes_per_block(16, torch.float32)
    llm = make_llm(str(path), kv_cache_bytes=blocks * per_block, max_model_len=64, max_num_seqs=4)
    assert llm.engine.block_manager.num_blocks == blocks
    prompts = prompts_of(llm)
    params = SamplingParams(temperature=0, max_tokens=16)
    reference = fresh_hf_greedy if name == "llama-dynamic" else hf_greedy
    expected = reference(path, prompts, params.max_tokens)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.batch_invariant
def test_dynamic_ntk_greedy_tokens_match_transformers(checkpoints: dict[str, Path],
                                                      make_llm: Callable[..., LLM]) -> None:
    """Past the original context the frequencies follow each sequence's length: a prompt longer than it rotates for
    its length (rows the step computes, over chunks), each later token for its p + 1 tokens."""
    path = checkpoints["llama-dynamic"]
    llm = make_llm(str(path), kv_cache_bytes=4 << 20, max_num_seqs=4, max_num_batched_tokens=16)
    assert llm.engine.max_model_len == 2 * ORIGINAL
    prompts = prompts_of(llm)
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = fresh_hf_greedy(path, prompts, params.max_tokens)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    again = llm.generate([prompts[-1]], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == expected[-1]


def edited(folder: Path, dest: Path, **changes: Any) -> Path:
    shutil.copytree(folder, dest)
    path = dest / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text(encoding="utf-8")) | changes), encoding="utf-8")
    return dest


@pytest.mark.parametrize("name,changes,message", [
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ("qwen3", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 10000.0}},
     "rope_scaling type 'proportional'"),
    ("phi3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     r"rope_scaling type 'linear' \(supported: default, longrope\)"),
], ids=["qwen3 activation", "qwen3 partial rotary", "qwen3 rope type", "phi3 rope type"])
def test_what_qwen3_and_phi3_configs_ask_for_unimplemented_is_refused(
        name: str, changes: dict[str, Any], message: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = edited(checkpoints[name], tmp_path / "m", **changes)
    with pytest.raises(ModelFolderError, match=f"unsupported checkpoint feature.*{message}"):
        LLM(str(folder))


def test_qwen3_without_its_qk_norm_weights_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(checkpoints["qwen3"], folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFolderError, match=r"weights missing for layers\.1\.k_norm\.weight"):
        LLM(str(folder))


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("name", ["qwen3-sliding", "phi4-mini"])
def test_triton_backend_matches_transformers(name: str, checkpoints: dict[str, Path],
                                             make_llm: Callable[..., LLM]) -> None:
    """Through the Triton kernels (interpreter on a CPU): q/k norms and a window (Qwen3), rotary over 96 of 128
    features and longrope's recompute (Phi-4-mini); chunked prefills, decodes, a prefix hit."""
    path = checkpoints[name]
    llm = make_llm(str(path), attention_backend="triton", kv_cache_bytes=4 << 20, max_model_len=128,
                   max_num_seqs=4, max_num_batched_tokens=16)
    assert llm.engine.worker_info.attention_backend == "triton"
    prompts = prompts_of(llm)[1:]
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = hf_greedy(path, prompts, 12)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    again = llm.generate([prompts[-1]], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == expected[-1]
