"""Speculative decoding of constrained requests: the grammar keeps only the drafts it takes (its matcher as it
was), each verified position is sampled under the grammar's mask after the drafts before it, the matcher
advances over the kept run; greedy output is token-identical to decoding without speculation and sampled
output follows the grammar."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest
import torch

from tritium.backend import LLM, SamplingParams
from tritium.backend.core.sequence import Sequence
from tritium.backend.outputs import RequestOutput
from tritium.backend.sample.sampler import SamplerOutput
from tritium.backend.spec.verify import Verified
from tritium.backend.structured_output.compiler import GrammarCompiler
from tritium.backend.structured_output.constraint import StructuredOutput
from tritium.backend.structured_output.decoding import StructuredDecoding
from tritium.backend.tokenizer import Tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINE = {"kv_cache_bytes": 32 << 20, "max_model_len": 512}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
RECORD = '{"name": "Alice Smith", "age": 31, "town": "Paris"}'
# The record repeats, so prompt lookup drafts it; the grammar refuses its spaces (compact JSON) and "town".
PROMPT = f"Copy the record.\nRecord: {RECORD}\nCopy: {RECORD}\nRecord: {RECORD}\nCopy: "
REGEX = r'\{"name": "[A-Za-z ]+", "age": [0-9]+, "city": "[A-Za-z]+"\}'
# Bounded (at most ~45 tokens), so a sampled request completes its grammar within max_tokens.
SMALL_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                 "city": {"type": "string", "maxLength": 12}},
                "required": ["name", "age", "city"], "additionalProperties": False}
SMALL_REGEX = r'\{"name": "[A-Za-z ]{1,16}", "age": [0-9]{1,3}, "city": "[A-Za-z]{1,12}"\}'
TEXT = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
REPEAT = f"Repeat the following text exactly.\nText: {TEXT}\nRepeated text: "


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLM, LLM]]:
    """The default model without and with n-gram speculation."""
    yield LLM(None, **ENGINE), LLM(None, speculative_config=NGRAM, **ENGINE)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engines" not in request.fixturenames:
        return
    for llm in request.getfixturevalue("engines"):
        engine = llm.engine
        bm = engine.block_manager
        assert not engine.requests and not engine.worker.held_requests()
        assert bm.num_free_blocks == bm.num_blocks


def greedy(structured_output: object, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_output=structured_output)


def same(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert (y.token_ids, y.text, y.finish_reason) == (x.token_ids, x.text, x.finish_reason), x.request_id


def test_constrained_greedy_speculation_is_identical_and_the_grammar_refuses_drafts(
        engines: tuple[LLM, LLM]) -> None:
    base, spec = engines
    totals = spec.engine.spec_totals
    assert totals is not None
    refused_before = totals.num_refused_tokens
    params = [greedy({"json": SCHEMA}), greedy({"regex": REGEX})]
    a, b = base.generate([PROMPT, PROMPT], params), spec.generate([PROMPT, PROMPT], params)
    same(a, b)
    jsonschema.validate(json.loads(b[0].text), SCHEMA)
    assert re.fullmatch(REGEX, b[1].text) and all(o.finish_reason == "stop" for o in b)  # the grammar's end
    assert totals.num_refused_tokens > refused_before  # the record's spaces and "town" were drafted
    stats = [o.spec_decoding for o in b]
    assert all(s is not None and s.num_accepted_tokens > 0 for s in stats)
    regex_stats = stats[1]
    assert regex_stats is not None and regex_stats.mean_acceptance_length > 1.5


@pytest.mark.batch_invariant
@pytest.mark.slow  # one of the fast tier's longest (~6-10 s); the full suite runs it
def test_a_mixed_batch_gives_each_request_its_solo_tokens(engines: tuple[LLM, LLM]) -> None:
    base, spec = engines
    prompts = [PROMPT, REPEAT, "Is the sky blue? Answer:", PROMPT]
    params = [greedy({"json": SCHEMA}), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              greedy({"choice": ["yes", "no", "maybe"]}), SamplingParams(temperature=0, max_tokens=16)]
    solo = [base.generate(p, q)[0] for p, q in zip(prompts, params, strict=True)]
    mixed = spec.generate(prompts, params)
    same(solo, mixed)
    assert mixed[2].text in ("yes", "no", "maybe")
    for out in (mixed[0], mixed[1], mixed[3]):
        assert out.spec_decoding is not None and out.spec_decoding.num_accepted_tokens > 0


def test_sampled_constrained_speculation_follows_the_grammar(engines: tuple[LLM, LLM]) -> None:
    _, spec = engines
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=64, structured_output={"json": SMALL_SCHEMA})
              for s in range(3)]
    params.append(SamplingParams(temperature=1.0, seed=7, max_tokens=64, structured_output={"regex": SMALL_REGEX}))
    outs = spec.generate([PROMPT] * 4, params)
    for out in outs[:3]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SMALL_SCHEMA)
    assert outs[3].finish_reason == "stop" and re.fullmatch(SMALL_REGEX, outs[3].text)
    assert sum(o.spec_decoding.num_accepted_tokens for o in outs if o.spec_decoding is not None) > 0
    again = spec.generate([PROMPT], params[0])[0]  # a seeded request is reproducible under speculation too
    assert again.token_ids == outs[0].token_ids


@pytest.mark.slow  # a second engine with a draft model: CI's full run, not the inner loop
def test_draft_model_drafts_are_checked_by_the_grammar(make_llm: Callable[..., LLM], engines: tuple[LLM, LLM],
                                                       default_model_path: Path) -> None:
    base, _ = engines
    spec = make_llm(None, speculative_config={"method": "draft_model", "model": str(default_model_path),
                                              "num_speculative_tokens": 3}, **ENGINE)
    params = [greedy({"json": SCHEMA}), greedy({"regex": REGEX})]
    a, b = base.generate([PROMPT, PROMPT], params), spec.generate([PROMPT, PROMPT], params)
    same(a, b)
    totals = spec.engine.spec_totals
    assert totals is not None and totals.num_refused_tokens > 0 and totals.num_accepted_tokens > 0


# The matchers themselves: no model, the default model's tokenizer.

@pytest.fixture(scope="module")
def decoding(default_model_path: Path) -> tuple[StructuredDecoding, Tokenizer]:
    tokenizer = Tokenizer(default_model_path)
    return StructuredDecoding(GrammarCompiler(tokenizer, eos_token_ids=[2]), torch.device("cpu"), 16), tokenizer


def mask_of(structured: StructuredDecoding, rid: str) -> torch.Tensor:
    words = (structured.compiler.vocab_size + 31) // 32
    out = torch.zeros(1, words, dtype=torch.int32)
    structured.matchers[rid].unsafe_compute_mask_ptr(out.data_ptr(), words * 4)
    return out[0]


def test_draft_prefix_stops_at_a_refusal_and_before_completion_and_keeps_the_state(
        decoding: tuple[StructuredDecoding, Tokenizer]) -> None:
    structured, tokenizer = decoding
    structured.add("r", StructuredOutput(regex="(ab ){2}c"))
    ids = tokenizer.encode("ab ab c", add_special_tokens=False)
    before = mask_of(structured, "r")
    bad = tokenizer.encode(" x", add_special_tokens=False)[0]
    assert structured.draft_prefix("r", [ids[0], bad, ids[1]]) == 1
    # The last token completes the grammar: the drafts end before it (and before EOS after it).
    assert structured.draft_prefix("r", ids) == len(ids) - 1
    assert structured.draft_prefix("r", [*ids, 2]) == len(ids) - 1
    assert structured.draft_prefix("unconstrained", [5, 6, 7]) == 3
    assert torch.equal(mask_of(structured, "r"), before) and not structured.matchers["r"].is_error()
    structured.remove("r")


def test_masks_per_verified_position_and_a_run_cut_where_the_grammar_completes(
        decoding: tuple[StructuredDecoding, Tokenizer]) -> None:
    structured, tokenizer = decoding
    structured.add("r", StructuredOutput(regex="(ab ){2}c"))
    structured.add("s", StructuredOutput(regex="x+"))
    ids = tokenizer.encode("ab ab c", add_special_tokens=False)
    views = [view("u"), view("r"), view("s")]
    drafts = [[7, 8], ids[:2], []]  # rows: u 0-2, r 3-5, s 6
    masks = structured.wait(structured.start(views, drafts))
    assert masks is not None and masks.rows == [3, 4, 5, 6]
    expected = [mask_of(structured, "r")]
    for t in ids[:2]:
        structured.matchers["r"].consume_token(t)
        expected.append(mask_of(structured, "r"))
    structured.matchers["r"].rollback(2)
    expected.append(mask_of(structured, "s"))
    assert all(torch.equal(masks.bitmask[i], e) for i, e in enumerate(expected))
    # Verification kept both drafts and sampled the completing token, then a bonus after it: the run is cut.
    verdicts = structured.accept(views, [None, ids[2], None], [[], ids[:2], []])
    assert verdicts[1].complete and verdicts[1].cut is None
    structured.matchers["r"].rollback(3)
    verdicts = structured.accept(views, [None, 2, None], [[], ids, []])
    assert verdicts[1].complete and verdicts[1].cut == 3
    structured.remove("r")
    structured.remove("s")


def view(rid: str) -> Sequence:
    return Sequence(rid, None, [1], SamplingParams(), 0)


def test_end_run_keeps_the_first_tokens_of_a_run() -> None:
    v = Verified(SamplerOutput([9, 5], [{9: -0.1}, None], [None, None]), [[1, 2, 3], []],
                 [[{1: -1.0}, {2: -2.0}, {3: -3.0}], []])
    v.end_run(0, 2)
    assert (v.sampled.token_ids[0], v.sampled.logprobs[0], v.accepted[0]) == (2, {2: -2.0}, [1])
    assert v.accepted_logprobs[0] == [{1: -1.0}] and v.sampled.token_ids[1] == 5
