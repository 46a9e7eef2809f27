"""Structured output: what JSON-schema constrained decoding (llguidance) costs, in one run on the default model.

1. Throughput at concurrency `num_requests` (32): the same requests submitted at once to one `LLM`, each
   constrained to a schema of `bench.schemas.SCHEMAS` (cycled; a short chat prompt asking for JSON,
   temperature 1, a fixed seed per request, `output_len` as max_tokens), against two unconstrained baselines
   with the same prompts and seeds: "free" (the same max_tokens; the model stops at EOS or the cap, so its
   token count differs) and "matched" (ignore_eos, max_tokens = the constrained request's actual output
   length: the same tokens per request, the fair comparison). After a warm-up (which also fills the engine's
   grammar cache: compile cost is section 2's), constrained, free and matched runs alternate `repeats`
   times; each run's output tokens / wall time, the medians, the constrained / unconstrained ratios and the
   engine's step time split (`LLMEngine.stats`) per mode.
2. Grammar compile time per schema, p50/p99 over `rounds` rounds: cold (a `GrammarCompiler` that caches
   nothing, its llguidance tokenizer already built; that build is timed on its own), the first mask of a
   cold matcher (llguidance builds its lexer lazily, so part of a compile's cost shows there), and cached
   (the engine's compiler again: cache hit + deep copy).
3. Mask time per decoding step: llguidance's `fill_next_token_bitmask_par` for batches of 1, 8 and 32
   constrained rows in mid-generation states, replaying the tokens the constrained runs produced (a row
   whose replay ends starts its schema over); and `reference.apply_token_bitmask` (the engine's CPU path)
   on a 32-row x vocab fp32 logits tensor.
4. Coverage: which of SCHEMAS (and of `bench.schemas.UNSUPPORTED`) compile. When `import xgrammar`
   works (it is not a dependency), sections 2-4 again through xgrammar's own API on the same tokenizer
   (compact JSON like llguidance's default), so the report records what the choice of llguidance rests on.

Results: `structured.json` and `structured.png` in `out_dir`, a summary on stdout. Timings are wall-clock
on whatever else the machine runs: the JSON records the CPU other processes used during each throughput run
and the whole benchmark (on 2 vCPUs, one busy neighbour slows the forward pass's OpenMP threads 10x or more).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import llguidance
import llguidance.torch
import numpy as np
import torch
from tqdm import tqdm

from tritium.backend import LLM, SamplingParams
from tritium.backend.engine import EngineStats
from tritium.backend.outputs import RequestOutput
from tritium.backend.structured_output.compiler import GrammarCompiler
from tritium.backend.structured_output.constraint import StructuredOutput
from tritium.backend.tokenizer import Tokenizer
from tritium.client.bench.report import distribution, load_average, machine_info, pyplot, save_figure, write_report
from tritium.client.bench.schemas import SCHEMAS, UNSUPPORTED
from tritium.client.bench.workload import json_schema_prompts
from tritium.kernels import reference

SEED = 1234
MASK_BATCHES = (1, 8, 32)
MODES = ("constrained", "free", "matched")
SHORT = {"llguidance": "llg", "xgrammar": "xgr"}  # plot labels
JSON_OPTIONS = {"any_whitespace": False, "separators": (",", ":")}  # xgrammar: llguidance's compact default


@dataclass
class Settings:
    """How much of everything one run does (`smoke` shrinks it all)."""

    num_requests: int
    output_len: int
    repeats: int
    compile_rounds: int
    mask_steps: int
    mask_warmup_steps: int
    apply_iters: int


@dataclass
class ThroughputRun:
    """One generate() of all the requests in one mode."""

    mode: str
    repeat: int
    output_tokens: int
    seconds: float
    steps: int
    step_s: float
    model_s: float
    finish_reasons: dict[str, int]
    valid_json: int | None = None  # constrained runs: outputs that parse (and validate, with jsonschema)
    other_cpu_cores: float | None = None  # CPU the rest of the machine used meanwhile (None: not on Linux)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of wall time."""
        return self.output_tokens / self.seconds


@dataclass
class Trajectory:
    """The tokens a constrained request produced, to replay through a matcher."""

    schema: str
    spec: StructuredOutput
    tokens: list[int]


@dataclass
class Timings:
    """p50/p99/mean of some samples, in milliseconds."""

    n: int
    p50_ms: float
    p99_ms: float
    mean_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> Timings:
        """The timings of `seconds` (NaN figures when there are none)."""
        block = distribution((1000 * s for s in seconds), "ms")
        nan = float("nan")
        return cls(len(seconds), block.get("p50", nan), block.get("p99", nan), block.get("avg", nan))


@dataclass
class MaskReplay:
    """Per-step mask times for `rows` constrained rows."""

    rows: int
    timings: Timings
    restarts: int = 0  # rows whose replay ended and started their schema over
    rejected_tokens: int = 0  # replayed tokens the library refused (its grammar differs from llguidance's)
    rejected_by_schema: dict[str, int] = field(default_factory=dict)
    rejected_examples: list[str] = field(default_factory=list)  # the first few: text so far, then the token


@dataclass
class LibraryReport:
    """Sections 2-4 for one grammar library."""

    library: str
    version: str
    tokenizer_build_s: float
    compile_cold: Timings
    first_mask: Timings
    compile_cached: Timings
    masks: list[MaskReplay]
    accepted: list[str]
    refused: dict[str, str]
    unsupported_accepted: list[str]
    unsupported_refused: dict[str, str]
    slowest_cold: dict[str, float] = field(default_factory=dict)  # schema -> median cold compile ms, top 3


class OtherCpu:
    """The CPU time (in cores, averaged over the wall time) that processes other than this one used since
    construction: the machine's busy time in /proc/stat less this process's. None where /proc/stat is not."""

    def __init__(self) -> None:
        self._start = (self._busy_s(), self._own_s(), time.perf_counter())

    @staticmethod
    def _busy_s() -> float | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        t = os.times()
        return t.user + t.system

    def cores(self) -> float | None:
        """CPU cores the other processes used on average since construction (None without /proc/stat)."""
        busy0, own0, t0 = self._start
        busy = self._busy_s()
        if busy is None or busy0 is None:
            return None
        return round(max(0.0, (busy - busy0) - (self._own_s() - own0)) / (time.perf_counter() - t0), 2)


def settings_for(num_requests: int, output_len: int, repeats: int, smoke: bool) -> Settings:
    """The run's sizes: as given, or (`smoke`) a few requests and tokens, one repeat, a few mask steps."""
    if smoke:
        return Settings(num_requests=min(num_requests, 4), output_len=min(output_len, 8), repeats=1,
                        compile_rounds=1, mask_steps=5, mask_warmup_steps=2, apply_iters=5)
    return Settings(num_requests, output_len, repeats, compile_rounds=5, mask_steps=200, mask_warmup_steps=20,
                    apply_iters=100)


def _specs(schemas: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, StructuredOutput]]:
    return [(name, StructuredOutput.from_value({"json": schema})) for name, schema in schemas]


# --- 1. throughput ---------------------------------------------------------------------------------------


def _params(mode: str, n: int, max_tokens: int, lengths: list[int] | None = None) -> list[SamplingParams]:
    out = []
    for i in range(n):
        if mode == "constrained":
            p = SamplingParams(temperature=1.0, seed=SEED + i, max_tokens=max_tokens,
                               structured_output={"json": SCHEMAS[i % len(SCHEMAS)][1]})
        elif mode == "free":
            p = SamplingParams(temperature=1.0, seed=SEED + i, max_tokens=max_tokens)
        else:
            assert lengths is not None
            p = SamplingParams(temperature=1.0, seed=SEED + i, max_tokens=max(1, lengths[i]), ignore_eos=True)
        out.append(p)
    return out


def _schema_valid_count(outs: list[RequestOutput]) -> int:
    """Outputs that parse as JSON and (when jsonschema is installed) validate against their schema."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    valid = 0
    for i, out in enumerate(outs):
        try:
            value = json.loads(out.text)
            if jsonschema is not None:
                jsonschema.validate(value, SCHEMAS[i % len(SCHEMAS)][1])
        except Exception:  # invalid JSON or schema violation alike: not counted
            continue
        valid += 1
    return valid


def _timed_generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], mode: str,
                    repeat: int) -> tuple[ThroughputRun, list[RequestOutput]]:
    before = replace(llm.engine.stats)
    others = OtherCpu()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - t0
    after: EngineStats = llm.engine.stats
    reasons: dict[str, int] = {}
    for o in outs:
        reasons[o.finish_reason or "none"] = reasons.get(o.finish_reason or "none", 0) + 1
    run = ThroughputRun(mode, repeat, sum(len(o.token_ids) for o in outs), seconds, after.steps - before.steps,
                        after.step_s - before.step_s, after.model_s - before.model_s, reasons,
                        _schema_valid_count(outs) if mode == "constrained" else None, others.cores())
    print(f"  {mode}: {run.output_tokens} tokens in {seconds:.1f} s, {run.tokens_per_s:.1f} tok/s, {run.steps} steps")
    return run, outs


def bench_throughput(llm: LLM, s: Settings) -> tuple[list[ThroughputRun], list[Trajectory]]:
    """Warm-up, then `repeats` x (constrained, free, matched); the runs and the last constrained outputs."""
    n = s.num_requests
    prompts = json_schema_prompts(llm.tokenizer, n)
    warm = min(4, s.output_len)
    for mode in ("constrained", "free"):
        print(f"warm-up ({mode}, {warm} tokens)")
        llm.generate(prompts, _params(mode, n, warm))
    runs: list[ThroughputRun] = []
    trajectories: list[Trajectory] = []
    for repeat in range(s.repeats):
        print(f"repeat {repeat + 1}/{s.repeats}: constrained")
        constrained = _params("constrained", n, s.output_len)
        run, outs = _timed_generate(llm, prompts, constrained, "constrained", repeat)
        runs.append(run)
        lengths = [len(o.token_ids) for o in outs]
        trajectories = [Trajectory(SCHEMAS[i % len(SCHEMAS)][0], p.structured_output, list(o.token_ids))
                        for i, (p, o) in enumerate(zip(constrained, outs, strict=True)) if p.structured_output]
        print(f"repeat {repeat + 1}/{s.repeats}: unconstrained, max_tokens={s.output_len}")
        runs.append(_timed_generate(llm, prompts, _params("free", n, s.output_len), "free", repeat)[0])
        print(f"repeat {repeat + 1}/{s.repeats}: unconstrained, ignore_eos, the constrained lengths")
        runs.append(_timed_generate(llm, prompts, _params("matched", n, s.output_len, lengths), "matched",
                                    repeat)[0])
    return runs, trajectories


def throughput_summary(runs: list[ThroughputRun]) -> dict[str, Any]:
    """Per mode the medians over its runs and the engine's step time split; the constrained / matched and
    constrained / free throughput ratios (of the medians)."""
    modes: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in runs if r.mode == mode]
        steps = sum(r.steps for r in mine)
        step_s = sum(r.step_s for r in mine)
        model_s = sum(r.model_s for r in mine)
        modes[mode] = {
            "median_tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
            "median_seconds": statistics.median(r.seconds for r in mine),
            "median_output_tokens": statistics.median(r.output_tokens for r in mine),
            "steps": steps, "step_s": step_s, "model_s": model_s,
            "step_ms_avg": 1000 * step_s / steps, "model_ms_avg": 1000 * model_s / steps,
            "overhead_ms_avg": 1000 * (step_s - model_s) / steps,
        }
    constrained = modes["constrained"]["median_tokens_per_s"]
    return {
        "modes": modes,
        "ratio_constrained_vs_matched": constrained / modes["matched"]["median_tokens_per_s"],
        "ratio_constrained_vs_free": constrained / modes["free"]["median_tokens_per_s"],
    }


# --- 2-4. compile, masks, coverage: llguidance --------------------------------------------------------------


def _replay(trajectories: list[Trajectory], rows: int, steps: int, warmup: int, new: Callable[[Trajectory], Any],
            advance: Callable[[Any, int], bool], done: Callable[[Any], bool],
            fill: Callable[[list[Any]], None], desc: str,
            describe: Callable[[Trajectory, int], str] | None = None) -> MaskReplay:
    """Time `fill` (the masks of `rows` matchers at once) per step while each row replays a trajectory; row r
    follows trajectory r % len, starting a few tokens in so that rows sit at different depths."""
    trajs = [t for t in trajectories if t.tokens]
    if not trajs:
        raise RuntimeError("no constrained request produced a token: nothing to replay for the mask timings")
    which = [trajs[r % len(trajs)] for r in range(rows)]
    matchers = [new(t) for t in which]
    pos = [0] * rows
    result = MaskReplay(rows, Timings.of([]))
    for r, traj in enumerate(which):
        for token in traj.tokens[: (3 * r) % max(1, len(traj.tokens) - 1)]:
            if not advance(matchers[r], token):
                matchers[r], pos[r] = new(traj), 0
                break
            pos[r] += 1
    samples = []
    for step in tqdm(range(warmup + steps), desc=desc, unit="step", leave=False):
        for r, traj in enumerate(which):
            if pos[r] >= len(traj.tokens) or done(matchers[r]):
                matchers[r], pos[r] = new(traj), 0
                result.restarts += int(step >= warmup)
        t0 = time.perf_counter()
        fill(matchers)
        if step >= warmup:
            samples.append(time.perf_counter() - t0)
        for r, traj in enumerate(which):
            if not advance(matchers[r], traj.tokens[pos[r]]):
                if step >= warmup:
                    result.rejected_tokens += 1
                    result.rejected_by_schema[traj.schema] = result.rejected_by_schema.get(traj.schema, 0) + 1
                    if describe is not None and len(result.rejected_examples) < 3:
                        result.rejected_examples.append(describe(traj, pos[r]))
                matchers[r], pos[r] = new(traj), 0
            else:
                pos[r] += 1
    result.timings = Timings.of(samples)
    return result


def _coverage(compile_one: Callable[[dict[str, Any]], None],
              schemas: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], dict[str, str]]:
    accepted, refused = [], {}
    for name, schema in schemas:
        try:
            compile_one(schema)
        except Exception as exc:  # each library's own error types: the message is what is reported
            refused[name] = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        else:
            accepted.append(name)
    return accepted, refused


def _slowest(per_schema: dict[str, list[float]], k: int = 3) -> dict[str, float]:
    medians = {name: 1000 * statistics.median(v) for name, v in per_schema.items() if v}
    return dict(sorted(medians.items(), key=lambda kv: -kv[1])[:k])


def bench_llguidance(tokenizer: Tokenizer, eos: list[int], cached: GrammarCompiler, trajectories: list[Trajectory],
                     s: Settings) -> LibraryReport:
    """Sections 2-4 through the engine's own GrammarCompiler (`cached` is the engine's, its cache warm)."""
    cold = GrammarCompiler(tokenizer, eos, cache_bytes=0)  # caches nothing: every compile is a cold one
    t0 = time.perf_counter()
    ll_tokenizer = cold.ll_tokenizer
    tokenizer_build_s = time.perf_counter() - t0
    specs = _specs(SCHEMAS)
    executor = llguidance.LLExecutor()
    words = (ll_tokenizer.vocab_size + 31) // 32
    one = torch.zeros(1, words, dtype=torch.int32)
    cold_s: list[float] = []
    first_s: list[float] = []
    per_schema: dict[str, list[float]] = {name: [] for name, _ in specs}
    for _ in tqdm(range(s.compile_rounds), desc="llguidance compile (cold)", unit="round"):
        for name, spec in specs:
            try:
                t0 = time.perf_counter()
                matcher = cold.compile(spec)
                t1 = time.perf_counter()
            except ValueError:
                continue  # reported by the coverage below
            llguidance.torch.fill_next_token_bitmask_par(executor, [(matcher, 0)], one)
            first_s.append(time.perf_counter() - t1)
            cold_s.append(t1 - t0)
            per_schema[name].append(t1 - t0)
    accepted, refused = _coverage(lambda schema: cold.compile(StructuredOutput.from_value({"json": schema})),
                                  SCHEMAS)
    unsupported = [(name, schema) for name, schema, _ in UNSUPPORTED]
    unsupported_accepted, unsupported_refused = _coverage(
        lambda schema: cold.compile(StructuredOutput.from_value({"json": schema})), unsupported)

    cached_s: list[float] = []
    good = [(name, spec) for name, spec in specs if name in accepted]
    for _, spec in good:
        cached.compile(spec)  # in the cache from here on (the throughput warm-up put them there already)
    for _ in tqdm(range(s.compile_rounds), desc="llguidance compile (cached)", unit="round"):
        for _, spec in good:
            t0 = time.perf_counter()
            cached.compile(spec)
            cached_s.append(time.perf_counter() - t0)

    host = torch.zeros(max(MASK_BATCHES), words, dtype=torch.int32)
    masks = []
    for rows in MASK_BATCHES:
        def fill(matchers: list[llguidance.LLMatcher], rows: int = rows) -> None:
            llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)],
                                                         host[:rows])

        masks.append(_replay(trajectories, rows, s.mask_steps, s.mask_warmup_steps,
                             new=lambda t: cached.compile(t.spec),
                             advance=lambda m, t: m.consume_token(t),
                             done=lambda m: m.is_stopped() or m.is_error(), fill=fill,
                             desc=f"llguidance masks x{rows}"))
    return LibraryReport("llguidance", _dist_version("llguidance"), tokenizer_build_s, Timings.of(cold_s),
                         Timings.of(first_s), Timings.of(cached_s), masks, accepted, refused, unsupported_accepted,
                         unsupported_refused, _slowest(per_schema))


def _dist_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def bench_apply(vocab: int, rows: int, iters: int) -> dict[str, Any]:
    """`reference.apply_token_bitmask` (the engine's CPU path) on `rows` x `vocab` fp32 logits with a random
    mask, at torch's thread count and, when that is more than one, on one thread (OpenMP threads that wait
    for a busy core make the multi-threaded time swing with whatever else the machine runs)."""
    g = torch.Generator().manual_seed(SEED)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(rows, vocab, generator=g)
    index = torch.arange(rows, dtype=torch.long)

    def timed() -> Timings:
        samples = []
        for i in range(iters + 2):
            t0 = time.perf_counter()
            reference.apply_token_bitmask(logits, bitmask, index)
            if i >= 2:  # two warm-up calls
                samples.append(time.perf_counter() - t0)
        return Timings.of(samples)

    threads = torch.get_num_threads()
    result: dict[str, Any] = {"rows": rows, "vocab": vocab, "threads": threads, "timings": asdict(timed()),
                              "one_thread": None}
    if threads > 1:
        torch.set_num_threads(1)
        try:
            result["one_thread"] = asdict(timed())
        finally:
            torch.set_num_threads(threads)
    return result


# --- 2-4 through xgrammar (optional) --------------------------------------------------------------------


def _canonical(schema: dict[str, Any] | str) -> str:
    """The schema text the engine gives llguidance (`StructuredOutput`'s): properties are generated in its key
    order, so xgrammar gets the same text to replay llguidance's tokens."""
    if isinstance(schema, str):
        return schema
    text = StructuredOutput.from_value({"json": schema}).json
    assert text is not None
    return text


def bench_xgrammar(tokenizer: Tokenizer, model_path: Path, vocab: int, eos: list[int],
                   trajectories: list[Trajectory], s: Settings) -> LibraryReport | str:
    """The same measurements through xgrammar's API; a string saying why not when it cannot run."""
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except Exception as exc:  # not installed, or broken against this torch: either way skipped
        return f"xgrammar not available ({type(exc).__name__}: {exc})"
    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_path) / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    tokenizer_build_s = time.perf_counter() - t0
    cold = xgr.GrammarCompiler(info, cache_enabled=False)
    warm = xgr.GrammarCompiler(info, cache_enabled=True)
    one = xgr.allocate_token_bitmask(1, vocab)

    def compile_with(compiler: Any, schema: dict[str, Any] | str) -> Any:
        return xgr.GrammarMatcher(compiler.compile_json_schema(_canonical(schema), **JSON_OPTIONS))

    accepted, refused = _coverage(lambda schema: compile_with(cold, schema), SCHEMAS)
    unsupported = [(name, schema) for name, schema, _ in UNSUPPORTED]
    unsupported_accepted, unsupported_refused = _coverage(lambda schema: compile_with(cold, schema), unsupported)
    good = [(name, _canonical(schema)) for name, schema in SCHEMAS if name in accepted]
    cold_s: list[float] = []
    first_s: list[float] = []
    per_schema: dict[str, list[float]] = {name: [] for name, _ in good}
    for _ in tqdm(range(s.compile_rounds), desc="xgrammar compile (cold)", unit="round"):
        for name, text in good:
            t0 = time.perf_counter()
            matcher = compile_with(cold, text)
            t1 = time.perf_counter()
            matcher.fill_next_token_bitmask(one)
            first_s.append(time.perf_counter() - t1)
            cold_s.append(t1 - t0)
            per_schema[name].append(t1 - t0)
    compiled = {name: warm.compile_json_schema(text, **JSON_OPTIONS) for name, text in good}
    cached_s: list[float] = []
    for _ in tqdm(range(s.compile_rounds), desc="xgrammar compile (cached)", unit="round"):
        for _, text in good:
            t0 = time.perf_counter()
            compile_with(warm, text)
            cached_s.append(time.perf_counter() - t0)

    usable = [t for t in trajectories if t.schema in compiled]
    batch = xgr.BatchGrammarMatcher()
    host = xgr.allocate_token_bitmask(max(MASK_BATCHES), vocab)
    masks = []
    for rows in MASK_BATCHES if usable else ():
        def fill(matchers: list[Any], rows: int = rows) -> None:
            batch.batch_fill_next_token_bitmask(matchers, host[:rows])

        masks.append(_replay(usable, rows, s.mask_steps, s.mask_warmup_steps,
                             new=lambda t: xgr.GrammarMatcher(compiled[t.schema]),
                             advance=lambda m, t: m.accept_token(t), done=lambda m: m.is_terminated(),
                             fill=fill, desc=f"xgrammar masks x{rows}",
                             describe=lambda t, pos: f"{t.schema}: {tokenizer.decode(t.tokens[:pos])!r} then "
                                                     f"{tokenizer.decode(t.tokens[pos : pos + 1])!r}"))
    return LibraryReport("xgrammar", _dist_version("xgrammar"), tokenizer_build_s, Timings.of(cold_s),
                         Timings.of(first_s), Timings.of(cached_s), masks, accepted, refused, unsupported_accepted,
                         unsupported_refused, _slowest(per_schema))


# --- report -----------------------------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> None:
    """Throughput per mode, compile times and mask times per library."""
    plt = pyplot()
    fig, (ax_tp, ax_compile, ax_mask) = plt.subplots(1, 3, figsize=(16, 4.5))
    modes = report["throughput"]["summary"]["modes"]
    labels = {"constrained": "constrained\n(JSON schema)", "free": "unconstrained\nsame max_tokens",
              "matched": "unconstrained\nsame lengths"}
    values = [modes[m]["median_tokens_per_s"] for m in MODES]
    bars = ax_tp.bar([labels[m] for m in MODES], values, color=["#c0392b", "#95a5a6", "#7f8c8d"])
    ax_tp.bar_label(bars, fmt="%.1f", label_type="center", color="white", fontweight="bold")
    for i, mode in enumerate(MODES):
        points = [r["tokens_per_s"] for r in report["throughput"]["runs"] if r["mode"] == mode]
        ax_tp.scatter([i] * len(points), points, color="black", s=10, zorder=3)
    ax_tp.set_ylabel("output tokens / s (median, dots: runs)")
    ax_tp.set_title(f"Throughput, {report['workload']['num_requests']} requests at once")
    ax_tp.set_ylim(0, max(values) * 1.25)

    libraries = report["libraries"]
    names, p50, p99, colors = [], [], [], []
    for lib in libraries:
        for key, label in (("compile_cold", "cold"), ("first_mask", "1st mask"), ("compile_cached", "cached")):
            names.append(f"{SHORT[lib['library']]}\n{label}")
            p50.append(lib[key]["p50_ms"])
            p99.append(lib[key]["p99_ms"])
            colors.append("#c0392b" if lib["library"] == "llguidance" else "#2980b9")
    x = np.arange(len(names))
    ax_compile.bar(x - 0.2, p50, 0.4, color=colors, label="p50")
    ax_compile.bar(x + 0.2, p99, 0.4, color=colors, alpha=0.45, label="p99")
    ax_compile.set_xticks(x, names, fontsize=7)
    ax_compile.set_yscale("log")
    ax_compile.set_ylabel("ms per schema (log)")
    ax_compile.set_title("Grammar compile per schema, p50 (solid) / p99 (light)", fontsize=10)

    names, p50, p99, colors = [], [], [], []
    for lib in libraries:
        for m in lib["masks"]:
            names.append(f"{SHORT[lib['library']]}\n{m['rows']} rows")
            p50.append(m["timings"]["p50_ms"])
            p99.append(m["timings"]["p99_ms"])
            colors.append("#c0392b" if lib["library"] == "llguidance" else "#2980b9")
    apply = report["mask_apply"]
    for key, threads in (("timings", apply["threads"]), ("one_thread", 1)):
        if apply[key] is not None:
            names.append(f"apply {apply['rows']}\n{threads} thr")
            p50.append(apply[key]["p50_ms"])
            p99.append(apply[key]["p99_ms"])
            colors.append("#27ae60")
    x = np.arange(len(names))
    ax_mask.bar(x - 0.2, p50, 0.4, color=colors)
    ax_mask.bar(x + 0.2, p99, 0.4, color=colors, alpha=0.45)
    ax_mask.set_xticks(x, names, fontsize=7)
    ax_mask.set_yscale("log")
    ax_mask.set_ylabel("ms per step (log)")
    ax_mask.set_title("Token masks per step (llg: llguidance, xgr: xgrammar;\napply: reference.apply_token_bitmask)",
                      fontsize=10)
    fig.suptitle("Structured output (llguidance), SmolLM2-135M, CPU: shared machine, see JSON for load", fontsize=10)
    save_figure(fig, path, dpi=120)


def print_summary(report: dict[str, Any]) -> None:
    """The throughput table and ratios, the compile / mask timings per library and the schema coverage."""
    w = report["workload"]
    tp = report["throughput"]
    print(f"\n{w['num_requests']} requests at once, max_tokens {w['output_len']}, temperature 1, "
          f"{w['repeats']} repeat(s); load average before/after: {report['machine']['loadavg_before']} / "
          f"{report['machine']['loadavg_after']}; other processes used {report['machine']['other_cpu_cores']} CPU "
          "cores on average meanwhile")
    print(f"{'mode':<14}{'run tok/s':>28}{'median':>9}{'tokens':>8}{'step ms':>9}{'model ms':>10}{'other ms':>10}")
    for mode in MODES:
        m = tp["summary"]["modes"][mode]
        runs = " ".join(f"{r['tokens_per_s']:.1f}" for r in tp["runs"] if r["mode"] == mode)
        print(f"{mode:<14}{runs:>28}{m['median_tokens_per_s']:>9.1f}{m['median_output_tokens']:>8.0f}"
              f"{m['step_ms_avg']:>9.1f}{m['model_ms_avg']:>10.1f}{m['overhead_ms_avg']:>10.2f}")
    others = [r["other_cpu_cores"] for r in tp["runs"]]
    if None not in others:
        per_mode = "; ".join(f"{mode} " + " ".join(f"{r['other_cpu_cores']:.2f}" for r in tp["runs"]
                                                   if r["mode"] == mode) for mode in MODES)
        print(f"CPU cores used by other processes during each run (of {report['machine']['cpu_count']}): {per_mode}"
              + ("  <- other work competed: expect noisy ratios" if max(others) > 0.25 else ""))
    last = next(r for r in reversed(tp["runs"]) if r["mode"] == "constrained")
    print(f"constrained / unconstrained tok/s: {tp['summary']['ratio_constrained_vs_matched']:.3f} (same lengths), "
          f"{tp['summary']['ratio_constrained_vs_free']:.3f} (same max_tokens); last constrained run: "
          f"{last['finish_reasons']}, {last['valid_json']}/{w['num_requests']} valid against their schema")
    print(f"\n{'library':<12}{'tokenizer s':>12}{'cold p50/p99 ms':>18}{'1st mask p50/p99':>18}"
          f"{'cached p50/p99':>16}  masks p50/p99 ms (rows)")
    for lib in report["libraries"]:
        masks = "  ".join(f"{m['timings']['p50_ms']:.2f}/{m['timings']['p99_ms']:.2f} ({m['rows']})"
                          for m in lib["masks"])
        cells = [f"{lib[k]['p50_ms']:.2f}/{lib[k]['p99_ms']:.2f}" for k in ("compile_cold", "first_mask",
                                                                          "compile_cached")]
        print(f"{lib['library']:<12}{lib['tokenizer_build_s']:>12.2f}{cells[0]:>18}{cells[1]:>18}{cells[2]:>16}  "
              f"{masks}")
    apply = report["mask_apply"]
    one = apply["one_thread"]
    print(f"torch apply_token_bitmask, {apply['rows']} x {apply['vocab']} fp32, {apply['threads']} thread(s): "
          f"p50 {apply['timings']['p50_ms']:.3f} ms, p99 {apply['timings']['p99_ms']:.3f} ms"
          + (f"; 1 thread: p50 {one['p50_ms']:.3f} ms, p99 {one['p99_ms']:.3f} ms" if one else ""))
    for lib in report["libraries"]:
        refused = ", ".join(lib["refused"]) or "none"
        print(f"{lib['library']}: {len(lib['accepted'])}/{len(SCHEMAS)} SCHEMAS compile (refused: {refused}); "
              f"of {len(UNSUPPORTED)} UNSUPPORTED, refuses {len(lib['unsupported_refused'])}, compiles "
              f"{len(lib['unsupported_accepted'])} ({', '.join(lib['unsupported_accepted']) or '-'})")
        rejected: dict[str, int] = {}
        for m in lib["masks"]:
            for name, count in m["rejected_by_schema"].items():
                rejected[name] = rejected.get(name, 0) + count
        if rejected:
            print(f"  {lib['library']} refused replayed tokens llguidance had allowed: {rejected}")
            for example in (e for m in lib["masks"] for e in m.get("rejected_examples", [])[:1]):
                print(f"    e.g. {example}")
    if report["xgrammar_skipped"]:
        print(f"xgrammar: skipped: {report['xgrammar_skipped']}")


def run_structured_benchmark(out_dir: str | Path = "bench_results", num_requests: int = 32, output_len: int = 256,
                             repeats: int = 3, smoke: bool = False) -> dict[str, Any]:
    """Run every section, print the summary, write `structured.json` and `structured.png` in `out_dir`;
    returns the JSON dict. `smoke`: a few requests and tokens, one repeat, one compile round (for CI)."""
    s = settings_for(num_requests, output_len, repeats, smoke)
    loadavg_before = load_average()
    others = OtherCpu()
    t_start = time.perf_counter()
    llm = LLM(None, max_num_seqs=max(32, s.num_requests), max_num_batched_tokens=2048)
    engine = llm.engine
    runs, trajectories = bench_throughput(llm, s)
    libraries = [bench_llguidance(engine.tokenizer, engine.eos_token_ids, engine.grammars, trajectories, s)]
    vocab = engine.grammars.vocab_size
    apply = bench_apply(vocab, max(MASK_BATCHES), s.apply_iters)
    xgrammar = bench_xgrammar(engine.tokenizer, engine.model_path, vocab, engine.eos_token_ids, trajectories, s)
    if isinstance(xgrammar, LibraryReport):
        libraries.append(xgrammar)
    report: dict[str, Any] = {
        "workload": {"model": str(engine.model_path), "num_requests": s.num_requests, "output_len": s.output_len,
                     "repeats": s.repeats, "temperature": 1.0, "seed": SEED, "smoke": smoke,
                     "compile_rounds": s.compile_rounds, "mask_steps": s.mask_steps, "schemas": len(SCHEMAS),
                     "device": str(engine.device), "dtype": str(engine.dtype)},
        "machine": machine_info(loadavg_before=loadavg_before, other_cpu_cores=others.cores(),
                                note="wall-clock timings on a machine shared with other work"),
        "throughput": {"runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in runs],
                       "summary": throughput_summary(runs)},
        "libraries": [asdict(lib) for lib in libraries],
        "mask_apply": apply,
        "xgrammar_skipped": xgrammar if isinstance(xgrammar, str) else None,
        "wall_s": time.perf_counter() - t_start,
    }
    print_summary(report)
    write_report(out_dir, "structured", report, lambda path: plot(report, path))
    return report
