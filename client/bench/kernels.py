"""Kernel benchmark (CUDA): prefill TFLOP/s next to torch SDPA (flash), decode GB/s next to a device-to-device
copy measured on the same GPU (and the data sheet's peak) and to a torch paged-gather baseline; then a sweep of
decode attention's key tile, warps and stages at the largest decode shape of each head_dim, whose winners
are printed as the line to paste into kernels/decode_configs.py; and decode with a 4k sliding window over contexts
of 4k to 32k next to full attention (the windowed time should stay flat past the window: the kernel reads only the
window's keys). Writes `kernels.json` and `kernels.png`.

`--smoke` runs tiny shapes on the CPU (TRITON_INTERPRET=1) to check the script itself; its numbers
mean nothing.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tritium.client.bench.report import pyplot, save_figure, write_report
from tritium.client.bench.timing import kernel_ms
from tritium.client.bench.workload import kernel_grids, paged_cache
from tritium.kernels import reference
from tritium.kernels.decode_configs import DecodeConfig, table_entry

# Peak HBM bandwidth (GB/s) from the vendors' data sheets, matched against the device name.
PEAK_BANDWIDTH_GBS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
                      "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600}
COPY_BYTES, SMOKE_COPY_BYTES = 1 << 30, 1 << 20  # the copy's source (and destination) size
COPY_REPEATS = 10
# The decode sweep: every key tile x warps x stages, each at most once per head_dim, within SWEEP_BUDGET_S.
SWEEP_BLOCK_N, SWEEP_WARPS, SWEEP_STAGES = (16, 32, 64, 128), (4, 8), (1, 2, 3)
SWEEP_BUDGET_S = 45.0
SMOKE_SWEEP = [DecodeConfig(16, 4, 2), DecodeConfig(32, 4, 1)]
# Windowed decode: (head_dim, batch, window, contexts), a Gemma-2-like 4k window at head_dim 128.
WINDOW_DECODE = (128, 8, 4096, (4096, 8192, 16384, 32768))
SMOKE_WINDOW_DECODE = (64, 1, 32, (32, 64))


@dataclass
class PrefillPoint:
    """One prefill shape: tritium's TFLOP/s and SDPA flash's (None off CUDA)."""

    head_dim: int
    batch: int
    seqlen: int
    tritium_tflops: float
    sdpa_flash_tflops: float | None


@dataclass
class DecodePoint:
    """One decode shape: KV bytes read per second by tritium's kernel and by the torch paged-gather reference."""

    head_dim: int
    batch: int
    context: int
    tritium_gbs: float
    torch_gather_gbs: float
    peak_gbs: float | None


@dataclass
class WindowPoint:
    """Decode with a sliding window at one context: milliseconds per call with the window and without it."""

    head_dim: int
    batch: int
    window: int
    context: int
    window_ms: float
    full_ms: float


@dataclass
class SweepPoint:
    """One decode launch configuration at one shape: KV GB/s, or why it has none (it failed to compile or run,
    or its output differs from the default configuration's)."""

    head_dim: int
    batch: int
    context: int
    block_n: int
    num_warps: int
    num_stages: int
    tritium_gbs: float | None = None
    error: str | None = None


@dataclass
class KernelMeasurements:
    """Every shape measured on one device."""

    device: str
    dtype: str
    peak_gbs: float | None
    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    not_measured: list[str]  # shapes left out when the time budget ran out
    copy_gbs: float | None = None  # a device-to-device copy on this device: bytes read + written per second
    capability: str | None = None  # "9.0": the compute capability the sweep's winners are for
    decode_sweep: list[SweepPoint] = field(default_factory=list)
    decode_best: dict[int, SweepPoint] = field(default_factory=dict)  # by head_dim
    decode_table_entry: str | None = None  # the winners as a line of kernels/decode_configs.py's TUNED
    decode_window: list[WindowPoint] = field(default_factory=list)  # WINDOW_DECODE's contexts


def copy_bandwidth(device: str, nbytes: int) -> float:
    """GB/s of `dst.copy_(src)` on `device` for `nbytes`-byte tensors, counting the bytes read and written:
    the median of COPY_REPEATS copies, each timed with CUDA events (perf_counter off CUDA)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times_ms: list[float] = []
    if device == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(COPY_REPEATS)]
        torch.cuda.synchronize()
        for start, end in events:
            start.record()
            dst.copy_(src)
            end.record()
        torch.cuda.synchronize()
        times_ms = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(COPY_REPEATS):
            t0 = time.perf_counter()
            dst.copy_(src)
            times_ms.append((time.perf_counter() - t0) * 1000)
    return float(2 * nbytes / statistics.median(times_ms) / 1e6)


def sweep_configs(default: DecodeConfig) -> list[DecodeConfig]:
    """The sweep's configurations, `default` first (so a budget cut still leaves the baseline)."""
    grid = [DecodeConfig(*c) for c in itertools.product(SWEEP_BLOCK_N, SWEEP_WARPS, SWEEP_STAGES)]
    return [default, *(c for c in grid if c != default)]



def decode_inputs(device: str, dtype: torch.dtype, head_dim: int, batch: int, context: int,
                  smoke: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """A decode step's inputs at GQA 4 (2048 / head_dim query heads; 2 in smoke mode): q, the paged K and V
    caches holding `context` random tokens for each of `batch` sequences, their block table, lengths and the
    softmax scale."""
    heads = 2048 // head_dim if not smoke else 2
    kv_heads = max(1, heads // 4)
    k_cache, v_cache, table = paged_cache([context] * batch, kv_heads, head_dim, dtype, device)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, table, lens, head_dim**-0.5

def sweep_decode(ops: Any, device: str, dtype: torch.dtype, head_dim: int, batch: int, context: int,
                 configs: list[DecodeConfig], deadline: float | None, smoke: bool) -> list[SweepPoint]:
    """Time `ops.decode_attention` with each of `configs` (the first is the baseline) on one shape; a
    configuration that raises, or whose output is not the baseline's within bf16/fp16 rounding, gets an error.
    Configurations still waiting at `deadline` are left out."""
    q, k_cache, v_cache, table, lens, scale = decode_inputs(device, dtype, head_dim, batch, context, smoke)
    kv_heads = k_cache.shape[2]
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size()
    points: list[SweepPoint] = []
    baseline: torch.Tensor | None = None
    for cfg in configs:
        if deadline is not None and time.perf_counter() > deadline and points:
            break
        point = SweepPoint(head_dim, batch, context, *cfg)
        try:
            out = ops.decode_attention(q, k_cache, v_cache, table, lens, scale, config=cfg)
            if baseline is None:
                baseline = out.float()
            elif not torch.allclose(out.float(), baseline, atol=2e-2, rtol=2e-2):
                raise ValueError(f"output differs from the baseline's by {(out.float() - baseline).abs().max():.3g}")

            def launch(cfg: DecodeConfig = cfg) -> object:
                return ops.decode_attention(q, k_cache, v_cache, table, lens, scale, config=cfg)

            ms = kernel_ms(launch, smoke)
            point.tritium_gbs = kv_bytes / ms / 1e6
        except Exception as exc:  # a configuration over the shared-memory limit must not stop the sweep
            point.error = f"{type(exc).__name__}: {exc}"[:200]
        points.append(point)
    return points


def sweep_shapes(decode_grid: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The decode point the sweep runs at, per head_dim: the grid's largest batch, then largest context."""
    best: dict[int, tuple[int, int, int]] = {}
    for hd, b, c in decode_grid:
        if hd not in best or (b, c) > best[hd][1:]:
            best[hd] = (hd, b, c)
    return [best[hd] for hd in sorted(best)]


def peak_bandwidth(name: str) -> float | None:
    """The data-sheet peak HBM bandwidth (GB/s) of the device named `name`, None when unknown."""
    for key, value in PEAK_BANDWIDTH_GBS.items():
        if key in name:
            return float(value)
    return None


def bench_prefill(ops: Any, device: str, dtype: torch.dtype, head_dim: int, batch: int, seqlen: int,
                  smoke: bool) -> PrefillPoint:
    """Time `ops.prefill_attention` (causal, paged) on `batch` sequences of `seqlen` tokens, and on CUDA
    SDPA flash on the same shape."""
    heads = 2048 // head_dim if not smoke else 2
    kv_heads = max(1, heads // 4)
    k_cache, v_cache, table = paged_cache([seqlen] * batch, kv_heads, head_dim, dtype, device)
    q = torch.randn(batch * seqlen, heads, head_dim, dtype=dtype, device=device)
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    # max_query_len given: no device sync inside the timed call (SDPA has none either)
    ms = kernel_ms(lambda: ops.prefill_attention(q, k_cache, v_cache, table, cu, lens, scale, seqlen), smoke)
    flops = 4 * batch * heads * seqlen * seqlen * head_dim / 2  # causal: half the score matrix
    sdpa = None
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qs = torch.randn(batch, heads, seqlen, head_dim, dtype=dtype, device=device)
        ks = torch.randn_like(qs)
        vs = torch.randn_like(qs)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa_ms = kernel_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
                               smoke)
        sdpa = flops / sdpa_ms / 1e9
    return PrefillPoint(head_dim, batch, seqlen, flops / ms / 1e9, sdpa)


def bench_decode(ops: Any, device: str, dtype: torch.dtype, head_dim: int, batch: int, context: int,
                 peak: float | None, smoke: bool) -> DecodePoint:
    """Time `ops.decode_attention` and the torch reference on `batch` sequences of `context` cached tokens."""
    q, k_cache, v_cache, table, lens, scale = decode_inputs(device, dtype, head_dim, batch, context, smoke)
    kv_heads = k_cache.shape[2]
    ms = kernel_ms(lambda: ops.decode_attention(q, k_cache, v_cache, table, lens, scale), smoke)
    base_ms = kernel_ms(lambda: reference.decode_attention(q, k_cache, v_cache, table, lens, scale), smoke)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size()
    return DecodePoint(head_dim, batch, context, kv_bytes / ms / 1e6, kv_bytes / base_ms / 1e6, peak)


def bench_decode_window(ops: Any, device: str, dtype: torch.dtype, head_dim: int, batch: int, context: int,
                        window: int, smoke: bool) -> WindowPoint:
    """Time `ops.decode_attention` with a `window`-key sliding window and without one on `batch` sequences of
    `context` cached tokens."""
    q, k_cache, v_cache, table, lens, scale = decode_inputs(device, dtype, head_dim, batch, context, smoke)
    window_ms = kernel_ms(lambda: ops.decode_attention(q, k_cache, v_cache, table, lens, scale, window), smoke)
    full_ms = kernel_ms(lambda: ops.decode_attention(q, k_cache, v_cache, table, lens, scale), smoke)
    return WindowPoint(head_dim, batch, window, context, window_ms, full_ms)


def plot(prefill: list[PrefillPoint], decode: list[DecodePoint], path: Path, title: str,
         copy_gbs: float | None = None, window: list[WindowPoint] | None = None) -> None:
    """Prefill TFLOP/s against sequence length; decode GB/s against batch, next to the copy and the peak; decode
    time with and without a sliding window against context."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3 if window else 2, figsize=(18 if window else 12, 4.5))
    ax1, ax2 = axes[0], axes[1]
    for hd in sorted({p.head_dim for p in prefill}):
        pts = sorted((p for p in prefill if p.head_dim == hd and p.batch == 1), key=lambda p: p.seqlen)
        ax1.plot([p.seqlen for p in pts], [p.tritium_tflops for p in pts], "o-", label=f"tritium d={hd}")
        if any(p.sdpa_flash_tflops for p in pts):
            ax1.plot([p.seqlen for p in pts], [p.sdpa_flash_tflops for p in pts], "s--", label=f"SDPA flash d={hd}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("sequence length (batch 1, causal)")
    ax1.set_ylabel("TFLOP/s")
    ax1.set_title("prefill attention")
    ax1.legend()
    context = max(d.context for d in decode)
    for hd in sorted({d.head_dim for d in decode}):
        row = sorted((d for d in decode if d.head_dim == hd and d.context == context), key=lambda d: d.batch)
        ax2.plot([d.batch for d in row], [d.tritium_gbs for d in row], "o-", label=f"tritium d={hd}")
        ax2.plot([d.batch for d in row], [d.torch_gather_gbs for d in row], "s--", label=f"torch gather d={hd}")
    peak = next((d.peak_gbs for d in decode if d.peak_gbs), None)
    if peak:
        ax2.axhline(peak, color="gray", linestyle=":", label=f"peak {peak:.0f} GB/s")
    if copy_gbs:
        ax2.axhline(copy_gbs, color="black", linestyle="--", label=f"copy {copy_gbs:.0f} GB/s (measured)")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel(f"batch (context {context})")
    ax2.set_ylabel("KV read GB/s")
    ax2.set_title("paged decode attention")
    ax2.legend()
    if window:
        ax3 = axes[2]
        ax3.plot([w.context for w in window], [w.window_ms for w in window], "o-", label=f"window {window[0].window}")
        ax3.plot([w.context for w in window], [w.full_ms for w in window], "s--", label="full attention")
        ax3.set_xscale("log", base=2)
        ax3.set_xlabel(f"context (batch {window[0].batch}, d={window[0].head_dim})")
        ax3.set_ylabel("ms per decode step")
        ax3.set_title("decode with a sliding window")
        ax3.legend()
    fig.suptitle(title)
    save_figure(fig, path)


def measure_kernels(prefill_grid: list[tuple[int, int, int]], decode_grid: list[tuple[int, int, int]],
                    smoke: bool = False, budget_s: float | None = None,
                    sweep_budget_s: float = SWEEP_BUDGET_S) -> KernelMeasurements:
    """Measure a device-to-device copy, then time the Triton kernels on each (head_dim, batch, seqlen) prefill
    and (head_dim, batch, context) decode shape: bf16 on CUDA, fp32 under the interpreter when `smoke`. With
    `budget_s`, shapes still waiting when it has run out are left out (listed in `not_measured`). Then sweep
    decode's launch configurations (`sweep_decode`, within `sweep_budget_s`; two configurations in smoke
    mode) at `sweep_shapes(decode_grid)` and print the winners as a line for kernels/decode_configs.py.
    Raises RuntimeError without CUDA (unless smoke)."""
    if smoke:
        device, dtype = "cpu", torch.float32
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("the kernel benchmark needs a CUDA GPU (use --smoke to check the script on a CPU)")
        device, dtype = "cuda", torch.bfloat16
    from tritium.kernels import triton_ops

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"
    peak = peak_bandwidth(name) if device == "cuda" else None
    deadline = time.perf_counter() + budget_s if budget_s is not None else None
    result = KernelMeasurements(name, str(dtype), peak, [], [], [])
    result.copy_gbs = copy_bandwidth(device, SMOKE_COPY_BYTES if smoke else COPY_BYTES)
    for hd, b, s in tqdm(prefill_grid, desc="prefill", unit="shape"):
        if deadline is not None and time.perf_counter() > deadline:
            result.not_measured.append(f"prefill d={hd} batch={b} seqlen={s}")
            continue
        result.prefill.append(bench_prefill(triton_ops, device, dtype, hd, b, s, smoke))
    for hd, b, c in tqdm(decode_grid, desc="decode", unit="shape"):
        if deadline is not None and time.perf_counter() > deadline:
            result.not_measured.append(f"decode d={hd} batch={b} context={c}")
            continue
        result.decode.append(bench_decode(triton_ops, device, dtype, hd, b, c, peak, smoke))
    hd, b, window, contexts = SMOKE_WINDOW_DECODE if smoke else WINDOW_DECODE
    for c in tqdm(contexts, desc="windowed decode", unit="shape"):
        if deadline is not None and time.perf_counter() > deadline:
            result.not_measured.append(f"windowed decode d={hd} batch={b} window={window} context={c}")
            continue
        result.decode_window.append(bench_decode_window(triton_ops, device, dtype, hd, b, c, window, smoke))
    sweep(result, triton_ops, device, dtype, decode_grid, sweep_budget_s, smoke)
    return result


def sweep(result: KernelMeasurements, ops: Any, device: str, dtype: torch.dtype,
          decode_grid: list[tuple[int, int, int]], budget_s: float, smoke: bool) -> None:
    """Run the decode sweep into `result` (points, the best per head_dim, the table line) and print it."""
    from tritium.kernels.decode_attention import decode_config

    deadline = time.perf_counter() + budget_s
    major, minor = torch.cuda.get_device_capability() if device == "cuda" else (0, 0)
    result.capability = f"{major}.{minor}" if device == "cuda" else None
    for hd, b, c in tqdm(sweep_shapes(decode_grid), desc="decode sweep", unit="shape"):
        default = decode_config(hd, dtype, "gpu" if not smoke else "small", device)
        configs = [default, *(c for c in SMOKE_SWEEP if c != default)] if smoke else sweep_configs(default)
        points = sweep_decode(ops, device, dtype, hd, b, c, configs, deadline, smoke)
        result.decode_sweep.extend(points)
        result.not_measured += [f"decode sweep d={hd} {cfg}" for cfg in configs[len(points):]]
        timed = [p for p in points if p.tritium_gbs is not None]
        if timed:
            result.decode_best[hd] = max(timed, key=lambda p: p.tritium_gbs or 0.0)
    if result.decode_best:
        best = {hd: DecodeConfig(p.block_n, p.num_warps, p.num_stages) for hd, p in result.decode_best.items()}
        result.decode_table_entry = table_entry((major, minor), best)
        for hd, p in sorted(result.decode_best.items()):
            base = next((q.tritium_gbs for q in result.decode_sweep if q.head_dim == hd and q.tritium_gbs), None)
            gain = f" ({p.tritium_gbs / base:.2f}x the current configuration)" if base and p.tritium_gbs else ""
            print(f"decode sweep d={hd} batch {p.batch} context {p.context}: best block_n {p.block_n}, "
                  f"{p.num_warps} warps, {p.num_stages} stages, {p.tritium_gbs:.0f} GB/s{gain}")
        print(f"kernels/decode_configs.py TUNED entry for this GPU: {result.decode_table_entry}")


def run_kernel_benchmark(out_dir: str | Path = "bench_results", smoke: bool = False) -> dict[str, Any]:
    """Run the grid (workload.kernel_grids), print tables, write `kernels.json` and `kernels.png` into
    `out_dir`; returns the JSON dict. Raises RuntimeError without CUDA (unless smoke)."""
    prefill_grid, decode_grid = kernel_grids(smoke)
    measured = measure_kernels(prefill_grid, decode_grid, smoke)
    name, dtype, peak, prefill, decode = (measured.device, measured.dtype, measured.peak_gbs, measured.prefill,
                                          measured.decode)
    print(f"\n{name}, {dtype}")
    print(f"{'prefill':<8}{'d':>5}{'batch':>7}{'seqlen':>8}{'tritium TF/s':>14}{'SDPA TF/s':>11}{'ratio':>7}")
    for p in prefill:
        ratio = f"{p.tritium_tflops / p.sdpa_flash_tflops:.2f}" if p.sdpa_flash_tflops else "-"
        sdpa = f"{p.sdpa_flash_tflops:.1f}" if p.sdpa_flash_tflops else "-"
        print(f"{'':<8}{p.head_dim:>5}{p.batch:>7}{p.seqlen:>8}{p.tritium_tflops:>14.1f}{sdpa:>11}{ratio:>7}")
    copy = measured.copy_gbs
    print(f"device-to-device copy: {copy:.0f} GB/s" if copy else "device-to-device copy: not measured")
    print(f"{'decode':<8}{'d':>5}{'batch':>7}{'context':>8}{'tritium GB/s':>14}{'gather GB/s':>12}{'% copy':>8}")
    for d in decode:
        pct = f"{100 * d.tritium_gbs / copy:.0f}" if copy else "-"
        print(f"{'':<8}{d.head_dim:>5}{d.batch:>7}{d.context:>8}{d.tritium_gbs:>14.0f}{d.torch_gather_gbs:>12.0f}{pct:>8}")
    window = measured.decode_window
    if window:
        print(f"{'window':<8}{'d':>5}{'batch':>7}{'context':>8}{'window ms':>11}{'full ms':>9}")
        for w in window:
            print(f"{w.window:<8}{w.head_dim:>5}{w.batch:>7}{w.context:>8}{w.window_ms:>11.3f}{w.full_ms:>9.3f}")
    report = {"device": name, "dtype": dtype, "peak_gbs": peak, "copy_gbs": copy,
              "prefill": [asdict(p) for p in prefill], "decode": [asdict(d) for d in decode],
              "decode_window": [asdict(w) for w in window],
              "decode_sweep": [asdict(p) for p in measured.decode_sweep],
              "decode_table_entry": measured.decode_table_entry}
    title = f"tritium kernels on {name}"
    write_report(out_dir, "kernels", report, lambda path: plot(prefill, decode, path, title, copy, window))
    return report
