"""`tritium bench tp`: tensor parallelism on this host against one rank doing the same arithmetic. For each model (a
random checkpoint of the default model's size whose heads divide: 12 heads of 48, 4 KV heads; and a tiny one) and
batch size: the median decode step and tokens/s at 1 rank with every thread and at N ranks sharing them, the share
of rank 0's step spent in collectives (all-reduces, the logits gather) and their count, and the memory each rank
holds (weights, KV-cache bytes per token). Runs
alternate between the setups (`--repeats`) so that a drifting host hits both.

Results: a table on stdout, `tensor_parallel.json` and `tensor_parallel.png` in `out_dir`."""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tritium.backend import LLM, SamplingParams
from tritium.backend.models.registry import resolve_model
from tritium.client.bench.checkpoints import save_random_model
from tritium.client.bench.report import machine_info, pyplot, save_figure, write_report
from tritium.client.bench.workload import random_token_prompts

SHAPES: dict[str, dict[str, Any]] = {
    "default-size": {"num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 48},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16},
}


def write_model(dest: Path, default: Path, **overrides: Any) -> Path:
    """A random Llama of the default model's shape with `overrides`, written by transformers (fp32)."""
    import transformers

    shape = json.loads((default / "config.json").read_text(encoding="utf-8"))
    common = {key: shape[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                          "bos_token_id", "eos_token_id")}
    config = transformers.LlamaConfig(**(common | {"max_position_embeddings": 2048, "tie_word_embeddings": True}
                                         | overrides))
    return save_random_model(config, dest, default)


def decode_steps(path: Path, ranks: int, threads: int, batch: int, steps: int) -> dict[str, float]:
    """Median decode step (ms), tokens/s, rank 0's collectives' share of the timed steps, and rank 0's bytes."""
    llm = LLM(str(path), tensor_parallel_size=ranks, num_threads=threads, max_num_seqs=batch, max_model_len=512,
              kv_cache_bytes=256 << 20)
    try:
        engine = llm.engine
        info = engine.worker_info
        params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        for i, prompt in enumerate(random_token_prompts(batch, 32, 32, seed=3)):
            engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
        for _ in range(4):  # every prompt computed, the first decode steps done
            engine.step()
        while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.requests.values()):
            engine.step()
        collectives = info.collective_time
        calls, waited = (collectives.calls, collectives.seconds) if collectives is not None else (0, 0.0)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        if collectives is not None:
            calls, waited = collectives.calls - calls, collectives.seconds - waited
        for request_id in list(engine.requests):
            engine.abort(request_id)
        engine.step()
        step_s = statistics.median(times)
        return {"step_ms": 1000 * step_s, "tokens_per_s": batch / step_s, "collective_share": waited / sum(times),
                "collectives_per_step": calls / steps, "weight_bytes": info.weight_bytes,
                "kv_bytes_per_token": info.kv_cache_bytes / (info.num_blocks * engine.config.block_size)}
    finally:
        llm.shutdown()
        del llm
        gc.collect()


def run_tensor_parallel_benchmark(ranks: int = 2, batches: tuple[int, ...] = (1, 32), steps: int = 24,
                                  repeats: int = 2, shapes: tuple[str, ...] = ("default-size", "tiny"),
                                  out_dir: str | Path = "bench_results") -> dict[str, Any]:
    """Measure, print the table, write the report; returns the JSON dict."""
    default = resolve_model(None)
    cores = len(os.sched_getaffinity(0))
    threads_per_rank = max(1, cores // ranks)
    setups = {"1 rank": (1, cores), f"{ranks} ranks": (ranks, threads_per_rank)}
    work = Path(tempfile.mkdtemp(prefix="tritium-tp-"))
    results: dict[str, dict[str, dict[str, list[dict[str, float]]]]] = {}
    try:
        runs = [(shape, batch, setup) for shape in shapes for batch in batches for _ in range(repeats)
                for setup in setups]
        paths = {shape: write_model(work / shape, default, **SHAPES[shape]) for shape in shapes}
        for shape, batch, setup in tqdm(runs, desc="tensor-parallel runs", unit="run"):
            n, threads = setups[setup]
            row = results.setdefault(shape, {}).setdefault(str(batch), {}).setdefault(setup, [])
            row.append(decode_steps(paths[shape], n, threads, batch, steps))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    one, many = setups
    print(f"{'model':13} {'batch':>5} {'setup':>8} {'step ms':>8} {'tok/s':>8} {'vs 1 rank':>9} "
          f"{'collectives':>11} {'per step':>8} {'weights MiB':>11} {'KV B/token':>10}")
    summary: dict[str, Any] = {}
    for shape, by_batch in results.items():
        for batch, by_setup in by_batch.items():
            base = statistics.median(r["tokens_per_s"] for r in by_setup[one])
            for setup, rows in by_setup.items():
                rate = statistics.median(r["tokens_per_s"] for r in rows)
                share = statistics.median(r["collective_share"] for r in rows)
                step = statistics.median(r["step_ms"] for r in rows)
                summary[f"{shape} batch {batch} {setup}"] = {"tokens_per_s": rate, "vs_one_rank": rate / base,
                                                             "collective_share": share, "step_ms": step}
                print(f"{shape:13} {batch:>5} {setup:>8} {step:8.1f} {rate:8.1f} {rate / base:9.2f} "
                      f"{share:11.1%} {rows[0]['collectives_per_step']:8.0f} {rows[0]['weight_bytes'] / 2**20:11.1f} "
                      f"{rows[0]['kv_bytes_per_token']:10.0f}")
    report = {"machine": machine_info(), "ranks": ranks, "threads": {k: v[1] for k, v in setups.items()},
              "steps": steps, "repeats": repeats, "runs": results, "summary": summary}

    def plot(path: Path) -> None:
        plt = pyplot()
        labels = [key.rsplit(" ", 2)[0] for key in summary if key.endswith(many)]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar(labels, [summary[f"{label} {many}"]["vs_one_rank"] for label in labels])
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.axhline(0.8, color="tab:red", linestyle="--", linewidth=0.8, label="goal at 32 sequences")
        ax.legend(loc="upper right")
        ax.set_ylabel(f"tokens/s, {many} / 1 rank")
        ax.set_title("tensor parallelism on this host: same arithmetic, plus the communication")
        save_figure(fig, path)

    write_report(out_dir, "tensor_parallel", report, plot)
    return report
