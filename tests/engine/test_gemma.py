"""Gemma 2 and Gemma 3 (text) on tiny random checkpoints written by transformers: logits and greedy tokens as
transformers computes them (sliding windows shorter than the prompts, chunked prefill, prefix hits, preemption),
their configs read as transformers reads them, what they ask for that is not implemented refused by name,
quantization and LoRA on their projections, and the Triton kernels (interpreter) for the sliding-window,
soft-capping and head_dim-256 cases."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tritium.backend import LLM, SamplingParams
from tritium.backend.layers.int4_linear import Int4Linear
from tritium.backend.layers.int8_linear import Int8Linear
from tritium.backend.model_config import ModelConfig, ModelFolderError
from tritium.backend.models.base import PROJECTIONS
from tritium.backend.models.gemma import GemmaForCausalLM
from tritium.backend.models.loader import load_model
from tritium.client.bench.accuracy import sequence_logits

from support.checkpoints import GEMMA_TINY, save_tiny
from support.hf_reference import hf_greedy
from support.lora import merge_adapter, write_adapter
from support.quantization import write_quantized_reference

KINDS = ("gemma2", "gemma3")
WINDOW = GEMMA_TINY["sliding_window"]
# Prompts of 1 to ~40 tokens: all but the first longer than the window, the longest five windows.
TEXTS = ["Hi", "The quick brown fox jumps over the lazy dog while the cat sleeps",
         "Once upon a time in a land far away, there lived a king who had three daughters and a dog named Rex",
         "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\nprint(add(2, 3), mul(4, 5))"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
CPU = torch.device("cpu")


def small_caps() -> dict[str, Any]:
    """Gemma 2 caps that bite on tiny weights (its own 50 and 30 would never be reached)."""
    return {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}


def own_ropes() -> dict[str, Any]:
    """Gemma 3 rope parameters, 5.x shape: a linear scaling on the full layers, a base of their own for the sliding."""
    return {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return save_tiny("gemma2", tmp_path_factory.mktemp("tiny-gemma2"), default_model_path, **small_caps())


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return save_tiny("gemma3", tmp_path_factory.mktemp("tiny-gemma3"), default_model_path, **own_ropes())


def tiny(request: pytest.FixtureRequest, kind: str) -> Path:
    path: Path = request.getfixturevalue(f"tiny_{kind}")
    return path


def prompts_of(llm: LLM) -> list[list[int]]:
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    assert len(prompts[0]) < WINDOW < len(prompts[1]) and max(map(len, prompts)) > 4 * WINDOW
    return prompts


def edit_config(folder: Path, dest: Path, drop: tuple[str, ...] = (), **changes: object) -> Path:
    """A copy of `folder` with config.json's `drop` keys removed and `changes` set."""
    shutil.copytree(folder, dest)
    path = dest / "config.json"
    config = {k: v for k, v in json.loads(path.read_text(encoding="utf-8")).items() if k not in drop}
    path.write_text(json.dumps(config | changes), encoding="utf-8")
    return dest


def test_tiny_checkpoints_have_what_the_tests_rely_on(tiny_gemma2: Path, tiny_gemma3: Path) -> None:
    g2, g3 = ModelConfig.from_folder(tiny_gemma2), ModelConfig.from_folder(tiny_gemma3)
    for config in (g2, g3):
        assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
        assert config.sliding_window == WINDOW and config.hidden_act == "gelu_pytorch_tanh"
        assert config.head_dim * config.num_attention_heads != config.hidden_size  # q_size is not hidden
        assert config.query_pre_attn_scalar != config.head_dim and config.tie_word_embeddings
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.qk_norm, g2.local_rope_theta) == \
        (2.0, 3.0, False, None)
    assert (g3.attn_logit_softcapping, g3.final_logit_softcapping, g3.qk_norm) == (None, None, True)
    assert (g3.rope_theta, g3.local_rope_theta, g3.rope_scaling, g3.local_rope_scaling) == \
        (10000.0, 100.0, {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, None)
    model = load_model(tiny_gemma3, torch.float32, CPU, max_positions=64)
    assert isinstance(model, GemmaForCausalLM) and len(model.rotaries()) == 2
    assert [layer.rotary is model.local_rotary for layer in model.layers] == [True, False, True]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind: str, request: pytest.FixtureRequest) -> None:
    """One 48-token prefill (six windows): every position's fp32 logits, soft-capped ones included."""
    from transformers import AutoModelForCausalLM

    path = tiny(request, kind)
    ids = list(range(100, 148))
    ours = sequence_logits(load_model(path, torch.float32, CPU, max_positions=64), ids)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = theirs(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    if kind == "gemma2":
        assert float(want.abs().max()) < 3.0  # the final cap of 3 applied


@pytest.mark.batch_invariant
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers_chunked_and_from_the_prefix_cache(
        kind: str, request: pytest.FixtureRequest, make_llm: Callable[..., LLM]) -> None:
    path = tiny(request, kind)
    llm = make_llm(str(path), kv_cache_bytes=4 << 20, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = prompts_of(llm)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    again = llm.generate([prompts[-1]], GREEDY)[0]  # its full prompt blocks are cached now
    assert again.num_cached_tokens > 0 and again.token_ids == expected[-1]


@pytest.mark.batch_invariant
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers_under_preemption(kind: str, request: pytest.FixtureRequest,
                                                           make_llm: Callable[..., LLM]) -> None:
    path = tiny(request, kind)
    blocks = 5  # the longest request needs 4 blocks of 16 (its last token stores no KV), the four together 10
    per_block = ModelConfig.from_folder(path).kv_bytes_per_block(16, torch.float32)
    llm = make_llm(str(path), kv_cache_bytes=blocks * per_block, max_model_len=64, max_num_seqs=4)
    assert llm.engine.block_manager.num_blocks == blocks
    prompts = prompts_of(llm)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.scheduler.num_preemptions > 0


def gemma3_old_shape() -> dict[str, Any]:
    """own_ropes() as configs before transformers 5 said it: no layer_types, no rope_parameters."""
    return {"sliding_window_pattern": 2, "rope_theta": 10000.0, "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}


CONFIG_SHAPES: dict[str, tuple[str, tuple[str, ...], dict[str, Any]]] = {
    "gemma3-older-keys": ("gemma3", ("layer_types", "rope_parameters", "_sliding_window_pattern"),
                          gemma3_old_shape()),
    "gemma3-default-pattern": ("gemma3", ("layer_types", "sliding_window_pattern", "_sliding_window_pattern"),
                               {"num_hidden_layers": 13}),
    "gemma3-legacy-scaling-type": ("gemma3", ("layer_types", "rope_parameters"),
                                   {"rope_scaling": {"type": "linear", "factor": 4.0}}),
    "gemma2-defaults": ("gemma2", ("layer_types", "attn_logit_softcapping", "final_logit_softcapping", "head_dim",
                                   "query_pre_attn_scalar", "tie_word_embeddings", "sliding_window",
                                   "max_position_embeddings"), {}),
}


@pytest.mark.parametrize("shape", list(CONFIG_SHAPES))
def test_configs_read_as_transformers_reads_them(shape: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Layer types, windows, rope bases and scalings, scales and caps, from configs that leave them to
    transformers' defaults or say them the older way."""
    from transformers import AutoConfig

    kind, drop, changes = CONFIG_SHAPES[shape]
    folder = edit_config(tiny(request, kind), tmp_path / "m", drop, **changes)
    ours, theirs = ModelConfig.from_folder(folder), AutoConfig.from_pretrained(folder)
    assert ours.layer_types == tuple(theirs.layer_types) and ours.sliding_window == theirs.sliding_window
    assert "full_attention" in ours.layer_types and "sliding_attention" in ours.layer_types
    assert (ours.head_dim, ours.query_pre_attn_scalar, ours.tie_word_embeddings, ours.max_position_embeddings) == \
        (theirs.head_dim, theirs.query_pre_attn_scalar, theirs.tie_word_embeddings, theirs.max_position_embeddings)
    assert (ours.attn_logit_softcapping, ours.final_logit_softcapping) == \
        ((theirs.attn_logit_softcapping if kind == "gemma2" else None), theirs.final_logit_softcapping)
    ropes = theirs.rope_parameters
    if kind == "gemma3":
        full, local = ropes["full_attention"], ropes["sliding_attention"]
        assert (ours.rope_theta, ours.local_rope_theta) == (full["rope_theta"], local["rope_theta"])
        assert ours.local_rope_scaling is None and local["rope_type"] == "default"
        if full["rope_type"] == "default":
            assert ours.rope_scaling is None
        else:
            assert ours.rope_scaling is not None and ours.rope_scaling["factor"] == full["factor"]
    else:
        assert (ours.rope_theta, ours.rope_scaling, ours.local_rope_theta) == (ropes["rope_theta"], None, None)
    if shape == "gemma3-older-keys":
        assert ours == ModelConfig.from_folder(tiny(request, kind))


REFUSALS: dict[str, tuple[str, dict[str, Any], str]] = {
    "bidirectional": ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention true"),
    "activation": ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    "attention-bias": ("gemma2", {"attention_bias": True}, "attention_bias true"),
    "gemma3-attention-cap": ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0"),
    "gemma3-rope-type": ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}},
                         "full_attention rope type 'dynamic'"),
    "gemma2-rope-type": ("gemma2", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
                         "rope type 'yarn'"),
    "quantized": ("gemma3", {"quantization_config": {"quant_method": "gptq"}}, r"quantization_config \(gptq\)"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_is_not_implemented_is_refused_by_name(case: str, request: pytest.FixtureRequest,
                                                    tmp_path: Path) -> None:
    kind, changes, named = REFUSALS[case]
    folder = edit_config(tiny(request, kind), tmp_path / "m", **changes)
    with pytest.raises(ModelFolderError, match=f"unsupported checkpoint feature.*{named}"):
        ModelConfig.from_folder(folder)


@pytest.mark.parametrize(("scheme", "layer_class"), [("int8", Int8Linear), ("int4", Int4Linear)])
def test_quantization_runs_every_projection(scheme: str, layer_class: type, tiny_gemma3: Path,
                                            tmp_path: Path) -> None:
    """As tests/engine/test_quantization.py checks the Llama family: the engine's quantized model is at least as
    close to the scheme's plain-torch reference as that reference is to fp32."""
    fp32 = load_model(tiny_gemma3, torch.float32, CPU, max_positions=64)
    quant = load_model(tiny_gemma3, torch.float32, CPU, max_positions=64, quantization=scheme)
    assert quant.quantization == scheme and isinstance(quant.packed_lm_head, Int8Linear)
    assert all(isinstance(getattr(layer, name), layer_class) for layer in quant.layers for name in PROJECTIONS)
    reference = load_model(write_quantized_reference(tiny_gemma3, tmp_path / "ref", scheme), torch.float32, CPU,
                           max_positions=64)
    ids = list(range(100, 140))
    want, ref, got = (sequence_logits(model, ids) for model in (fp32, reference, quant))

    def worst(a: torch.Tensor, b: torch.Tensor) -> float:
        return 1 - float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())

    assert worst(ref, got) <= worst(want, ref), (worst(ref, got), worst(want, ref))


@pytest.mark.batch_invariant
def test_lora_matches_transformers_with_the_adapter_merged(tiny_gemma3: Path, make_llm: Callable[..., LLM],
                                                           tmp_path: Path) -> None:
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter = write_adapter(tmp_path / "all8", ModelConfig.from_folder(tiny_gemma3), 8, targets, seed=3)
    llm = make_llm(str(tiny_gemma3), enable_lora=True, lora_modules={"all8": str(adapter)}, kv_cache_bytes=4 << 20,
                   max_num_seqs=8, max_num_batched_tokens=16)
    prompts = prompts_of(llm)
    outs = llm.generate(prompts + prompts, GREEDY, lora_name=["all8"] * len(prompts) + [None] * len(prompts))
    merged = hf_greedy(merge_adapter(tiny_gemma3, adapter, tmp_path / "merged"), prompts, GREEDY.max_tokens)
    assert [o.token_ids for o in outs[: len(prompts)]] == merged
    assert [o.token_ids for o in outs[len(prompts):]] == hf_greedy(tiny_gemma3, prompts, GREEDY.max_tokens) != merged


TRITON_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2-softcap-window": ("gemma2", small_caps()),
    "gemma3-window-qk-norm": ("gemma3", own_ropes()),
    "gemma3-head-dim-256": ("gemma3", {"head_dim": 256, "query_pre_attn_scalar": 256, "num_hidden_layers": 2}),
}


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_backend_matches_transformers(case: str, make_llm: Callable[..., LLM], tmp_path: Path,
                                             default_model_path: Path) -> None:
    """Through the Triton kernels (interpreter on a CPU): chunked prefills past the window, decodes, a prefix hit."""
    kind, overrides = TRITON_CASES[case]
    path = save_tiny(kind, tmp_path / kind, default_model_path, **overrides)
    llm = make_llm(str(path), attention_backend="triton", kv_cache_bytes=4 << 20, max_model_len=128, max_num_seqs=4,
                   max_num_batched_tokens=16)
    assert llm.engine.worker_info.attention_backend == "triton"
    prompts = prompts_of(llm)[:3]
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = hf_greedy(path, prompts, 8)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    again = llm.generate([prompts[-1]], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == expected[-1]
