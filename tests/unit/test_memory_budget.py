"""The KV cache budget: gpu_memory_utilization arithmetic (numbers), the repository's shares of one GPU,
and an engine that cannot hold one full-length sequence refusing to start."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tritium.backend import LLM, EngineConfig
from tritium.backend.model_config import ModelConfig
from tritium.backend.serving.settings import load_settings
from tritium.backend.worker.memory_budget import (
    CAPTURE_STREAM_WORKSPACE_BYTES,
    CUDA_OVERHEAD_BYTES,
    SAMPLER_BYTES_PER_LOGIT,
    GiB,
    MiB,
    check_fits_one_sequence,
    check_free_memory,
    estimate_activation_bytes,
    estimate_graph_pool_bytes,
    estimate_sampler_bytes,
    kv_cache_budget,
    module_bytes,
    plan_memory,
)
from tritium.client.triton.launcher import PACKAGE_REPOSITORY

TINY_BLOCK_BYTES = 2 * 3 * 2 * 16 * 4 * 16  # K and V x 3 layers x 2 KV heads x head_dim 16 x fp32 x 16 tokens


def test_kv_budget_is_the_share_less_weights_activations_and_overhead() -> None:
    # An 80 GiB GPU, a 45% share: 36 GiB, less 16 GiB of weights, 2 GiB of activations, 1 GiB overhead.
    assert kv_cache_budget(80 * GiB, 0.45, 16 * GiB, 2 * GiB, overhead_bytes=GiB) == 17 * GiB
    # Two engines at 0.45 and 0.40 of one H200 (141 GiB) leave each a disjoint KV cache.
    a = kv_cache_budget(141 * GiB, 0.45, 270 * MiB, 100 * MiB)
    b = kv_cache_budget(141 * GiB, 0.40, 270 * MiB, 100 * MiB)
    assert a + b + 2 * (270 + 100) * MiB + 2 * CUDA_OVERHEAD_BYTES <= 0.85 * 141 * GiB
    assert a - b == int(0.45 * 141 * GiB) - int(0.40 * 141 * GiB)


def test_kv_budget_refuses_a_share_the_weights_do_not_fit() -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.1 of 80.00 GiB is 8.00 GiB.*weights \(16.00 GiB\)"):
        kv_cache_budget(80 * GiB, 0.1, 16 * GiB, GiB)


def test_free_memory_check_names_both_numbers() -> None:
    check_free_memory(10 * GiB, GiB, 11 * GiB, 0.5)  # exactly fits
    with pytest.raises(ValueError, match=r"need 11.00 GiB, but only 10.00 GiB of the device is free"):
        check_free_memory(10 * GiB, GiB, 10 * GiB, 0.5)


def test_one_full_length_sequence_must_fit() -> None:
    check_fits_one_sequence(10, 16, 1024, 160, 0)  # 10 blocks of 16 hold exactly 160 tokens
    with pytest.raises(ValueError, match=r"holds 10 blocks \(160 tokens.*max_model_len 161 tokens = 11 blocks"):
        check_fits_one_sequence(10, 16, 1024, 161, 5 * MiB)


def test_activation_estimate_by_hand() -> None:
    config = ModelConfig("LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
                         tie_word_embeddings=True, attention_bias=False)
    per_token = 4 * 64 + 2 * (4 + 2 * 2) * 16 + 4 * 16 + 3 * 128  # 960 elements
    expected = 2 * (100 * per_token * 2 + 8 * 1000 * (2 + 4))
    assert estimate_activation_bytes(config, num_tokens=100, num_logit_rows=8, dtype_bytes=2) == expected


def test_module_bytes_counts_parameters_buffers_and_packed_weights() -> None:
    linear = torch.nn.Linear(4, 3)
    assert module_bytes(linear) == (12 + 3) * 4
    linear.register_buffer("table", torch.zeros(5, dtype=torch.float16))
    assert module_bytes(linear) == (12 + 3) * 4 + 5 * 2


def test_gpu_memory_utilization_is_validated() -> None:
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineConfig(gpu_memory_utilization=bad)


def test_repository_engines_share_one_gpu() -> None:
    shares = {}
    for name in ("tritium", "tritium_ids"):
        raw = json.loads((PACKAGE_REPOSITORY / name / "1" / "model.json").read_text())
        assert "gpu_memory_utilization" in raw, name
        shares[name] = load_settings(PACKAGE_REPOSITORY / name / "1").engine.gpu_memory_utilization
        assert shares[name] == raw["gpu_memory_utilization"] > 0
    assert sum(shares.values()) <= 0.9, shares


def test_engine_that_cannot_hold_one_sequence_refuses_to_start(make_llm: Callable[..., LLM],
                                                               tiny_llama_path: Path) -> None:
    # The tiny Llama's context is 1024 tokens = 64 blocks; 10 blocks cannot hold it.
    with pytest.raises(ValueError, match=r"holds 10 blocks \(160 tokens.*max_model_len 1024 tokens = 64 blocks"):
        LLM(str(tiny_llama_path), kv_cache_bytes=10 * TINY_BLOCK_BYTES)
    llm = make_llm(str(tiny_llama_path), kv_cache_bytes=10 * TINY_BLOCK_BYTES, max_model_len=160)
    assert llm.engine.block_manager.num_blocks == 10 and llm.engine.max_model_len == 160


def test_kv_cache_bytes_wins_over_gpu_memory_utilization(make_llm: Callable[..., LLM], tiny_llama_path: Path) -> None:
    llm = make_llm(str(tiny_llama_path), kv_cache_bytes=100 * TINY_BLOCK_BYTES, gpu_memory_utilization=0.01)
    assert llm.engine.block_manager.num_blocks == 100


def _small_config() -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
                       tie_word_embeddings=True, attention_bias=False)


def test_the_plan_counts_the_graph_pool_and_the_sampler() -> None:
    config = _small_config()
    per_token = 4 * 64 + 2 * (4 + 2 * 2) * 16 + 4 * 16 + 3 * 128  # 960 elements, as above
    # 8 GiB at 0.5, 1 GiB of weights, 512 tokens a step, 32 sequences, graphs up to 32 rows, bf16
    plan = plan_memory(config, 8 * GiB, 0.5, GiB, 512, 32, 32, 2, overhead_bytes=512 * MiB)
    activations = 2 * (512 * per_token * 2 + 32 * 1000 * (2 + 4))
    graph_pool = 2 * (32 * per_token * 2) + CAPTURE_STREAM_WORKSPACE_BYTES  # the largest bucket, no logits
    sampler = 32 * 1000 * SAMPLER_BYTES_PER_LOGIT + 33 * 1001 * 5  # and the penalty rows of 32 requests
    assert (plan.activations, plan.graph_pool, plan.sampler) == (activations, graph_pool, sampler)
    assert plan.kv_cache == 4 * GiB - GiB - 512 * MiB - activations - graph_pool - sampler
    assert plan.torch_bytes == GiB + plan.kv_cache + activations + graph_pool + sampler == 4 * GiB - 512 * MiB
    eager = plan_memory(config, 8 * GiB, 0.5, GiB, 512, 32, 0, 2, overhead_bytes=512 * MiB)
    assert eager.graph_pool == 0 and eager.kv_cache == plan.kv_cache + graph_pool


def test_the_pool_and_sampler_estimates_by_hand() -> None:
    config = _small_config()
    assert estimate_graph_pool_bytes(config, 0, 2) == 0
    assert estimate_graph_pool_bytes(config, 8, 2) == estimate_activation_bytes(config, 8, 0, 2) + 32 * MiB
    # The default model (vocabulary 49,152) sampling 64 rows: 192 MiB of top-k / top-p temporaries, and 15.2 MiB
    # of penalty rows (seen and counts for 64 requests and the empty row).
    assert estimate_sampler_bytes(64, 49152) == 192 * MiB + 65 * 49153 * 5


def test_a_plan_whose_terms_exceed_the_share_is_refused() -> None:
    # 0.1 of 8 GiB is 819 MiB: the sampler alone (1,024 rows x 150k vocabulary x 64 B = 9.2 GiB) does not fit.
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.1 of 8.00 GiB"):
        plan_memory(_small_config(), 8 * GiB, 0.1, 0, 512, 1024, 0, 2)


def test_on_cuda_adapters_and_a_draft_model_come_out_of_the_share(monkeypatch: pytest.MonkeyPatch) -> None:
    from tritium.backend.models.llama import LlamaForCausalLM
    from tritium.backend.worker.kv_sizing import num_kv_blocks

    config, model = _small_config(), LlamaForCausalLM(_small_config())
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # K and V x 2 layers x 2 KV heads x head_dim 16 x fp32 x 16 tokens
    # No CUDA here: the device's (free, total) is the one thing num_kv_blocks asks of it.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (8 * GiB, 8 * GiB))
    engine = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256)
    cuda = torch.device("cuda")

    def blocks(**kwargs: int) -> int:
        return num_kv_blocks(engine, model, cuda, torch.float32, 128, **kwargs).num_blocks

    plain = num_kv_blocks(engine, model, cuda, torch.float32, 128)
    assert plain.plan is not None and plain.num_blocks == plain.plan.kv_cache // per_block
    assert blocks(resident_bytes=100 * per_block) == plain.num_blocks - 100  # adapter slots / draft weights
    assert blocks(planned_block_bytes=per_block) == plain.num_blocks // 2  # a draft cache as large as the target's
    spec_rows = num_kv_blocks(engine, model, cuda, torch.float32, 128, logit_rows=8 * 5).plan
    assert spec_rows is not None and spec_rows.sampler == estimate_sampler_bytes(40, config.vocab_size)
