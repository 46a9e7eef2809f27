"""`tritium gpu-check` / `make gpu-check`: one command that checks tritium on a GPU in about 5 minutes.

Steps, each timed and reported pass / fail / skip with its figures (a failed step does not stop the run):
  1  kernels vs reference   every Triton kernel against its torch reference at GPU tiles (checks/kernels.py)
  2  greedy parity          the engine's greedy tokens against transformers, same device and dtype
  3  sync-free decode       decode steps under torch.cuda.set_sync_debug_mode: one sync per step allowed
  3b step timing            a batch-64 decode step's host time against its GPU time (checks/engine.py)
  2b greedy parity          the same on a few random layers of a head_dim-128, GQA-4 shape (Llama-3-8B-like)
  3c step timing            the same on those layers
  4  kernel benchmark       prefill TFLOP/s next to SDPA flash, decode GB/s next to the peak (bench/kernels.py);
                            LoRA shrink + expand next to the base GEMM they sit beside (checks/kernels.py);
                            the fused MoE kernel's tile sweep, its winners printed for kernels/moe_configs.py
  5  offline throughput     tritium next to transformers on the default model (bench/offline.py)
  3d LoRA and n-gram steps  a LoRA r16 decode step at batch 1 against the base step, n-gram speculation against
                            plain decoding at batch 64, syncs per step watched (checks/decode_features.py)
then the goal verdicts. gpu_check.json and gpu_check.png in --out are rewritten after every step (a run cut
short leaves what it did, the rest reported "not run"); a one-screen summary is printed at the end.

`--steps 1,2,3b` runs only those steps (the others are reported "not run"; nothing is merged from an earlier
run). `--model` is "auto" (the default model when installed, else "random"), "default", "random" (random
weights with the default model's shapes and real tokenizer, config and tokenizer from `--model-files` or the
default model) or a folder; `--budget-s` reports the steps not started within that many seconds "not run".

`--smoke` runs the same steps on a CPU with tiny shapes (the Triton interpreter, TRITON_INTERPRET=1, which
must be set before triton is imported: this entry sets it, or starts itself again when triton already is),
to check the script itself; its performance figures mean nothing and the CUDA-only steps are skipped.
"""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tritium.client.bench.report import write_report
from tritium.client.checks import report as report
from tritium.client.checks.report import FAIL, NOT_RUN, PASS, Outcome, StepResult

DEFAULT_OUT = "bench_results/gpu_check"
KERNEL_BENCH_BUDGET_S = 100.0
MOE_SWEEP_BUDGET_S = 45.0  # step 4's fused MoE tile sweep (bench/moe.py)
GPU_PREFILL_GRID = [(hd, 1, s) for hd in (64, 128) for s in (2048, 4096, 8192, 16384)]
# the goal's shape (batch 64, 4k context) first, so that a budget cut drops only the curve around it
GPU_DECODE_GRID = [(hd, 64, 4096) for hd in (64, 128)] + [(hd, b, 4096) for hd in (64, 128) for b in (1, 8, 32)]


@dataclass(frozen=True)
class Workload:
    """Step 5's requests (workload.random_token_prompts) and the transformers batch sizes it compares."""

    num_requests: int
    output_len: int
    min_prompt: int
    max_prompt: int
    transformers_batches: tuple[int, ...]


GPU_WORKLOAD = Workload(64, 128, 32, 256, (8, 64))
SMOKE_WORKLOAD = Workload(4, 8, 16, 32, (4,))


@dataclass(frozen=True)
class Step:
    """A step of the check: its number and name in the report, its title, what runs it, and which engine it
    uses ("default", "wide", a family of CheckModels.family, or None: engines other than its own are freed before
    it runs)."""

    number: str
    name: str
    title: str
    run: Callable[[], Outcome]
    engine: str | None = None


STEP_NUMBERS = ("1", "2", "3", "3b", "2b", "3c", "4", "5", "3d", "2c", "2d")  # in the order they run


def check_kernel_bench(smoke: bool) -> Outcome:
    """Step 4: the kernel benchmark on the check's grid (within KERNEL_BENCH_BUDGET_S), or the smoke grid."""
    from tritium.client.bench.kernels import measure_kernels
    from tritium.client.bench.moe import moe_sweep_figures
    from tritium.client.bench.workload import kernel_grids
    from tritium.client.checks.int8_speed import int8_gemm_figures
    from tritium.client.checks.kernels import time_lora

    if smoke:
        measured = measure_kernels(*kernel_grids(smoke=True), smoke=True)
    else:
        measured = measure_kernels(GPU_PREFILL_GRID, GPU_DECODE_GRID, budget_s=KERNEL_BENCH_BUDGET_S)
    figures = asdict(measured)
    try:
        figures["lora"] = time_lora(smoke)
    except Exception as exc:  # the attention figures stand on their own
        figures["lora"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    try:
        figures["moe"] = moe_sweep_figures(smoke, MOE_SWEEP_BUDGET_S)
    except Exception as exc:
        figures["moe"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    try:
        figures["int8_gemm"] = int8_gemm_figures(smoke)
    except Exception as exc:
        figures["int8_gemm"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    timed = f"{len(measured.prefill)} prefill + {len(measured.decode)} decode shapes"
    if smoke:
        summary = f"{timed} under the interpreter (smoke: the numbers mean nothing)"
    else:
        ratios = [p.tritium_tflops / p.sdpa_flash_tflops for p in measured.prefill if p.sdpa_flash_tflops]
        goal = [d for d in measured.decode
                if d.batch == report.DECODE_GOAL_BATCH and d.context == report.DECODE_GOAL_CONTEXT]
        parts = [timed]
        if ratios:
            parts.append(f"prefill {min(ratios):.2f}-{max(ratios):.2f}x SDPA flash")
        if goal:
            peak = f" = {min(d.tritium_gbs for d in goal) / goal[0].peak_gbs:.0%} of peak" if goal[0].peak_gbs else ""
            parts.append(f"decode b{report.DECODE_GOAL_BATCH} {min(d.tritium_gbs for d in goal):.0f} GB/s{peak}")
        if measured.not_measured:
            parts.append(f"{len(measured.not_measured)} shapes left out (budget {KERNEL_BENCH_BUDGET_S:.0f} s)")
        lora = figures["lora"]
        parts.append(f"LoRA r{lora['rank']} <= {lora['max_ratio']:.2f}x its base GEMM" if "error" not in lora
                     else f"LoRA timing failed: {lora['error']}")
        summary = "; ".join(parts)
    return Outcome(PASS, summary, figures)


def check_throughput(smoke: bool, model: str | None = None) -> Outcome:
    """Step 5: offline throughput of tritium and transformers on the same prompts, on `model` (None: the default
    model); fails when any of them produced fewer than the requested tokens."""
    import torch

    from tritium.client.bench.offline import bench_transformers, bench_tritium
    from tritium.client.bench.workload import random_token_prompts
    from tritium.client.checks.engine import (
        GPU_MEMORY_UTILIZATION,
        SMOKE_KV_CACHE_BYTES,
        SMOKE_MAX_MODEL_LEN,
        SMOKE_TOKEN_BUDGET,
    )

    work = SMOKE_WORKLOAD if smoke else GPU_WORKLOAD
    if smoke:
        device, dtype = "cpu", torch.float32
        settings: dict[str, Any] = {"device": "cpu", "kv_cache_bytes": SMOKE_KV_CACHE_BYTES,
                                    "max_model_len": SMOKE_MAX_MODEL_LEN, "max_num_batched_tokens": SMOKE_TOKEN_BUDGET}
    else:
        device, dtype = "cuda", torch.bfloat16
        settings = {"device": "cuda", "gpu_memory_utilization": GPU_MEMORY_UTILIZATION}
    prompts = random_token_prompts(work.num_requests, work.min_prompt, work.max_prompt)
    tritium, step = bench_tritium(prompts, work.output_len, max_num_seqs=64, model=model, **settings)
    _free_memory()
    results = [tritium] + [bench_transformers(prompts, work.output_len, b, device, dtype, model)
                           for b in work.transformers_batches]
    expected = work.num_requests * work.output_len
    short = [r.name for r in results if r.output_tokens != expected]
    figures = {"workload": asdict(work), "device": device, "dtype": str(dtype).removeprefix("torch."),
               "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results], "tritium_step": step}
    ratios = ", ".join(f"{tritium.tokens_per_s / r.tokens_per_s:.1f}x {r.name}" for r in results[1:])
    summary = (f"{work.num_requests} x {work.output_len} tokens: tritium {tritium.tokens_per_s:,.1f} tok/s "
               f"({ratios})")
    if short:
        return Outcome(FAIL, f"expected {expected} output tokens from each, got fewer from {', '.join(short)}",
                       figures)
    return Outcome(PASS, summary, figures)


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_step(step: Step) -> StepResult:
    """Run one step, timed; an exception fails that step alone (its traceback goes into the figures). On CUDA
    the figures also count the kernels Triton compiled during the step (new entries in its cache)."""
    print(f"\n== step {step.number}: {step.title}", flush=True)
    cache = triton_cache_dir()
    before = compiled_kernels(cache)
    t0 = time.perf_counter()
    try:
        outcome = step.run()
    except Exception as exc:
        traceback.print_exc()
        outcome = Outcome(FAIL, f"{type(exc).__name__}: {exc}"[:300], {"traceback": traceback.format_exc()})
    result = StepResult(step.number, step.name, step.title, outcome.status, time.perf_counter() - t0,
                        outcome.summary, outcome.figures)
    if os.environ.get("TRITON_INTERPRET") != "1":
        result.figures["triton_compiled"] = len(compiled_kernels(cache) - before)
    print(f"-- step {step.number} {result.status} in {result.seconds:.1f} s: {result.summary}", flush=True)
    return result


def not_run(step: Step, why: str) -> StepResult:
    """A step reported without running: status "not run", `why` as its summary."""
    return StepResult(step.number, step.name, step.title, NOT_RUN, 0.0, why)


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels: $TRITON_CACHE_DIR, else ~/.triton/cache."""
    env = os.environ.get("TRITON_CACHE_DIR")
    return Path(env) if env else Path.home() / ".triton" / "cache"


def compiled_kernels(cache: Path) -> set[str]:
    """The cache entries (one folder per compiled kernel variant) that hold a GPU binary."""
    if not cache.is_dir():
        return set()
    return {d.name for d in cache.iterdir() if d.is_dir() and (any(d.glob("*.cubin")) or any(d.glob("*.hsaco")))}


def parse_steps(text: str | None) -> list[str]:
    """The step numbers of `--steps` ("1,2,3b"), in run order; None or "all" is every step. Raises ValueError
    naming an unknown step."""
    if text is None or text.strip() in ("", "all"):
        return list(STEP_NUMBERS)
    asked = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in asked if t not in STEP_NUMBERS]
    if unknown:
        raise ValueError(f"unknown step {', '.join(unknown)} (steps: {', '.join(STEP_NUMBERS)})")
    return [n for n in STEP_NUMBERS if n in asked]


def machine_info(smoke: bool) -> dict[str, Any]:
    """The device (or "cpu (smoke)"), GPU count, torch / CUDA / triton / transformers versions, python, platform,
    the git commit and TRITON_INTERPRET."""
    import torch
    import triton

    info: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not smoke else "cpu (smoke)",
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0, "torch": torch.__version__,
        "cuda": torch.version.cuda, "triton": triton.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "git_commit": git_commit(), "triton_interpret":
        os.environ.get("TRITON_INTERPRET"),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def git_commit() -> str | None:
    """The checkout's HEAD commit; outside a git checkout (or without git) $TRITIUM_GIT_COMMIT (the device
    command sets it from the bundle's manifest), else None."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is not None and out.returncode == 0 and out.stdout.strip():
        return out.stdout.strip()
    return os.environ.get("TRITIUM_GIT_COMMIT") or None


@dataclass(frozen=True)
class Options:
    """What `tritium gpu-check` was asked: see the module docstring."""

    out_dir: str = DEFAULT_OUT
    smoke: bool = False
    steps: str | None = None
    model: str = "auto"
    model_files: str | None = None
    budget_s: float | None = None


def run_gpu_check(out_dir: str = DEFAULT_OUT, smoke: bool = False, options: Options | None = None) -> dict[str, Any]:
    """Run the selected steps, rewriting gpu_check.json and gpu_check.png after each, print the summary;
    returns the JSON dict. `options` (when given) wins over `out_dir` and `smoke`. Raises RuntimeError without
    CUDA unless smoke, ValueError for an unknown step."""
    import torch

    opts = options or Options(out_dir, smoke)
    smoke = opts.smoke
    selected = parse_steps(opts.steps)
    if not smoke and not torch.cuda.is_available():
        raise RuntimeError("gpu-check needs a CUDA GPU (--smoke checks the script itself on a CPU)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tritium.client.checks.triton_compat import patch_interpreter

        patch_interpreter()
    with tempfile.TemporaryDirectory(prefix="tritium-gpu-check-") as work:
        return _run(opts, selected, Path(work))


def _run(opts: Options, selected: list[str], work: Path) -> dict[str, Any]:
    from tritium.client.checks.decode_features import check_decode_features
    from tritium.client.checks.engine import SharedEngine, check_parity, check_step_timing, check_sync_free_decode
    from tritium.client.checks.kernels import check_kernels
    from tritium.client.checks.models import CheckModels

    smoke = opts.smoke
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    machine = machine_info(smoke)
    models = CheckModels(opts.model, Path(opts.model_files) if opts.model_files else None, work, smoke)
    engines: dict[str, SharedEngine] = {}

    def engine(kind: str) -> SharedEngine:
        if kind not in engines:
            folder = {"default": models.default, "wide": models.wide}.get(kind, lambda: models.family(kind))()
            engines[kind] = SharedEngine(smoke, folder)
        return engines[kind]

    steps = [
        Step("1", "kernels", "kernels vs reference", lambda: check_kernels(smoke)),
        Step("2", "parity", "greedy parity vs HF", lambda: check_parity(engine("default"), smoke), "default"),
        Step("3", "sync_free_decode", "sync-free decode", lambda: check_sync_free_decode(engine("default"), smoke),
             "default"),
        Step("3b", "step_timing", "step host vs GPU time", lambda: check_step_timing(engine("default"), smoke),
             "default"),
        Step("2b", "parity_wide", "parity, hd128 GQA-4", lambda: check_parity(engine("wide"), smoke), "wide"),
        Step("3c", "step_timing_wide", "step time, hd128 GQA-4", lambda: check_step_timing(engine("wide"), smoke),
             "wide"),
        Step("4", "kernel_bench", "kernel benchmark", lambda: check_kernel_bench(smoke)),
        Step("5", "throughput", "offline throughput", lambda: check_throughput(smoke, models.default())),
        Step("3d", "decode_features", "LoRA and n-gram decode steps",
             lambda: check_decode_features(smoke, models.default())),
        Step("2c", "parity_qwen3", "parity, Qwen3 hd128", lambda: check_parity(engine("qwen3"), smoke), "qwen3"),
        Step("2d", "parity_gemma3", "parity, Gemma 3 hd256", lambda: check_parity(engine("gemma3"), smoke), "gemma3"),
    ]
    assert [s.number for s in steps] == list(STEP_NUMBERS)
    results: dict[str, StepResult] = {s.number: not_run(s, "not selected (--steps)") for s in steps
                                      if s.number not in selected}
    for step in steps:
        if step.number not in selected:
            continue
        for kind in [k for k in engines if k != step.engine]:  # give the memory of engines done with back
            engines.pop(kind).close()
        if opts.budget_s is not None and time.perf_counter() - t0 > opts.budget_s:
            results[step.number] = not_run(step, f"time budget of {opts.budget_s:.0f} s spent")
            continue
        results[step.number] = not_run(step, "started, did not finish (the run was cut short)")
        write_results(opts, machine, started, t0, steps, results, models, plot=False)
        results[step.number] = run_step(step)
        write_results(opts, machine, started, t0, steps, results, models, plot=True)
    for shared in engines.values():
        shared.close()
    data = write_results(opts, machine, started, t0, steps, results, models, plot=True)
    print("\n" + "\n".join(data["summary"]))
    print(f"\nresults: {Path(opts.out_dir) / 'gpu_check.json'}, {Path(opts.out_dir) / 'gpu_check.png'}", flush=True)
    return data


def write_results(opts: Options, machine: dict[str, Any], started: str, t0: float, steps: list[Step],
                  results: dict[str, StepResult], models: Any, plot: bool) -> dict[str, Any]:
    """Write gpu_check.json (and with `plot` gpu_check.png) from the results so far, every step listed
    (those without a result as "not run"); returns the JSON dict."""
    ordered = [results.get(s.number) or not_run(s, "not reached") for s in steps]
    by_name = {r.name: r for r in ordered if r.status != NOT_RUN}
    smoke = opts.smoke
    goals = report.goal_verdicts(by_name) if not smoke else [
        report.Goal(g.goal, "not measured", "smoke mode (CPU)") for g in report.goal_verdicts({})]
    total = time.perf_counter() - t0
    commit = (machine["git_commit"] or "unknown")[:10]
    header = (f"tritium gpu-check{' --smoke' if smoke else ''} on {machine['device']} (torch {machine['torch']}, "
              f"triton {machine['triton']}, commit {commit})")
    lines = report.summary_lines(header, ordered, goals, total)
    data = {"tool": "tritium gpu-check", "smoke": smoke, "started": started, "total_s": total, "machine": machine,
            "options": asdict(opts), "models": models.log,
            "passed": all(r.status != FAIL for r in ordered),
            "complete": all(r.status != NOT_RUN for r in ordered if r.number in parse_steps(opts.steps)),
            "steps": [asdict(r) for r in ordered], "goals": [asdict(g) for g in goals], "summary": lines}

    def draw(path: Path) -> None:
        try:
            report.plot(by_name, path, header)
        except Exception:  # the figures are in the JSON: a broken plot must not fail the check
            traceback.print_exc()

    write_report(opts.out_dir, "gpu_check", data, draw if plot else None)
    return data


def ensure_interpreter(argv: list[str]) -> None:
    """Smoke mode runs the kernels under Triton's interpreter, whose flag triton reads when imported: set it,
    or start this module again with it set when triton is imported already."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        os.execv(sys.executable, [sys.executable, "-m", "tritium.client.checks.gpu_check", *argv])


def main(argv: list[str] | None = None) -> int:
    """`python -m tritium.client.checks.gpu_check [--smoke] [--out DIR]`: the same as `tritium gpu-check`
    (whose module declares the options); returns the exit status."""
    from tritium.client.cli.main import main as cli_main

    return cli_main(["gpu-check", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
