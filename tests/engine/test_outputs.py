"""The engine's outputs are delta-only: a step's output carries what is new, never the request's whole text,
token list or logprobs (the final output alone carries the totals), so the work per output does not grow
with the length of the generation."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tritium.backend import LLM, SamplingParams
from tritium.backend.models.random_checkpoint import write_random_llama
from tritium.backend.outputs import RequestOutput


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("random-llama"), default_model_path,
                              max_position_embeddings=4096)


def stream(llm: LLM, prompt: str, params: SamplingParams, monkeypatch: pytest.MonkeyPatch
           ) -> tuple[list[RequestOutput], list[int]]:
    """Every output of one request, and the bytes the output side (`OutputProcessor`: detokenizing, stop strings,
    building the output) allocated at its peak in each step, as tracemalloc counts them."""
    engine, step_bytes = llm.engine, [0]

    def traced(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            tracemalloc.start()
            try:
                return method(*args)
            finally:
                step_bytes[0] += tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
        return call

    for name in ("append_token", "output"):
        monkeypatch.setattr(engine.outputs, name, traced(getattr(engine.outputs, name)))
    engine.add_request("r", prompt, params)
    outputs, per_step = [], []
    while engine.has_unfinished_requests():
        step_bytes[0] = 0
        outputs += engine.step()
        per_step.append(step_bytes[0])
    return outputs, per_step


@pytest.mark.slow  # 2,000 tokens on a random 2k-context model (~100 s)
def test_a_2000_token_generation_streams_deltas_only(make_llm: Callable[..., LLM], long_context_model: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make_llm(str(long_context_model), kv_cache_bytes=64 << 20)
    params = SamplingParams(max_tokens=2000, temperature=1.0, seed=7, ignore_eos=True, logprobs=1)
    outputs, step_bytes = stream(llm, "Once upon a time", params, monkeypatch)
    *steps, final = outputs
    assert len(steps) == 1999 and final.finished and final.finish_reason == "length"
    for out in steps:
        assert not out.finished
        assert len(out.delta_token_ids) == 1 and len(out.delta_logprobs or []) == 1
        assert out.text == "" and out.token_ids == [] and out.logprobs is None  # no totals before the end
        assert len(out.delta_text) < 100
    assert final.num_output_tokens == len(final.token_ids) == 2000
    assert final.token_ids == [t for out in outputs for t in out.delta_token_ids]
    assert final.text == "".join(out.delta_text for out in outputs)
    assert final.logprobs == [lp for out in outputs for lp in out.delta_logprobs or []]
    assert final.text == llm.tokenizer.decode(final.token_ids)
    # The per-step output work does not grow with the length: the median step of the last 300 allocates what one
    # of steps 300-600 does (past 256 tokens, where counts stop being Python's cached small ints), give or take a
    # word or two of text; a copy of the whole text or token list per step would add kilobytes.
    early, late = sorted(step_bytes[300:600]), sorted(step_bytes[-300:])
    assert late[150] <= early[150] + 64, (early[150], late[150])


def test_stop_strings_and_a_seeded_request_keep_their_text_in_deltas(make_llm: Callable[..., LLM],
                                                                       long_context_model: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make_llm(str(long_context_model), kv_cache_bytes=64 << 20)
    free = llm.generate("Tell me", SamplingParams(max_tokens=200, temperature=1.0, seed=3))[0]
    words = free.text.split()
    assert len(words) > 5
    stop = words[4]
    outputs, _ = stream(llm, "Tell me", SamplingParams(max_tokens=200, temperature=1.0, seed=3, stop=[stop]),
                        monkeypatch)
    final = outputs[-1]
    assert final.finish_reason == "stop" and stop not in final.text
    assert free.text.startswith(final.text) and final.text == "".join(o.delta_text for o in outputs)
