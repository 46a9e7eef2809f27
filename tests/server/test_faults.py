"""Faults through a real tritonserver: a model step that raises, a KV cache too small for the load, a
request that can never fit, and tritonserver killed with SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tritium.backend.testing.faults import FAULT_MARKER_ENV
from tritium.client.triton.launcher import pid_alive
from tritium.client.triton.repository import write_model

from support.serving import (
    Served,
    grpc_stream,
    http_generate,
    metric_value,
    shm_segments,
    start_serve,
    stub_pids,
    wait_for,
    wait_until_idle,
)

pytestmark = pytest.mark.slow
MARKER = "<<tritium-fault>>"
BLOCK_BYTES = 2 * 3 * 2 * 16 * 4 * 16  # K and V x 3 layers x 2 KV heads x head_dim 16 x fp32 x 16 tokens (tiny Llama)
SMALL_KV_BLOCKS = 12
OVERLOAD_PENDING = 2


def tiny_repository(dest: Path, model: Path) -> Path:
    """The `tritium` model with three versions of the tiny Llama: 1 with room, 2 with a 12-block KV cache,
    3 with one seat and room for 2 waiting requests."""
    common = {"model": str(model), "request_timeout_s": 120}
    write_model(dest, versions={
        1: common | {"kv_cache_bytes": 16 << 20},
        2: common | {"kv_cache_bytes": SMALL_KV_BLOCKS * BLOCK_BYTES, "max_model_len": SMALL_KV_BLOCKS * 16},
        3: common | {"kv_cache_bytes": 16 << 20, "max_num_seqs": 1, "max_pending_requests": OVERLOAD_PENDING}})
    return dest


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Path:
    return tiny_repository(tmp_path_factory.mktemp("fault-repo"), tiny_llama_path)


@pytest.fixture(scope="module")
def faulty(repo: Path) -> Iterator[Served]:
    served = start_serve(f"--model-repository={repo}", "--model-control=explicit", "--load-model=tritium",
                         env={FAULT_MARKER_ENV: MARKER})
    yield served
    served.stop()
    assert not served.leftovers()


def test_a_failing_model_step_fails_only_its_requests(faulty: Served) -> None:
    long = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    before = metric_value(faulty, "tritium_generation_tokens_total")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(grpc_stream, faulty.grpc, "Once upon a time", long, version="1")
        assert wait_for(lambda: metric_value(faulty, "tritium_generation_tokens_total") >= before + 5)
        poisoned = grpc_stream(faulty.grpc, f"{MARKER} tell me a story", long, version="1")
        victim = running.result(120)
    # Each error names what failed and the request id to look for in the log; the exception stays there.
    assert len(poisoned.errors) == 1 and poisoned.finals == 0
    assert "the model step failed (request id req-" in poisoned.errors[0] and "injected" not in poisoned.errors[0]
    # The running request shared the failed step: it ends with one error after the text it already had.
    assert len(victim.errors) == 1 and "the model step failed" in victim.errors[0] and victim.finals == 0
    assert 5 <= len(victim.texts) < 1000
    after = grpc_stream(faulty.grpc, "Once upon a time", {"max_tokens": 8, "temperature": 0}, version="1")
    assert not after.errors and after.finals == 1 and after.texts
    assert wait_until_idle(faulty)


def test_kv_exhaustion_preempts_instead_of_failing(faulty: Served) -> None:
    sampling = {"max_tokens": 60, "ignore_eos": True, "temperature": 0}
    prompts = [f"Request {i} asks for a long answer about" for i in range(6)]  # 6 x ~5 blocks > 12 blocks
    before = metric_value(faulty, "tritium_num_preemptions_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: grpc_stream(faulty.grpc, p, sampling, version="2",
                                                       return_num_output_tokens=True), prompts))
    for r in results:
        assert not r.errors and r.finals == 1
        assert int(r.outputs[-1]["num_output_tokens"][0]) == 60
    assert wait_for(lambda: metric_value(faulty, "tritium_num_preemptions_total") > before, 10)
    assert wait_until_idle(faulty)


def test_a_request_that_can_never_fit_gets_a_clear_error(faulty: Served) -> None:
    capacity = SMALL_KV_BLOCKS * 16  # version 2's max_model_len: its KV cache holds one such sequence
    result = grpc_stream(faulty.grpc, "Once upon a time", {"max_tokens": capacity}, version="2")
    assert len(result.errors) == 1 and f"exceeds the model's context of {capacity} tokens" in result.errors[0]
    body = {"text_input": "Hello", "max_tokens": 4}
    assert http_generate(faulty.http, body, version="2").status_code == 200


def test_restart_after_kill_9_comes_back_clean(repo: Path) -> None:
    args = (f"--model-repository={repo}", "--model-control=explicit", "--load-model=tritium")
    # tritonserver killed, the launcher alive: the launcher notices, cleans up and exits with an error.
    first = start_serve(*args)
    os.kill(first.server_pid, signal.SIGKILL)
    assert first.process.wait(60) == 1
    assert "tritonserver exited with -9" in first.stop()
    assert not first.leftovers()
    # Everything killed (launcher, tritonserver and its stubs): nothing could clean up, the shm stays ...
    second = start_serve(*args)
    os.kill(second.process.pid, signal.SIGKILL)
    os.killpg(second.server_pid, signal.SIGKILL)  # tritonserver leads its own process group, stubs included
    second.process.wait(10)
    assert wait_for(lambda: not pid_alive(second.server_pid), 10)
    assert shm_segments(f"tritium_{second.server_pid}_"), "expected the killed server's shared memory"
    # ... until the next `tritium serve` removes them, and serves.
    third = start_serve(*args)
    try:
        assert not second.leftovers()
        assert stub_pids(third.server_pid)
        resp = http_generate(third.http, {"text_input": "Hello", "max_tokens": 3}, version="1")
        assert resp.status_code == 200, resp.text
    finally:
        third.stop()
    assert not third.leftovers()


def test_overload_is_refused_at_once_and_the_admitted_requests_finish(faulty: Served) -> None:
    long = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    refused_before = metric_value(faulty, "tritium_num_requests_refused_total")
    with ThreadPoolExecutor(1 + OVERLOAD_PENDING) as pool:  # one seat, two waiting: version 3 is full
        admitted = [pool.submit(grpc_stream, faulty.grpc, "Story 0:", long, version="3")]
        assert wait_for(lambda: metric_value(faulty, "tritium_num_requests_running") >= 1, 30)
        admitted += [pool.submit(grpc_stream, faulty.grpc, f"Story {i}:", long, version="3")
                     for i in range(1, 1 + OVERLOAD_PENDING)]
        assert wait_for(lambda: metric_value(faulty, "tritium_num_requests_waiting") >= OVERLOAD_PENDING, 30)
        latencies, statuses, errors = [], set(), set()
        for i in range(20):
            started = time.monotonic()
            resp = http_generate(faulty.http, {"text_input": f"One more {i}", "max_tokens": 4}, version="3")
            latencies.append(time.monotonic() - started)
            statuses.add(resp.status_code)
            errors.add(re.sub(r"req-\d+", "req-N", resp.json()["error"]))
        refused_grpc = grpc_stream(faulty.grpc, "And one over gRPC", {"max_tokens": 4}, version="3")
        results = [f.result(300) for f in admitted]
    assert statuses == {400}  # Triton's HTTP generate answers every model error with 400; gRPC keeps the code
    assert errors == {"overloaded: 2 requests are already waiting (max_pending_requests 2); retry later "
                      "(request id req-N)"}
    # A gRPC stream carries an error's message only (no status code): the "overloaded:" prefix is the signal.
    assert len(refused_grpc.errors) == 1 and refused_grpc.errors[0].startswith("overloaded: ")
    print(f"refusal latency over HTTP: p50 {np.percentile(latencies, 50) * 1000:.1f} ms, "
          f"p99 {np.percentile(latencies, 99) * 1000:.1f} ms")
    assert max(latencies) < 1.0  # answered at once, not after a seat freed (each admitted request takes seconds)
    for r in results:  # the admitted ones were not disturbed
        assert not r.errors and r.finals == 1
    assert wait_for(lambda: metric_value(faulty, "tritium_num_requests_refused_total") >= refused_before + 21, 10)
    assert wait_until_idle(faulty)
