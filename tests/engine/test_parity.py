"""Greedy outputs are token-identical to transformers, alone and under every batching regime."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tritium.backend import LLM, SamplingParams

from support.hf_reference import hf_greedy

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "List three prime numbers and explain why each of them is prime, step by step.",
    "def fibonacci(n):",
    "The history of the Roman Empire began",
    "Translate to French: I would like a cup of coffee, please, and a croissant with butter.",
    "Hi",
    "Explain how a paged KV cache works in an LLM inference engine, and why it helps when many "
    "requests of different lengths are served at the same time on a single GPU.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def chat_ids(llm: LLM, texts: list[str]) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), False) for t in texts]


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def smol_prompts(default_model_path: Path) -> list[list[int]]:
    llm = LLM(default_model_path, kv_cache_bytes=64 << 20, max_model_len=1024)
    return chat_ids(llm, PROMPTS)


@pytest.fixture(scope="module")
def smol_expected(default_model_path: Path, smol_prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(default_model_path, smol_prompts, 32)


@pytest.mark.batch_invariant
@pytest.mark.slow  # the default model against transformers: the tiny models cover the inner loop
def test_default_model_batched(make_llm: Callable[..., LLM], default_model_path: Path,
                               smol_prompts: list[list[int]], smol_expected: list[list[int]]) -> None:
    llm = make_llm(None, kv_cache_bytes=256 << 20, max_model_len=4096)
    assert generate_ids(llm, smol_prompts) == smol_expected
    assert any(len(e) == 32 for e in smol_expected)


@pytest.mark.slow  # the default model against transformers: the tiny models cover the inner loop
def test_default_model_one_at_a_time(make_llm: Callable[..., LLM], smol_prompts: list[list[int]],
                                     smol_expected: list[list[int]]) -> None:
    llm = make_llm(None, kv_cache_bytes=64 << 20, max_model_len=1024, enable_prefix_caching=False)
    assert [generate_ids(llm, [p])[0] for p in smol_prompts] == smol_expected


@pytest.mark.batch_invariant
@pytest.mark.slow  # the default model against transformers: the tiny models cover the inner loop
def test_default_model_chunked_prefill(make_llm: Callable[..., LLM], smol_prompts: list[list[int]],
                                       smol_expected: list[list[int]]) -> None:
    llm = make_llm(None, kv_cache_bytes=64 << 20, max_model_len=1024, max_num_seqs=4,
                   max_num_batched_tokens=13)
    assert generate_ids(llm, smol_prompts) == smol_expected
    assert llm.engine.stats.steps > 0


@pytest.mark.batch_invariant
@pytest.mark.slow  # the default model against transformers: the tiny models cover the inner loop
def test_default_model_preemption(make_llm: Callable[..., LLM], smol_prompts: list[list[int]],
                                  smol_expected: list[list[int]]) -> None:
    longest = max(len(p) for p in smol_prompts) + 32
    blocks = -(-longest // 16) + 2  # enough for any one request, far too few for all at once
    llm = make_llm(None, kv_cache_bytes=blocks * 2 * 30 * 3 * 64 * 4 * 16, max_model_len=blocks * 16,
                   enable_prefix_caching=False)
    assert llm.engine.block_manager.num_blocks == blocks
    assert generate_ids(llm, smol_prompts) == smol_expected
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.batch_invariant
@pytest.mark.slow  # the default model against transformers: the tiny models cover the inner loop
def test_default_model_prefix_cache_hit(make_llm: Callable[..., LLM], default_model_path: Path,
                                        smol_prompts: list[list[int]], smol_expected: list[list[int]]) -> None:
    llm = make_llm(None, kv_cache_bytes=64 << 20, max_model_len=1024)
    generate_ids(llm, [smol_prompts[7]])  # fills the cache with the system prompt + a long question
    bm = llm.engine.block_manager
    before = bm.prefix_hit_tokens
    outs = llm.generate(smol_prompts, GREEDY)
    assert [o.token_ids for o in outs] == smol_expected
    assert bm.prefix_hit_tokens > before
    assert outs[7].num_cached_tokens >= 16 * ((len(smol_prompts[7]) - 1) // 16)
    assert all(o.num_cached_tokens >= 16 for o in outs)  # the shared system prompt


@pytest.mark.batch_invariant
@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path", "tiny_llama_sharded_path"])
def test_tiny_models_match_transformers(make_llm: Callable[..., LLM], request: pytest.FixtureRequest,
                                        fixture: str) -> None:
    path = request.getfixturevalue(fixture)
    llm = make_llm(str(path), kv_cache_bytes=32 << 20)
    prompts = [llm.tokenizer.encode(t) for t in PROMPTS] + [llm.tokenizer.encode(" ".join(PROMPTS) * 2)]
    expected = hf_greedy(path, prompts, 24)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    assert generate_ids(llm, prompts, params) == expected
    chunked = make_llm(str(path), kv_cache_bytes=32 << 20, max_num_seqs=3, max_num_batched_tokens=7)
    assert generate_ids(chunked, prompts, params) == expected
