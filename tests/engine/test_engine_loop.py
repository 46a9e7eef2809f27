"""The engine loop's response thread: outputs that wait while a send is slow are merged into one response per
request (adaptive coalescing), `stream_interval` bounds how small a streamed response may be, the first
token is never held, nothing is lost, and a cancelled or expired request is aborted, within the documented
number of cancellation polls (on a clock the test advances). The pacer widens responses only while sending
is the bottleneck."""

from __future__ import annotations

import json
import time
from itertools import pairwise
from pathlib import Path

import pytest

from tritium.backend import LLM, SamplingParams
from tritium.backend.engine import LLMEngine
from tritium.backend.outputs import RequestOutput
from tritium.backend.serving.cancel_polls import CANCEL_CHECKS_PER_S, CANCEL_MIN_INTERVAL_S
from tritium.backend.serving.engine_loop import EngineLoop
from tritium.backend.serving.jobs import Job, merge_outputs
from tritium.backend.serving.settings import load_settings
from tritium.backend.serving.stream_pacer import StreamPacer

from support.lockstep import FakeClock, Lockstep
from support.sinks import PolledSink, RecordingSink

LONG = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=1)
ENDLESS = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)  # outlives every test here
TICK = 1 / 32  # the test clock's step: exact in binary, 50/32 polls earned a tick


class SlowSink(RecordingSink):
    """A sender whose every call takes `delay_s` (an IPC round trip under load)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def send_output(self, output: RequestOutput) -> None:
        time.sleep(self.delay_s)
        super().send_output(output)


@pytest.fixture(scope="module")
def engine(tiny_llama_path: Path) -> LLMEngine:
    return LLM(str(tiny_llama_path), kv_cache_bytes=16 << 20).engine


def serve(engine: LLMEngine, sinks: list[SlowSink], stream_interval: int = 1,
          params: SamplingParams = LONG) -> list[Job]:
    loop = EngineLoop(engine, stream_interval=stream_interval)
    jobs = [Job(request_id=f"r{i}", params=params, sink=sink, prompt="Once upon a time") for i, sink in
            enumerate(sinks)]
    loop.start()
    try:
        for j in jobs:
            loop.submit(j)
        assert all(j.sink.done.wait(60) for j in jobs)
    finally:
        loop.stop()
    return jobs


def check_complete(sink: RecordingSink, expected_tokens: int) -> None:
    """Nothing lost or repeated: the deltas add up to the final totals, and exactly one final came."""
    outs = sink.outputs
    assert not sink.errors and [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    final = outs[-1]
    assert final.token_ids == [t for o in outs for t in o.delta_token_ids] and len(final.token_ids) == expected_tokens
    assert final.text == "".join(o.delta_text for o in outs)
    assert final.logprobs == [lp for o in outs for lp in o.delta_logprobs or []]


def test_slow_sends_coalesce_into_fewer_responses_and_lose_nothing(engine: LLMEngine) -> None:
    fast, slow = SlowSink(0.0), SlowSink(0.03)  # 30 ms a send: far slower than a tiny-model step
    serve(engine, [fast, slow])
    check_complete(fast, 48)
    check_complete(slow, 48)
    assert len(slow.outputs) < 48 / 2  # several tokens per response
    assert len(slow.outputs[0].delta_token_ids) <= 3  # the first token was not held back for company


def test_stream_interval_bounds_the_response_size(engine: LLMEngine) -> None:
    sink = SlowSink(0.0)
    serve(engine, [sink], stream_interval=5)
    check_complete(sink, 48)
    first, *middle, _final = sink.outputs
    assert first.delta_token_ids and len(first.delta_token_ids) < 5  # the first token goes at once
    assert middle and all(len(o.delta_token_ids) >= 5 for o in middle)


def test_a_cancelled_request_is_aborted_at_the_next_poll(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    sink = PolledSink(clock)
    with Lockstep(engine, monkeypatch, clock) as run:
        run.loop.submit(Job(request_id="r", params=ENDLESS, sink=sink, prompt="Once upon a time"))
        while len(sink.outputs) < 3:
            run.tick(TICK)
        sink.cancelled, cancelled_at = True, clock.now
        while not sink.done.is_set() and run.ticks < 100:
            run.tick(TICK)
    (seen_at, _), = [ask for ask in sink.asks if ask[1]]
    assert sink.asks[-1] == (seen_at, True)  # never asked again
    assert seen_at <= cancelled_at + CANCEL_MIN_INTERVAL_S + TICK  # alone, it is asked every 0.1 s
    assert sink.done_at <= seen_at + 2 * TICK  # aborted by the engine thread before the next step but one
    final = sink.outputs[-1]
    assert final.finish_reason == "abort" and not sink.errors and len(final.token_ids) < 20
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_request_past_its_timeout_is_aborted_and_the_others_run_on(engine: LLMEngine,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    timed, untimed = RecordingSink(clock=clock), RecordingSink(clock=clock)
    with Lockstep(engine, monkeypatch, clock) as run:
        run.loop.submit(Job(request_id="timed", params=ENDLESS, sink=timed, prompt="Once upon a time", timeout_s=1.0))
        run.loop.submit(Job(request_id="untimed", params=LONG, sink=untimed, prompt="Once upon a time"))
        arrival = clock.now
        while not untimed.done.is_set() and run.ticks < 100:
            run.tick(TICK)
    assert timed.outputs[-1].finish_reason == "abort" and not timed.errors
    # Expired at the first sweep past the timeout (arrival + 33 ticks), aborted within two steps of it.
    assert arrival + 1.0 < timed.done_at <= arrival + 1.0 + 3 * TICK
    assert len(timed.outputs[-1].token_ids) <= 35 < LONG.max_tokens
    check_complete(untimed, LONG.max_tokens)


def test_merged_outputs_join_their_deltas() -> None:
    def out(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
        return RequestOutput("r", text, ids, finished, "length" if finished else None, 3, 0, 0,
                             delta_logprobs=[{i: -1.0} for i in ids])
    merged = merge_outputs(out("a", [1]), out("b", [2], finished=True))
    assert (merged.delta_text, merged.delta_token_ids, merged.finished) == ("ab", [1, 2], True)
    assert merged.delta_logprobs == [{1: -1.0}, {2: -1.0}]


def test_the_pacer_coalesces_only_while_sending_is_the_bottleneck() -> None:
    pacer = StreamPacer(1, 16)
    now = 0.0
    for _ in range(40):  # sending takes 80% of the time: double, up to the bound
        now += 0.1
        pacer.record(0.08, now)
    assert pacer.interval == 16
    for _ in range(40):  # sending is cheap again: back to one token per response
        now += 0.1
        pacer.record(0.001, now)
    assert pacer.interval == 1
    for _ in range(40):  # in between: no change either way
        now += 0.1
        pacer.record(0.03, now)
    assert pacer.interval == 1


@pytest.mark.parametrize("settings,message", [({"stream_interval": 0}, "stream_interval must be an integer >= 1"),
                                              ({"stream_interval": "2"}, "stream_interval must be an integer"),
                                              ({"stream_interval": 4, "max_stream_interval": 2},
                                               "max_stream_interval must be an integer >= 4"),
                                              ({"request_timeout_s": -5}, "request_timeout_s must be a number of "
                                                                          "seconds > 0"),
                                              ({"request_timeout_s": 0}, "request_timeout_s must be"),
                                              ({"request_timeout_s": "10"}, "request_timeout_s must be"),
                                              ({"request_timeout_s": True}, "request_timeout_s must be"),
                                              ({"request_timeout_s": float("inf")}, "request_timeout_s must be")])
def test_serving_settings_are_checked(tmp_path: Path, settings: dict, message: str) -> None:
    (tmp_path / "model.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match=message):
        load_settings(tmp_path)


def test_a_cancel_is_seen_within_the_documented_bound_with_64_streams(engine: LLMEngine,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """is_cancelled() is budgeted (CANCEL_CHECKS_PER_S a second of the clock, the least recently asked first,
    each request at most every CANCEL_MIN_INTERVAL_S): with N streams a cancel is seen within
    max(0.1 s, N / 50 s), 1.28 s at 64, plus a sweep. Here the clock is the test's, a sweep per tick."""
    n = 64
    clock = FakeClock()
    sinks = [PolledSink(clock) for _ in range(n)]
    with Lockstep(engine, monkeypatch, clock) as run:
        for i, sink in enumerate(sinks):
            run.loop.submit(Job(request_id=f"c{i}", params=ENDLESS, sink=sink, prompt="Once upon a time"))
        while not all(len(s.asks) >= 2 for s in sinks) and run.ticks < 400:  # all streaming, in the round robin
            run.tick(TICK)
        cancelled = sinks[::13]  # five of them, at once
        for sink in cancelled:
            sink.cancelled = True
        cancelled_at = clock.now
        while not all(s.done.is_set() for s in cancelled) and run.ticks < 800:
            run.tick(TICK)
    bound = max(CANCEL_MIN_INTERVAL_S, n / CANCEL_CHECKS_PER_S)
    for sink in cancelled:
        (seen_at, _), = [ask for ask in sink.asks if ask[1]]
        assert sink.asks[-1] == (seen_at, True)  # never asked again
        assert cancelled_at < seen_at <= cancelled_at + bound + TICK, (seen_at - cancelled_at, bound)
        assert sink.done_at <= seen_at + 2 * TICK and sink.outputs[-1].finish_reason == "abort"
    for sink in sinks:
        times = [t for t, _ in sink.asks]
        assert all(later - earlier >= CANCEL_MIN_INTERVAL_S for earlier, later in pairwise(times))
    # Never more than CANCEL_CHECKS_PER_S asks within one second of the clock, and the budget is used: every
    # second after the first, exactly that many.
    asks = sorted(t for s in sinks for t, _ in s.asks)
    assert all(later - earlier >= 1.0 for earlier, later in zip(asks, asks[CANCEL_CHECKS_PER_S:], strict=False))
    start = asks[0]
    per_second = [sum(1 for t in asks if start + k <= t < start + k + 1) for k in range(1, int(asks[-1] - start))]
    assert per_second and set(per_second) == {CANCEL_CHECKS_PER_S}, per_second
