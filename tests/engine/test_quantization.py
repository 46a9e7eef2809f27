"""int8 and int4 weight-only quantization (models/quantization.py, layers/int8_linear.py, int4_linear.py):
refusals, the quantized linear against its fp32 reference, LoRA on a quantized base, and the accuracy of quantized
models against fp32. Int4Linear's own tests are in tests/unit/test_int4.py.

Accuracy bounds come from a reference each test computes: the same checkpoint with its weights through the scheme
in plain torch (support/quantization.py), run unquantized in fp32, so it carries the scheme's own rounding error
and nothing else. The engine's quantized model must be at least as close to that reference as the reference is
to fp32: what the engine adds (bf16 activations, packed kernels) must stay below what the scheme itself costs,
whatever the CPU. A wrong scale, zero or rounding moves the engine's model away from the reference by more.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tritium.backend import LLM, EngineConfig, SamplingParams
from tritium.backend.layers.int4_linear import Int4Linear
from tritium.backend.layers.int8_linear import PATHS, Int8Linear, quantize_per_channel
from tritium.backend.model_config import ModelConfig
from tritium.backend.models.base import PROJECTIONS
from tritium.backend.models.loader import load_model
from tritium.backend.models.quantization import QuantizationOptions
from tritium.backend.serving.settings import load_settings
from tritium.backend.tokenizer import Tokenizer
from tritium.client.bench.accuracy import TEXT, agreement, greedy_tokens, perplexity, sequence_logits

from support.lora import write_adapter
from support.quantization import write_quantized_reference


@pytest.mark.parametrize("value", ["nf4", "fp8", "INT8", "awq", 8])
def test_unknown_scheme_is_refused_by_name(value: object) -> None:
    with pytest.raises(ValueError, match=r"quantization must be one of \['int8', 'int4'\]"):
        EngineConfig(quantization=value)  # type: ignore[arg-type]


def test_model_json_key(tmp_path: Path) -> None:
    (tmp_path / "model.json").write_text('{"quantization": "int8"}', encoding="utf-8")
    assert load_settings(tmp_path).engine.quantization == "int8"
    (tmp_path / "model.json").write_text('{"quantization": "int4"}', encoding="utf-8")
    assert load_settings(tmp_path).engine.quantization == "int4"
    (tmp_path / "model.json").write_text('{"quantization": "nf4"}', encoding="utf-8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_settings(tmp_path)


def test_per_channel_quantization_round_trips() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 64) * torch.logspace(-3, 0, 48)[:, None]  # rows of very different ranges
    w[5] = 0
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (48,)
    assert int(q.abs().max()) == 127 and bool((q[5] == 0).all())
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-12).all())  # half a step per row


@pytest.mark.parametrize("path", [p for p in PATHS if p != "triton"])
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_linear_paths_match_dequantized_reference(path: str, rows: int) -> None:
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64) * 0.05, torch.randn(96), torch.randn(rows, 64)
    q, scale = quantize_per_channel(w)
    want = torch.nn.functional.linear(x, q.float() * scale[:, None], b)
    got = Int8Linear(w, b, path=path)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    tol = 3e-2 if path == "cpu_bf16" else 1e-4  # bf16 activations
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_int8_linear_odd_reduction_uses_dequant() -> None:
    assert Int8Linear(torch.randn(8, 40), None).path == "dequant"  # the packed CPU op needs K % 32 == 0


def worst_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The lowest cosine similarity between matching rows of `a` and `b`."""
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


@pytest.mark.parametrize(("scheme", "layer_class"), [("int8", Int8Linear), ("int4", Int4Linear)])
@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path"])  # untied head; tied + q/k/v bias
def test_tiny_models_quantize_every_projection(fixture: str, scheme: str, layer_class: type, tmp_path: Path,
                                               request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(fixture)
    cpu = torch.device("cpu")
    fp32 = load_model(folder, torch.float32, cpu, max_positions=64)
    quant = load_model(folder, torch.float32, cpu, max_positions=64, quantization=scheme)
    # the logits head is int8 for both (HEAD_SCHEMES); with tied embeddings it is a copy of the embedding
    assert quant.quantization == scheme and quant.lm_head is None and isinstance(quant.packed_lm_head, Int8Linear)
    assert all(isinstance(getattr(layer, name), layer_class) for layer in quant.layers for name in PROJECTIONS)
    assert quant.embed_tokens.weight.dtype == torch.float32  # the lookup stays unquantized
    reference = load_model(write_quantized_reference(folder, tmp_path / "ref", scheme), torch.float32, cpu,
                           max_positions=64)
    ids = list(range(100, 140))
    want, ref, got = (sequence_logits(model, ids) for model in (fp32, reference, quant))
    # random weights: the scheme alone costs much (int4 ~0.7 cosine); the engine adds far less
    assert 1 - worst_cosine(ref, got) <= 1 - worst_cosine(want, ref), (worst_cosine(ref, got), worst_cosine(want, ref))


def test_int4_model_matches_its_dequantized_weights(tiny_qwen2_path: Path) -> None:
    """The engine's int4 model (packed op where the host has it) against the same int4 weights dequantized and
    multiplied in fp32: the wiring and the packed paths, without the quantization error."""
    cpu = torch.device("cpu")
    model = load_model(tiny_qwen2_path, torch.float32, cpu, max_positions=64, quantization="int4")
    ref = load_model(tiny_qwen2_path, torch.float32, cpu, max_positions=64, quantization="int4",
                     quantization_options=QuantizationOptions(path="dequant"))
    assert ref.layers[0].qkv_proj.path == "dequant"
    ids = list(range(100, 140))
    want, got = sequence_logits(ref, ids), sequence_logits(model, ids)
    assert float(torch.nn.functional.cosine_similarity(want, got, dim=-1).min()) > 0.999


def test_int4_head_option_quantizes_a_tied_head(tiny_qwen2_path: Path) -> None:
    """The int4 head (a measurement knob) is its own int4 copy of the tied embedding, which stays as it was."""
    cpu = torch.device("cpu")
    fp32 = load_model(tiny_qwen2_path, torch.float32, cpu, max_positions=64)
    model = load_model(tiny_qwen2_path, torch.float32, cpu, max_positions=64, quantization="int4",
                       quantization_options=QuantizationOptions(head="int4", group_size=64))
    head = model.packed_lm_head
    assert isinstance(head, Int4Linear) and head.group_size == 64 and head.out_dtype == torch.float32
    assert torch.equal(model.embed_tokens.weight, fp32.embed_tokens.weight)
    hidden = torch.randn(3, model.config.hidden_size)
    want = torch.nn.functional.linear(hidden, fp32.embed_tokens.weight.detach())
    got = model.compute_logits(hidden)
    assert got.dtype == torch.float32
    assert float(torch.nn.functional.cosine_similarity(want, got, dim=-1).min()) > 0.95


def test_load_model_refuses_int4_on_cuda_before_reading_weights(tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match="'int4' is implemented for CPUs only"):
        load_model(tiny_llama_path, torch.float32, torch.device("cuda"), quantization="int4")


def test_lora_on_an_int4_base(make_llm: Callable[..., LLM], tiny_llama_path: Path, tmp_path: Path) -> None:
    """An adapter applies beside the int4 projections (llama.py adds its delta to their outputs)."""
    adapter = write_adapter(tmp_path / "a", ModelConfig.from_folder(tiny_llama_path), 8,
                            ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=3)
    llm = make_llm(str(tiny_llama_path), quantization="int4", enable_lora=True, lora_modules={"a": str(adapter)},
                   kv_cache_bytes=4 << 20)
    assert isinstance(llm.engine.worker.runner.model.layers[0].qkv_proj, Int4Linear)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = "The quick brown fox jumps over the lazy dog"
    base = llm.generate([prompt], params)[0].token_ids
    tuned = llm.generate([prompt], params, lora_name="a")[0].token_ids
    assert len(base) == len(tuned) == 10 and base != tuned
    assert llm.generate([prompt], params)[0].token_ids == base  # the base is untouched by the adapter's run


def test_load_model_refuses_unknown_scheme(tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(tiny_llama_path, torch.float32, torch.device("cpu"), quantization="nf4")


@pytest.mark.slow  # greedy agreement and perplexity of the default model: fp32, the reference, quantized
@pytest.mark.parametrize(("scheme", "layer_class"), [("int8", "Int8Linear"), ("int4", "Int4Linear")])
def test_accuracy_against_fp32(scheme: str, layer_class: str, make_llm: Callable[..., LLM], default_model_path: Path,
                               tmp_path: Path) -> None:
    """Greedy agreement over 8 prompts x 32 tokens and the perplexity of a fixed text, of the engine's quantized
    model against the scheme's plain-torch reference and of that reference against fp32. (The default checkpoint
    comes from a Q4_1 GGUF, 4-bit in groups of 32, which int4 reproduces almost exactly: int4's reference differs
    from fp32 by the bf16 rounding of its steps and offsets, and by the int8 head.)"""
    ids = Tokenizer(default_model_path).encode(TEXT)
    reference = write_quantized_reference(default_model_path, tmp_path / "reference", scheme)
    runs, ppl = {}, {}
    for name, folder, q in (("fp32", default_model_path, None), ("reference", reference, None),
                            (scheme, default_model_path, scheme)):
        llm = make_llm(str(folder), quantization=q, max_num_seqs=8, max_num_batched_tokens=256)
        runs[name] = greedy_tokens(llm, 32)
        model = llm.engine.worker.runner.model
        if q is not None:
            assert type(model.layers[0].qkv_proj).__name__ == layer_class
            assert type(model.packed_lm_head).__name__ == "Int8Linear"  # int4's head too (HEAD_SCHEMES)
        ppl[name] = perplexity(model, ids)
    scheme_agree, engine_agree = agreement(runs["fp32"], runs["reference"]), agreement(runs["reference"], runs[scheme])
    scheme_change, engine_change = ppl["reference"] / ppl["fp32"] - 1, ppl[scheme] / ppl["reference"] - 1
    print(f"mean matching prefix of 32: reference/fp32 {scheme_agree.mean_matching_prefix:.2f} "
          f"{scheme}/reference {engine_agree.mean_matching_prefix:.2f}; perplexity fp32 {ppl['fp32']:.4f}, "
          f"reference {ppl['reference']:.4f} ({scheme_change:+.3%}), {scheme} {ppl[scheme]:.4f} ({engine_change:+.3%} "
          f"on the reference, {ppl[scheme] / ppl['fp32'] - 1:+.3%} on fp32)")
    # Perplexity averages over the whole text: the engine's change must stay below the scheme's. A greedy prefix
    # ends at the first near-tie either perturbation flips, and 8 prompts make a coarse mean: the engine may flip
    # them up to twice as often as the scheme does (int4's scheme, on a checkpoint already in 4-bit groups, flips
    # about as few as bf16 activations do), which still fails a model that decodes garbage after a few tokens.
    assert abs(engine_change) <= abs(scheme_change), ppl
    assert engine_agree.mean_matching_prefix >= scheme_agree.mean_matching_prefix / 2, (scheme_agree, engine_agree)
