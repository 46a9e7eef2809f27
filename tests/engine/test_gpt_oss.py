"""gpt-oss on tiny random checkpoints written by transformers (random non-zero sinks and biases): logits and greedy
fp32 tokens as transformers computes them (sliding windows shorter than the prompts, chunked prefill, a prefix-cache
hit, preemption, the Triton kernels under the interpreter), the stacked experts converted to FusedMoE's layout, its
config read as transformers reads it, MXFP4 experts dequantized at load, and what is not implemented refused by
name."""

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
from tritium.backend.models.gpt_oss import GptOssForCausalLM, deinterleave
from tritium.backend.models.loader import load_model
from tritium.backend.models.mxfp4 import FP4_E2M1, dequantize_mxfp4
from tritium.client.bench.accuracy import sequence_logits
from tritium.kernels.reference import moe_activation

from support.checkpoints import GPT_OSS_TINY, save_tiny
from support.hf_reference import hf_greedy

WINDOW = GPT_OSS_TINY["sliding_window"]
# Prompts of 1 to ~40 tokens: all but the first longer than the window, the longest five windows.
TEXTS = ["Hi", "The quick brown fox jumps over the lazy dog while the cat sleeps",
         "Once upon a time in a land far away, there lived a king who had three daughters and a dog named Rex",
         "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\nprint(add(2, 3), mul(4, 5))"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
CPU = torch.device("cpu")
EXPERTS = "model.layers.{}.mlp.experts.{}"


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return save_tiny("gpt_oss", tmp_path_factory.mktemp("tiny-gpt-oss"), default_model_path)


def prompts_of(llm: LLM) -> list[list[int]]:
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    assert len(prompts[0]) < WINDOW < len(prompts[1]) and max(map(len, prompts)) > 4 * WINDOW
    return prompts


def copy_with(folder: Path, dest: Path, drop: tuple[str, ...] = (), **changes: object) -> Path:
    """A copy of `folder` with config.json's `drop` keys removed and `changes` set."""
    shutil.copytree(folder, dest)
    path = dest / "config.json"
    config = {k: v for k, v in json.loads(path.read_text(encoding="utf-8")).items() if k not in drop}
    path.write_text(json.dumps(config | changes), encoding="utf-8")
    return dest


def test_tiny_checkpoint_has_what_the_tests_rely_on(tiny_gpt_oss: Path) -> None:
    config = ModelConfig.from_folder(tiny_gpt_oss)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2 and config.sliding_window == WINDOW
    assert config.attention_sinks and config.attention_bias and config.o_proj_bias
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 32)
    assert config.head_dim * config.num_attention_heads != config.hidden_size
    assert config.rope_theta == 150000.0 and config.rope_scaling is not None
    assert {k: config.rope_scaling[k] for k in ("rope_type", "factor", "beta_fast", "beta_slow", "truncate",
                                                "original_max_position_embeddings")} == \
        {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096}
    tensors = load_file(tiny_gpt_oss / "model.safetensors")
    for name in ("self_attn.sinks", "self_attn.q_proj.bias", "self_attn.o_proj.bias", "mlp.router.bias",
                 "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"):
        assert (tensors[f"model.layers.0.{name}"] != 0).all(), name


def test_experts_convert_to_gate_rows_first(tiny_gpt_oss: Path) -> None:
    """w13[e] = [gate; up] rows de-interleaved from the checkpoint's [H, 2I] columns (bias alike), w2[e] = down[e]^T."""
    tensors = load_file(tiny_gpt_oss / "model.safetensors")
    gate_up, gate_up_bias = tensors[EXPERTS.format(1, "gate_up_proj")], tensors[EXPERTS.format(1, "gate_up_proj_bias")]
    down = tensors[EXPERTS.format(1, "down_proj")]
    w13 = GptOssForCausalLM.convert_weight("layers.1.moe.w13", gate_up)
    w13_bias = GptOssForCausalLM.convert_weight("layers.1.moe.w13_bias", gate_up_bias)
    w2 = GptOssForCausalLM.convert_weight("layers.1.moe.w2", down)
    inter = GPT_OSS_TINY["intermediate_size"]
    assert w13.shape == (4, 2 * inter, 64) and w2.shape == (4, 64, inter) and w13.is_contiguous()
    x, act = torch.randn(3, 64), torch.randn(3, inter)
    for e in range(4):
        ours, theirs = x @ w13[e].T + w13_bias[e], x @ gate_up[e] + gate_up_bias[e]
        torch.testing.assert_close(ours[:, :inter], theirs[:, 0::2])  # transformers' gate: the even columns
        torch.testing.assert_close(ours[:, inter:], theirs[:, 1::2])
        torch.testing.assert_close(act @ w2[e].T, act @ down[e])


def test_swiglu_oai_is_transformers_clamped_swiglu() -> None:
    """fused_moe's "swiglu_oai" on the de-interleaved gate / up equals transformers' gpt-oss gate on the interleaved
    ones, with values past the clamp of 7 on both sides."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=2))
    gate_up = torch.randn(5, 64) * 6
    assert (gate_up > 7).any() and (gate_up < -7).any()
    torch.testing.assert_close(moe_activation(deinterleave(gate_up), "swiglu_oai"), experts._apply_gate(gate_up))


def test_logits_match_transformers(tiny_gpt_oss: Path) -> None:
    """One 48-token prefill (six windows): every position's fp32 logits."""
    from transformers import AutoModelForCausalLM

    ids = list(range(100, 148))
    ours = sequence_logits(load_model(tiny_gpt_oss, torch.float32, CPU, max_positions=64), ids)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = theirs(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


@pytest.mark.batch_invariant
def test_greedy_tokens_match_transformers_chunked_and_from_the_prefix_cache(
        tiny_gpt_oss: Path, make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(str(tiny_gpt_oss), kv_cache_bytes=4 << 20, max_model_len=128, max_num_seqs=4,
                   max_num_batched_tokens=16)
    prompts = prompts_of(llm)
    expected = hf_greedy(tiny_gpt_oss, prompts, GREEDY.max_tokens)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    again = llm.generate([prompts[-1]], GREEDY)[0]  # its full prompt blocks are cached now
    assert again.num_cached_tokens > 0 and again.token_ids == expected[-1]


@pytest.mark.batch_invariant
def test_greedy_tokens_match_transformers_under_preemption(tiny_gpt_oss: Path, make_llm: Callable[..., LLM]) -> None:
    blocks = 5  # the longest request needs 4 blocks of 16 (its last token stores no KV), the four together 10
    per_block = ModelConfig.from_folder(tiny_gpt_oss).kv_bytes_per_block(16, torch.float32)
    llm = make_llm(str(tiny_gpt_oss), kv_cache_bytes=blocks * per_block, max_model_len=64, max_num_seqs=4)
    assert llm.engine.block_manager.num_blocks == blocks
    prompts = prompts_of(llm)
    expected = hf_greedy(tiny_gpt_oss, prompts, GREEDY.max_tokens)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.scheduler.num_preemptions > 0


def test_config_defaults_read_as_transformers_reads_them(tiny_gpt_oss: Path, tmp_path: Path) -> None:
    """A config that leaves layer types, rope parameters, head_dim and the expert counts to GptOssConfig."""
    from transformers import AutoConfig

    drop = ("layer_types", "rope_parameters", "head_dim", "num_local_experts", "num_experts_per_tok",
            "attention_bias", "sliding_window")
    folder = copy_with(tiny_gpt_oss, tmp_path / "m", drop, num_hidden_layers=5)
    ours, theirs = ModelConfig.from_folder(folder), AutoConfig.from_pretrained(folder)
    assert ours.layer_types == tuple(theirs.layer_types) and ours.sliding_window == theirs.sliding_window == 128
    assert (ours.head_dim, ours.num_experts, ours.num_experts_per_tok, ours.attention_bias) == \
        (theirs.head_dim, theirs.num_local_experts, theirs.num_experts_per_tok, theirs.attention_bias)
    params = theirs.rope_parameters
    assert ours.rope_theta == params["rope_theta"] and ours.rope_scaling is not None
    assert {k: ours.rope_scaling[k] for k in params if k != "rope_theta"} == \
        {k: v for k, v in params.items() if k != "rope_theta"}


REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "swiglu-limit": ({"swiglu_limit": 5.0}, "swiglu_limit 5.0"),
    "swiglu-alpha": ({"swiglu_alpha": 1.5}, "swiglu_alpha 1.5"),
    "top-k": ({"num_experts_per_tok": 5}, "num_experts_per_tok 5"),
    "quantized": ({"quantization_config": {"quant_method": "gptq"}}, r"quantization_config \(gptq\)"),
    "rope-type": ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "type 'proportional'"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_is_not_implemented_is_refused_by_name(case: str, tiny_gpt_oss: Path, tmp_path: Path) -> None:
    changes, named = REFUSALS[case]
    folder = copy_with(tiny_gpt_oss, tmp_path / "m", **changes)
    with pytest.raises(ModelFolderError, match=f"unsupported checkpoint feature.*{named}"):
        ModelConfig.from_folder(folder)


def test_lora_and_int8_of_gpt_oss_are_refused(tiny_gpt_oss: Path) -> None:
    with pytest.raises(ModelFolderError, match="mixture-of-experts"):
        load_model(tiny_gpt_oss, torch.float32, CPU, max_positions=64, quantization="int8")
    with pytest.raises(ModelFolderError, match="enable_lora: LoRA of a mixture-of-experts model"):
        LLM(str(tiny_gpt_oss), enable_lora=True, kv_cache_bytes=1 << 20, max_model_len=64)


# MXFP4: blocks of 32 FP4 E2M1 values (two a byte, the low nibble first) and one E8M0 scale byte each.


def decode_e2m1(code: int) -> float:
    """An FP4 E2M1 code's value from its bits (sign, 2 exponent bits biased by 1, 1 mantissa bit; exponent 0:
    subnormal), independent of the table the loader uses."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    return sign * (mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1))


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 `[..., G, 16]`, scales uint8 `[..., G]`) of `weight` `[..., G * 32]`: each block's scale the
    power of two that brings its largest magnitude to at most 6, each value the nearest E2M1 one."""
    values = torch.tensor([decode_e2m1(c) for c in range(16)])
    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - values).abs().argmin(-1).to(torch.uint8)  # -0.0 (code 8) never wins over 0.0
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_dequantizes_every_code_and_scale() -> None:
    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 2, 16)  # every byte: every pair of codes
    scales = torch.tensor([[0, 127], [100, 130], [127, 200], [1, 126], [127, 127], [120, 140], [90, 160], [127, 0]],
                          dtype=torch.uint8)
    got = dequantize_mxfp4(codes, scales)
    assert got.shape == (8, 64) and got.dtype == torch.float32
    for row in range(8):
        for g in range(2):
            for i in range(32):
                byte = int(codes[row, g, i // 2])
                code = byte & 0x0F if i % 2 == 0 else byte >> 4
                want = decode_e2m1(code) * 2.0 ** (int(scales[row, g]) - 127)
                assert float(got[row, g * 32 + i]) == want
    assert [decode_e2m1(c) for c in range(16)] == list(FP4_E2M1)
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(codes, scales[:, :1])


def write_mxfp4_pair(folder: Path, quantized: Path, plain: Path) -> None:
    """From `folder`: `quantized`, its experts in MXFP4 as gpt-oss checkpoints store them ([E, out, in] blocks,
    quantization_config mxfp4), and `plain`, the same checkpoint with the experts' dequantized values unquantized."""
    tensors = load_file(folder / "model.safetensors")
    packed, dequantized = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors[name].transpose(1, 2))
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
        dequantized[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        assert not torch.equal(dequantized[name], tensors[name])  # quantization changed the weights
    quant = {"quant_method": "mxfp4",
             "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                        "lm_head"]}
    for dest, weights, changes in ((quantized, packed, {"quantization_config": quant}), (plain, dequantized, {})):
        copy_with(folder, dest, **changes)
        save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})


def test_mxfp4_experts_load_dequantized(tiny_gpt_oss: Path, tmp_path: Path) -> None:
    """The MXFP4 checkpoint's logits are those transformers computes on its dequantized values."""
    from transformers import AutoModelForCausalLM

    write_mxfp4_pair(tiny_gpt_oss, tmp_path / "mxfp4", tmp_path / "plain")
    ids = list(range(100, 140))
    ours = sequence_logits(load_model(tmp_path / "mxfp4", torch.float32, CPU, max_positions=64), ids)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32).eval()
    with torch.inference_mode():
        want = theirs(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    # A half of a pair alone is a tensor the model cannot use: refused by name.
    tensors = load_file(tmp_path / "mxfp4" / "model.safetensors")
    del tensors[EXPERTS.format(2, "down_proj_scales")]
    save_file(tensors, tmp_path / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFolderError, match=r"does not use \(model\.layers\.2\.mlp\.experts\.down_proj_blocks"):
        load_model(tmp_path / "mxfp4", torch.float32, CPU, max_positions=64)


@pytest.mark.slow  # the Triton interpreter
def test_triton_backend_matches_transformers(tiny_gpt_oss: Path, make_llm: Callable[..., LLM]) -> None:
    """Through the Triton kernels (interpreter on a CPU): chunked prefills past the window, decodes, a prefix hit."""
    llm = make_llm(str(tiny_gpt_oss), attention_backend="triton", kv_cache_bytes=4 << 20, max_model_len=128,
                   max_num_seqs=4, max_num_batched_tokens=16)
    assert llm.engine.worker_info.attention_backend == "triton"
    prompts = prompts_of(llm)[:3]
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = hf_greedy(tiny_gpt_oss, prompts, 8)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    again = llm.generate([prompts[-1]], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == expected[-1]
