"""MoE kernel benchmark (CUDA): the fused MoE Triton kernel (kernels/fused_moe.py) against the torch reference's
per-expert loop (one GEMM pair per expert that got tokens) at Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes in
bf16, over batches of 1 to 512 tokens; then a sweep of the kernel's tiles at a decode- and a prefill-sized batch of
the first shape, whose winners are printed as the entry to paste into kernels/moe_configs.py (`sweep_moe`, also
run by gpu-check's kernel benchmark). Writes `moe.json` and `moe.png`.

`--smoke` runs tiny shapes on the CPU (TRITON_INTERPRET=1) to check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tritium.client.bench.report import pyplot, save_figure, write_report
from tritium.client.bench.timing import kernel_ms
from tritium.kernels import reference
from tritium.kernels.moe_configs import MoeConfig, moe_config, rows_per_expert, table_entry


@dataclass(frozen=True)
class MoeShape:
    """A model's expert layer: hidden size, each expert's intermediate size, experts, experts per token."""

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int


SHAPES = (MoeShape("Qwen3-30B-A3B", 2048, 768, 128, 8), MoeShape("Mixtral-8x7B", 4096, 14336, 8, 2))
SMOKE_SHAPES = (MoeShape("tiny", 32, 32, 4, 2),)
BATCHES, SMOKE_BATCHES = (1, 8, 32, 64, 128, 256, 512), (1, 8)
SWEEP_BATCHES, SMOKE_SWEEP_BATCHES = (8, 512), (8,)
# The sweep: row tiles that fit the rows per expert, x columns x depth x warps x stages, within SWEEP_BUDGET_S.
SWEEP_BLOCK_M, SWEEP_BLOCK_N, SWEEP_BLOCK_K = (16, 32, 64, 128), (64, 128), (64, 128)
SWEEP_WARPS, SWEEP_STAGES = (4, 8), (3, 4)
SWEEP_BUDGET_S = 90.0
SMOKE_SWEEP = [MoeConfig(16, 16, 16, 1, 4, 1), MoeConfig(16, 32, 16, 1, 4, 1)]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@dataclass
class MoePoint:
    """One shape and batch: milliseconds of the Triton kernel and of the reference, and their largest difference."""

    shape: str
    batch: int
    rows_per_expert: int
    triton_ms: float
    reference_ms: float
    max_abs_err: float

    @property
    def speedup(self) -> float:
        """Reference time / Triton time."""
        return self.reference_ms / self.triton_ms if self.triton_ms > 0 else 0.0


@dataclass
class MoeSweepPoint:
    """One tile configuration at one batch: milliseconds, or why it has none (it failed to compile or run, or its
    output differs from the default configuration's)."""

    shape: str
    batch: int
    rows_per_expert: int
    config: tuple[int, ...]
    ms: float | None = None
    error: str | None = None


@dataclass
class MoeMeasurements:
    """Everything measured on one device."""

    device: str
    dtype: str
    points: list[MoePoint] = field(default_factory=list)
    capability: str | None = None
    sweep: list[MoeSweepPoint] = field(default_factory=list)
    best: dict[int, MoeSweepPoint] = field(default_factory=dict)  # by rows per expert
    table_entry: str | None = None  # the winners as a line of kernels/moe_configs.py's TUNED


def expert_weights(shape: MoeShape, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Random `w13` and `w2` of `shape`, scaled to keep activations near 1."""
    g = torch.Generator(device=device).manual_seed(0)
    h, inter, e = shape.hidden, shape.intermediate, shape.experts
    return {"w13": (torch.randn(e, 2 * inter, h, device=device, generator=g) * h**-0.5).to(dtype),
            "w2": (torch.randn(e, h, inter, device=device, generator=g) * inter**-0.5).to(dtype)}


def moe_inputs(shape: MoeShape, batch: int, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fused_moe's arguments: `weights`, random hidden states, each token's top-k of random router logits."""
    w13 = weights["w13"]
    g = torch.Generator(device=w13.device).manual_seed(batch)
    topk_weights, topk_ids = torch.randn(batch, shape.experts, device=w13.device, generator=g).softmax(-1).topk(
        shape.top_k)
    hidden = torch.randn(batch, shape.hidden, device=w13.device, generator=g).to(w13.dtype)
    return {"hidden": hidden, **weights, "topk_weights": topk_weights, "topk_ids": topk_ids.to(torch.int32)}


def bench_point(shape: MoeShape, batch: int, weights: dict[str, torch.Tensor], smoke: bool) -> MoePoint:
    """Time the Triton kernel and the reference on one batch of `shape` with its expert `weights`."""
    from tritium.kernels import triton_ops

    args = moe_inputs(shape, batch, weights)
    tiles = "gpu" if smoke else "auto"
    got = triton_ops.fused_moe(**args, tiles=tiles)
    err = float((got.float() - reference.fused_moe(**args).float()).abs().max())
    triton_ms = kernel_ms(lambda: triton_ops.fused_moe(**args, tiles=tiles), smoke)
    reference_ms = kernel_ms(lambda: reference.fused_moe(**args), smoke)
    return MoePoint(shape.name, batch, rows_per_expert(batch, shape.top_k, shape.experts), triton_ms, reference_ms,
                    err)


def sweep_configs(rows: int, default: MoeConfig) -> list[MoeConfig]:
    """The sweep's configurations at `rows` per expert, `default` first: row tiles up to twice the rows (at
    least 16), GROUP_M 1 for 16-row tiles and 8 above."""
    grid = [MoeConfig(m, n, k, 1 if m == 16 else 8, w, s)
            for m, n, k, w, s in itertools.product(SWEEP_BLOCK_M, SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_WARPS,
                                                   SWEEP_STAGES)
            if m <= max(16, 2 * rows)]
    return [default, *(c for c in grid if c != default)]


def sweep_moe(shape: MoeShape, batches: tuple[int, ...], dtype: torch.dtype, device: str, budget_s: float,
              smoke: bool = False) -> tuple[list[MoeSweepPoint], dict[int, MoeSweepPoint]]:
    """Time the kernel with each configuration of `sweep_configs` (SMOKE_SWEEP when `smoke`) at each of `batches`
    of `shape`, sharing `budget_s` between the batches; a configuration that raises, or whose output is not the
    default configuration's within TOLERANCE, gets an error. Returns the points and the fastest by rows per
    expert."""
    from tritium.kernels import triton_ops

    points: list[MoeSweepPoint] = []
    best: dict[int, MoeSweepPoint] = {}
    weights = expert_weights(shape, dtype, device)
    end = time.perf_counter() + budget_s
    for i, batch in enumerate(batches):
        deadline = time.perf_counter() + (end - time.perf_counter()) / (len(batches) - i)
        rows = rows_per_expert(batch, shape.top_k, shape.experts)
        default = moe_config(rows, dtype, "gpu" if smoke else "auto", device)
        configs = [default, *(c for c in SMOKE_SWEEP if c != default)] if smoke else sweep_configs(rows, default)
        args = moe_inputs(shape, batch, weights)
        baseline: torch.Tensor | None = None
        for cfg in tqdm(configs, desc=f"moe sweep batch {batch}", unit="config"):
            if time.perf_counter() > deadline and baseline is not None:
                break
            point = MoeSweepPoint(shape.name, batch, rows, tuple(cfg))
            try:
                out = triton_ops.fused_moe(**args, config=cfg).float()
                if baseline is None:
                    baseline = out
                elif not torch.allclose(out, baseline, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]):
                    raise ValueError(f"output differs from the default's by {(out - baseline).abs().max():.3g}")
                point.ms = kernel_ms(lambda cfg=cfg, args=args: triton_ops.fused_moe(**args, config=cfg), smoke)
            except Exception as exc:  # a configuration over the shared-memory limit must not stop the sweep
                point.error = f"{type(exc).__name__}: {exc}"[:200]
            points.append(point)
        timed = [p for p in points if p.batch == batch and p.ms is not None]
        if timed:
            best[rows] = min(timed, key=lambda p: p.ms or 0.0)
    return points, best


def measure_moe(smoke: bool = False, sweep_budget_s: float = SWEEP_BUDGET_S) -> MoeMeasurements:
    """Time every shape and batch (bf16 on CUDA; fp32 under the interpreter when `smoke`), then sweep the tiles
    and print the winners as a line for kernels/moe_configs.py. Raises RuntimeError without CUDA (unless smoke)."""
    if smoke:
        device, dtype, shapes, batches = "cpu", torch.float32, SMOKE_SHAPES, SMOKE_BATCHES
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("the MoE benchmark needs a CUDA GPU (use --smoke to check the script on a CPU)")
        device, dtype, shapes, batches = "cuda", torch.bfloat16, SHAPES, BATCHES
    result = MoeMeasurements(torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)", str(dtype))
    for shape in shapes:
        weights = expert_weights(shape, dtype, device)
        for batch in tqdm(batches, desc=f"fused_moe vs reference {shape.name}", unit="batch"):
            result.points.append(bench_point(shape, batch, weights, smoke))
        del weights
        if device == "cuda":
            torch.cuda.empty_cache()
    sweep_into(result, shapes[0], SMOKE_SWEEP_BATCHES if smoke else SWEEP_BATCHES, dtype, device, sweep_budget_s,
               smoke)
    return result


def sweep_into(result: MoeMeasurements, shape: MoeShape, batches: tuple[int, ...], dtype: torch.dtype, device: str,
               budget_s: float, smoke: bool) -> None:
    """Run `sweep_moe` into `result` (points, the best by rows per expert, the table line) and print the winners."""
    major, minor = torch.cuda.get_device_capability() if device == "cuda" else (0, 0)
    result.capability = f"{major}.{minor}" if device == "cuda" else None
    result.sweep, result.best = sweep_moe(shape, batches, dtype, device, budget_s, smoke)
    if not result.best:
        return
    result.table_entry = table_entry((major, minor), {r: MoeConfig(*p.config) for r, p in result.best.items()})
    for rows, p in sorted(result.best.items()):
        base = next((q.ms for q in result.sweep if q.batch == p.batch and q.ms), None)
        gain = f" ({base / p.ms:.2f}x the current configuration)" if base and p.ms else ""
        print(f"moe sweep {p.shape} batch {p.batch} ({rows} rows per expert): best {MoeConfig(*p.config)}, "
              f"{p.ms:.3f} ms{gain}")
    print(f"kernels/moe_configs.py TUNED entry for this GPU: {result.table_entry}")


def plot(points: list[MoePoint], path: Path, title: str) -> None:
    """Milliseconds per call against batch, the kernel next to the reference, per shape."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(p.shape for p in points):
        row = [p for p in points if p.shape == name]
        ax.plot([p.batch for p in row], [p.triton_ms for p in row], "o-", label=f"fused_moe {name}")
        ax.plot([p.batch for p in row], [p.reference_ms for p in row], "s--", label=f"per-expert loop {name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (tokens)")
    ax.set_ylabel("ms per MoE layer")
    ax.legend()
    fig.suptitle(title)
    save_figure(fig, path)


def run_moe_benchmark(out_dir: str | Path = "bench_results", smoke: bool = False) -> dict[str, Any]:
    """Measure (`measure_moe`), print a table, write `moe.json` and `moe.png` into `out_dir`; returns the JSON
    dict. Raises RuntimeError without CUDA (unless smoke)."""
    measured = measure_moe(smoke)
    print(f"\n{measured.device}, {measured.dtype}")
    print(f"{'shape':<16}{'batch':>6}{'rows/E':>8}{'fused ms':>10}{'loop ms':>10}{'speedup':>9}{'max err':>10}")
    for p in measured.points:
        print(f"{p.shape:<16}{p.batch:>6}{p.rows_per_expert:>8}{p.triton_ms:>10.3f}{p.reference_ms:>10.3f}"
              f"{p.speedup:>9.2f}{p.max_abs_err:>10.2e}")
    report = {"device": measured.device, "dtype": measured.dtype, "capability": measured.capability,
              "points": [asdict(p) | {"speedup": p.speedup} for p in measured.points],
              "sweep": [asdict(p) for p in measured.sweep], "table_entry": measured.table_entry}
    title = f"fused MoE on {measured.device}"
    write_report(out_dir, "moe", report, lambda path: plot(measured.points, path, title))
    return report


def moe_sweep_figures(smoke: bool, budget_s: float = 60.0) -> dict[str, Any]:
    """gpu-check step 4's MoE figures: the tile sweep at the first shape's sweep batches (bf16 on CUDA; the smoke
    shape in fp32 under the interpreter when `smoke`) within `budget_s`, its winners printed as the TUNED line."""
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    shape, batches = (SMOKE_SHAPES[0], SMOKE_SWEEP_BATCHES) if smoke else (SHAPES[0], SWEEP_BATCHES)
    result = MoeMeasurements(torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)", str(dtype))
    sweep_into(result, shape, batches, dtype, device, budget_s, smoke)
    return {"shape": shape.name, "table_entry": result.table_entry,
            "best": {rows: asdict(p) for rows, p in result.best.items()}, "points": len(result.sweep)}
