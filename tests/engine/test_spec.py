"""Speculative decoding (n-gram prompt lookup) in the engine: greedy output token-identical to decoding without
speculation in every situation (mixed batches, stops, penalties, logprobs, preemption, prefix hits, the decode
graph path), sampled output with the same distribution, seeded requests reproducible."""

from __future__ import annotations

import time
import types
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from tritium.backend import LLM, SamplingParams
from tritium.backend.outputs import RequestOutput

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "Knowledge is power, and power is knowledge. ")


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLM, LLM]]:
    """The default model without and with speculation (the tiny random checkpoints never repeat themselves, so
    prompt lookup would draft nothing there)."""
    kwargs = {"kv_cache_bytes": 32 << 20, "max_model_len": 512}
    yield LLM(None, **kwargs), LLM(None, speculative_config=NGRAM, **kwargs)


@pytest.fixture(autouse=True)
def no_leaks(engines: tuple[LLM, LLM]) -> Iterator[None]:
    yield
    for llm in engines:
        engine = llm.engine
        while engine.has_unfinished_requests() and not engine.requests:
            engine.step()
        bm = engine.block_manager
        assert not engine.requests and bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
        assert not engine.worker.held_requests()


def same(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert (y.token_ids, y.text, y.finish_reason) == (x.token_ids, x.text, x.finish_reason), x.request_id


def drafted(outs: list[RequestOutput]) -> tuple[int, int]:
    """(draft tokens, accepted tokens) over `outs`."""
    stats = [o.spec_decoding for o in outs if o.spec_decoding is not None]
    return sum(s.num_draft_tokens for s in stats), sum(s.num_accepted_tokens for s in stats)


REPEAT = f"Repeat the following text exactly.\nText: {TEXT}\nRepeated text: "
COUNT = "1 2 3 1 2 3 1 2 3 1 2 3 1 2"


@pytest.mark.slow  # one of the fast tier's longest (~6-10 s); the full suite runs it
def test_repeating_prompt_is_greedy_identical_and_accepts(engines: tuple[LLM, LLM]) -> None:
    base, spec = engines
    prompts = [REPEAT, "Once upon a time,"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a, b = base.generate(prompts, params), spec.generate(prompts, params)
    same(a, b)
    stats = b[0].spec_decoding
    assert stats is not None and stats.num_accepted_tokens > 16 and stats.mean_acceptance_length > 2
    totals = spec.engine.spec_totals
    assert totals is not None and totals.num_accepted_tokens >= drafted(b)[1]


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, presence_penalty=0.5, frequency_penalty=0.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=25),
        SamplingParams(temperature=0, max_tokens=20, structured_output={"choice": ["yes", "no", "maybe"]}),
    ]


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
def test_mixed_batch_is_greedy_identical(engines: tuple[LLM, LLM]) -> None:
    base, spec = engines
    prompts = [REPEAT, COUNT, REPEAT, COUNT, "Hello", "Is the sky blue? Answer:"]
    params = mixed_params()
    a, b = base.generate(prompts, params), spec.generate(prompts, params)
    same(a, b)
    for x, y in zip(a[1].logprobs or [], b[1].logprobs or [], strict=True):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    total, accepted = drafted(b)
    assert 0 < accepted < total  # drafts both kept and rejected
    assert b[5].spec_decoding is not None  # structured output speculates too (its grammar checks the drafts)


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
def test_stops_cut_an_accepted_run(engines: tuple[LLM, LLM]) -> None:
    base, spec = engines
    free = base.generate(REPEAT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    stop_string = free.text[len(free.text) // 2 :][:4]
    stop_id = free.token_ids[21]
    cases = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop_string]),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop_string],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=19, ignore_eos=True),
    ]
    # max_tokens one past the stop string's token: both fire inside one accepted run, the stop string first.
    at = len(base.generate(REPEAT, cases[0])[0].token_ids)
    cases.append(SamplingParams(temperature=0, max_tokens=at + 1, ignore_eos=True, stop=[stop_string]))
    a, b = base.generate([REPEAT] * 5, cases), spec.generate([REPEAT] * 5, cases)
    same(a, b)
    assert [o.finish_reason for o in b] == ["stop", "stop", "stop", "length", "stop"]
    assert drafted(b)[1] > 0


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
def test_preemption_and_prefix_hits_are_greedy_identical(make_llm: Callable[..., LLM]) -> None:
    # 20 blocks of 16 tokens: four requests of ~120 tokens cannot all stay.
    block = 30 * 2 * 3 * 64 * 4 * 16
    kwargs = {"kv_cache_bytes": 20 * block, "max_model_len": 256, "max_num_seqs": 4}
    base, spec = make_llm(None, **kwargs), make_llm(None, speculative_config=NGRAM, **kwargs)
    prompts = [REPEAT + str(i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a, b = base.generate(prompts, params), spec.generate(prompts, params)
    same(a, b)
    assert spec.engine.scheduler.num_preemptions > 0
    assert drafted(b)[1] > 0
    again = spec.generate(prompts[:1], params)[0]  # its prompt's blocks are cached now
    assert again.num_cached_tokens > 0 and again.token_ids == a[0].token_ids


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
def test_decode_graph_path_with_speculation_is_greedy_identical(make_llm: Callable[..., LLM],
                                                                 engines: tuple[LLM, LLM]) -> None:
    """Verification steps (every row one token plus its drafts, some none) run as their bucket's verification
    graph, padded to a width of 1 + the most drafts (on a CPU: the same padded step, run uncaptured)."""
    base, _ = engines
    graphs = make_llm(None, kv_cache_bytes=32 << 20, max_model_len=512, enforce_eager=False,
                      speculative_config=NGRAM)
    runner = graphs.engine.worker.runner
    assert runner.graphs.widths == [2, 3, 4, 5]
    run, shapes = runner.graphs.run, []

    def recording_run(bucket: int, forward: Callable[[], object], lora: bool = False, width: int = 1) -> object:
        shapes.append((bucket, width))
        return run(bucket, forward, lora=lora, width=width)

    runner.graphs.run = recording_run
    prompts = [REPEAT, "Once upon a time,", COUNT]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    b = graphs.generate(prompts, params)
    same(base.generate(prompts, params), b)
    assert drafted(b)[1] > 0
    assert {w for _, w in shapes} - {1} and {b for b, _ in shapes} <= {1, 2, 4}, shapes


def test_abort_while_speculating_frees_everything(engines: tuple[LLM, LLM]) -> None:
    _, spec = engines
    engine = spec.engine
    engine.add_request("a", REPEAT, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort("a")
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["abort"]  # no_leaks checks every block came back


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
def test_seeded_sampling_is_reproducible(engines: tuple[LLM, LLM]) -> None:
    _, spec = engines
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=30, seed=11, ignore_eos=True)
    first = spec.generate([REPEAT, COUNT], params)
    second = spec.generate([REPEAT, COUNT], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert drafted(first)[1] > 0


@pytest.mark.slow  # one of the fast tier's longest (~6-10 s); the full suite runs it
def test_a_seeded_request_keeps_its_text_when_drafts_are_rejected(make_llm: Callable[..., LLM],
                                                                   engines: tuple[LLM, LLM]) -> None:
    """A seeded sampled request gives the text it gives without speculation, alone or beside others in a step
    whose token budget caps its drafts: its generator advances by the positions it kept, never by the positions
    a step verified."""
    base, roomy = engines
    tight = make_llm(None, kv_cache_bytes=32 << 20, max_model_len=512, speculative_config=NGRAM,
                     max_num_batched_tokens=3, max_num_seqs=3)
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=5, ignore_eos=True)
    others = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = base.generate([COUNT], seeded)[0]
    alone = roomy.generate([COUNT], seeded)[0]
    beside = tight.generate([COUNT, COUNT], [others, seeded])[-1]
    stats = [o.spec_decoding for o in (alone, beside)]
    assert all(s is not None and s.num_accepted_tokens < s.num_draft_tokens for s in stats)  # drafts rejected
    assert stats[0] != stats[1]  # its steps verified other numbers of drafts
    assert alone.token_ids == beside.token_ids == plain.token_ids


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
def test_sampled_output_keeps_its_distribution(engines: tuple[LLM, LLM]) -> None:
    """Token frequencies at the first output positions over many seeds, with and without speculation: a
    two-sample chi-square test per position (positions after the first come from verification steps)."""
    base, spec = engines
    n = 192
    params = [SamplingParams(temperature=1.5, top_k=4, max_tokens=4, seed=i, ignore_eos=True) for i in range(n)]
    a = base.generate([COUNT] * n, params)
    params = [SamplingParams(temperature=1.5, top_k=4, max_tokens=4, seed=10_000 + i, ignore_eos=True)
              for i in range(n)]
    b = spec.generate([COUNT] * n, params)
    total, accepted = drafted(b)
    assert total > n and 0 < accepted < total
    for pos in range(1, 4):
        stat, dof = two_sample_chi_square(Counter(o.token_ids[pos] for o in a), Counter(o.token_ids[pos] for o in b))
        assert stat < CHI2_999[dof], (pos, stat)


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
            11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


def two_sample_chi_square(x: Counter[int], y: Counter[int]) -> tuple[float, int]:
    """The chi-square statistic of a 2 x k table of counts (rare tokens pooled into one cell) and its degrees
    of freedom."""
    n_x, n_y = sum(x.values()), sum(y.values())
    common = [t for t in set(x) | set(y) if x[t] + y[t] >= 10]
    cells = [(x[t], y[t]) for t in common]
    rest = (n_x - sum(c[0] for c in cells), n_y - sum(c[1] for c in cells))
    if sum(rest):
        cells.append(rest)
    stat = 0.0
    for cx, cy in cells:
        total = cx + cy
        for observed, n in ((cx, n_x), (cy, n_y)):
            expected = total * n / (n_x + n_y)
            stat += (observed - expected) ** 2 / expected
    return stat, max(1, len(cells) - 1)


def test_prometheus_counters_follow_the_engine(engines: tuple[LLM, LLM]) -> None:
    from tritium.backend.serving.metrics import EngineMetrics

    _, spec = engines
    counts: Counter[str] = Counter()

    class Metric:
        def __init__(self, name: str) -> None:
            self.name = name

        def increment(self, value: float) -> None:
            counts[self.name] += value

        def set(self, value: float) -> None: ...

        def observe(self, value: float) -> None: ...

    class MetricFamily:
        HISTOGRAM, COUNTER, GAUGE = "histogram", "counter", "gauge"

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name = name

        def Metric(self, labels: dict[str, str], **kwargs: object) -> Metric:
            return Metric(self.name)

    metrics = EngineMetrics(types.SimpleNamespace(MetricFamily=MetricFamily), "tritium", "1", spec.engine)
    spec.generate([REPEAT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    metrics.on_step(spec.engine, time.monotonic(), force=True)
    totals = spec.engine.spec_totals
    assert totals is not None
    assert counts["tritium_spec_decode_num_drafts_total"] == totals.num_drafts > 0
    assert counts["tritium_spec_decode_num_draft_tokens_total"] == totals.num_draft_tokens > 0
    assert counts["tritium_spec_decode_num_accepted_tokens_total"] == totals.num_accepted_tokens > 0
