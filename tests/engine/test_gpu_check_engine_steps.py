"""The drivers of gpu-check's engine steps on a CPU engine: the mixed steps of step 3b really mix a prefill with
decode rows, and step 3's batch (every sampler path) runs through the engine."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from tritium.backend import EngineConfig, LLMEngine
from tritium.backend.structured_output.compiler import llguidance_available
from tritium.client.bench.workload import random_token_prompts
from tritium.client.checks.engine import (
    count_launches,
    finish,
    mixed_step,
    start_decoding,
    sync_batch_params,
)


@pytest.fixture(scope="module")
def engine(tiny_llama_path: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_path), device="cpu", kv_cache_bytes=16 << 20,
                                  max_num_seqs=8, max_num_batched_tokens=256))


def test_mixed_steps_prefill_beside_the_decode_rows(engine: LLMEngine) -> None:
    ids = start_decoding(engine, 4, 16, "decode")
    prompts = random_token_prompts(3, 100, 100, vocab=engine.model_config.vocab_size, seed=2)
    try:
        assert [mixed_step(engine, p, f"prefill-{i}") for i, p in enumerate(prompts)] == [True] * 3
        assert engine.scheduler.running and len(engine.scheduler.running) == 4  # the prefills ended at once
    finally:
        finish(engine, ids)
    # a step with nothing running is not a mixed one
    assert not mixed_step(engine, prompts[0], "alone")


def test_the_sync_batch_runs_every_sampler_path(engine: LLMEngine) -> None:
    constrained = llguidance_available()
    params = sync_batch_params(8, 6, constrained)
    assert len({repr(p) for p in params}) == (7 if constrained else 6)
    assert any(p.logprobs for p in params) and any(p.seed is not None for p in params)
    assert any(p.repetition_penalty != 1.0 for p in params) and (
        any(p.structured_output is not None for p in params) == constrained)
    ids = start_decoding(engine, 8, 6, "sync", params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                outs[out.request_id] = out
    assert sorted(outs) == sorted(ids)
    assert all(len(o.token_ids) == 6 for o in outs.values())  # ignore_eos: none ended early, grammars included
    assert all(o.logprobs for rid, o in outs.items() if params[ids.index(rid)].logprobs is not None)


def test_launches_are_counted_per_step() -> None:
    def event(name: str, device: DeviceType = DeviceType.CPU) -> SimpleNamespace:
        return SimpleNamespace(name=name, device_type=device)

    events = [event("cudaLaunchKernel"), event("cuLaunchKernel"), event("cudaGraphLaunch_v10000"),
              event("cudaMemcpyAsync"), event("triton_kernel", DeviceType.CUDA), event("cuLaunchKernelEx")]
    assert count_launches(events, steps=2) == 2.0
