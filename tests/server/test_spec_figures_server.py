"""A request's speculative figures through every door of one real tritonserver whose `tritium` and `tritium_ids`
run the default model with n-gram speculation: the text model's and the ids model's final responses carry
`spec_num_drafts`, `spec_num_draft_tokens`, `spec_num_accepted_tokens` and `spec_mean_acceptance_length` (output
tensors; response parameters too where the python backend has them), a request that never verified a draft
carries none, the ensemble drops them, and the OpenAI endpoint puts them in `usage.speculative_decoding` (plain
and streamed) and serves vLLM's `vllm:spec_decode_*_total` counters equal to the requests' sums."""

from __future__ import annotations

import queue
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from tritium.backend.tokenizer import Tokenizer
from tritium.client.cluster.replica_load import parse_samples
from tritium.client.triton.repository import copy_with_settings

from support.serving import Served, http_generate, start_openai_with, start_serve, text_inputs, wait_until_idle

pytestmark = pytest.mark.slow
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
TEXT = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
PROMPT = f"Repeat the following text exactly.\nText: {TEXT}\nRepeated text: "
MAX_TOKENS = 32
COUNTS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
FIGURES = (*COUNTS, "spec_mean_acceptance_length")
METRICS = {"num_drafts": "tritium_spec_decode_num_drafts_total",
           "num_draft_tokens": "tritium_spec_decode_num_draft_tokens_total",
           "num_accepted_tokens": "tritium_spec_decode_num_accepted_tokens_total"}


@dataclass
class SpecServer:
    served: Served
    openai: str  # the endpoint's /v1 URL


@pytest.fixture(scope="module")
def spec(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpecServer]:
    settings = {"kv_cache_bytes": 32 << 20, "max_model_len": 512, "speculative_config": NGRAM}
    repo = copy_with_settings(tmp_path_factory.mktemp("spec-server") / "repo",
                              {"tritium": settings, "tritium_ids": settings})
    served = start_serve(f"--model-repository={repo}")
    try:
        proc, base = start_openai_with([served.grpc], f"--upstream-metrics={served.metrics}")
    except Exception:
        served.stop()
        raise
    try:
        yield SpecServer(served, base)
    finally:
        proc.terminate()
        proc.wait(30)
        served.stop()
    assert not served.leftovers()


def check(figures: dict[str, Any]) -> None:
    """Figures of a request that repeated text under prompt lookup: drafts verified, some accepted, the mean
    as vLLM defines it."""
    drafts, drafted, accepted = (int(figures[name]) for name in COUNTS)
    assert drafts >= 1 and drafts <= drafted <= 4 * drafts and 0 < accepted <= drafted
    assert figures["spec_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts, rel=1e-6)


def grpc_final(url: str, prompt: str, sampling: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stream one request to `tritium`; the final response's outputs (scalars) and its parameters."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("tritium", text_inputs(prompt, True, sampling), enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                outputs = {o.name: result.as_numpy(o.name).reshape(-1)[0] for o in response.outputs}
                return outputs, dict(response.parameters)
            assert not set(FIGURES) & {o.name for o in response.outputs}  # only the final response has them
    finally:
        client.stop_stream()
        client.close()


def test_text_model_final_response_carries_the_figures(spec: SpecServer) -> None:
    sampling = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    outputs, parameters = grpc_final(spec.served.grpc, PROMPT, sampling)
    check(outputs)
    assert outputs["spec_num_drafts"].dtype == np.uint32
    if "spec_num_drafts" in parameters:  # a python backend with response parameters (25.02+); 2.51 has none
        assert {n: parameters[n].int64_param for n in COUNTS} == {n: int(outputs[n]) for n in COUNTS}
        assert float(parameters["spec_mean_acceptance_length"].string_param) == pytest.approx(
            float(outputs["spec_mean_acceptance_length"]), rel=1e-5)
    # a request that cannot draft (one token: nothing to verify) carries none of them
    outputs, parameters = grpc_final(spec.served.grpc, PROMPT, sampling | {"max_tokens": 1})
    assert not set(FIGURES) & (set(outputs) | set(parameters))


def test_ids_model_carries_them_and_the_ensemble_drops_them(spec: SpecServer,
                                                            default_model_path: Path) -> None:
    ids = Tokenizer(default_model_path).encode(PROMPT)
    body = {"input_ids": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = http_generate(spec.served.http, body, model="tritium_ids")
    assert response.status_code == 200, response.text
    check(response.json())
    ensemble = http_generate(spec.served.http, {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
                             model="tritium_ensemble")
    assert ensemble.status_code == 200, ensemble.text
    assert ensemble.json()["text_output"] and not set(FIGURES) & set(ensemble.json())


def engine_counters(served: Served) -> dict[str, float]:
    page = urllib.request.urlopen(served.metrics, timeout=5).read().decode()
    wanted = {metric: key for key, metric in METRICS.items()}
    return {wanted[name]: value for name, labels, value in parse_samples(page)
            if name in wanted and labels.get("model") == "tritium"}


def endpoint_counters(base: str) -> dict[str, float]:
    page = urllib.request.urlopen(base.removesuffix("/v1") + "/metrics", timeout=5).read().decode()
    return {key: value for name, _, value in parse_samples(page) for key in METRICS
            if name == f"vllm:spec_decode_{key}_total"}


def test_openai_usage_and_metrics(spec: SpecServer) -> None:
    assert wait_until_idle(spec.served)
    before = engine_counters(spec.served)
    client = openai.OpenAI(base_url=spec.openai, api_key="unused", max_retries=0)
    extra = {"ignore_eos": True}
    plain = client.completions.create(model="tritium", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=extra)
    streamed = list(client.completions.create(model="tritium", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body=extra))
    chat = list(client.chat.completions.create(
        model="tritium", messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra))
    one = client.completions.create(model="tritium", prompt=PROMPT, max_tokens=1, temperature=0)
    assert one.usage is not None and "speculative_decoding" not in (one.usage.model_extra or {})
    usages = []
    for usage in (plain.usage, streamed[-1].usage, chat[-1].usage):
        assert usage is not None and usage.completion_tokens == MAX_TOKENS
        figures = (usage.model_extra or {})["speculative_decoding"]
        assert set(figures) == {*METRICS, "mean_acceptance_length"}
        check({"spec_" + k: v for k, v in figures.items()})
        usages.append(figures)
    assert all(chunk.usage is None for chunk in streamed[:-1])
    # the counters moved by exactly what the requests report (every request ran to its end)
    assert wait_until_idle(spec.served)
    after = engine_counters(spec.served)
    assert {k: after[k] - before[k] for k in METRICS} == {k: sum(u[k] for u in usages) for k in METRICS}
    assert endpoint_counters(spec.openai) == after
