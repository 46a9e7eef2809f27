"""The model families beside Llama of the same size, and sliding-window decode against context length.

Families: random checkpoints written by transformers at the default model's shape (hidden, layers, heads, MLP,
vocabulary; head_dim 64 everywhere) for Llama, Qwen3, Phi-3, Gemma 2 and Gemma 3, each loaded and run in-process
on the same prompts (greedy, ignore_eos): load seconds (LLM construction, warm-up included) and output tokens / s,
with the ratio to Llama's. Windows: a Mistral of the same shape with and without a sliding window, one sequence
decoding after a prompt of each context length (prefix caching off): ms per decode token.
Results: tables on stdout, `families.json` and `families.png` in `out_dir`.
"""

from __future__ import annotations

import gc
import json
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

FAMILIES = ("llama", "qwen3", "phi3", "gemma2", "gemma3")


def write_family(kind: str, dest: Path, default: Path, **overrides: Any) -> Path:
    """A random `kind` checkpoint at the default model's shape, written by transformers (fp32) with its tokenizer."""
    import transformers

    shape = json.loads((default / "config.json").read_text(encoding="utf-8"))
    common = {key: shape[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads", "bos_token_id",
                                          "eos_token_id")}
    common |= {"head_dim": 64, "max_position_embeddings": 8192, "tie_word_embeddings": True} | overrides
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "mistral": lambda: transformers.MistralConfig(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common),
        "phi3": lambda: transformers.Phi3Config(**common),
        "gemma2": lambda: transformers.Gemma2Config(query_pre_attn_scalar=64, **common),
        "gemma3": lambda: transformers.Gemma3TextConfig(query_pre_attn_scalar=64, **common),
    }
    return save_random_model(configs[kind](), dest, default)


def bench_family(path: Path, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Load seconds and output tokens / s of the checkpoint at `path` on `prompts`."""
    t0 = time.perf_counter()
    llm = LLM(str(path), max_num_seqs=len(prompts), max_model_len=1024)
    load_s = time.perf_counter() - t0
    rate = tokens_per_s(llm, prompts, output_len)
    del llm
    gc.collect()
    return {"load_s": load_s, "tokens_per_s": rate}


def tokens_per_s(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens / s of `llm` on `prompts` (greedy, `output_len` each, ignore_eos), after a short warm-up."""
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def decode_ms(path: Path, contexts: list[int], new_tokens: int) -> list[float]:
    """ms per decode step of one sequence after a prompt of each length in `contexts`: the median of `new_tokens`
    engine steps timed once the prompt is computed."""
    llm = LLM(str(path), max_num_seqs=1, max_model_len=max(contexts) + new_tokens + 2, enable_prefix_caching=False,
              max_num_batched_tokens=2048)
    engine = llm.engine
    out = []
    for i, context in enumerate(contexts):
        prompt = random_token_prompts(1, context, context)[0]
        params = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=params)
        while not any(o.delta_token_ids for o in engine.step()):  # the prompt, in chunks, until its first token
            pass
        steps = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        out.append(1000 * statistics.median(steps))
    del llm
    gc.collect()
    return out


def run_families_benchmark(num_requests: int = 16, output_len: int = 64, window: int = 512,
                           contexts: tuple[int, ...] = (512, 1024, 2048, 4096), new_tokens: int = 32,
                           out_dir: str | Path = "bench_results") -> dict[str, Any]:
    """Run both parts, print their tables, write `families.json` and `families.png`; returns the JSON dict."""
    default = resolve_model(None)
    prompts = random_token_prompts(num_requests, 32, 128)
    work = Path(tempfile.mkdtemp(prefix="tritium-families-"))
    try:
        families: dict[str, dict[str, float]] = {}
        for kind in tqdm(FAMILIES, desc="families", unit="family"):
            families[kind] = bench_family(write_family(kind, work / kind, default), prompts, output_len)
            shutil.rmtree(work / kind)
        windows: dict[str, list[float]] = {}
        for name, size in (("full", None), (f"window {window}", window)):
            path = write_family("mistral", work / "mistral", default, sliding_window=size)
            windows[name] = decode_ms(path, list(contexts), new_tokens)
            shutil.rmtree(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    llama = families["llama"]
    print(f"{'family':8} {'load s':>7} {'tok/s':>7} {'load / llama':>13} {'tok/s / llama':>14}")
    for kind, r in families.items():
        print(f"{kind:8} {r['load_s']:7.2f} {r['tokens_per_s']:7.1f} {r['load_s'] / llama['load_s']:13.2f} "
              f"{r['tokens_per_s'] / llama['tokens_per_s']:14.2f}")
    print(f"\nmedian ms per decode step, one sequence ({new_tokens} steps after the prompt)")
    print(f"{'context':>8} " + " ".join(f"{name:>12}" for name in windows))
    for i, context in enumerate(contexts):
        print(f"{context:8d} " + " ".join(f"{ms[i]:12.2f}" for ms in windows.values()))
    report = {"machine": machine_info(), "num_requests": num_requests, "output_len": output_len,
              "families": families, "contexts": list(contexts), "decode_ms": windows}

    def plot(path: Path) -> None:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, ms in windows.items():
            ax.plot(contexts, ms, marker="o", label=name)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per decode token")
        ax.set_title("Decode with and without a sliding window (Mistral, default model's shape)")
        ax.legend()
        save_figure(fig, path)

    write_report(out_dir, "families", report, plot)
    return report
