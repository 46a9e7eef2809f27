"""No request can fail another: whatever one request carries, the others get exactly the tokens they would
have got alone. The engine and its loop on a real tiny checkpoint, no server."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritium.backend import LLM, SamplingParams
from tritium.backend.engine import LLMEngine
from tritium.backend.outputs import RequestOutput
from tritium.backend.sample import logits_ops
from tritium.backend.sampling_params import SAMPLING_FIELDS
from tritium.backend.serving.engine_loop import EngineLoop
from tritium.backend.serving.jobs import ErrorKind, Job, Stage
from tritium.backend.testing.faults import FaultInjector

from support.serving import wait_for
from support.sinks import RecordingSink

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
VOCAB = 49152


@pytest.fixture(scope="module")
def engine(tiny_llama_path: Path) -> LLMEngine:
    return LLM(str(tiny_llama_path), kv_cache_bytes=16 << 20).engine


@pytest.fixture(scope="module")
def solo(engine: LLMEngine) -> list[int]:
    """What the greedy bystander produces alone."""
    return run(engine, {"bystander": ("Once upon a time", GREEDY)})["bystander"].token_ids


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]], max_steps: int = 200
        ) -> dict[str, RequestOutput]:
    """Add the requests, step until all are done; the final output of each. Afterwards nothing may be left."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == set(requests)
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return finals


def beside_bystander(engine: LLMEngine, solo: list[int], params: SamplingParams, prompt: str = "Tell me more"
                     ) -> RequestOutput:
    """Run `params` beside the greedy bystander; the bystander must be untouched. Returns the odd one's output."""
    finals = run(engine, {"bystander": ("Once upon a time", GREEDY), "odd": (prompt, params)})
    assert finals["bystander"].finish_reason == "length" and finals["bystander"].token_ids == solo
    return finals["odd"]


@pytest.mark.parametrize("fields,message", [
    ({"stop_token_ids": [99999999]}, "stop_token_ids must be token ids in \\[0, 49152\\)"),
    ({"stop_token_ids": [VOCAB], "min_tokens": 2}, "stop_token_ids must be token ids"),
    ({"repetition_penalty": 1e30}, "repetition_penalty must be in \\[0.01, 100\\]"),
    ({"temperature": 1e39}, "temperature must be in \\[0, 100\\]"),
])
def test_odd_values_are_refused_at_admission(engine: LLMEngine, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request("odd", "hi", SamplingParams(max_tokens=4, **fields))
    assert not engine.requests


@pytest.mark.batch_invariant
@pytest.mark.parametrize("fields", [
    {"temperature": 1e-45}, {"min_p": 1.0}, {"top_k": 10**12}, {"top_k": 10**30, "top_p": 1e-9},
    {"repetition_penalty": 100.0, "presence_penalty": 2.0, "frequency_penalty": -2.0}, {"logprobs": 20},
    {"repetition_penalty": 0.01, "temperature": 100.0, "seed": 2**63 - 1},
])
def test_odd_but_valid_values_generate_beside_a_greedy_request(engine: LLMEngine, solo: list[int],
                                                             fields: dict[str, Any]) -> None:
    odd = beside_bystander(engine, solo, SamplingParams(max_tokens=6, **fields))
    assert odd.finish_reason in ("length", "stop") and odd.error is None


def test_a_temperature_that_underflows_is_greedy(engine: LLMEngine) -> None:
    tiny_t = run(engine, {"a": ("Once upon a time", SamplingParams(max_tokens=8, temperature=1e-30,
                                                                   ignore_eos=True))})["a"]
    assert tiny_t.token_ids == run(engine, {"b": ("Once upon a time", GREEDY)})["b"].token_ids


@pytest.mark.batch_invariant
def test_a_request_with_every_token_banned_ends_alone_with_its_error(engine: LLMEngine, solo: list[int]) -> None:
    odd = beside_bystander(engine, solo, SamplingParams(max_tokens=4, min_tokens=2,
                                                        stop_token_ids=list(range(VOCAB))))
    assert odd.finish_reason == "error" and "every token is banned" in (odd.error or "")


@pytest.mark.batch_invariant
def test_a_failing_detokenizer_fails_only_its_request(engine: LLMEngine, solo: list[int],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real_add = engine.add_request

    def add_request(rid: str, *args: Any, **kwargs: Any) -> None:
        real_add(rid, *args, **kwargs)
        if rid == "odd":
            monkeypatch.setattr(engine.outputs.states[rid].detokenizer, "add_token", lambda token: 1 / 0)

    monkeypatch.setattr(engine, "add_request", add_request)
    odd = beside_bystander(engine, solo, SamplingParams(max_tokens=4))
    assert odd.finish_reason == "error" and odd.error == "internal error while processing the generated token"


@pytest.mark.batch_invariant
def test_a_failing_sampler_row_fails_only_its_request_and_seeded_rows_keep_their_tokens(
        engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)
    expected = run(engine, {"seeded": ("A seeded one", seeded)})["seeded"].token_ids
    real = logits_ops.penalized

    def penalized(logits: Any, inputs: Any, penalties: Any) -> Any:
        if inputs.host.penalized:  # only "odd" is penalized
            raise RuntimeError("a bug in penalties")
        return real(logits, inputs, penalties)

    monkeypatch.setattr(logits_ops, "penalized", penalized)
    finals = run(engine, {"seeded": ("A seeded one", seeded),
                          "odd": ("Tell me more", SamplingParams(max_tokens=4, repetition_penalty=1.3))})
    assert finals["seeded"].token_ids == expected and finals["seeded"].finish_reason == "length"
    assert finals["odd"].finish_reason == "error"
    assert finals["odd"].error == "internal error while sampling this request's token"


TOKEN_IDS = st.lists(st.one_of(st.integers(-5, VOCAB + 5), st.integers(-(2**70), 2**70)), max_size=5)
EXTREME_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
    [0.0, 1e-45, 1e-30, 1e-5, 0.01, 1.0, 2.0, 100.0, 1e30, 1e300, -1e-45]), st.integers(-(2**70), 2**70))
EXTREME_INTS = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70), st.sampled_from([VOCAB, 10**12]))
VARIED = {
    "max_tokens": st.integers(1, 12), "min_tokens": st.integers(0, 12), "temperature": EXTREME_FLOATS,
    "top_p": EXTREME_FLOATS, "top_k": EXTREME_INTS, "min_p": EXTREME_FLOATS, "repetition_penalty": EXTREME_FLOATS,
    "presence_penalty": EXTREME_FLOATS, "frequency_penalty": EXTREME_FLOATS, "seed": EXTREME_INTS,
    "stop": st.lists(st.text(min_size=0, max_size=4), max_size=3), "stop_token_ids": TOKEN_IDS,
    "include_stop_str_in_output": st.booleans(), "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), EXTREME_INTS), "skip_special_tokens": st.booleans(),
    "priority": st.one_of(st.just(0), EXTREME_INTS),  # fcfs here: any other value is refused at admission
    "structured_output": st.one_of(st.none(), st.sampled_from([
        {"choice": ["yes", "no"]}, {"regex": "[0-9]{1,4}"}, {"json_object": True}, {"regex": "a"},
        {"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
        {"json": {"not": {}}}, {"regex": "("}, {"grammar": "start: start"}, {"choice": []}, "{not json",
    ]), st.text(max_size=8), st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2)),
}
FIELDS = st.fixed_dictionaries({}, optional=VARIED)


def test_the_strategy_varies_every_sampling_field() -> None:
    assert set(VARIED) == set(SAMPLING_FIELDS)  # a new field joins the test below, or this fails


@pytest.mark.batch_invariant
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(fields=FIELDS, prompt=st.sampled_from(["Tell me more", "\u00e9\u00e8 \U0001f600 ok", "1 2 3 4"]))
def test_any_sampling_parameters_leave_a_greedy_request_alone(engine: LLMEngine, solo: list[int],
                                                              fields: dict[str, Any], prompt: str) -> None:
    try:
        params = SamplingParams.from_dict({"max_tokens": 8} | fields)
        engine.add_request("probe", prompt, params)
    except ValueError:
        assert not engine.requests  # refused at admission, with its reason: nothing else to check
        return
    engine.abort("probe")
    engine.step()
    odd = beside_bystander(engine, solo, params, prompt)
    assert odd.finish_reason in ("length", "stop") or (odd.finish_reason == "error" and odd.error)
    if odd.finish_reason != "error":
        assert len(odd.token_ids) <= params.max_tokens and all(0 <= t < VOCAB for t in odd.token_ids)
        assert all(math.isfinite(lp) or lp == -math.inf for entry in odd.logprobs or [] for lp in entry.values())




def job(rid: str, prompt: str, params: SamplingParams = GREEDY, prompt_token_ids: list[int] | None = None,
        **kwargs: Any) -> Job:
    return Job(request_id=rid, params=params, sink=RecordingSink(**kwargs), prompt=prompt,
               prompt_token_ids=prompt_token_ids)


@pytest.fixture
def loop_engine(engine: LLMEngine) -> LLMEngine:
    return engine


def test_the_loop_tokenizes_off_the_engine_thread(loop_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    real = loop_engine.tokenizer.encode
    monkeypatch.setattr(loop_engine.tokenizer, "encode",
                        lambda *a, **k: threads.append(threading.current_thread().name) or real(*a, **k))
    loop = EngineLoop(loop_engine)
    loop.start()
    try:
        jobs = [job("a", "Once upon a time"), job("b", "x " * 5000)]  # b: too long for the context
        for j in jobs:
            loop.submit(j)
        assert all(j.sink.done.wait(60) for j in jobs)
    finally:
        loop.stop()
    assert threads and set(threads) == {"tritium-tokenize"}
    assert jobs[0].sink.outputs[-1].token_ids == run(loop_engine, {"s": ("Once upon a time", GREEDY)})["s"].token_ids
    (message, kind), = jobs[1].sink.errors
    assert kind is ErrorKind.INVALID and "the model's context is 1024 tokens" in message and "(request id b)" in message


def test_a_response_that_cannot_be_formatted_fails_only_its_request(loop_engine: LLMEngine) -> None:
    loop = EngineLoop(loop_engine)
    loop.start()
    try:
        bad, good = job("bad", "Tell me more", fail_on_output=True), job("good", "Once upon a time")
        loop.submit(bad)
        loop.submit(good)
        assert bad.sink.done.wait(60) and good.sink.done.wait(60)
    finally:
        loop.stop()
    assert bad.sink.errors == [("internal error while formatting the response (request id bad)", ErrorKind.INTERNAL)]
    assert not good.sink.errors and good.sink.outputs[-1].finish_reason == "length"
    assert not loop_engine.requests


def test_admission_control_refuses_at_once_beyond_max_pending(loop_engine: LLMEngine) -> None:
    loop = EngineLoop(loop_engine, max_pending_requests=3)  # not started: nothing leaves the queue
    seats = loop_engine.config.max_num_seqs
    jobs = [job(f"r{i}", "hello") for i in range(seats + 5)]
    refused_by_submit = []
    for j in jobs:
        loop.submit(j)
        refused_by_submit.append(j.sink.done.is_set())  # answered before submit returned, or not at all yet
    assert loop.num_queued == seats + 3 and loop.num_pending == 3
    # Every seat's worth and 3 more are accepted (they would wait); the rest are refused at once.
    assert refused_by_submit == [bool(j.sink.errors) for j in jobs] == [False] * (seats + 3) + [True, True]
    message, kind = jobs[seats + 3].sink.errors[0]
    assert kind is ErrorKind.OVERLOADED and message.startswith("overloaded: 3 requests are already waiting")
    loop.stop(timeout=0)
    assert all(j.sink.errors for j in jobs)  # the queued ones are answered when the model shuts down


def test_a_request_id_in_use_is_refused_and_the_first_keeps_it(loop_engine: LLMEngine) -> None:
    loop = EngineLoop(loop_engine)  # not started: the first stays queued
    first, second = job("same", "hello"), job("same", "hello again")
    loop.submit(first)
    loop.submit(second)
    assert second.sink.errors == [("invalid request: its request id is in use (request id same)", ErrorKind.INVALID)]
    assert not first.sink.done.is_set() and loop.num_queued == 1
    loop.stop(timeout=0)
    assert first.sink.errors == [("the model is shutting down (request id same)", ErrorKind.UNAVAILABLE)]


def test_a_failed_engine_loop_answers_everything_at_once(tiny_llama_path: Path) -> None:
    engine = LLM(str(tiny_llama_path), kv_cache_bytes=16 << 20).engine  # its state is given up with it
    FaultInjector(None, loop_marker="<<die>>").install(engine)
    loop = EngineLoop(engine)
    loop.start()
    try:
        running = job("running", "Once upon a time", SamplingParams(max_tokens=900, temperature=0, ignore_eos=True))
        loop.submit(running)
        assert wait_for(lambda: bool(running.sink.outputs), 30, 0.01), "the long request never started"
        poison = job("poison", "<<die>> now")
        loop.submit(poison)
        assert running.sink.done.wait(30) and loop.failed
        late = job("late", "hello")
        loop.submit(late)
        assert late.sink.done.is_set()  # answered before submit returned
        assert loop.num_queued == loop.num_pending == 0
    finally:
        loop.stop()
    for j in (running, poison, late):
        (message, kind), = j.sink.errors
        assert kind is ErrorKind.UNAVAILABLE and "the engine stopped after an internal error" in message


class RecordedMetric:
    """One metric of the python backend's `MetricFamily` (which exists only inside Triton's stub process):
    what was set, in order."""

    def __init__(self, name: str, log: list[tuple[str, float]]) -> None:
        self.name, self.log = name, log

    def set(self, value: float) -> None:
        self.log.append((self.name, value))

    def increment(self, value: float) -> None: ...

    def observe(self, value: float) -> None: ...


class RecordingPbUtils:
    """The part of `triton_python_backend_utils` that EngineMetrics uses, recording every gauge set."""

    def __init__(self) -> None:
        self.log: list[tuple[str, float]] = []
        log = self.log

        class MetricFamily:
            HISTOGRAM, COUNTER, GAUGE = "histogram", "counter", "gauge"

            def __init__(self, name: str, description: str, kind: str) -> None:
                self.name = name

            def Metric(self, labels: dict[str, str], **kwargs: Any) -> RecordedMetric:
                return RecordedMetric(self.name, log)

        self.MetricFamily = MetricFamily


def test_after_an_engine_failure_every_request_is_answered_at_once_and_the_gauges_stay_zero(
        tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tritium.backend.serving.metrics import FLUSH_INTERVAL_S, EngineMetrics

    engine = LLM(str(tiny_llama_path), kv_cache_bytes=16 << 20, max_num_seqs=2).engine
    FaultInjector(None, loop_marker="<<die>>").install(engine)
    release, tokenizing = threading.Event(), threading.Event()
    real_tokenize, real_compile = engine.tokenize, engine.grammars.submit

    def stalling_tokenize(prompt: str) -> list[int]:
        if "stall" in prompt:
            tokenizing.set()
            release.wait(60)
        return real_tokenize(prompt)

    # Stalls that hold a request in the tokenizer thread and another in a compile when the engine fails.
    monkeypatch.setattr(engine, "tokenize", stalling_tokenize)
    monkeypatch.setattr(engine.grammars, "submit", lambda spec, done: threading.Thread(
        target=lambda: (release.wait(60), real_compile(spec, done)), daemon=True).start())
    pb = RecordingPbUtils()
    loop = EngineLoop(engine, observer=EngineMetrics(pb, "tritium", "1", engine))
    loop.start()
    long = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    try:
        running = [job(f"run{i}", "Once upon a time", long) for i in range(2)]
        queued = job("queued", "Queued behind them", long)
        for j in (*running, queued):
            loop.submit(j)
        assert wait_for(lambda: all(j.sink.outputs for j in running), 30, 0.01), "the long requests never started"
        compiling = job("compiling", "Yes or no?", SamplingParams(max_tokens=4, structured_output={"choice": ["y"]}))
        loop.submit(compiling)
        stalled = job("tokenizing", "stall here")
        loop.submit(stalled)
        assert tokenizing.wait(10) and stalled.stage is Stage.TOKENIZING and compiling.stage is Stage.COMPILING
        assert wait_for(lambda: ("tritium_num_requests_running", 2) in pb.log, 10, 0.01)
        poison = job("poison", "<<die>> now", prompt_token_ids=[1, 2, 3])  # past the stalled tokenizer thread
        loop.submit(poison)
        everyone = [*running, queued, compiling, stalled, poison]
        # All answered while the tokenize and the compile still stall (60 s): nobody waits for them.
        assert wait_for(lambda: all(j.sink.done.is_set() for j in everyone), 20, 0.01)
        assert loop.num_queued == loop.num_pending == 0
        failed_at = len(pb.log)
        release.set()  # the stalled tokenize and compile finish now: their requests were answered already
        time.sleep(4 * FLUSH_INTERVAL_S)
        loop.observer.on_step(engine, loop.clock(), True, 3)
    finally:
        release.set()
        loop.stop()
    for j in everyone:
        assert len(j.sink.errors) == 1 and not any(o.finished for o in j.sink.outputs), j.request_id
        assert j.sink.errors[0][1] is ErrorKind.UNAVAILABLE, j.sink.errors
    # From the failure on, running and waiting are 0, however often the response thread pushes (it did, above).
    assert pb.log.index(("tritium_engine_healthy", 0)) < failed_at < len(pb.log)
    assert all(value == 0 for name, value in pb.log[pb.log.index(("tritium_engine_healthy", 0)):]
               if name in ("tritium_num_requests_running", "tritium_num_requests_waiting")), pb.log[-12:]



def test_a_slow_compile_holds_up_no_other_request(loop_engine: LLMEngine) -> None:
    schema = {"type": "object", "properties": {f"slow_{i}": {"type": "string"} for i in range(3000)}}
    loop = EngineLoop(loop_engine)
    loop.start()
    try:
        slow = job("slow", "Fill the form", SamplingParams(max_tokens=2, structured_output={"json": schema}))
        plain = job("plain", "Once upon a time")
        loop.submit(slow)
        loop.submit(plain)
        assert plain.sink.done.wait(60) and slow.sink.done.wait(60)
    finally:
        loop.stop()
    assert not plain.sink.errors and plain.sink.outputs[-1].finish_reason == "length"
    # (llguidance gives up on so many optional keys once decoding starts: an error for that request alone)
    assert len(slow.sink.errors) + sum(o.finished for o in slow.sink.outputs) == 1
    assert plain.sink.done_at < slow.sink.first_at  # the plain one finished before the schema compiled
