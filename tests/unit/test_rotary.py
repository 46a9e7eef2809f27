"""Rotary scalings against transformers' own (modeling_rope_utils.py and each model's rotary module): the inverse
frequencies and attention factor bit for bit, the cos/sin rows each token gets; for longrope and dynamic NTK, the
rows of prompts on both sides of the original context and of decode steps crossing it, as transformers' generate
rotates one sequence (prefill, then one token a step)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tritium.backend.layers.attention import get_attention_backend
from tritium.backend.layers.rotary import RopeChunk, RotaryEmbedding, length_dependent_rotary, rope_inv_freq
from tritium.backend.model_config import ModelConfig, ModelFolderError

ORIGINAL = 32  # the original context of the length-dependent cases
POSITIONS = 96  # the table: prompts and decodes on both sides of ORIGINAL
BACKEND = get_attention_backend("torch", torch.device("cpu"))


def hf_config(arch: str, rope: dict[str, Any] | None, **fields: Any) -> Any:
    import transformers

    cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen3ForCausalLM": transformers.Qwen3Config,
           "Phi3ForCausalLM": transformers.Phi3Config}[arch]
    common = {"vocab_size": 100, "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
    config = cls(**(common | fields), rope_scaling=rope)
    config.architectures = [arch]
    return config


def hf_rotary(config: Any) -> torch.nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cls = {"llama": LlamaRotaryEmbedding, "qwen3": Qwen3RotaryEmbedding, "phi3": Phi3RotaryEmbedding}
    module: torch.nn.Module = cls[config.model_type](config)
    return module


def ours(config: Any, tmp_path: Path) -> tuple[ModelConfig, RotaryEmbedding]:
    """Our config read from the config.json transformers writes, and its rotary (its scratch reserved)."""
    config.save_pretrained(tmp_path)
    mine = ModelConfig.from_folder(tmp_path)
    rotary = RotaryEmbedding(int(mine.head_dim * mine.partial_rotary_factor), mine.rope_theta, mine.rope_scaling,
                             POSITIONS, BACKEND)
    rotary.reserve(POSITIONS)
    return mine, rotary


def hf_rows(module: torch.nn.Module, positions: list[int]) -> torch.Tensor:
    """transformers' cat(cos, sin) halves for one forward pass over `positions`."""
    x = torch.zeros(1)
    cos, sin = module(x, torch.tensor([positions]))
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)


def generate_rows(module: torch.nn.Module, prompt_len: int, new_tokens: int) -> torch.Tensor:
    """Each token's rows as transformers' generate rotates one sequence: the prompt in one pass, then a pass a token."""
    rows = [hf_rows(module, list(range(prompt_len)))]
    rows += [hf_rows(module, [p]) for p in range(prompt_len, prompt_len + new_tokens)]
    return torch.cat(rows)


def engine_rows(rotary: RotaryEmbedding, prompt_len: int, new_tokens: int, chunk: int) -> torch.Tensor:
    """The same tokens through our table: the prompt in chunks of `chunk` (one step each), then a token a step."""
    out = []
    for start in range(0, prompt_len + new_tokens, 1):
        if start < prompt_len and start % chunk:
            continue
        end = min(start + chunk, prompt_len) if start < prompt_len else start + 1
        chunks: list[RopeChunk] = []
        rows = rotary.rows(start, end, prompt_len, max(prompt_len, end), chunks)
        rotary.fill(chunks)
        out.append(rotary.cos_sin_cache[torch.tensor(list(rows))].clone())
    return torch.cat(out)


LONGROPE = {"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(24)],
            "long_factor": [2.0 + i for i in range(24)]}
STATIC_CASES = {
    "default": ("LlamaForCausalLM", None, {}),
    "linear": ("LlamaForCausalLM", {"rope_type": "linear", "factor": 4.0}, {}),
    "llama3": ("LlamaForCausalLM", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, {}),
    "yarn": ("Qwen3ForCausalLM", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
             {"head_dim": 32}),
    "yarn mscale": ("LlamaForCausalLM", {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16,
                                         "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2,
                                         "truncate": False}, {}),
    "yarn attention_factor": ("LlamaForCausalLM", {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.25,
                                                   "original_max_position_embeddings": 16}, {}),
    "phi3 partial": ("Phi3ForCausalLM", None, {"partial_rotary_factor": 0.75}),
}


@pytest.mark.parametrize("case", STATIC_CASES)
def test_static_scalings_match_transformers(case: str, tmp_path: Path) -> None:
    arch, rope, fields = STATIC_CASES[case]
    config = hf_config(arch, rope, **fields)
    theirs = hf_rotary(config)
    mine, rotary = ours(config, tmp_path)
    assert not rotary.length_dependent and length_dependent_rotary([rotary]) is None
    dim = int(mine.head_dim * mine.partial_rotary_factor)
    assert torch.equal(rope_inv_freq(dim, mine.rope_theta, mine.rope_scaling), theirs.inv_freq)
    positions = list(range(POSITIONS))
    torch.testing.assert_close(rotary.cos_sin_cache, hf_rows(theirs, positions), atol=1e-6, rtol=0)
    assert rotary.rows(3, 9, 100, 100, []) == range(3, 9)  # the common case: rows are positions


def test_yarn_scales_cos_and_sin_and_extends_the_context(tmp_path: Path) -> None:
    config = hf_config("LlamaForCausalLM", {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 16})
    theirs = hf_rotary(config)
    mine, rotary = ours(config, tmp_path)
    assert theirs.attention_scaling == pytest.approx(1.1386, abs=1e-4)
    assert float(rotary.cos_sin_cache[0, 0]) == pytest.approx(theirs.attention_scaling, rel=1e-7)  # cos(0) x it
    assert mine.max_position_embeddings == 64  # max(64, 16 x 4); a larger factor extends it
    assert ModelConfig.from_folder(tmp_path).rope_scaling == {**config.rope_parameters, "rope_type": "yarn"}


@pytest.mark.parametrize("prompt_len,new_tokens", [(7, 40), (ORIGINAL, 8), (ORIGINAL + 1, 8), (60, 20)])
@pytest.mark.parametrize("chunk", [5, 64])
def test_longrope_switches_per_sequence_as_generate_does(prompt_len: int, new_tokens: int, chunk: int,
                                                        tmp_path: Path) -> None:
    """Short factors while the sequence is within the original context; a longer prompt takes the long ones for
    all its tokens, a short one from the decode step whose p + 1 passes it; the attention factor on both."""
    config = hf_config("Phi3ForCausalLM", LONGROPE, partial_rotary_factor=0.75,
                       original_max_position_embeddings=ORIGINAL, max_position_embeddings=128)
    theirs = hf_rotary(config)
    mine, rotary = ours(config, tmp_path)
    assert mine.rope_scaling is not None and mine.rope_scaling["factor"] == 4.0  # 128 / 32, as transformers derives
    assert rotary.length_dependent and length_dependent_rotary([rotary]) is rotary
    assert theirs.attention_scaling == pytest.approx(1.1832, abs=1e-4)
    assert torch.equal(rope_inv_freq(48, mine.rope_theta, mine.rope_scaling), theirs.original_inv_freq)
    want = generate_rows(theirs, prompt_len, new_tokens)
    torch.testing.assert_close(engine_rows(rotary, prompt_len, new_tokens, chunk), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("prompt_len,new_tokens", [(7, 40), (ORIGINAL, 8), (ORIGINAL + 1, 8), (60, 30)])
@pytest.mark.parametrize("chunk", [5, 64])
def test_dynamic_ntk_follows_each_sequence_as_generate_does(prompt_len: int, new_tokens: int, chunk: int,
                                                            tmp_path: Path) -> None:
    """Unscaled within the original context; a longer prompt rotates for its length, then each decode step for its
    p + 1 tokens: scratch rows for the prompt's tokens, table rows for the rest."""
    config = hf_config("LlamaForCausalLM", {"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=ORIGINAL)
    theirs = hf_rotary(config)  # fresh: transformers' dynamic rotary keeps the longest length it saw
    mine, rotary = ours(config, tmp_path)
    assert mine.max_position_embeddings == 2 * ORIGINAL and rotary.scratch_rows == POSITIONS
    assert torch.equal(rope_inv_freq(64, mine.rope_theta, mine.rope_scaling), theirs.inv_freq)
    want = generate_rows(theirs, prompt_len, new_tokens)
    assert torch.equal(engine_rows(rotary, prompt_len, new_tokens, chunk), want)


def test_dynamic_scratch_rows_are_checked(tmp_path: Path) -> None:
    config = hf_config("LlamaForCausalLM", {"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=ORIGINAL)
    _, rotary = ours(config, tmp_path)
    chunks: list[RopeChunk] = []
    assert list(rotary.rows(0, 40, 50, 50, chunks)) == list(range(POSITIONS, POSITIONS + 40))
    assert list(rotary.rows(45, 52, 50, 52, chunks)) == [*range(POSITIONS + 40, POSITIONS + 44), 49, 50, 51]
    assert chunks == [RopeChunk(0, 40, 50, POSITIONS), RopeChunk(45, 49, 50, POSITIONS + 40)]
    with pytest.raises(RuntimeError, match="need 104 rotary scratch rows; 96 were reserved"):
        rotary.rows(0, 60, 61, 61, chunks)


def test_a_length_dependent_rotary_must_be_the_only_one(tmp_path: Path) -> None:
    config = hf_config("LlamaForCausalLM", {"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=ORIGINAL)
    _, dynamic = ours(config, tmp_path)
    plain = RotaryEmbedding(64, 10000.0, None, POSITIONS, BACKEND)
    with pytest.raises(ValueError, match="rope type 'dynamic' needs the model's only rotary"):
        length_dependent_rotary([plain, dynamic])


def write_config(folder: Path, **config: Any) -> Path:
    folder.mkdir()
    base = {"vocab_size": 100, "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(base | config))
    return folder


@pytest.mark.parametrize("config,message", [
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "proportional"}},
     "rope_scaling type 'proportional' \\(supported: default, linear, llama3, yarn, longrope, dynamic\\)"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope_scaling type 'linear' \\(supported: default, longrope\\)"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {**LONGROPE, "long_factor": [1.0] * 23},
      "partial_rotary_factor": 0.75}, "rope_scaling long_factor of 23 values \\(the rotary dim needs 24\\)"),
    ({"architectures": ["Qwen3ForCausalLM"], "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
], ids=["unknown type", "phi3 linear", "longrope factors", "qwen3 partial rotary"])
def test_rope_settings_not_implemented_are_named(config: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match=f"unsupported checkpoint feature.*{message}"):
        ModelConfig.from_folder(write_config(tmp_path / "m", **config))


@pytest.mark.parametrize("kind,original", [("longrope", 4096), ("su", 4096), ("yarn", 4096)])
def test_phi3_original_context_as_phi3config_reads_it(kind: str, original: int, tmp_path: Path) -> None:
    """Phi3Config's own reading: its original_max_position_embeddings field (4096 when absent) wins over the rope
    settings' own, and it reads "su" and "yarn" as longrope."""
    import transformers

    rope = {**LONGROPE, "type": kind, "original_max_position_embeddings": 8}
    raw = {"architectures": ["Phi3ForCausalLM"], "rope_scaling": rope, "partial_rotary_factor": 0.75,
           "max_position_embeddings": 8192}
    mine = ModelConfig.from_folder(write_config(tmp_path / "m", **raw))
    theirs = transformers.Phi3Config.from_pretrained(tmp_path / "m").rope_parameters
    assert mine.rope_scaling is not None and theirs["original_max_position_embeddings"] == original
    assert (mine.rope_scaling["rope_type"], mine.rope_scaling["original_max_position_embeddings"],
            mine.rope_scaling["factor"], mine.partial_rotary_factor) == ("longrope", original, 8192 / original, 0.75)
