"""gpu-check step 3d: decode steps with the features that leave the plain graph path's happy case, on the default
model. A LoRA decode step at batch 1 (one rank-16 adapter on all seven modules) against the base model's step, and
n-gram speculation against plain decoding at batch 64 on prompts it can draft from (repeating) and prompts it
cannot (random tokens), each step watched by the sync debug mode (one sync per step allowed, the sampled ids).

Issue 39's goals, judged in report.py: LoRA r16 adds <= LORA_GOAL_OVERHEAD to the base step at batch 1; n-gram
speculation is never slower than plain graph decoding at batch 64 (NGRAM_GOAL_RATIO allows for timing noise).
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tritium.backend import EngineConfig, LLMEngine, SamplingParams
from tritium.backend.model_config import ModelConfig
from tritium.backend.models.registry import resolve_model
from tritium.client.bench.lora import write_random_adapter
from tritium.client.bench.workload import random_token_prompts
from tritium.client.checks.engine import GPU_MEMORY_UTILIZATION, SMOKE_KV_CACHE_BYTES, finish, recording_syncs
from tritium.client.checks.report import FAIL, PASS, Outcome

LORA_RANK, LORA_MODULES = 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
GPU_SIZES = {"lora_steps": 64, "spec_batch": 64, "spec_steps": 32, "max_num_seqs": 64}
SMOKE_SIZES = {"lora_steps": 3, "spec_batch": 2, "spec_steps": 3, "max_num_seqs": 4}


def _config(smoke: bool, model: str | None, **features: Any) -> EngineConfig:
    if smoke:
        return EngineConfig(model=model, device="cpu", kv_cache_bytes=SMOKE_KV_CACHE_BYTES, max_model_len=1024,
                            max_num_batched_tokens=256, max_num_seqs=SMOKE_SIZES["max_num_seqs"], **features)
    return EngineConfig(model=model, device="cuda", gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
                        max_num_seqs=GPU_SIZES["max_num_seqs"], **features)


def _free(engine: LLMEngine | None) -> None:
    if engine is not None:
        engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _decode(engine: LLMEngine, prompts: list[list[int]], steps: int, tag: str,
            lora_name: str | None = None) -> dict[str, Any]:
    """Start `prompts` (greedy, ignore_eos), step until each has a token, then time `steps` steps under the sync
    debug mode (on CUDA): milliseconds per step (median), tokens per second, syncs per step (worst)."""
    ids = [f"gpu-check-{tag}-{i}" for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=steps * 8 + 64, ignore_eos=True)
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, None, params, prompt_token_ids=prompt, lora_name=lora_name)
    started: set[str] = set()
    while not started.issuperset(ids):
        started.update(o.request_id for o in engine.step() if o.delta_token_ids)
    for _ in range(3):  # a graph bucket first used here is captured outside the timed steps
        engine.step()
    walls, tokens, syncs = [], 0, []
    watch = torch.cuda.is_available() and engine.device.type == "cuda"
    try:
        for _ in range(steps):
            found: list[str] = []
            t0 = _clock(engine)
            if watch:
                with recording_syncs() as found:
                    outs = engine.step()
            else:
                outs = engine.step()
            walls.append(_clock(engine) - t0)
            tokens += sum(len(o.delta_token_ids) for o in outs)
            syncs.append(len(found))
    finally:
        finish(engine, ids)
    total = sum(walls)
    return {"rows": len(prompts), "steps": steps, "ms_per_step_p50": 1e3 * statistics.median(walls),
            "tokens_per_s": tokens / total if total > 0 else 0.0, "syncs_per_step_max": max(syncs, default=0)}


def _clock(engine: LLMEngine) -> float:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter()


def _prompts(engine: LLMEngine, n: int, repeating: bool) -> list[list[int]]:
    """`n` prompts of 64-192 random ordinary tokens, or (`repeating`) a random 24-token phrase said six times."""
    vocab = engine.model_config.vocab_size
    if not repeating:
        return random_token_prompts(n, 64, 192, vocab=vocab, seed=3)
    return [phrase * 6 for phrase in random_token_prompts(n, 24, 24, vocab=vocab, seed=4)]


def measure_lora(smoke: bool, model: str | None) -> dict[str, Any]:
    """Batch-1 decode steps on the base model and on a random rank-16 adapter over all seven modules, one engine."""
    sizes = SMOKE_SIZES if smoke else GPU_SIZES
    with tempfile.TemporaryDirectory(prefix="tritium-gpu-check-lora-") as tmp:
        cfg = ModelConfig.from_folder(resolve_model(model))
        folder = write_random_adapter(Path(tmp) / "r16", cfg, LORA_RANK, LORA_MODULES, seed=7)
        engine = None
        try:
            engine = LLMEngine(_config(smoke, model, enable_lora=True, max_lora_rank=LORA_RANK, max_loras=2,
                                       lora_modules={"r16": str(folder)}))
            prompt = _prompts(engine, 1, repeating=False)
            base = _decode(engine, prompt, sizes["lora_steps"], "lora-base")
            lora = _decode(engine, prompt, sizes["lora_steps"], "lora-r16", lora_name="r16")
        finally:
            _free(engine)
    return {"rank": LORA_RANK, "modules": list(LORA_MODULES), "base": base, "lora": lora,
            "overhead": lora["ms_per_step_p50"] / base["ms_per_step_p50"] - 1.0}


def measure_ngram(smoke: bool, model: str | None) -> dict[str, Any]:
    """Decode tokens/s at the spec batch with and without n-gram speculation, on repeating and random prompts."""
    sizes = SMOKE_SIZES if smoke else GPU_SIZES
    figures: dict[str, Any] = {"speculative_config": NGRAM, "batch": sizes["spec_batch"]}
    for arm, features in (("off", {}), ("ngram", {"speculative_config": NGRAM})):
        engine = None
        try:
            engine = LLMEngine(_config(smoke, model, **features))
            for workload in ("repeating", "random"):
                prompts = _prompts(engine, sizes["spec_batch"], repeating=workload == "repeating")
                figures.setdefault(workload, {})[arm] = _decode(engine, prompts, sizes["spec_steps"],
                                                                f"spec-{arm}-{workload}")
        finally:
            _free(engine)
    for workload in ("repeating", "random"):
        runs = figures[workload]
        runs["ratio"] = runs["ngram"]["tokens_per_s"] / runs["off"]["tokens_per_s"] if runs["off"]["tokens_per_s"] \
            else 0.0
    return figures


def check_decode_features(smoke: bool, model: str | None = None,
                          measures: tuple[Callable[[bool, str | None], dict[str, Any]], ...] | None = None
                          ) -> Outcome:
    """Step 3d: `measure_lora` and `measure_ngram`; fails when a step synchronized more than once (CUDA). The
    goals are judged in report.goal_verdicts."""
    lora, ngram = (fn(smoke, model) for fn in (measures or (measure_lora, measure_ngram)))
    runs = [lora["base"], lora["lora"], *(ngram[w][a] for w in ("repeating", "random") for a in ("off", "ngram"))]
    worst = max(r["syncs_per_step_max"] for r in runs)
    summary = (f"LoRA r{LORA_RANK} at batch 1: {lora['lora']['ms_per_step_p50']:.2f} vs "
               f"{lora['base']['ms_per_step_p50']:.2f} ms per step ({lora['overhead']:+.0%}); n-gram at batch "
               f"{ngram['batch']}: {ngram['repeating']['ratio']:.2f}x (repeating), {ngram['random']['ratio']:.2f}x "
               f"(random) plain decoding's tokens/s; at most {worst} sync per step")
    if smoke:
        summary += " (smoke: the numbers mean nothing)"
    return Outcome(PASS if worst <= 1 else FAIL, summary, {"smoke": smoke, "lora": lora, "ngram": ngram})
