"""Tensor parallelism at 2 gloo ranks on a CPU (rank 1 a spawned process): greedy fp32 tokens as one rank's and as
transformers' for the families, KV heads split and replicated, through chunked prefill, prefix hits and preemption;
int8 weights, speculative decoding and structured output beside it; a rank killed fails the engine and leaves no
process; what the ranks cannot split is refused before a process starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tritium.backend import LLM, SamplingParams
from tritium.backend.model_config import ModelFolderError
from tritium.backend.serving.engine_loop import EngineLoop
from tritium.backend.serving.jobs import ENGINE_FAILED, Job
from tritium.backend.worker.ranks import RanksFailed

from support.checkpoints import save_tiny
from support.hf_reference import hf_greedy
from support.sinks import RecordingSink

pytestmark = pytest.mark.slow  # every engine here spawns a rank process

TEXTS = ["Hi", "The quick brown fox jumps over the lazy dog while the cat sleeps",
         "Once upon a time in a land far away, there lived a king who had three daughters and a dog named Rex"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
TP2 = {"tensor_parallel_size": 2}
# name -> (save_tiny kind, overrides): KV heads split (2 of 2 ranks) or replicated (1), the families' own parts
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-one-kv-head": ("llama", {"num_key_value_heads": 1}),
    "qwen3": ("qwen3", {"attention_bias": True}),
    "phi3": ("phi3", {}),  # q/k/v and gate/up fused in the checkpoint
    "gemma2": ("gemma2", {"tie_word_embeddings": True}),  # soft-capping, tied vocabulary-parallel head
    "qwen3_moe": ("qwen3_moe", {}),  # experts' intermediate rows split, a dense layer beside
    "gpt_oss": ("gpt_oss", {}),  # sinks split by head, experts converted then sliced, row-parallel biases
}


def prompts_of(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode(t) for t in TEXTS]


def rank_pids(llm: LLM) -> list[int]:
    ranks = llm.engine.worker.ranks
    assert ranks is not None
    return [p.pid for p in ranks.processes if p.pid is not None]


def gone(pid: int, wait_s: float = 10.0) -> bool:
    """Whether process `pid` ended (reaped, or a zombie) within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_give_transformers_greedy_tokens_chunked_and_from_the_prefix_cache(
        family: str, make_llm: Callable[..., LLM], tmp_path: Path, default_model_path: Path) -> None:
    kind, overrides = FAMILIES[family]
    path = save_tiny(kind, tmp_path / family, default_model_path, **overrides)
    llm = make_llm(str(path), kv_cache_bytes=4 << 20, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
                   **TP2)
    assert llm.engine.worker_info.tensor_parallel_size == 2
    prompts = prompts_of(llm)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    again = llm.generate([prompts[-1]], GREEDY)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == expected[-1]


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_two_ranks_give_one_ranks_tokens_under_preemption(kv_heads: int, make_llm: Callable[..., LLM],
                                                         tmp_path: Path, default_model_path: Path) -> None:
    """A cache of 5 blocks of 16 for sequences needing up to 4 each: preempted ones recompute their KV."""
    path = save_tiny("llama", tmp_path / "llama", default_model_path, num_key_value_heads=kv_heads)
    one = make_llm(str(path), kv_cache_bytes=4 << 20, max_model_len=64, max_num_seqs=4)
    per_block = one.engine.model_config.kv_bytes_per_block(16, one.engine.dtype) // 2  # a rank holds half the heads
    if kv_heads == 1:
        per_block *= 2  # the one KV head is replicated: each rank holds all of it
    two = make_llm(str(path), kv_cache_bytes=5 * per_block, max_model_len=64, max_num_seqs=4, **TP2)
    assert two.engine.block_manager.num_blocks == 5
    prompts = [[100 + i + 7 * j for j in range(10 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert [o.token_ids for o in two.generate(prompts, params)] == [o.token_ids for o in one.generate(prompts, params)]
    assert two.engine.scheduler.num_preemptions > 0


def test_int8_speculation_and_structured_output_run_on_two_ranks(make_llm: Callable[..., LLM], tmp_path: Path,
                                                                 default_model_path: Path) -> None:
    """Sampling, drafts and grammars stay on rank 0: n-gram- and draft-model-speculating engines' greedy tokens are
    the plain engine's, a regex is kept; int8 weights quantized per rank give tokens close to one rank's int8."""
    path = save_tiny("llama", tmp_path / "llama", default_model_path)
    base = make_llm(str(path), kv_cache_bytes=4 << 20, max_model_len=128, **TP2)
    spec = make_llm(str(path), kv_cache_bytes=4 << 20, max_model_len=128,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **TP2)
    repeating = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(repeating, params)] == \
        [o.token_ids for o in base.generate(repeating, params)]
    assert spec.engine.spec_totals is not None and spec.engine.spec_totals.num_draft_tokens > 0
    # a draft model is rank 0's alone, on the one-rank kernels: its layers must not wait for the other rank
    drafted = make_llm(str(path), kv_cache_bytes=4 << 20, max_model_len=128,
                       speculative_config={"method": "draft_model", "model": str(path), "num_speculative_tokens": 2},
                       **TP2)
    assert [o.token_ids for o in drafted.generate(repeating, params)] == \
        [o.token_ids for o in base.generate(repeating, params)]
    assert drafted.engine.spec_totals is not None and drafted.engine.spec_totals.num_accepted_tokens > 0
    digits = SamplingParams(temperature=0, max_tokens=8, structured_output={"regex": "[0-9]{3}"})
    out = base.generate(prompts_of(base)[:1], digits)[0]
    assert out.text.isdigit() and len(out.text) == 3
    # int8 scales of whole rows on each rank; the CPU's bf16 int8 path rounds each rank's partial sums, so a near
    # tie may flip: the first token's distribution is compared, not the tokens
    int8_two = make_llm(str(path), kv_cache_bytes=4 << 20, max_model_len=128, quantization="int8", **TP2)
    int8_one = make_llm(str(path), kv_cache_bytes=4 << 20, max_model_len=128, quantization="int8")
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for two, one in zip(int8_two.generate(prompts_of(base), first), int8_one.generate(prompts_of(base), first),
                        strict=True):
        assert two.logprobs is not None and one.logprobs is not None
        shared = two.logprobs[0].keys() & one.logprobs[0].keys()
        assert len(shared) >= 3
        assert all(abs(two.logprobs[0][t] - one.logprobs[0][t]) < 0.1 for t in shared)


def test_a_rank_killed_mid_generation_fails_the_engine_and_leaves_no_process(
        tiny_llama_path: Path) -> None:
    llm = LLM(str(tiny_llama_path), kv_cache_bytes=4 << 20, max_model_len=128, **TP2)
    try:
        engine = llm.engine
        for i, prompt in enumerate(prompts_of(llm)):
            engine.add_request(f"r{i}", None, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                               prompt_token_ids=prompt)
        for _ in range(3):
            engine.step()
        (pid,) = rank_pids(llm)
        os.kill(pid, signal.SIGKILL)
        assert gone(pid)
        with pytest.raises(RanksFailed, match="rank 1"):
            for _ in range(100):  # the step after the monitor saw it, or the collective it breaks
                engine.step()
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in llm.engine.worker.ranks.processes)  # type: ignore[union-attr]


def test_a_rank_that_hangs_fails_the_step_within_the_step_timeout(tiny_llama_path: Path) -> None:
    """A stopped rank (SIGSTOP) never reaches the step's all-reduce: rank 0 gives up after STEP_TIMEOUT_S (10 s)
    instead of waiting, and shutdown still ends the process."""
    llm = LLM(str(tiny_llama_path), kv_cache_bytes=4 << 20, max_model_len=128, **TP2)
    (pid,) = rank_pids(llm)
    try:
        engine = llm.engine
        engine.add_request("r", None, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                           prompt_token_ids=prompts_of(llm)[1])
        engine.step()
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(RanksFailed):
            for _ in range(100):
                engine.step()
    finally:
        llm.shutdown()
    assert gone(pid)


def test_a_rank_lost_while_idle_fails_the_served_engine_and_its_requests_get_an_error(tiny_llama_path: Path) -> None:
    llm = LLM(str(tiny_llama_path), kv_cache_bytes=4 << 20, max_model_len=128, **TP2)
    loop = EngineLoop(llm.engine)
    loop.start()
    try:
        (pid,) = rank_pids(llm)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not loop.failed and time.monotonic() < deadline:  # the idle engine thread checks its ranks
            time.sleep(0.05)
        assert loop.failed
        sink = RecordingSink()
        loop.submit(Job(request_id="late", params=GREEDY, sink=sink, prompt="Hi"))
        assert sink.done.wait(10)
        assert sink.errors and sink.errors[0][0].startswith(ENGINE_FAILED[0])
    finally:
        loop.stop()
        llm.shutdown()


def test_ranks_exit_when_the_engines_process_is_killed(tiny_llama_path: Path, tmp_path: Path) -> None:
    """No stop message reaches them: each rank sees its parent gone and exits."""
    script = tmp_path / "engine.py"
    script.write_text(
        "import sys, time\n"
        "from tritium.backend import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(tiny_llama_path)!r}, kv_cache_bytes=4 << 20, max_model_len=128, tensor_parallel_size=2)\n"
        "    print(*[p.pid for p in llm.engine.worker.ranks.processes], flush=True)\n"
        "    time.sleep(600)\n")
    engine = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None
        pids = [int(pid) for pid in engine.stdout.readline().split()]
        assert pids
        engine.kill()
        engine.wait(10)
        assert all(gone(pid, wait_s=30) for pid in pids)
    finally:
        engine.kill()


def test_shutdown_ends_the_rank_processes(tiny_llama_path: Path) -> None:
    with LLM(str(tiny_llama_path), kv_cache_bytes=4 << 20, max_model_len=128, **TP2) as llm:
        pids = rank_pids(llm)
        assert llm.generate(prompts_of(llm)[:1], GREEDY)[0].token_ids
    assert pids and all(gone(pid) for pid in pids)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48},
     "tensor_parallel_size 2 does not divide num_attention_heads 3"),
    ({"intermediate_size": 129}, "tensor_parallel_size 2 does not divide intermediate_size 129"),
])
def test_sizes_the_ranks_cannot_split_are_refused_before_a_process_starts(
        overrides: dict[str, Any], message: str, tmp_path: Path, default_model_path: Path) -> None:
    path = save_tiny("llama", tmp_path / "llama", default_model_path, **overrides)
    with pytest.raises(ModelFolderError, match=message):
        LLM(str(path), **TP2)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"enable_lora": True}, "LoRA adapters with tensor_parallel_size > 1 are not implemented"),
    ({"tensor_parallel_size": 0}, r"tensor_parallel_size must be an integer in \[1, 64\]"),
])
def test_what_tensor_parallelism_does_not_take_is_refused_by_name(kwargs: dict[str, Any], message: str,
                                                                 tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_path), **({"tensor_parallel_size": 2} | kwargs))


@pytest.mark.parametrize("family", ["llama-one-kv-head", "qwen3_moe"])
def test_two_ranks_on_the_triton_kernels(family: str, make_llm: Callable[..., LLM], tmp_path: Path,
                                         default_model_path: Path) -> None:
    """The Triton kernels (interpreter on a CPU) on each rank's shard: transformers' greedy tokens."""
    kind, overrides = FAMILIES[family]
    path = save_tiny(kind, tmp_path / family, default_model_path, **overrides)
    llm = make_llm(str(path), attention_backend="triton", kv_cache_bytes=4 << 20, max_model_len=128, max_num_seqs=4,
                   max_num_batched_tokens=16, **TP2)
    prompts = prompts_of(llm)[:2]
    params = SamplingParams(temperature=0, max_tokens=6)
    assert [o.token_ids for o in llm.generate(prompts, params)] == hf_greedy(path, prompts, 6)
