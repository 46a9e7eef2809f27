"""The engine and LLM API on real checkpoints: bad input, streaming, stops, seeds, aborts, faults."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tritium.backend import LLM, SamplingParams
from tritium.backend.testing.faults import FaultInjector


@pytest.fixture
def tiny(make_llm: Callable[..., LLM], tiny_llama_path: Path) -> LLM:
    return make_llm(str(tiny_llama_path), kv_cache_bytes=16 << 20)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"prompt": ""}, "prompt must not be empty"),
        ({"prompt": "word " * 1100}, "the model's context is 1024 tokens"),
        ({"prompt": None, "prompt_token_ids": [1, 10**6]}, "prompt_token_ids must be in"),
    ],
)
def test_bad_requests_raise_before_touching_the_engine(tiny: LLM, kwargs: dict, message: str) -> None:
    engine = tiny.engine
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", params=SamplingParams(), **kwargs)
    assert not engine.requests and not engine.scheduler.waiting
    assert tiny.generate("still serving", SamplingParams(max_tokens=3, temperature=0))[0].finish_reason == "length"


def test_max_tokens_beyond_the_context_is_refused(tiny: LLM) -> None:
    with pytest.raises(ValueError, match=r"max_tokens \(1000000000\) \+ prompt \(\d+ tokens\) exceeds the model"):
        tiny.engine.add_request("huge", "hello", SamplingParams(max_tokens=10**9))
    assert not tiny.engine.requests


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(tiny: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny.engine
    limit = engine.max_model_len * engine.tokenizer.max_token_bytes
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized a hopeless prompt"))
    with pytest.raises(ValueError, match="longer than the model's context of 1024 tokens could hold"):
        engine.add_request("long", "x" * (limit + 1), SamplingParams())


def test_an_engine_whose_kv_cache_cannot_hold_one_full_sequence_refuses_to_start(tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match=r"holds 4 blocks .* fewer than one full-length sequence needs"):
        LLM(str(tiny_llama_path), kv_cache_bytes=4 * 2 * 3 * 2 * 16 * 16 * 4)  # 4 blocks = 64 tokens of 1024


def test_streaming_deltas_add_up_to_the_final_text(tiny: LLM) -> None:
    engine = tiny.engine
    engine.add_request("s", "Once upon a time", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    deltas, ids, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.delta_text)
            ids.extend(out.delta_token_ids)
            final = out
    assert final is not None and final.finished and final.finish_reason == "length"
    assert "".join(deltas) == final.text and ids == final.token_ids and len(ids) == 20
    assert final.num_input_tokens == len(tiny.tokenizer.encode("Once upon a time"))


def test_stop_string_ends_text_before_it(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(None, kv_cache_bytes=32 << 20, max_model_len=512)
    free = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0))[0]
    assert "Paris" in free.text
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, stop=["Paris"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index("Paris")]


@pytest.mark.batch_invariant
def test_seeded_sampling_repeats_whatever_the_batch(tiny: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    alone = tiny.generate("The weather", params)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 5
    prompts = ["Other prompt", "The weather", "x y z", "more", "and more", "!"]
    batch = tiny.generate(prompts, [others[0], params, *others[1:]])
    assert batch[1].token_ids == alone
    unseeded = [o.token_ids for o in tiny.generate(["The weather"] * 4, others[0])]
    assert len({tuple(u) for u in unseeded}) > 1


def test_stop_token_ids_and_min_tokens(tiny: LLM) -> None:
    out = tiny.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))[0]
    first = out.token_ids[0]
    stopped = tiny.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = tiny.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, min_tokens=3,
                                                     stop_token_ids=[first]))[0]
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_eos_stops_unless_ignore_eos_and_min_tokens_hold_it_back(make_llm: Callable[..., LLM],
                                                                 tiny_llama_path: Path, tmp_path: Path) -> None:
    """A copy of the tiny model whose EOS is the token it generates first, so EOS comes at once."""
    first = make_llm(str(tiny_llama_path), kv_cache_bytes=16 << 20).generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    folder = tmp_path / "tiny-eos"
    shutil.copytree(tiny_llama_path, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    llm = make_llm(str(folder), kv_cache_bytes=16 << 20)
    assert llm.engine.eos_token_ids == [first]
    stopped = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    ignored = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(ignored.token_ids) == 8 and ignored.token_ids[0] == first and ignored.finish_reason == "length"
    held = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, min_tokens=3))[0]
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_logprobs_returned_per_token(tiny: LLM) -> None:
    out = tiny.generate("Hello", SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for tid, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert tid in entry and len(entry) >= 3
        assert entry[tid] == max(entry.values())  # greedy picks the most likely


def test_abort_frees_blocks_and_reports_abort(tiny: LLM) -> None:
    engine = tiny.engine
    engine.add_request("a", "A long story begins", SamplingParams(max_tokens=500, ignore_eos=True))
    engine.add_request("b", "Another one", SamplingParams(max_tokens=5, temperature=0))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort("a")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.finish_reason
    assert finals == {"a": "abort", "b": "length"}


def test_injected_fault_fails_only_the_requests_of_that_step(tiny: LLM) -> None:
    engine = tiny.engine
    FaultInjector("<<poison>>").install(engine)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("running", "Once upon a time", greedy)
    engine.step()
    engine.add_request("poison", "<<poison>> and more", greedy)
    outs = {o.request_id: o for o in engine.step()}
    assert {k: o.finish_reason for k, o in outs.items()} == {"running": "error", "poison": "error"}
    assert all(o.error == "the model step failed" for o in outs.values())
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    after = tiny.generate("Once upon a time", greedy)[0]
    assert after.finish_reason == "length" and len(after.token_ids) == 6


def test_bf16_generates(make_llm: Callable[..., LLM], tiny_llama_path: Path) -> None:
    llm = make_llm(str(tiny_llama_path), dtype="bfloat16", kv_cache_bytes=8 << 20)
    assert llm.engine.dtype == torch.bfloat16
    out = llm.generate(["Hello there", "Bye"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in out)


def test_chat_applies_the_template(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(None, kv_cache_bytes=32 << 20, max_model_len=512)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0))
    assert out[0].prompt_token_ids[0] == llm.tokenizer.token_to_id("<|im_start|>")
    assert "Paris" in out[0].text
