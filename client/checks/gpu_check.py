"""`tritium gpu-check` / `make gpu-check`: one command that checks tritium on a GPU in about 5 minutes.

Steps, each timed and reported pass / fail / skip with its figures (a failed step does not stop the run):
  1  kernels vs reference   every Triton kernel against its torch reference at GPU tiles (checks/kernels.py)
  2  greedy parity          the engine's greedy tokens against transformers, same device and dtype
  3  sync-free decode       decode steps under torch.cuda.set_sync_debug_mode: one sync per step allowed
  3b step timing            a batch-64 decode step's host time against its GPU time (checks/engine.py)
  4  kernel benchmark       prefill TFLOP/s next to SDPA flash, decode GB/s next to the peak (bench/kernels.py)
  5  offline throughput     tritium next to transformers on the default model (bench/offline.py)
then the goal verdicts. Writes gpu_check.json and gpu_check.png to --out and prints a one-screen summary.

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
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tritium.client.bench.report import write_report
from tritium.client.checks import report as report
from tritium.client.checks.report import FAIL, PASS, Outcome, StepResult

DEFAULT_OUT = "bench_results/gpu_check"
KERNEL_BENCH_BUDGET_S = 100.0
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
    """A step of the check: its number and name in the report, its title, what runs it."""

    number: str
    name: str
    title: str
    run: Callable[[], Outcome]


def check_kernel_bench(smoke: bool) -> Outcome:
    """Step 4: the kernel benchmark on the check's grid (within KERNEL_BENCH_BUDGET_S), or the smoke grid."""
    from tritium.client.bench.kernels import measure_kernels
    from tritium.client.bench.workload import kernel_grids

    if smoke:
        measured = measure_kernels(*kernel_grids(smoke=True), smoke=True)
    else:
        measured = measure_kernels(GPU_PREFILL_GRID, GPU_DECODE_GRID, budget_s=KERNEL_BENCH_BUDGET_S)
    figures = asdict(measured)
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
        summary = "; ".join(parts)
    return Outcome(PASS, summary, figures)


def check_throughput(smoke: bool) -> Outcome:
    """Step 5: offline throughput of tritium and transformers on the same prompts; fails when any of them
    produced fewer than the requested tokens."""
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
    tritium, step = bench_tritium(prompts, work.output_len, max_num_seqs=64, **settings)
    _free_memory()
    results = [tritium] + [bench_transformers(prompts, work.output_len, b, device, dtype)
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
    """Run one step, timed; an exception fails that step alone (its traceback goes into the figures)."""
    print(f"\n== step {step.number}: {step.title}", flush=True)
    t0 = time.perf_counter()
    try:
        outcome = step.run()
    except Exception as exc:
        traceback.print_exc()
        outcome = Outcome(FAIL, f"{type(exc).__name__}: {exc}"[:300], {"traceback": traceback.format_exc()})
    result = StepResult(step.number, step.name, step.title, outcome.status, time.perf_counter() - t0,
                        outcome.summary, outcome.figures)
    print(f"-- step {step.number} {result.status} in {result.seconds:.1f} s: {result.summary}", flush=True)
    return result


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
    """The checkout's HEAD commit, None outside a git checkout (or without git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def run_gpu_check(out_dir: str = DEFAULT_OUT, smoke: bool = False) -> dict[str, Any]:
    """Run every step, write gpu_check.json and gpu_check.png, print the summary; returns the JSON dict.
    Raises RuntimeError without CUDA unless smoke."""
    import torch

    from tritium.client.checks.engine import SharedEngine, check_parity, check_step_timing, check_sync_free_decode
    from tritium.client.checks.kernels import check_kernels

    if not smoke and not torch.cuda.is_available():
        raise RuntimeError("gpu-check needs a CUDA GPU (--smoke checks the script itself on a CPU)")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    machine = machine_info(smoke)
    engine = SharedEngine(smoke)
    steps = [
        Step("1", "kernels", "kernels vs reference", lambda: check_kernels(smoke)),
        Step("2", "parity", "greedy parity vs HF", lambda: check_parity(engine, smoke)),
        Step("3", "sync_free_decode", "sync-free decode", lambda: check_sync_free_decode(engine, smoke)),
        Step("3b", "step_timing", "step host vs GPU time", lambda: check_step_timing(engine, smoke)),
        Step("4", "kernel_bench", "kernel benchmark", lambda: check_kernel_bench(smoke)),
        Step("5", "throughput", "offline throughput", lambda: check_throughput(smoke)),
    ]
    results = []
    for step in steps:
        if step.name == "kernel_bench":  # the engine steps are done: give its memory back
            engine.close()
        results.append(run_step(step))
    by_name = {r.name: r for r in results}
    goals = report.goal_verdicts(by_name) if not smoke else [
        report.Goal(g.goal, "not measured", "smoke mode (CPU)") for g in report.goal_verdicts({})]
    total = time.perf_counter() - t0
    commit = (machine["git_commit"] or "unknown")[:10]
    header = (f"tritium gpu-check{' --smoke' if smoke else ''} on {machine['device']} (torch {machine['torch']}, "
              f"triton {machine['triton']}, commit {commit})")
    lines = report.summary_lines(header, results, goals, total)
    data = {"tool": "tritium gpu-check", "smoke": smoke, "started": started, "total_s": total, "machine": machine,
            "passed": all(r.status != FAIL for r in results), "steps": [asdict(r) for r in results],
            "goals": [asdict(g) for g in goals], "summary": lines}

    def plot(path: Path) -> None:
        try:
            report.plot(by_name, path, header)
        except Exception:  # the figures are in the JSON: a broken plot must not fail the check
            traceback.print_exc()

    path = write_report(out_dir, "gpu_check", data, plot)
    print("\n" + "\n".join(lines))
    print(f"\nresults: {path}, {path.with_suffix('.png')}", flush=True)
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
