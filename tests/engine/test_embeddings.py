"""Embeddings in process (LLMEngine.embed / LLM.embed) against transformers' AutoModel hidden states pooled the same
way, in fp32 (docs/architecture.md, "Embeddings")."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch

from tritium.backend import LLM
from tritium.backend.worker.pooling import PoolingConfig

TEXTS = ["Hello world", "The capital of France is Paris, and the capital of Italy is Rome.",
         "a", "Embeddings pool the final hidden states of every token of a prompt into one vector " * 3]


@cache
def _hf_model(path: str) -> torch.nn.Module:
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def hf_embeddings(path: Path, prompts: list[list[int]], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' last_hidden_state of each prompt alone (no padding), pooled."""
    model = _hf_model(str(path))
    out = []
    with torch.inference_mode():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0].float()
            vector = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[pooling]
            out.append(torch.nn.functional.normalize(vector, dim=-1) if normalize else vector)
    return torch.stack(out)


def _llm(make_llm: Callable[..., LLM], path: Path, **kwargs: object) -> LLM:
    settings: dict[str, object] = {"max_model_len": 512} | kwargs
    return make_llm(str(path), dtype="float32", device="cpu", kv_cache_bytes=32 << 20, max_num_seqs=4,
                    max_num_batched_tokens=32, **settings)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_default_model_matches_transformers(make_llm: Callable[..., LLM], default_model_path: Path, pooling: str,
                                            normalize: bool) -> None:
    """Inputs of different lengths, max_num_batched_tokens 32: several passes, the longest input alone."""
    llm = _llm(make_llm, default_model_path)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    assert max(map(len, prompts)) > 32 and sum(map(len, prompts)) > 2 * 32
    ours = llm.engine.embed(prompts, PoolingConfig(pooling, normalize))
    torch.testing.assert_close(ours, hf_embeddings(default_model_path, prompts, pooling, normalize),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_tiny_random_checkpoint_matches_transformers(make_llm: Callable[..., LLM], tiny_llama_path: Path,
                                                     pooling: str) -> None:
    llm = _llm(make_llm, tiny_llama_path, embedding_pooling=pooling)
    assert llm.engine.pooling == PoolingConfig(pooling, True, source="settings")
    prompts = [llm.tokenizer.encode(t) for t in TEXTS] + [[5, 6, 7] * 20]  # 9 inputs: more than max_num_seqs
    prompts += prompts[:4]
    ours = torch.tensor(llm.embed(prompts))
    torch.testing.assert_close(ours, hf_embeddings(tiny_llama_path, prompts, pooling, True), rtol=1e-5, atol=1e-5)


def test_batched_equals_alone(make_llm: Callable[..., LLM], tiny_llama_path: Path) -> None:
    llm = _llm(make_llm, tiny_llama_path, embedding_pooling="mean")
    together = torch.tensor(llm.embed(TEXTS))
    alone = torch.tensor([llm.embed(t)[0] for t in TEXTS])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_embedding_between_generation_steps_leaves_requests_alone(make_llm: Callable[..., LLM],
                                                                  tiny_llama_path: Path) -> None:
    from tritium.backend import SamplingParams

    llm = _llm(make_llm, tiny_llama_path)
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = llm.generate(["Hello there"], params)[0].token_ids
    engine = llm.engine
    engine.add_request("r", "Hello there", params)
    tokens = [t for out in engine.step() for t in out.delta_token_ids]
    engine.embed([llm.tokenizer.encode(t) for t in TEXTS])  # between steps: blocks taken and given back
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.delta_token_ids
    assert tokens == expected


def test_refusals_name_the_input(make_llm: Callable[..., LLM], tiny_llama_path: Path) -> None:
    llm = _llm(make_llm, tiny_llama_path, max_model_len=64)
    with pytest.raises(ValueError, match=r"input 1 is 65 tokens; the model's context is 64 tokens"):
        llm.engine.embed([[1, 2], [3] * 65])
    with pytest.raises(ValueError, match=r"input 0 must not be empty"):
        llm.engine.embed([[]])
    with pytest.raises(ValueError, match=r"input 2: token ids must be in \[0, 49152\)"):
        llm.engine.embed([[1], [2], [49152]])
    assert len(llm.embed([[3] * 64])[0]) == 64  # the whole context fits (no generated token needed)
    with pytest.raises(ValueError, match="embedding_pooling must be one of 'last', 'mean', 'cls'"):
        LLM(str(tiny_llama_path), embedding_pooling="max")
