"""`tritium gpu-check`'s results: what each step reports, the goal verdicts, the one-screen summary and the PNG."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tritium.client.checks.int8_speed import INT8_GOAL_MAX_ROWS, INT8_GOAL_SPEEDUP, int8_goal

PASS, FAIL, SKIP = "pass", "fail", "skip"
PREFILL_GOAL_RATIO = 0.9  # tritium prefill TFLOP/s over SDPA flash's, at PREFILL_GOAL_MIN_TOKENS tokens and more
PREFILL_GOAL_MIN_TOKENS = 2048
# decode KV read GB/s over a device-to-device copy's GB/s (bytes read + written) measured on the same GPU, which
# is what the memory system delivers there (the data sheet's peak is above what any kernel reaches)
DECODE_GOAL_COPY_FRACTION = 0.7
DECODE_GOAL_PEAK_FRACTION = DECODE_GOAL_COPY_FRACTION  # the PNG's goal line (drawn against the peak until it moves)
DECODE_GOAL_BATCH, DECODE_GOAL_CONTEXT = 64, 4096
LORA_GOAL_OVERHEAD = 0.15  # step 3d: what a rank-16 adapter may add to a batch-1 decode step
NGRAM_GOAL_RATIO = 0.97  # step 3d: n-gram speculation's tokens/s over plain decoding's (timing noise allowed)


@dataclass
class Outcome:
    """What a step found: its status, a one-line summary and every figure it measured."""

    status: str
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    """A step's outcome as reported: its number, name, title, status, duration, summary and figures."""

    number: str  # "1", "2", "3", "3b", ...: the numbering
    name: str
    title: str
    status: str
    seconds: float
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class Goal:
    """A performance goal and its verdict."""

    goal: str
    verdict: str  # "met", "missed" or "not measured"
    value: str


def goal_verdicts(steps: dict[str, StepResult]) -> list[Goal]:
    """The performance goals, judged from the kernel benchmark and the step timing."""
    bench = steps.get("kernel_bench")
    prefill = [p for p in (bench.figures.get("prefill", []) if bench else [])
               if p["seqlen"] >= PREFILL_GOAL_MIN_TOKENS and p["sdpa_flash_tflops"]]
    ratios = [p["tritium_tflops"] / p["sdpa_flash_tflops"] for p in prefill]
    copy = bench.figures.get("copy_gbs") if bench else None
    decode = [d for d in (bench.figures.get("decode", []) if bench and copy else [])
              if d["batch"] == DECODE_GOAL_BATCH and d["context"] == DECODE_GOAL_CONTEXT]
    fractions = [d["tritium_gbs"] / copy for d in decode] if copy else []
    timing = steps.get("step_timing")
    host = timing.figures.get("host_ms_per_step") if timing else None
    gpu = timing.figures.get("gpu_ms_per_step") if timing else None
    int8_met, int8_measured, int8_detail = int8_goal(bench.figures.get("int8_gemm", {}) if bench else {})
    features = steps.get("decode_features")
    features = None if features is None or features.figures.get("smoke", True) else features
    lora = features.figures.get("lora") if features else None
    ngram = features.figures.get("ngram") if features else None
    ngram_ratios = [ngram[w]["ratio"] for w in ("repeating", "random")] if ngram else []
    return [
        Goal(f"prefill >= {PREFILL_GOAL_RATIO}x SDPA flash TFLOP/s at {PREFILL_GOAL_MIN_TOKENS // 1024}k+ tokens",
             _verdict(bool(ratios) and min(ratios) >= PREFILL_GOAL_RATIO, bool(ratios)),
             f"worst {min(ratios):.2f}x over {len(ratios)} shapes" if ratios else "no SDPA flash figures"),
        Goal(f"decode >= {DECODE_GOAL_COPY_FRACTION:.0%} of a measured device copy's GB/s at batch "
             f"{DECODE_GOAL_BATCH}, {DECODE_GOAL_CONTEXT // 1024}k context",
             _verdict(bool(fractions) and min(fractions) >= DECODE_GOAL_COPY_FRACTION, bool(fractions)),
             f"worst {min(fractions):.0%} of {copy:.0f} GB/s (copy)" if fractions and copy
             else "no batch-64 figures" if copy else "no copy bandwidth measured"),
        Goal("engine step host time < GPU time (default model, decode, batch 64)",
             _verdict(host is not None and gpu is not None and host < gpu, host is not None and gpu is not None),
             f"host {host:.2f} ms vs GPU {gpu:.2f} ms per step" if host is not None and gpu is not None
             else "not measured"),
        Goal(f"int8 GEMM >= {INT8_GOAL_SPEEDUP}x bf16 at <= {INT8_GOAL_MAX_ROWS} rows (4096 x 4096 layer)",
             _verdict(int8_met, int8_measured), int8_detail),
        Goal(f"LoRA r16 decode at batch 1 adds <= {LORA_GOAL_OVERHEAD:.0%} to the base step",
             _verdict(lora is not None and lora["overhead"] <= LORA_GOAL_OVERHEAD, lora is not None),
             f"{lora['overhead']:+.0%}" if lora is not None else "not measured"),
        Goal("n-gram speculation never slower than plain graph decoding at batch 64",
             _verdict(bool(ngram_ratios) and min(ngram_ratios) >= NGRAM_GOAL_RATIO, bool(ngram_ratios)),
             f"worst {min(ngram_ratios):.2f}x (repeating and random prompts)" if ngram_ratios else "not measured"),
    ]


def _verdict(met: bool, measured: bool) -> str:
    return "not measured" if not measured else "met" if met else "missed"


NOT_RUN = "not run"  # a step left out by --steps, by the time budget, or by a run cut short


def summary_lines(header: str, steps: list[StepResult], goals: list[Goal], total_s: float) -> list[str]:
    """The one-screen summary: a line per step (those not run too), a line per goal."""
    lines = [f"{header}   total {total_s:.0f} s", "",
             f"{'step':<28}{'status':<8}{'time':>7}  figures"]
    for s in steps:
        lines.append(f"{f'{s.number} {s.title}':<28}{s.status:<8}{s.seconds:>6.1f}s  {s.summary}")
    lines += ["", f"{'goal':<72}{'verdict':<14}value"]
    lines += [f"{g.goal:<72}{g.verdict:<14}{g.value}" for g in goals]
    return lines


def plot(steps: dict[str, StepResult], path: Path, title: str) -> None:
    """Three panels: prefill TFLOP/s next to SDPA flash, decode GB/s next to the peak, offline throughput."""
    from tritium.client.bench.report import pyplot, save_figure

    plt = pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.8))
    bench = steps.get("kernel_bench")
    figures = bench.figures if bench else {}
    _plot_prefill(ax1, figures.get("prefill", []))
    _plot_decode(ax2, figures.get("decode", []), figures.get("peak_gbs"))
    throughput = steps.get("throughput")
    _plot_throughput(ax3, throughput.figures.get("results", []) if throughput else [])
    fig.suptitle(title)
    save_figure(fig, path)


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: not measured", ha="center", va="center", transform=ax.transAxes)


def _plot_prefill(ax: Any, points: list[dict[str, Any]]) -> None:
    ax.set_title("prefill attention (batch 1, causal)")
    if not points:
        _no_data(ax, "prefill")
        return
    for hd in sorted({p["head_dim"] for p in points}):
        pts = sorted((p for p in points if p["head_dim"] == hd), key=lambda p: p["seqlen"])
        line = ax.plot([p["seqlen"] for p in pts], [p["tritium_tflops"] for p in pts], "o-", label=f"tritium d={hd}")
        sdpa = [p for p in pts if p["sdpa_flash_tflops"]]
        if sdpa:
            ax.plot([p["seqlen"] for p in sdpa], [p["sdpa_flash_tflops"] for p in sdpa], "s--",
                    color=line[0].get_color(), alpha=0.6, label=f"SDPA flash d={hd}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=8)


def _plot_decode(ax: Any, points: list[dict[str, Any]], peak: float | None) -> None:
    ax.set_title("paged decode attention")
    if not points:
        _no_data(ax, "decode")
        return
    context = DECODE_GOAL_CONTEXT if any(p["context"] == DECODE_GOAL_CONTEXT for p in points) else \
        max(p["context"] for p in points)
    ax.set_title(f"paged decode attention (context {context})")
    for hd in sorted({p["head_dim"] for p in points}):
        pts = sorted((p for p in points if p["head_dim"] == hd and p["context"] == context), key=lambda p: p["batch"])
        ax.plot([p["batch"] for p in pts], [p["tritium_gbs"] for p in pts], "o-", label=f"tritium d={hd}")
    if peak:
        ax.axhline(peak, color="gray", linestyle=":", label=f"peak {peak:.0f} GB/s")
        ax.axhline(DECODE_GOAL_PEAK_FRACTION * peak, color="gray", linestyle="--", alpha=0.5,
                   label=f"goal {DECODE_GOAL_PEAK_FRACTION:.0%} of peak")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"batch (context {context})")
    ax.set_ylabel("KV read GB/s")
    ax.legend(fontsize=8)


def _plot_throughput(ax: Any, results: list[dict[str, Any]]) -> None:
    ax.set_title("offline throughput, default model")
    if not results:
        _no_data(ax, "throughput")
        return
    names = [r["name"] for r in results]
    values = [r["tokens_per_s"] for r in results]
    bars = ax.barh(names, values, color=["#c0392b" if n == "tritium" else "#7f8c8d" for n in names])
    ax.bar_label(bars, fmt="%.1f tok/s", padding=3)
    ax.set_xlabel("output tokens / s")
    ax.set_xlim(0, max(values) * 1.35)
