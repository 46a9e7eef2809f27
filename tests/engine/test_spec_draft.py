"""Speculative decoding with a draft model: the default model as its own draft accepts every draft, a copy with
fewer layers is rejected often; greedy output is token-identical to decoding without speculation either way."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tritium.backend import LLM, SamplingParams
from tritium.backend.outputs import RequestOutput

PROMPTS = ["Once upon a time,", "The capital of France is", "Write a list of three fruits:"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE = {"kv_cache_bytes": 32 << 20, "max_model_len": 256}


@pytest.fixture(scope="module")
def shallow_model(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    """The default model's first 8 of 30 layers (same tokenizer and head): a weaker drafter."""
    dest = tmp_path_factory.mktemp("shallow")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(default_model_path / name, dest / name)
    config = json.loads((default_model_path / "config.json").read_text())
    config["num_hidden_layers"] = 8
    (dest / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(default_model_path / "model.safetensors"))
    keep = {k: v for k, v in tensors.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < 8}
    save_file(keep, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


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
