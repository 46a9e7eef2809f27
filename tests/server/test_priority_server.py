"""Request priority end to end on one real tritonserver: `tritium` on scheduling_policy "priority" (one seat),
`tritium_ids` (and so the ensemble) on the default "fcfs". A high-priority request from the OpenAI endpoint
overtakes a running low-priority one (sampling_parameters); the request parameter is parsed; the ids model and
the ensemble pass their `priority` input to an engine that refuses it by name."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from tritium.client.triton.repository import copy_with_settings

from support.serving import Served, http_generate, start_openai, start_serve

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox jumps over the lazy dog while"


@dataclass
class PriorityServer:
    served: Served
    openai: str


@pytest.fixture(scope="module")
def prio(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PriorityServer]:
    root = tmp_path_factory.mktemp("priority-server")
    common = {"model": str(tiny_llama_path), "kv_cache_bytes": 32 << 20}
    repo = copy_with_settings(root / "repo", {
        "tritium": common | {"scheduling_policy": "priority", "max_num_seqs": 1},
        "tritium_ids": common,
        "preprocessing": {"model": str(tiny_llama_path)}, "postprocessing": {"model": str(tiny_llama_path)}})
    served = start_serve(f"--model-repository={repo}")
    proc, base = start_openai([served.grpc], tokenizer=str(tiny_llama_path))
    try:
        yield PriorityServer(served, base)
    finally:
        proc.terminate()
        proc.wait(30)
        served.stop()
    assert not served.leftovers()


def generate(prio: PriorityServer, body: dict[str, Any], model: str = "tritium") -> tuple[float, requests.Response]:
    """The response and the time it came back."""
    response = http_generate(prio.served.http, body, model=model)
    return time.monotonic(), response


def body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"text_input": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, **extra}


def test_high_priority_overtakes_the_running_request(prio: PriorityServer) -> None:
    # Preemption needs both priorities to arrive: priority 2 through sampling_parameters for the long request,
    # priority 1 through the OpenAI endpoint for the short one. Had either been dropped (0), the short one
    # would wait for the long one's 600 tokens.
    def openai_high() -> tuple[float, requests.Response]:
        request = {"model": "tritium", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "priority": 1}
        response = requests.post(f"{prio.openai}/completions", json=request, timeout=300)
        return time.monotonic(), response

    with ThreadPoolExecutor(2) as pool:
        long_low = pool.submit(generate, prio, body(600, sampling_parameters=json.dumps({"priority": 2})))
        time.sleep(1.0)  # it holds the only seat
        high = pool.submit(openai_high)
        (low_done, low_response), (high_done, high_response) = long_low.result(), high.result()
    assert low_response.status_code == 200, low_response.text
    assert high_response.status_code == 200, high_response.text
    assert high_done < low_done


def test_bad_priorities_are_refused_by_name(prio: PriorityServer) -> None:
    _, response = generate(prio, body(4, sampling_parameters=json.dumps({"priority": "high"})))
    assert response.status_code == 400 and "priority must be an integer" in response.text
    _, response = generate(prio, body(4, priority=2**31))
    assert response.status_code == 400 and "priority must be <= 2147483647" in response.text
    for model, request in (("tritium_ensemble", {"text_input": PROMPT, "max_tokens": 4, "priority": 3}),
                           ("tritium_ids", {"input_ids": [1, 2, 3], "max_tokens": 4, "priority": 3})):
        _, response = generate(prio, request, model=model)
        assert response.status_code == 400, (model, response.text)
        assert "priority must be 0 (got 3)" in response.text and "scheduling_policy" in response.text
        _, response = generate(prio, request | {"priority": 0}, model=model)
        assert response.status_code == 200, (model, response.text)


def test_openai_endpoint_sends_priority_upstream(prio: PriorityServer) -> None:
    url = f"{prio.openai}/completions"
    request = {"model": "tritium", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    assert requests.post(url, json=request | {"priority": 5}, timeout=120).status_code == 200
    response = requests.post(url, json=request | {"priority": 2**31}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
    chat = {"model": "tritium", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "priority": -3}
    assert requests.post(f"{prio.openai}/chat/completions", json=chat, timeout=120).status_code == 200
