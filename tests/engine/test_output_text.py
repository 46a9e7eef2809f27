"""A request's text is exactly what its tokens say: streamed deltas join to the final text, and the final text is
the decode of the final tokens, cut only at the first stop string (through it with
include_stop_str_in_output), whatever ended the request: EOS, a stop token id, max_tokens, a complete grammar
or the stop string itself. Text held back because it might have become a stop string belongs to the output
when it did not."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tritium.backend import LLM, SamplingParams
from tritium.backend.core.stop_checker import StopStrings
from tritium.backend.outputs import RequestOutput

STOP_CANDIDATES = ["e", "th", " t", "a", "the", "\n", "}", "yes", "yesterday", "r!never", "an", "in", "s ", ".", "o"]
CONSTRAINTS = [None, {"choice": ["yes"]}, {"choice": ["yes", "no way", "maybe"]}, {"regex": "[a-z ]{1,12}"},
               {"regex": "(ab|a b|the )+"}, {"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                      "required": ["a"]}}]


def first_stop(text: str, stop: list[str], include: bool) -> str:
    """`text` up to the stop string complete first when it is read a character at a time (through it with
    `include`), or all of it."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if s and text[:end].endswith(s)]
        if ending:
            s = max(ending, key=len)
            return text[:end] if include else text[: end - len(s)]
    return text


@given(text=st.text(alphabet="abdehnorsty !.}\n", max_size=40),
       stop=st.lists(st.sampled_from(STOP_CANDIDATES), max_size=3), include=st.booleans(),
       cuts=st.lists(st.integers(0, 40), max_size=6))
@example(text="yesterday", stop=["yesterday", "e"], include=False, cuts=[]).via("a later stop string ends first")
@example(text="xthe", stop=["he", "the"], include=False, cuts=[3]).via("the same end: the longer one")
def test_stop_strings_give_one_verdict_however_the_text_arrives(text: str, stop: list[str], include: bool,
                                                                cuts: list[int]) -> None:
    pieces, last = [], 0
    for cut in sorted(c for c in cuts if c <= len(text)):
        pieces.append(text[last:cut])
        last = cut
    pieces.append(text[last:])
    checker = StopStrings(stop, include)
    released = "".join(checker.feed(p) for p in pieces) + checker.flush()
    assert released == first_stop(text, stop, include)
    assert checker.stopped == (first_stop(text, stop, True) != text or any(s and text.endswith(s) for s in stop))


@pytest.fixture(scope="module")
def llm(tiny_llama_path: Path) -> Iterator[LLM]:
    yield LLM(str(tiny_llama_path), kv_cache_bytes=16 << 20, max_num_seqs=4)


@pytest.fixture(scope="module")
def eos_llm(llm: LLM, tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """The same model with a token it samples early (greedy, and often at temperature 1) as its EOS."""
    token = run(llm, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[-1].token_ids[2]
    folder = tmp_path_factory.mktemp("tiny-eos")
    for path in tiny_llama_path.iterdir():
        if path.is_file():
            shutil.copy(path, folder / path.name)
    for name in ("config.json", "generation_config.json"):
        if (folder / name).is_file():
            config = json.loads((folder / name).read_text())
            config["eos_token_id"] = [2, token]
            (folder / name).write_text(json.dumps(config))
    yield LLM(str(folder), kv_cache_bytes=16 << 20, max_num_seqs=4)


def run(llm: LLM, params: SamplingParams, prompt: str = "The story of") -> list[RequestOutput]:
    engine = llm.engine
    engine.add_request("r", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(constraint=st.sampled_from(CONSTRAINTS), stop=st.lists(st.sampled_from(STOP_CANDIDATES), max_size=3),
       include=st.booleans(), stop_id_at=st.one_of(st.none(), st.integers(0, 7)), min_tokens=st.integers(0, 3),
       logprobs=st.one_of(st.none(), st.integers(0, 2)), seed=st.one_of(st.none(), st.integers(0, 3)),
       with_eos=st.booleans())
def test_the_text_is_the_decode_of_the_tokens_cut_at_the_first_stop_string(
        llm: LLM, eos_llm: LLM, constraint: dict | None, stop: list[str], include: bool, stop_id_at: int | None,
        min_tokens: int, logprobs: int | None, seed: int | None, with_eos: bool) -> None:
    """`with_eos`: the model whose EOS is a token it samples early, EOS honoured; else EOS ignored."""
    engine = eos_llm if with_eos else llm
    common = dict(max_tokens=8, temperature=1.0 if seed is not None else 0.0, seed=seed,
                  structured_output=constraint)
    stop_ids: list[int] = []
    if stop_id_at is not None:  # a token this request really samples, so a stop id ends it
        free = run(engine, SamplingParams(**common, ignore_eos=True))[-1]
        stop_ids = [free.token_ids[min(stop_id_at, len(free.token_ids) - 1)]]
    params = SamplingParams(**common, stop=stop, include_stop_str_in_output=include, stop_token_ids=stop_ids,
                            min_tokens=min_tokens, logprobs=logprobs, ignore_eos=not with_eos)
    outputs = run(engine, params)
    final = outputs[-1]
    assert final.finished and all(not o.finished for o in outputs[:-1]), outputs
    if final.finish_reason == "error":  # a grammar left only tokens min_tokens bans (EOS, a stop id): documented
        assert constraint is not None and min_tokens > 0 and "banned" in (final.error or ""), final
        return
    assert final.finish_reason in ("stop", "length"), final
    assert "".join(o.delta_text for o in outputs) == final.text  # streamed = not streamed
    assert [t for o in outputs for t in o.delta_token_ids] == final.token_ids
    decoded = llm.tokenizer.decode(final.token_ids)
    assert final.text == first_stop(decoded, stop, include), (decoded, stop, final)
    if logprobs is not None:
        assert len(final.logprobs or []) == len(final.token_ids)


@pytest.mark.parametrize(("constraint", "stop", "expected"), [
    ({"choice": ["yes"]}, ["yesterday"], "yes"),  # a complete grammar ends it: the held "yes" is the answer
    ({"regex": "yes"}, ["yes!", "ye!"], "yes"),
])
def test_text_held_for_a_stop_string_is_released_when_a_grammar_completes(
        llm: LLM, constraint: dict, stop: list[str], expected: str) -> None:
    for stream in (True, False):
        outputs = run(llm, SamplingParams(max_tokens=8, structured_output=constraint, stop=stop))
        text = "".join(o.delta_text for o in outputs) if stream else outputs[-1].text
        assert text == expected and outputs[-1].finish_reason == "stop"


def test_text_held_for_a_stop_string_is_released_at_a_stop_token_id(llm: LLM) -> None:
    free = run(llm, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[-1]
    last = free.token_ids[-1]
    text = llm.tokenizer.decode(free.token_ids)
    held_tail = text[-1]
    out = run(llm, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[last],
                                  stop=[held_tail + "\x00never"]))[-1]
    first = free.token_ids.index(last)
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    assert out.text == llm.tokenizer.decode(out.token_ids)  # the tail that might have begun the stop string is there
