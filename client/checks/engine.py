"""gpu-check steps on the engine itself (default model): greedy parity with transformers, sync-free decode
steps, and a decode step's host time against its GPU time.

One engine serves the three steps (`SharedEngine`); it is freed before the throughput step builds its own.
On CUDA it takes GPU_MEMORY_UTILIZATION of the device, so transformers fits beside it.
"""

from __future__ import annotations

import gc
import re
import statistics
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import tritium.backend
import tritium.kernels
from tritium.backend import EngineConfig, LLMEngine, SamplingParams
from tritium.backend.models.registry import resolve_model
from tritium.client.bench.workload import random_token_prompts
from tritium.client.checks.parity import PARITY_TOP_K, tokens_agree, top_ids
from tritium.client.checks.report import FAIL, PASS, SKIP, Outcome

GPU_MEMORY_UTILIZATION = 0.4
SMOKE_KV_CACHE_BYTES = 128 << 20
SMOKE_MAX_MODEL_LEN = 2048
SMOKE_TOKEN_BUDGET = 256  # max_num_batched_tokens: the engine's warm-up runs a forward pass of this many tokens
PARITY_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "List three prime numbers and explain why each of them is prime, step by step.",
    "def fibonacci(n):",
    "The history of the Roman Empire began",
    "Explain how a paged KV cache works in an LLM inference engine.",
]
SYNC_MESSAGE = "synchronizing CUDA operation"  # what torch.cuda.set_sync_debug_mode("warn") says
SYNC_BATCH, SYNC_STEPS = 32, 16
TIMING_BATCH, TIMING_STEPS, PROFILED_STEPS = 64, 32, 16
STEP_LABEL = "gpu_check.engine_step"
# CUDA runtime calls in which the host waits for the GPU (a D2H copy into pageable memory waits inside
# cudaMemcpyAsync; an H2D one from pageable memory may too).
WAITING_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                 "cudaMemcpyAsync"}
HOOK_NEEDED = ("LLMEngine.step could time what it spends blocked on the sampled ids (EngineStats.sync_wait_s), "
               "and ModelRunner.execute could record CUDA events around the forward pass (opt-in, e.g. "
               "EngineStats.gpu_forward_s): host time = step_s - sync_wait_s without a profiler")


class SharedEngine:
    """The engine of the parity, sync and timing steps, built on first use (a failure is kept and re-raised)."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self._engine: LLMEngine | None = None
        self._error: Exception | None = None

    def get(self) -> LLMEngine:
        """The engine, built on the first call. Raises what building it raised (later calls: RuntimeError)."""
        if self._error is not None:
            raise RuntimeError(f"the engine failed to start: {self._error}")
        if self._engine is None:
            try:
                self._engine = LLMEngine(engine_config(self.smoke))
            except Exception as exc:
                self._error = exc
                raise
        return self._engine

    def close(self) -> None:
        """Drop the engine and give its memory back (a later get() builds a new one)."""
        self._engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def engine_config(smoke: bool) -> EngineConfig:
    """The default model with default settings but a GPU_MEMORY_UTILIZATION share of the GPU; in smoke mode on
    the CPU with a small KV cache and token budget."""
    if smoke:
        return EngineConfig(model=None, device="cpu", kv_cache_bytes=SMOKE_KV_CACHE_BYTES,
                            max_model_len=SMOKE_MAX_MODEL_LEN, max_num_batched_tokens=SMOKE_TOKEN_BUDGET)
    return EngineConfig(model=None, device="cuda", gpu_memory_utilization=GPU_MEMORY_UTILIZATION)


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
             tag: str) -> list[tuple[list[int], list[dict[int, float]] | None]]:
    """Each prompt's generated token ids and their logprobs (None unless `params.logprobs`), through the
    continuous batcher."""
    ids = [f"gpu-check-{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    final: dict[str, tuple[list[int], list[dict[int, float]] | None]] = {}
    while len(final) < len(ids) and engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in ids:
                if out.error:
                    raise RuntimeError(f"{out.request_id}: {out.error}")
                final[out.request_id] = (out.token_ids, out.logprobs)
    return [final[i] for i in ids]


def hf_greedy(prompts: list[list[int]], max_new_tokens: int, device: str,
              dtype: torch.dtype) -> list[tuple[list[int], list[set[int]]]]:
    """transformers' greedy continuation of each prompt, one at a time (stops at EOS like tritium), with the
    PARITY_TOP_K most likely token ids of its raw logits at each position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=dtype).to(device).eval()
    outs = []
    for prompt in tqdm(prompts, desc="transformers greedy", unit="prompt"):
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, temperature=None, top_p=None, top_k=None,
                                 output_logits=True, return_dict_in_generate=True)
        topk = [set(step[0].float().topk(PARITY_TOP_K).indices.tolist()) for step in out.logits]
        outs.append((out.sequences[0, len(prompt):].tolist(), topk))
    del model
    return outs


def matching_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_parity(shared: SharedEngine, smoke: bool) -> Outcome:
    """Greedy token ids of tritium and transformers, same device and dtype, chat-templated prompts."""
    engine = shared.get()
    texts, max_tokens = (PARITY_PROMPTS[:2], 8) if smoke else (PARITY_PROMPTS, 32)
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), False) for t in texts]
    ours = generate(engine, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=PARITY_TOP_K),
                    "parity")
    theirs = hf_greedy(prompts, max_tokens, str(engine.device), engine.dtype)
    exact = engine.dtype == torch.float32
    rows: list[dict[str, Any]] = []
    for t, (a, a_logprobs), (b, b_topk) in zip(texts, ours, theirs, strict=True):
        a_topk = [top_ids(lp) for lp in a_logprobs] if a_logprobs is not None else None
        verdict = tokens_agree(a, b, a_topk, b_topk, exact)
        rows.append({"prompt": t[:40], "matching_prefix": matching_prefix(a, b), "tritium_tokens": len(a),
                     "transformers_tokens": len(b), "identical": a == b, "ok": verdict.ok,
                     "verdict": verdict.reason})
    identical = sum(r["identical"] for r in rows)
    rule = ("all identical (float32)" if exact else
            f"identical, or at the first divergence each side's token in the other's top-{PARITY_TOP_K}")
    ok = all(r["ok"] for r in rows)
    dtype = str(engine.dtype).removeprefix("torch.")
    summary = (f"{identical}/{len(rows)} identical x {max_tokens} tokens on {engine.device.type} {dtype}; "
               f"matching prefixes {[r['matching_prefix'] for r in rows]} (pass: {rule})")
    return Outcome(PASS if ok else FAIL, summary, {"device": str(engine.device), "dtype": dtype,
                                                    "max_tokens": max_tokens, "rule": rule, "prompts": rows})


def start_decoding(engine: LLMEngine, n: int, max_tokens: int, tag: str) -> list[str]:
    """Add `n` greedy requests (prompts of 64-192 random ordinary tokens, ignore_eos) and step until every
    one has produced a token, so that the next steps are decode steps of the whole batch."""
    prompts = random_token_prompts(n, 64, 192, vocab=engine.model_config.vocab_size, seed=1)
    ids = [f"gpu-check-{tag}-{i}" for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    started: set[str] = set()
    for _ in range(10 * n):
        started.update(o.request_id for o in engine.step() if o.delta_token_ids)
        if started.issuperset(ids):
            return ids
    raise RuntimeError(f"{n - len(started & set(ids))} of {n} requests produced no token")


def finish(engine: LLMEngine, ids: list[str]) -> None:
    """Abort `ids` and step until the engine has nothing left."""
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()


def _tritium_roots() -> list[str]:
    return [str(Path(m.__file__).resolve().parent) for m in (tritium.backend, tritium.kernels)]


def top_tritium_frame(stack: list[traceback.FrameSummary], roots: list[str]) -> str:
    """`file:line in function` of the innermost frame in tritium's engine or kernels, else of the innermost."""
    for frame in reversed(stack):
        path = str(Path(frame.filename).resolve())
        for root in roots:
            if path.startswith(root):
                return f"{Path(root).name}/{Path(path).relative_to(root)}:{frame.lineno} in {frame.name}"
    last = stack[-1] if stack else None
    return f"{last.filename}:{last.lineno} in {last.name}" if last else "unknown"


@contextmanager
def recording_syncs() -> Iterator[list[str]]:
    """torch.cuda.set_sync_debug_mode("warn") for the block; yields the list that collects each synchronizing
    call's top tritium frame (other warnings are shown as usual)."""
    found: list[str] = []
    roots = _tritium_roots()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show = warnings.showwarning

        def record(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   file: Any = None, line: str | None = None) -> None:
            if SYNC_MESSAGE in str(message):
                found.append(top_tritium_frame(traceback.extract_stack()[:-1], roots))
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")


def check_sync_free_decode(shared: SharedEngine, smoke: bool) -> Outcome:
    """Decode steps of a batch of SYNC_BATCH requests under the sync debug mode: one sync per step (fetching
    the sampled ids) is allowed, any other is a failure."""
    if smoke or not torch.cuda.is_available():
        return Outcome(SKIP, "CUDA only: torch.cuda.set_sync_debug_mode has nothing to watch on a CPU (smoke mode)")
    engine = shared.get()
    generate(engine, [[1, 2, 3, 4]] * 4, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "warm")
    ids = start_decoding(engine, SYNC_BATCH, SYNC_STEPS + 16, "sync")
    try:
        for _ in range(3):  # settle: a graph bucket first used here is captured outside the watched steps
            engine.step()
        per_step: list[int] = []
        with recording_syncs() as found:
            for _ in tqdm(range(SYNC_STEPS), desc="decode steps under sync debug", unit="step"):
                before = len(found)
                engine.step()
                per_step.append(len(found) - before)
    finally:
        finish(engine, ids)
    places = dict(Counter(found).most_common())
    worst = max(per_step)
    where = "; ".join(f"{place} ({n}x)" for place, n in list(places.items())[:3]) or "none"
    summary = (f"{SYNC_STEPS} decode steps at batch {SYNC_BATCH}: at most {worst} sync per step "
               f"(allowed: 1, the sampled ids); {where}")
    return Outcome(PASS if worst <= 1 else FAIL, summary,
                   {"batch": SYNC_BATCH, "steps": SYNC_STEPS, "syncs_per_step": per_step, "syncs_by_place": places})


def split_profile(events: Any, steps: int) -> dict[str, float | None]:
    """Per step, from a torch.profiler trace of `steps` labelled engine steps: wall time, time blocked in
    CUDA calls that wait for the GPU, host time (the difference) and GPU busy time (kernels and copies)."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    wall = sum(e.time_range.elapsed_us() for e in cpu if e.name == STEP_LABEL)
    # CUPTI's names may carry an API version ("cudaMemcpyAsync_v3020")
    waiting = sum(e.time_range.elapsed_us() for e in cpu if re.sub(r"_v\d+$", "", e.name) in WAITING_CALLS)
    gpu = [e.time_range.elapsed_us() for e in events
           if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False) and e.name != STEP_LABEL]
    return {"profiled_wall_ms_per_step": wall / steps / 1e3, "sync_wait_ms_per_step": waiting / steps / 1e3,
            "host_ms_per_step": (wall - waiting) / steps / 1e3,
            "gpu_ms_per_step": sum(gpu) / steps / 1e3 if gpu else None}


def check_step_timing(shared: SharedEngine, smoke: bool) -> Outcome:
    """Decode steps of TIMING_BATCH requests: wall time per step (perf_counter around engine.step), then host
    time (wall minus waits for the GPU) against GPU busy time per step, from a torch.profiler trace."""
    if smoke or not torch.cuda.is_available():
        return Outcome(SKIP, "CUDA only: a CPU has no GPU time to set the host time against (smoke mode)")
    engine = shared.get()
    ids = start_decoding(engine, TIMING_BATCH, TIMING_STEPS + PROFILED_STEPS + 16, "timing")
    try:
        for _ in range(3):
            engine.step()
        walls = []
        for _ in tqdm(range(TIMING_STEPS), desc=f"decode steps at batch {TIMING_BATCH}", unit="step"):
            t0 = time.perf_counter()
            engine.step()
            walls.append(1e3 * (time.perf_counter() - t0))
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_STEPS):
                with record_function(STEP_LABEL):
                    engine.step()
            torch.cuda.synchronize()
        split = split_profile(prof.events(), PROFILED_STEPS)
    finally:
        finish(engine, ids)
    figures: dict[str, Any] = {"batch": TIMING_BATCH, "steps": TIMING_STEPS, "wall_ms_per_step_p50":
                               statistics.median(walls), "wall_ms_per_step_mean": statistics.fmean(walls), **split,
                               "method": "host = profiled step wall time minus time in CUDA calls that wait for "
                               "the GPU; GPU = sum of kernel and copy times (the profiler adds host time, so "
                               "the host figure is an upper bound)", "hook_needed": HOOK_NEEDED}
    host, gpu = split["host_ms_per_step"], split["gpu_ms_per_step"]
    if gpu is None:
        return Outcome(FAIL, "the profiler recorded no GPU activity (CUPTI unavailable?)", figures)
    summary = (f"batch {TIMING_BATCH}: step {figures['wall_ms_per_step_p50']:.2f} ms (p50); host {host:.2f} ms vs "
               f"GPU {gpu:.2f} ms per step (profiled)")
    return Outcome(PASS, summary, figures)
