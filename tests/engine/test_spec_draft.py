"""Speculative decoding with a draft model: the default model as its own draft accepts every draft, a copy with
fewer layers is rejected often; greedy output is token-identical to decoding without speculation either way."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tritium.backend import LLM, SamplingParams
from tritium.backend.outputs import RequestOutput
from tritium.backend.spec.draft_model import draft_footprint
from tritium.backend.worker.memory_budget import module_bytes
from tritium.client.bench.spec import truncated_copy

PROMPTS = ["Once upon a time,", "The capital of France is", "Write a list of three fruits:"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE = {"kv_cache_bytes": 32 << 20, "max_model_len": 256}


@pytest.fixture(scope="module")
def shallow_model(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    """The default model's first 8 of 30 layers (same tokenizer and head): a weaker drafter."""
    return truncated_copy(default_model_path, tmp_path_factory.mktemp("shallow"), 8)


def stats(outs: list[RequestOutput]) -> tuple[int, int]:
    s = [o.spec_decoding for o in outs if o.spec_decoding is not None]
    return sum(x.num_draft_tokens for x in s), sum(x.num_accepted_tokens for x in s)


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
def test_the_default_model_as_its_own_draft_accepts_everything(make_llm: Callable[..., LLM],
                                                                default_model_path: Path) -> None:
    base = make_llm(None, **ENGINE)
    spec = make_llm(None, speculative_config={"method": "draft_model", "model": str(default_model_path),
                                              "num_speculative_tokens": 3}, **ENGINE)
    a, b = base.generate(PROMPTS, PARAMS), spec.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in b] == [o.token_ids for o in a]
    drafted, accepted = stats(b)
    assert drafted > 20 and accepted == drafted


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
def test_a_shallow_draft_is_rejected_and_rolled_back_exactly(make_llm: Callable[..., LLM],
                                                              shallow_model: Path) -> None:
    base = make_llm(None, **ENGINE)
    spec = make_llm(None, speculative_config={"method": "draft_model", "model": str(shallow_model),
                                              "num_speculative_tokens": 3}, **ENGINE)
    a, b = base.generate(PROMPTS, PARAMS), spec.generate(PROMPTS, PARAMS)
    assert [(o.token_ids, o.text) for o in b] == [(o.token_ids, o.text) for o in a]
    drafted, accepted = stats(b)
    assert 0 < accepted < drafted
    proposer = spec.engine.worker.proposer
    drafter = proposer.drafter if proposer is not None else None
    assert drafter is not None  # what the memory plan leaves for it covers what it took
    per_block = sum(k.nbytes + v.nbytes for k, v in drafter.kv_caches) // spec.engine.worker_info.num_blocks
    weights, block = draft_footprint(str(shallow_model), torch.float32, 16)
    # On a CPU the tied logits projection is packed as a copy (module_bytes counts it); CUDA shares it.
    tied_copy = drafter.model.embed_tokens.weight.nbytes
    assert block == per_block and 0 <= module_bytes(drafter.model) - tied_copy - weights < 1 << 20  # + rotary tables
    seeded = SamplingParams(temperature=0.8, max_tokens=16, seed=5, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(PROMPTS, seeded)] == \
        [o.token_ids for o in spec.generate(PROMPTS, seeded)]


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_qwen2_path: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_qwen2_path, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 1000
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"speculative_config\.model .* vocabulary of 1000 tokens"):
        LLM(None, speculative_config={"method": "draft_model", "model": str(other), "num_speculative_tokens": 2},
            **ENGINE)


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
def test_a_draft_model_under_preemption_is_greedy_identical(make_llm: Callable[..., LLM],
                                                            default_model_path: Path) -> None:
    """The default model as its own draft accepts everything only if a preempted request's draft cache is
    rebuilt (its blocks, the draft's KV in them included, were freed)."""
    block = 30 * 2 * 3 * 64 * 4 * 16
    # 20 blocks of 16 tokens: four requests of ~100 tokens cannot all stay.
    engine = {"kv_cache_bytes": 20 * block, "max_model_len": 256, "max_num_seqs": 4}
    prompts = [f"{i}: " + "The river rose slowly through the night and the fields were under water. " * 4
               for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = make_llm(None, **engine)
    spec = make_llm(None, speculative_config={"method": "draft_model", "model": str(default_model_path),
                                              "num_speculative_tokens": 3}, **engine)
    a, b = base.generate(prompts, params), spec.generate(prompts, params)
    assert [o.token_ids for o in b] == [o.token_ids for o in a]
    drafted, accepted = stats(b)
    assert spec.engine.scheduler.num_preemptions > 0 and accepted == drafted > 0
