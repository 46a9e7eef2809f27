"""Structured output in the engine: the constraint's shapes, its compilation, and decoding under it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from tritium.backend.llm import LLM
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.serving.request import parse_text_request
from tritium.backend.structured_output.compiler import GrammarCompiler, estimated_bytes
from tritium.backend.structured_output.constraint import StructuredOutput
from tritium.backend.tokenizer import Tokenizer

from support.clock import Clock
from support.serving import wait_for

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("value", [
    {"json": PERSON}, {"json": json.dumps(PERSON)}, json.dumps({"regex": "[0-9]+"}), {"choice": ["yes", "no"]},
    {"grammar": 'start: "a"+'}, {"json_object": True}, {"regex": "x", "backend": "xgrammar"},
])
def test_structured_output_takes_vllm_shapes(value: object) -> None:
    spec = StructuredOutput.from_value(value)
    assert StructuredOutput.from_value(spec.to_dict()) == spec
    assert SamplingParams(structured_output=value).structured_output == spec


def test_a_schema_as_object_or_text_is_one_cache_key_in_its_own_key_order() -> None:
    a = StructuredOutput.from_value({"json": {"type": "object", "required": ["b", "a"]}})
    b = StructuredOutput.from_value({"json": '{"type": "object", "required": ["b", "a"]}'})
    assert a == b and hash(a) == hash(b)
    assert a.json == '{"type":"object","required":["b","a"]}'  # properties are generated in the schema's order


@pytest.mark.parametrize(("value", "words"), [
    ({}, "exactly one of"), ({"json": PERSON, "regex": "a"}, "got json, regex"), ({"regex": ""}, "non-empty"),
    ({"choice": []}, "non-empty list"), ({"choice": ["a", 3]}, "non-empty strings"), ({"json": "{not json"}, "JSON"),
    ({"json_object": "yes"}, "must be true"), ({"regex": "a", "structural_tag": {}}, "structural_tag"),
    ("[1]", "must be an object"), ({"json": 3}, "JSON schema"),
    ({"choice": ["a", "x\U000B1586"]}, "U+B1586"), ({"json": {"const": "\U00040000"}}, "U+40000"),
    ({"regex": "a", "disable_any_whitespace": "no"}, "boolean"),
])
def test_malformed_constraints_are_refused_by_name(value: object, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(structured_output=value)


def test_the_text_models_vllm_fields_are_structured_output() -> None:
    text = np.array([b"hi"], dtype=object)
    for key in ("structured_outputs", "guided_decoding", "structured_output"):
        for value in ({"regex": "a+"}, json.dumps({"regex": "a+"})):
            sampling = np.array([json.dumps({key: value})], dtype=object)
            parsed = parse_text_request({"text_input": text, "sampling_parameters": sampling}, {})
            assert parsed.params.structured_output == StructuredOutput(regex="a+")
    both = np.array([json.dumps({"guided_decoding": {"regex": "a"}, "structured_outputs": {"regex": "b"}})],
                    dtype=object)
    with pytest.raises(ValueError, match="only one of"):
        parse_text_request({"text_input": text, "sampling_parameters": both}, {})
    parsed = parse_text_request({"text_input": text}, {"guided_decoding": '{"choice": ["x", "y"]}'})
    assert parsed.params.structured_output == StructuredOutput(choice=("x", "y"))


@pytest.fixture(scope="module")
def compiler(default_model_path: Path) -> GrammarCompiler:
    return GrammarCompiler(Tokenizer(default_model_path), eos_token_ids=[2])


@pytest.mark.parametrize(("value", "words"), [
    ({"json": {"type": "array", "uniqueItems": True}}, 'Unimplemented keys: ["uniqueItems"]'),
    ({"json": {"not": {"type": "string"}}}, '["not"]'),
    ({"regex": "a(b"}, "structured_output.regex cannot be enforced"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"grammar": "root ::= ("}, "structured_output.grammar"),
])
def test_what_cannot_be_enforced_is_refused_naming_it(compiler: GrammarCompiler, value: dict, words: str) -> None:
    spec = StructuredOutput.from_value(value)
    with pytest.raises(ValueError, match=re.escape(words)):
        compiler.compile(spec)
    compiled, hits = compiler.stats.compiled, compiler.stats.cache_hits
    with pytest.raises(ValueError, match=re.escape(words)):  # the verdict is cached: this compiles nothing
        compiler.compile(spec)
    assert (compiler.stats.compiled, compiler.stats.cache_hits) == (compiled, hits + 1)


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_matcher(compiler: GrammarCompiler) -> None:
    spec = StructuredOutput.from_value({"json": PERSON})
    before = compiler.stats.compiled
    first, second = compiler.compile(spec), compiler.compile(spec)
    assert compiler.stats.compiled == before + 1 and compiler.stats.cache_hits >= 1
    assert first is not second
    forced = first.compute_ff_tokens()  # '{"name":"' is the only way to start
    assert forced and first.consume_tokens(forced)
    assert second.compute_ff_tokens() == forced  # the other copy has not moved


def wide_schema(n: int, tag: str = "") -> dict:
    """A JSON schema of `n` optional string properties: slow to compile (~0.3 s per 1000 on this CPU) and
    large in memory."""
    return {"type": "object", "properties": {f"field_{tag}{i}": {"type": "string"} for i in range(n)}}


def test_a_compile_over_the_time_limit_is_refused_and_not_cached(default_model_path: Path) -> None:
    # The wall clock stands still: the compile's own CPU time is what reaches the limit.
    slow = GrammarCompiler(Tokenizer(default_model_path), eos_token_ids=[2], timeout_s=0.02, clock=Clock())
    slow.ll_tokenizer  # noqa: B018  (built outside the limit, as a running engine has it)
    spec = StructuredOutput.from_value({"json": wide_schema(3000)})
    answers: list[tuple[str | None, int, int]] = []  # each answer, with the compiles ended and cached by then
    slow.submit(spec, lambda matcher, error: answers.append((error, slow.stats.compiled, len(slow))))
    assert wait_for(lambda: (slow.compile_cpu_s(spec) or 0.0) >= 0.02 or bool(answers), 60, 0.01)
    slow.check_time_limits()  # the request's own timer may have refused it already: the same refusal
    assert [(compiled, cached) for _, compiled, cached in answers] == [(0, 0)]  # before the compile ended
    assert answers[0][0] is not None and "structured_output.json did not compile within 0.02 s" in answers[0][0]
    assert slow.stats.timeouts == 1
    # The compile goes on; once it ends its matcher is cached: the time limit was no verdict on the schema.
    assert wait_for(lambda: len(slow) == 1, 60, 0.01)
    assert len(answers) == 1
    slow.timeout_s = 30
    assert slow.compile(spec) is not None and slow.stats.compiled == 1 and slow.stats.cache_hits == 1


def test_the_cache_is_bounded_by_bytes(default_model_path: Path) -> None:
    specs = [StructuredOutput.from_value({"json": wide_schema(40, tag=str(i))}) for i in range(6)]
    bound = 3 * estimated_bytes(specs[0]) + 1000
    cache = GrammarCompiler(Tokenizer(default_model_path), eos_token_ids=[2], cache_bytes=bound)
    for spec in specs:
        cache.compile(spec)
        assert cache.cached_bytes <= bound
    assert len(cache) == 3 and cache.stats.evictions == 3
    cache.compile(specs[-1])  # the newest are kept
    assert cache.stats.compiled == 6
    cache.compile(specs[0])  # the oldest went
    assert cache.stats.compiled == 7
    huge = GrammarCompiler(Tokenizer(default_model_path), eos_token_ids=[2], cache_bytes=1000)
    huge.compile(specs[0])  # bigger than the whole cache: served, not kept
    assert len(huge) == 0


def test_a_constraint_over_the_size_limit_is_refused_naming_it(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(None, kv_cache_bytes=16 << 20, max_model_len=256, max_structured_output_bytes=2048)
    big = SamplingParams(structured_output={"json": wide_schema(200)})
    with pytest.raises(ValueError, match=r"structured_output.json is \d+ bytes; this engine takes at most 2048 "
                                         r"\(max_structured_output_bytes\)"):
        llm.generate("x", big)
    assert llm.generate("x", SamplingParams(max_tokens=2, structured_output={"regex": "[a-z]+"}))[0].text


def test_requests_wait_for_no_compile_but_their_own(default_model_path: Path) -> None:
    """A slow compile holds up neither an unconstrained request nor a cached constraint behind it."""
    compiler = GrammarCompiler(Tokenizer(default_model_path), eos_token_ids=[2])
    cached = StructuredOutput.from_value({"regex": "[0-9]+"})
    compiler.compile(cached)
    slow = [StructuredOutput.from_value({"json": wide_schema(2500, tag=f"s{i}")}) for i in range(3)]
    answered: list[str] = []
    for i, spec in enumerate(slow):
        compiler.submit(spec, lambda m, e, i=i: answered.append(f"slow{i}"))
    compiler.submit(cached, lambda m, e: answered.append("cached"))
    assert answered == ["cached"]  # answered in submit, ahead of the slow compiles submitted before it
    assert wait_for(lambda: len(answered) == 4, 60, 0.01)
    assert sorted(answered[1:]) == ["slow0", "slow1", "slow2"]
    assert (compiler.stats.compiled, compiler.stats.cache_hits, compiler.stats.timeouts) == (4, 1, 0)


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> LLM:
    return LLM(None, kv_cache_bytes=64 << 20, max_model_len=1024, seed=7)


def _generate(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list:
    outs = llm.generate(prompts, params)
    assert not llm.engine.requests and not llm.engine.worker.held_requests()
    return outs


@pytest.mark.slow  # sampled constrained outputs on the default model (~25 s)
def test_constrained_outputs_hold_and_end_when_the_grammar_is_complete(llm: LLM) -> None:
    prompts = ["Give me a person as JSON:", "Pick a number:", "Yes or no?", "Count:"]
    params = [SamplingParams(temperature=1.0, max_tokens=200, structured_output={"json": PERSON}),
              SamplingParams(temperature=1.0, max_tokens=20, structured_output={"regex": "[1-9][0-9]{0,2}"}),
              SamplingParams(temperature=1.0, max_tokens=20, structured_output={"choice": ["yes", "no", "maybe"]}),
              SamplingParams(temperature=1.0, max_tokens=40, structured_output={"grammar": 'start: "1" (", " "1")*'})]
    for _ in range(3):
        person, number, choice, ones = _generate(llm, prompts, params)
        jsonschema.validate(json.loads(person.text), PERSON)
        assert re.fullmatch("[1-9][0-9]{0,2}", number.text)
        assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
        assert re.fullmatch(r"1(, 1)*" if ones.finish_reason == "stop" else r"1(, 1)*(, ?)?", ones.text)
        assert person.finish_reason == "stop"


@pytest.mark.slow  # one of the fast tier's longest (~6-10 s); the full suite runs it
def test_an_unconstrained_request_beside_constrained_ones_makes_its_solo_tokens(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=24)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=24)
    solo = _generate(llm, ["The capital of France is", "Once upon a time"], [plain, seeded])
    constrained = [SamplingParams(temperature=1.0, max_tokens=60, structured_output={"json": PERSON})] * 6
    mixed = _generate(llm, ["The capital of France is", "Once upon a time", *["JSON:"] * 6],
                      [plain, seeded, *constrained])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in solo]


def test_a_row_whose_grammar_allows_no_token_ends_with_an_error_alone(llm: LLM) -> None:
    x = llm.tokenizer.encode("x", add_special_tokens=False)
    assert len(x) == 1
    trapped = SamplingParams(temperature=0, max_tokens=4, min_tokens=1, stop_token_ids=x,
                             structured_output={"regex": "x"})  # the one allowed token is banned
    plain = SamplingParams(temperature=0, max_tokens=8)
    solo = _generate(llm, ["Hello"], [plain])[0]
    bad, good = _generate(llm, ["Say x", "Hello"], [trapped, plain])
    assert bad.finish_reason == "error" and "structured_output grammar" in (bad.error or "")
    assert good.token_ids == solo.token_ids



def test_an_unenforceable_constraint_is_refused_before_anything_is_queued(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(None, kv_cache_bytes=16 << 20, max_model_len=256)
    with pytest.raises(ValueError, match="uniqueItems"):
        llm.generate("x", SamplingParams(structured_output={"json": {"type": "array", "uniqueItems": True}}))
