"""Mixture-of-experts models (Qwen3-MoE, Mixtral) on tiny random checkpoints written by transformers: greedy fp32
tokens as transformers' generate gives them (chunked prefill, prefix-cache hits, preemption, n-gram speculation,
the Triton kernels under the interpreter), both checkpoint layouts of the experts, the FusedMoE layer against a
per-token loop, and what is not implemented refused by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tritium.backend import LLM, SamplingParams
from tritium.backend.layers.attention import get_attention_backend
from tritium.backend.layers.moe import FusedMoE
from tritium.backend.model_config import ModelConfig, ModelFolderError
from tritium.backend.models.loader import load_model
from tritium.backend.models.mixtral import MixtralForCausalLM
from tritium.backend.models.qwen3_moe import Qwen3MoeForCausalLM
from tritium.backend.worker.memory_budget import module_bytes

from support.checkpoints import save_tiny
from support.hf_reference import hf_greedy

TEXTS = ["Hi", "The quick brown fox jumps over the lazy dog while the cat sleeps",
         "Once upon a time in a land far away, there lived a king who had three daughters and a dog named Rex",
         "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\nprint(add(2, 3), mul(4, 5))"]
GREEDY = SamplingParams(temperature=0, max_tokens=20)
CPU = torch.device("cpu")
FAMILIES = ("qwen3_moe", "mixtral")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> dict[str, Path]:
    return {kind: save_tiny(kind, tmp_path_factory.mktemp(kind), default_model_path) for kind in FAMILIES}


def prompts_of(llm: LLM) -> list[list[int]]:
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    assert [len(p) for p in prompts] == [1, 14, 23, 44]
    return prompts


def edited(folder: Path, dest: Path, **changes: Any) -> Path:
    shutil.copytree(folder, dest)
    path = dest / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text(encoding="utf-8")) | changes), encoding="utf-8")
    return dest


def test_configs_and_layers_read_as_transformers_reads_them(checkpoints: dict[str, Path]) -> None:
    """Which layers run experts, the routing settings, and every expert's weights counted in the memory plan."""
    from transformers import AutoModelForCausalLM

    for kind, cls in (("qwen3_moe", Qwen3MoeForCausalLM), ("mixtral", MixtralForCausalLM)):
        config = ModelConfig.from_folder(checkpoints[kind])
        hf = AutoModelForCausalLM.from_pretrained(checkpoints[kind], dtype=torch.float32)
        hf_moe = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
        assert [config.is_moe_layer(i) for i in range(config.num_hidden_layers)] == hf_moe
        assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (8, 2, True)
        ids = torch.randint(0, config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
        router_logits = hf(ids, output_router_logits=True).router_logits
        assert len(router_logits) == sum(hf_moe)
        for logits in router_logits:  # routing is not degenerate: 40 tokens spread over most experts
            assert len(set(torch.topk(logits, 2).indices.flatten().tolist())) >= 6
        model = load_model(checkpoints[kind], torch.float32, CPU, max_positions=64)
        assert isinstance(model, cls)
        hf_bytes = sum(p.numel() * 4 for p in hf.parameters())
        assert module_bytes(model) >= hf_bytes  # every expert (and the packed projections: oneDNN may pad)
    assert ModelConfig.from_folder(checkpoints["qwen3_moe"]).qk_norm
    assert [ModelConfig.from_folder(checkpoints["qwen3_moe"]).is_moe_layer(i) for i in range(3)] == [True, False, True]
    sparse = ModelConfig(**{**vars(ModelConfig.from_folder(checkpoints["qwen3_moe"])), "decoder_sparse_step": 2,
                            "mlp_only_layers": ()})
    assert [sparse.is_moe_layer(i) for i in range(3)] == [False, True, False]


@pytest.mark.batch_invariant
@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_tokens_match_transformers_chunked_and_from_the_prefix_cache(
        kind: str, checkpoints: dict[str, Path], make_llm: Callable[..., LLM]) -> None:
    path = checkpoints[kind]
    llm = make_llm(str(path), kv_cache_bytes=4 << 20, max_num_seqs=4, max_num_batched_tokens=16)
    layers = llm.engine.worker.runner.model.layers
    assert [isinstance(layer.moe, FusedMoE) for layer in layers] == [True, kind == "mixtral", True]
    prompts = prompts_of(llm)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    again = llm.generate([prompts[-1]], GREEDY)[0]  # its full prompt blocks are cached now
    assert again.num_cached_tokens > 0 and again.token_ids == expected[-1]


@pytest.mark.batch_invariant
@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_tokens_match_transformers_under_preemption(kind: str, checkpoints: dict[str, Path],
                                                           make_llm: Callable[..., LLM]) -> None:
    """A cache of 5 blocks of 16 for four sequences needing 1 + 2 + 3 + 4 blocks: preempted ones recompute."""
    path = checkpoints[kind]
    per_block = ModelConfig.from_folder(path).kv_bytes_per_block(16, torch.float32)
    llm = make_llm(str(path), kv_cache_bytes=5 * per_block, max_model_len=64, max_num_seqs=4)
    prompts = prompts_of(llm)
    params = SamplingParams(temperature=0, max_tokens=16)
    assert [o.token_ids for o in llm.generate(prompts, params)] == hf_greedy(path, prompts, params.max_tokens)
    assert llm.engine.scheduler.num_preemptions > 0


def test_ngram_speculation_gives_the_same_greedy_tokens(checkpoints: dict[str, Path],
                                                         make_llm: Callable[..., LLM]) -> None:
    path = checkpoints["qwen3_moe"]
    llm = make_llm(str(path), kv_cache_bytes=4 << 20, max_num_seqs=4, speculative_config=NGRAM)
    prompts = prompts_of(llm)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, GREEDY.max_tokens)
    assert sum(o.spec_decoding.num_draft_tokens for o in outs if o.spec_decoding is not None) > 0


def test_structured_output_constrains_an_moe_model(checkpoints: dict[str, Path],
                                                   make_llm: Callable[..., LLM]) -> None:
    """A grammar's mask applies to the experts' logits as to a dense model's: random weights, valid output."""
    import json

    llm = make_llm(str(checkpoints["mixtral"]), kv_cache_bytes=4 << 20, max_num_seqs=4)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=24, structured_output={"json": schema})
    for out in llm.generate(prompts_of(llm)[:2], params):
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text)["n"], int)


def test_stacked_experts_load_as_per_expert_ones(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """transformers' in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) loads to the
    same weights as the per-expert names Hugging Face checkpoints hold."""
    from safetensors.torch import load_file, save_file

    for kind, block, gate, up, down in (("qwen3_moe", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
                                        ("mixtral", "block_sparse_moe.experts", "w1", "w3", "w2")):
        folder = tmp_path / kind
        shutil.copytree(checkpoints[kind], folder)
        tensors = load_file(folder / "model.safetensors")
        config = ModelConfig.from_folder(folder)
        for layer in (i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)):
            prefix = f"model.layers.{layer}."
            experts = range(config.num_experts)
            pop = [{n: tensors.pop(f"{prefix}{block}.{e}.{n}.weight") for n in (gate, up, down)} for e in experts]
            tensors[f"{prefix}mlp.experts.gate_up_proj"] = torch.stack([torch.cat([p[gate], p[up]]) for p in pop])
            tensors[f"{prefix}mlp.experts.down_proj"] = torch.stack([p[down] for p in pop])
            if kind == "mixtral":
                tensors[f"{prefix}mlp.gate.weight"] = tensors.pop(f"{prefix}block_sparse_moe.gate.weight")
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        per_expert = load_model(checkpoints[kind], torch.float32, CPU, max_positions=64).state_dict()
        stacked = load_model(folder, torch.float32, CPU, max_positions=64).state_dict()
        assert per_expert.keys() == stacked.keys()
        assert all(torch.equal(per_expert[k], stacked[k]) for k in per_expert)


def per_token_moe(moe: FusedMoE, w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE MLP one token and one expert at a time, from the interface's formula."""
    logits = moe.router(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        if moe.routing == "softmax_topk":
            probs = torch.softmax(logits[t], dim=-1)
            weights, ids = torch.topk(probs, moe.top_k)
            weights = weights / weights.sum() if moe.renormalize else weights
        else:
            top, ids = torch.topk(logits[t], moe.top_k)
            weights = torch.softmax(top, dim=-1)
        for weight, e in zip(weights.tolist(), ids.tolist(), strict=True):
            gate_up = w13[e] @ x[t] + (0 if w13_bias is None else w13_bias[e])
            gate, up = gate_up.chunk(2)
            if moe.activation == "silu":
                act = F.silu(gate) * up
            else:
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                act = gate * torch.sigmoid(1.702 * gate) * (up + 1)
            out[t] += weight * (w2[e] @ act + (0 if w2_bias is None else w2_bias[e]))
    return out


def random_moe(routing: str = "softmax_topk", gpt_oss: bool = False, top_k: int = 2) -> FusedMoE:
    torch.manual_seed(0)
    moe = FusedMoE(32, 16, 8, top_k, get_attention_backend("torch", CPU), routing=routing, renormalize=False,
                   activation="swiglu_oai" if gpt_oss else "silu", router_bias=gpt_oss, expert_bias=gpt_oss)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    return moe


@pytest.mark.parametrize("forced,top_k", [((5,), 1), ((5, 3), 2), ((), 2)],
                         ids=["every token to expert 5", "every token to experts 5 and 3", "spread"])
@torch.inference_mode()
def test_fused_moe_matches_a_per_token_loop(forced: tuple[int, ...], top_k: int) -> None:
    """Routing forced through the router's weights (tokens whose features are all positive: a router row of
    positive weights wins), so most experts are idle, or left spread."""
    moe = random_moe(top_k=top_k)
    x = torch.randn(9, 32)
    if forced:
        x = x.abs() + 1.0
        moe.router.weight.fill_(-0.02)
        for rank, expert in enumerate(forced):
            moe.router.weight[expert] = 0.02 - 0.005 * rank
    expected = per_token_moe(moe, moe.w13.clone(), moe.w2.clone(), x)
    picked = set(torch.topk(moe.router(x), top_k).indices.flatten().tolist())
    assert picked == set(forced) if forced else len(picked) >= 6
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_fused_moe_gpt_oss_form_matches_a_per_token_loop() -> None:
    """A router bias and top-k-then-softmax routing, expert biases, the swiglu_oai activation (clamps reached)."""
    moe = random_moe("topk_softmax", gpt_oss=True)
    x = 4 * torch.randn(7, 32)
    expected = per_token_moe(moe, moe.w13.clone(), moe.w2.clone(), x, moe.w13_bias, moe.w2_bias)
    assert moe.w13_bias is not None and moe.w2_bias is not None
    assert bool((torch.einsum("eih,th->tei", moe.w13, x).abs() > 7).any())  # the clamps matter
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["lora", "int8", "int4"])
def test_lora_and_quantization_of_an_moe_model_are_refused_by_name(case: str, checkpoints: dict[str, Path]) -> None:
    for kind, arch in (("qwen3_moe", "Qwen3MoeForCausalLM"), ("mixtral", "MixtralForCausalLM")):
        asked: dict[str, Any] = {"enable_lora": True} if case == "lora" else {"quantization": case}
        message = "enable_lora: LoRA" if case == "lora" else f"quantization '{case}'"
        with pytest.raises(ModelFolderError, match=f"{message} of a mixture-of-experts model \\({arch}\\)"):
            LLM(str(checkpoints[kind]), kv_cache_bytes=4 << 20, **asked)


@pytest.mark.parametrize("kind,changes,message", [
    ("qwen3_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok 9 \(supported: 1..8\)"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step 0"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size 64"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
], ids=["top k over the experts", "sparse step 0", "shared experts", "mixtral activation"])
def test_what_moe_configs_ask_for_unimplemented_is_refused(kind: str, changes: dict[str, Any], message: str,
                                                           checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match=message):
        LLM(str(edited(checkpoints[kind], tmp_path / "m", **changes)))


def test_a_missing_expert_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(checkpoints["mixtral"], folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.7.w3.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFolderError, match=r"incomplete expert weights for layers\.2\.moe\.w13 \(15 of 16"):
        LLM(str(folder))


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("kind", FAMILIES)
def test_triton_backend_matches_transformers(kind: str, checkpoints: dict[str, Path],
                                             make_llm: Callable[..., LLM]) -> None:
    """Through the Triton kernels, fused_moe included (interpreter on a CPU): chunked prefills, decodes, a prefix
    hit."""
    path = checkpoints[kind]
    llm = make_llm(str(path), attention_backend="triton", kv_cache_bytes=4 << 20, max_model_len=128,
                   max_num_seqs=4, max_num_batched_tokens=16)
    assert llm.engine.worker_info.attention_backend == "triton"
    prompts = prompts_of(llm)[1:]
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = hf_greedy(path, prompts, 8)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    again = llm.generate([prompts[-1]], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == expected[-1]
