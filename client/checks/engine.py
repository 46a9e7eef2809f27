"""gpu-check steps on the engine itself (default model): greedy parity with transformers, sync-free decode
steps (a batch that uses every sampler path), and the host time of a decode step and of a mixed
prefill + decode step against their GPU time, with torch's reserved memory against the engine's estimate.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
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
# A mixed step: MIXED_DECODE_ROWS decode rows and one new prompt of MIXED_PREFILL_TOKENS tokens (max_num_seqs
# is 64, so the decode batch leaves a seat for it).
MIXED_DECODE_ROWS, MIXED_PREFILL_TOKENS = 48, 512
STEP_LABEL = "gpu_check.engine_step"
# CUDA runtime calls in which the host waits for the GPU (a D2H copy into pageable memory waits inside
# cudaMemcpyAsync; an H2D one from pageable memory may too).
WAITING_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                 "cudaMemcpyAsync"}
# CUDA calls that start work on the GPU from the host: a kernel (torch's runtime launches, Triton's driver ones)
# or a whole CUDA graph.
LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}
HOOK_NEEDED = ("LLMEngine.step could time what it spends blocked on the sampled ids (EngineStats.sync_wait_s), "
               "and ModelRunner.execute could record CUDA events around the forward pass (opt-in, e.g. "
               "EngineStats.gpu_forward_s): host time = step_s - sync_wait_s without a profiler")


class SharedEngine:
    """The engine of the parity, sync and timing steps, built on first use (a failure is kept and re-raised)."""

    def __init__(self, smoke: bool, model: str | None = None) -> None:
        self.smoke = smoke
        self.model = model  # a folder, or None for the default model
        self._engine: LLMEngine | None = None
        self._error: Exception | None = None

    def get(self) -> LLMEngine:
        """The engine, built on the first call. Raises what building it raised (later calls: RuntimeError)."""
        if self._error is not None:
            raise RuntimeError(f"the engine failed to start: {self._error}")
        if self._engine is None:
            try:
                self._engine = LLMEngine(engine_config(self.smoke, self.model))
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


def engine_config(smoke: bool, model: str | None = None) -> EngineConfig:
    """`model` (None: the default model) with default settings but a GPU_MEMORY_UTILIZATION share of the GPU;
    in smoke mode on the CPU with a small KV cache and token budget."""
    if smoke:
        return EngineConfig(model=model, device="cpu", kv_cache_bytes=SMOKE_KV_CACHE_BYTES,
                            max_model_len=SMOKE_MAX_MODEL_LEN, max_num_batched_tokens=SMOKE_TOKEN_BUDGET)
    return EngineConfig(model=model, device="cuda", gpu_memory_utilization=GPU_MEMORY_UTILIZATION)


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
              dtype: torch.dtype, model_path: str | None = None) -> list[tuple[list[int], list[set[int]]]]:
    """transformers' greedy continuation of each prompt, one at a time (stops at EOS like tritium), with the
    PARITY_TOP_K most likely token ids of its raw logits at each position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model(model_path), dtype=dtype).to(device).eval()
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
    theirs = hf_greedy(prompts, max_tokens, str(engine.device), engine.dtype, shared.model)
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


def start_decoding(engine: LLMEngine, n: int, max_tokens: int, tag: str,
                   params: list[SamplingParams] | None = None) -> list[str]:
    """Add `n` requests (prompts of 64-192 random ordinary tokens; `params` per request, default greedy with
    ignore_eos) and step until every one has produced a token, so that the next steps are decode steps of the
    whole batch."""
    prompts = random_token_prompts(n, 64, 192, vocab=engine.model_config.vocab_size, seed=1)
    ids = [f"gpu-check-{tag}-{i}" for i in range(n)]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt, p in zip(ids, prompts, params or [greedy] * n, strict=True):
        engine.add_request(rid, None, p, prompt_token_ids=prompt)
    started: set[str] = set()
    for _ in range(10 * n):
        started.update(o.request_id for o in engine.step() if o.delta_token_ids)
        if started.issuperset(ids):
            return ids
    raise RuntimeError(f"{n - len(started & set(ids))} of {n} requests produced no token")


def sync_batch_params(n: int, max_tokens: int, constrained: bool) -> list[SamplingParams]:
    """`n` requests' settings that together use every sampler path: greedy, logprobs (greedy and random),
    penalties, seeded top-p, top-k / min-p, min_tokens, and (when `constrained`) a regex grammar that never
    ends. Every one ignores EOS, so none stops before `max_tokens`."""
    kinds: list[dict[str, Any]] = [
        {"temperature": 0},
        {"temperature": 0, "logprobs": 5},
        {"temperature": 0.8, "top_k": 40, "logprobs": 1},
        {"temperature": 0, "repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.2},
        {"temperature": 1.0, "top_p": 0.9, "seed": 1234},
        {"temperature": 0.7, "min_p": 0.05, "min_tokens": max_tokens // 2},
    ]
    if constrained:
        kinds.append({"temperature": 0.7, "structured_output": {"regex": "[a-z ]+"}})
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kinds[i % len(kinds)]) for i in range(n)]


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
    """Decode steps of a batch of SYNC_BATCH requests that use every sampler path (`sync_batch_params`:
    logprobs, penalties, seeded, min_tokens, top-k/top-p/min-p and, when llguidance is installed, constrained
    rows) under the sync debug mode: one sync per step (fetching the sampled ids and logprobs) is allowed, any
    other is a failure."""
    from tritium.backend.structured_output.compiler import llguidance_available

    if smoke or not torch.cuda.is_available():
        return Outcome(SKIP, "CUDA only: torch.cuda.set_sync_debug_mode has nothing to watch on a CPU (smoke mode)")
    engine = shared.get()
    generate(engine, [[1, 2, 3, 4]] * 4, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "warm")
    constrained = llguidance_available()
    params = sync_batch_params(SYNC_BATCH, SYNC_STEPS + 16, constrained)
    ids = start_decoding(engine, SYNC_BATCH, SYNC_STEPS + 16, "sync", params)
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
    rows = "logprobs, penalties, seeded, min_tokens, top-k/p, min-p" + (
        ", constrained" if constrained else "; no constrained rows: llguidance is not installed")
    summary = (f"{SYNC_STEPS} decode steps at batch {SYNC_BATCH} ({rows}): at most {worst} sync per step "
               f"(allowed: 1, the sampled ids); {where}")
    return Outcome(PASS if worst <= 1 else FAIL, summary,
                   {"batch": SYNC_BATCH, "steps": SYNC_STEPS, "rows": rows, "constrained_rows": constrained,
                    "syncs_per_step": per_step, "syncs_by_place": places})


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


def count_launches(events: Any, steps: int) -> float:
    """Kernel and graph launches per step (host-side CUDA calls, LAUNCH_CALLS) in a torch.profiler trace."""
    from torch.autograd import DeviceType

    launches = sum(1 for e in events
                   if e.device_type == DeviceType.CPU and re.sub(r"_v\d+$", "", e.name) in LAUNCH_CALLS)
    return launches / steps


def add_prefill(engine: LLMEngine, prompt: list[int], request_id: str) -> None:
    """Queue a request that prefills `prompt` and ends with its first token (the next step mixes its prefill
    with the running decode rows)."""
    engine.add_request(request_id, None, SamplingParams(temperature=0, max_tokens=1), prompt_token_ids=prompt)


def mixed_step(engine: LLMEngine, prompt: list[int], request_id: str) -> bool:
    """One step of the running decode rows plus `prompt`'s whole prefill. Returns whether it was that: the
    new request finished in it and at least one other request got a token."""
    add_prefill(engine, prompt, request_id)
    outs = engine.step()
    prefilled = any(o.request_id == request_id and o.finished for o in outs)
    return prefilled and any(o.request_id != request_id and o.delta_token_ids for o in outs)


def profiled_steps(step: Callable[[int], object], steps: int) -> dict[str, float | None]:
    """`split_profile` and `count_launches` of `steps` calls of `step(i)` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            with record_function(STEP_LABEL):
                step(i)
        torch.cuda.synchronize()
    events = prof.events()
    return {**split_profile(events, steps), "launches_per_step": count_launches(events, steps)}


def timed_steps(step: Callable[[int], object], steps: int, desc: str) -> list[float]:
    """Wall milliseconds of each of `steps` calls of `step(i)`."""
    walls = []
    for i in tqdm(range(steps), desc=desc, unit="step"):
        t0 = time.perf_counter()
        step(i)
        walls.append(1e3 * (time.perf_counter() - t0))
    return walls


def memory_figures(engine: LLMEngine) -> dict[str, Any]:
    """torch's reserved memory (now, and at most since the last reset of the peak statistics) against the
    engine's memory plan (memory_budget.py), in GiB: what the allocator holds should stay within the plan's
    `torch_bytes`."""
    gib = 1 << 30
    figures: dict[str, Any] = {"reserved_gib": torch.cuda.memory_reserved() / gib,
                               "max_reserved_gib": torch.cuda.max_memory_reserved() / gib,
                               "max_allocated_gib": torch.cuda.max_memory_allocated() / gib}
    plan = engine.worker_info.memory_plan
    if plan is not None:
        figures["estimate"] = {k: v / gib for k, v in asdict(plan).items()}
        figures["estimate_torch_gib"] = plan.torch_bytes / gib
        figures["max_reserved_over_estimate"] = torch.cuda.max_memory_reserved() / plan.torch_bytes
    return figures


def check_step_timing(shared: SharedEngine, smoke: bool) -> Outcome:
    """Decode steps of TIMING_BATCH requests, then mixed steps (MIXED_DECODE_ROWS decode rows and a prefill of
    MIXED_PREFILL_TOKENS tokens: these run eagerly, decode rows included, see decode_graphs.py): wall time per
    step (perf_counter around engine.step), then host time (wall minus waits for the GPU) against GPU busy
    time and kernel launches per step, from a torch.profiler trace. Then torch's reserved memory against the
    engine's memory plan. Fails when a mixed step was not one or the profiler saw no GPU work."""
    if smoke or not torch.cuda.is_available():
        return Outcome(SKIP, "CUDA only: a CPU has no GPU time to set the host time against (smoke mode)")
    engine = shared.get()
    gc.collect()  # what the parity step's transformers model left in torch's cache is not the engine's
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ids = start_decoding(engine, TIMING_BATCH, TIMING_STEPS + PROFILED_STEPS + 16, "timing")
    try:
        for _ in range(3):
            engine.step()
        walls = timed_steps(lambda i: engine.step(), TIMING_STEPS, f"decode steps at batch {TIMING_BATCH}")
        split = profiled_steps(lambda i: engine.step(), PROFILED_STEPS)
    finally:
        finish(engine, ids)
    mixed_steps = 3 + TIMING_STEPS + PROFILED_STEPS
    prompts = random_token_prompts(mixed_steps, MIXED_PREFILL_TOKENS, MIXED_PREFILL_TOKENS,
                                   vocab=engine.model_config.vocab_size, seed=2)
    ids = start_decoding(engine, MIXED_DECODE_ROWS, mixed_steps + 16, "mixed")
    mixed_ok: list[bool] = []

    def mixed(i: int) -> None:
        mixed_ok.append(mixed_step(engine, prompts[i], f"gpu-check-prefill-{i}"))

    try:
        for i in range(3):
            mixed(i)
        mixed_walls = timed_steps(lambda i: mixed(3 + i), TIMING_STEPS,
                                  f"mixed steps ({MIXED_DECODE_ROWS} decode + {MIXED_PREFILL_TOKENS} prefill)")
        mixed_split = profiled_steps(lambda i: mixed(3 + TIMING_STEPS + i), PROFILED_STEPS)
    finally:
        finish(engine, ids)
    memory = memory_figures(engine)
    figures: dict[str, Any] = {"batch": TIMING_BATCH, "steps": TIMING_STEPS, "wall_ms_per_step_p50":
                               statistics.median(walls), "wall_ms_per_step_mean": statistics.fmean(walls), **split,
                               "mixed": {"decode_rows": MIXED_DECODE_ROWS, "prefill_tokens": MIXED_PREFILL_TOKENS,
                                         "steps_that_were_mixed": f"{sum(mixed_ok)}/{len(mixed_ok)}",
                                         "wall_ms_per_step_p50": statistics.median(mixed_walls), **mixed_split},
                               "memory": memory,
                               "method": "host = profiled step wall time minus time in CUDA calls that wait for "
                               "the GPU; GPU = sum of kernel and copy times (the profiler adds host time, so "
                               "the host figure is an upper bound)", "hook_needed": HOOK_NEEDED}
    host, gpu = split["host_ms_per_step"], split["gpu_ms_per_step"]
    m_host, m_gpu = mixed_split["host_ms_per_step"], mixed_split["gpu_ms_per_step"]
    if gpu is None or m_gpu is None:
        return Outcome(FAIL, "the profiler recorded no GPU activity (CUPTI unavailable?)", figures)
    estimate = (f" vs estimate {memory['estimate_torch_gib']:.2f} GiB" if "estimate_torch_gib" in memory
                else " (no estimate: kv_cache_bytes set)")
    summary = (f"decode batch {TIMING_BATCH}: step {figures['wall_ms_per_step_p50']:.2f} ms (p50); host "
               f"{host:.2f} ms vs GPU {gpu:.2f} ms, {split['launches_per_step']:.0f} launches; mixed "
               f"({MIXED_DECODE_ROWS}+{MIXED_PREFILL_TOKENS}): host {m_host:.2f} ms vs GPU {m_gpu:.2f} ms, "
               f"{mixed_split['launches_per_step']:.0f} launches (profiled, per step); reserved max "
               f"{memory['max_reserved_gib']:.2f} GiB{estimate}")
    if not all(mixed_ok):
        return Outcome(FAIL, f"only {sum(mixed_ok)}/{len(mixed_ok)} mixed steps mixed a prefill with decode rows; "
                       + summary, figures)
    return Outcome(PASS, summary, figures)
