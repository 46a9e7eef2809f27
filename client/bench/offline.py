"""Offline throughput: tritium's continuous batcher against transformers' `generate`, one run.

Workload: N requests with prompt lengths spread evenly over [min_prompt, max_prompt] tokens
(workload.random_token_prompts: random non-special token ids, fixed seed), `output_len` new tokens each,
greedy, ignore_eos.
transformers runs them one at a time and in static batches of 8 (left padding).
Results: a table on stdout, `offline.json` and `offline.png` in `out_dir`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tritium.backend import LLM, SamplingParams
from tritium.backend.models.registry import resolve_model
from tritium.client.bench.report import machine_info, pyplot, save_figure, write_report
from tritium.client.bench.workload import random_token_prompts


@dataclass
class BenchResult:
    """One engine's run: output tokens generated in `seconds` of wall time."""

    name: str
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second (AIPerf: output_token_throughput, tokens/sec)."""
        return self.output_tokens / self.seconds


def bench_tritium(prompts: list[list[int]], output_len: int, max_num_seqs: int, model: str | None = None,
                  **engine_settings: Any) -> tuple[BenchResult, dict[str, Any]]:
    """tritium's continuous batcher on `model` (None: the default model), after a short warm-up; returns the
    run and its per-step figures (steps, step / model / overhead ms per step, overhead fraction).
    `engine_settings` are further EngineConfig fields (max_num_batched_tokens defaults to 2048 here)."""
    llm = LLM(model, max_num_seqs=max_num_seqs, **{"max_num_batched_tokens": 2048, **engine_settings})
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    stats = llm.engine.stats
    base_steps, base_step_s, base_model_s = stats.steps, stats.step_s, stats.model_s
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - t0
    steps = stats.steps - base_steps
    step_s, model_s = stats.step_s - base_step_s, stats.model_s - base_model_s
    overhead = {
        "steps": steps,
        "step_ms_avg": 1000 * step_s / steps,
        "model_ms_avg": 1000 * model_s / steps,
        "overhead_ms_avg": 1000 * (step_s - model_s) / steps,
        "overhead_fraction": (step_s - model_s) / step_s,
    }
    return BenchResult("tritium", sum(len(o.token_ids) for o in outs), seconds), overhead


def bench_transformers(prompts: list[list[int]], output_len: int, batch_size: int, device: str = "cpu",
                       dtype: torch.dtype = torch.float32, model: str | None = None) -> BenchResult:
    """transformers' `generate` on `model` (None: the default model) in static batches of `batch_size` (left
    padding), after a short warm-up batch."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    pad = model.generation_config.pad_token_id or 0

    def generate(batch: list[list[int]], new_tokens: int) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad)
        return (out.shape[1] - width) * len(batch)

    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    generate(batches[0], 2)  # warm-up: lazy initialization is not throughput
    total = 0
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc=f"transformers batch={batch_size}", unit="batch"):
        total += generate(batch, output_len)
    return BenchResult(f"transformers batch={batch_size}", total, time.perf_counter() - t0)


def plot(results: list[BenchResult], path: Path) -> None:
    """Output tokens / s per engine, tritium's bar in red."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r.name for r in results]
    values = [r.tokens_per_s for r in results]
    bars = ax.barh(names, values, color=["#c0392b" if n == "tritium" else "#7f8c8d" for n in names])
    ax.bar_label(bars, fmt="%.1f tok/s", padding=3)
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.set_title("Offline throughput, SmolLM2-135M fp32, CPU")
    ax.set_xlim(0, max(values) * 1.3)
    save_figure(fig, path, dpi=120)


def run_offline_benchmark(
    num_requests: int = 32,
    output_len: int = 128,
    min_prompt: int = 32,
    max_prompt: int = 256,
    skip_transformers: bool = False,
    out_dir: str | Path = "bench_results",
    max_num_seqs: int = 64,
    dtype: str = "auto",
    quantization: str | None = None,
) -> dict[str, Any]:
    """Run the benchmark (tritium in `dtype` with `quantization`'s weights, transformers in fp32), print the table
    and ratios, write `offline.json` and `offline.png` into `out_dir`; returns the JSON dict."""
    prompts = random_token_prompts(num_requests, min_prompt, max_prompt)
    results = []
    tritium, overhead = bench_tritium(prompts, output_len, max_num_seqs, dtype=dtype, quantization=quantization)
    results.append(tritium)
    if not skip_transformers:
        results.append(bench_transformers(prompts, output_len, batch_size=1))
        results.append(bench_transformers(prompts, output_len, batch_size=8))
    print(f"\n{num_requests} requests, prompts {min_prompt}-{max_prompt} tokens, {output_len} new tokens each")
    print(f"{'engine':<24}{'tokens':>8}{'seconds':>10}{'tok/s':>10}{'tritium x':>11}")
    for r in results:
        ratio = tritium.tokens_per_s / r.tokens_per_s
        print(f"{r.name:<24}{r.output_tokens:>8}{r.seconds:>10.1f}{r.tokens_per_s:>10.1f}{ratio:>10.2f}x")
    print(
        f"tritium per step: {overhead['step_ms_avg']:.1f} ms, of which model {overhead['model_ms_avg']:.1f} ms and "
        f"Python overhead {overhead['overhead_ms_avg']:.2f} ms ({100 * overhead['overhead_fraction']:.1f}%)"
    )
    report = {
        "workload": {"num_requests": num_requests, "output_len": output_len, "min_prompt": min_prompt, "dtype": dtype,
                     "quantization": quantization,
                     "max_prompt": max_prompt, "greedy": True, "ignore_eos": True},
        "machine": machine_info(),
        "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results],
        "tritium_step_overhead": overhead,
    }
    write_report(out_dir, "offline", report, lambda path: plot(results, path))
    return report
