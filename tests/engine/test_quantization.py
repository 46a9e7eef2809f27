"""int8 weight-only quantization (models/quantization.py): refusals, the quantized linear against its fp32
reference, and the measured accuracy of the default model against fp32 (greedy agreement, perplexity).

Thresholds come from measurements on the development host (AVX512-BF16, the cpu_bf16 path; README,
"Quantization"): mean matching prefix 17.5 of 32 tokens (first divergences 26, -, 5, 3, 1, 19, 22, -: the
135M model has near-ties), perplexity +0.62% (the cpu_fp32 and dequant paths, fp32 activations: +0.56%).
The prefix bound leaves a margin for other CPUs' rounding; the perplexity bound is the issue's 1%.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tritium.backend import LLM, EngineConfig
from tritium.backend.models.loader import load_model
from tritium.backend.models.quantization import LAYER_PROJECTIONS, PATHS, Int8Linear, quantize_per_channel
from tritium.backend.serving.settings import load_settings
from tritium.backend.tokenizer import Tokenizer
from tritium.client.bench.accuracy import TEXT, agreement, greedy_tokens, perplexity, sequence_logits

MIN_MEAN_MATCHING_PREFIX = 12.0  # of 32 greedy tokens, over the 8 prompts (measured 17.5)
MAX_PERPLEXITY_INCREASE = 0.01  # relative to fp32 (measured +0.62%)


@pytest.mark.parametrize("value", ["int4", "fp8", "INT8", "awq", 8])
def test_unknown_scheme_is_refused_by_name(value: object) -> None:
    with pytest.raises(ValueError, match=r"quantization must be one of \['int8'\]"):
        EngineConfig(quantization=value)  # type: ignore[arg-type]


def test_model_json_key(tmp_path: Path) -> None:
    (tmp_path / "model.json").write_text('{"quantization": "int8"}', encoding="utf-8")
    assert load_settings(tmp_path).engine.quantization == "int8"
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


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path"])  # untied head; tied + q/k/v bias
def test_tiny_models_quantize_every_projection(fixture: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(fixture)
    cpu = torch.device("cpu")
    fp32 = load_model(folder, torch.float32, cpu, max_positions=64)
    int8 = load_model(folder, torch.float32, cpu, max_positions=64, quantization="int8")
    assert int8.quantization == "int8" and int8.lm_head is None and isinstance(int8.packed_lm_head, Int8Linear)
    assert all(isinstance(getattr(layer, name), Int8Linear) for layer in int8.layers for name in LAYER_PROJECTIONS)
    assert int8.embed_tokens.weight.dtype == torch.float32  # the lookup stays unquantized
    ids = list(range(100, 140))
    want, got = sequence_logits(fp32, ids), sequence_logits(int8, ids)
    assert float(torch.nn.functional.cosine_similarity(want, got, dim=-1).min()) > 0.99


def test_load_model_refuses_unknown_scheme(tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(tiny_llama_path, torch.float32, torch.device("cpu"), quantization="int4")


@pytest.mark.slow  # greedy agreement and perplexity on the default model (~40 s)
def test_int8_accuracy_against_fp32(make_llm: Callable[..., LLM], default_model_path: Path) -> None:
    """Greedy agreement over 8 prompts x 32 tokens and the perplexity of a fixed text, int8 against fp32."""
    ids = Tokenizer(default_model_path).encode(TEXT)
    runs, ppl = [], []
    for q in (None, "int8"):
        llm = make_llm(quantization=q, max_num_seqs=8, max_num_batched_tokens=256)
        runs.append(greedy_tokens(llm, 32))
        model = llm.engine.worker.runner.model
        if q is not None:
            assert type(model.layers[0].qkv_proj).__name__ == "Int8Linear"
            assert type(model.packed_lm_head).__name__ == "Int8Linear"
        ppl.append(perplexity(model, ids))
    agree = agreement(runs[0], runs[1])
    increase = ppl[1] / ppl[0] - 1
    print(f"mean matching prefix {agree.mean_matching_prefix:.2f}/32, first divergences {agree.first_divergence}, "
          f"perplexity fp32 {ppl[0]:.4f} int8 {ppl[1]:.4f} ({increase:+.2%})")
    assert agree.mean_matching_prefix >= MIN_MEAN_MATCHING_PREFIX, agree
    assert abs(increase) <= MAX_PERPLEXITY_INCREASE, (ppl, increase)
