"""End-to-end: a repeated prompt's cached tokens are the engine's prefix-cache hit, through both doors: the
`num_cached_tokens` output of `tritium` and `tritium_ids` (tritonclient against a real tritonserver) and
`usage.prompt_tokens_details.cached_tokens` of the OpenAI endpoint (the official `openai` client)."""

from __future__ import annotations

import json
import queue
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from tritium.backend import LLM, SamplingParams
from tritium.backend.tokenizer import Tokenizer
from tritium.client.triton.launcher import PACKAGE_REPOSITORY

from support.serving import Served, grpc_stream, openai_client

pytestmark = pytest.mark.slow
# Long enough for several KV blocks; each test puts a marker of its own in front, so no other request's blocks
# are hit.
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had "
        "taught him, and lit the great lamp that warned the fishing boats away from the rocks below. ")


def block_size(model: str) -> int:
    settings = json.loads((PACKAGE_REPOSITORY / model / "1" / "model.json").read_text())
    return int(settings.get("block_size", 16))


def expected_hit(num_prompt_tokens: int, block: int) -> int:
    """The block manager's rule (match_prefix): every full block of the prompt but one token is served from the
    cache, so the last token is always computed: a prompt of exactly k blocks gets k - 1 of them."""
    return (num_prompt_tokens - 1) // block * block


def fresh_prompt() -> str:
    return f"[{uuid.uuid4().hex}] " + TEXT * 2


@pytest.fixture(scope="module")
def tok(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


def test_in_process_engine_follows_the_rule(make_llm: Any) -> None:
    """The expectation the servers are held to is what LLM(...).generate reports for the same prompt twice."""
    llm: LLM = make_llm(None, kv_cache_bytes=64 << 20, max_model_len=1024)
    prompt = fresh_prompt()
    params = SamplingParams(temperature=0, max_tokens=2)
    first, second = (llm.generate(prompt, params)[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == expected_hit(second.num_input_tokens, llm.engine.config.block_size) > 0


def _final(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    assert outputs, "no response"
    return outputs[-1]


def test_text_model_reports_the_prefix_hit(server: Served) -> None:
    prompt = fresh_prompt()
    hits = []
    for _ in range(2):
        result = grpc_stream(server.grpc, prompt, {"max_tokens": 3, "temperature": 0}, return_num_cached_tokens=True,
                             return_num_input_tokens=True)
        assert not result.errors and result.finals == 1, result.errors
        final = _final(result.outputs)
        assert all("num_cached_tokens" not in o for o in result.outputs[:-1])  # on the final response only
        hits.append((int(final["num_input_tokens"][0]), int(final["num_cached_tokens"][0])))
    (n, first), (n_again, second) = hits
    assert n == n_again and first == 0
    assert second == expected_hit(n, block_size("tritium")) > 0
    plain = grpc_stream(server.grpc, prompt, {"max_tokens": 2, "temperature": 0})
    assert not plain.errors and "num_cached_tokens" not in _final(plain.outputs)  # only when asked


def ids_final_response(url: str, inputs: list[Any]) -> dict[str, Any]:
    """The outputs of tritium_ids' final response to one request over a gRPC stream."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model_name="tritium_ids", inputs=inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                return {o.name: result.as_numpy(o.name) for o in response.outputs}
    finally:
        client.stop_stream()
        client.close()


def test_ids_model_reports_the_prefix_hit(server: Served, tok: Tokenizer) -> None:
    from tritonclient.grpc import InferInput

    ids = tok.encode(fresh_prompt())

    def inputs() -> list[Any]:
        values = {"input_ids": np.array(ids, dtype=np.int32), "max_tokens": np.array([2], dtype=np.int32),
                  "stream": np.array([False]), "return_num_cached_tokens": np.array([True])}
        out = []
        for name, array in values.items():
            tensor = InferInput(name, list(array.shape), "BOOL" if array.dtype == bool else "INT32")
            tensor.set_data_from_numpy(array)
            out.append(tensor)
        return out

    hits = []
    for _ in range(2):
        final = ids_final_response(server.grpc, inputs())
        assert final["output_ids"].size >= 1
        hits.append(int(final["num_cached_tokens"][0]))
    assert hits == [0, expected_hit(len(ids), block_size("tritium_ids"))] and hits[1] > 0


@pytest.fixture(scope="module")
def client(server: Served) -> Iterator[openai.OpenAI]:
    with openai_client([server.grpc]) as endpoint:
        yield endpoint


def test_openai_usage_reports_the_prefix_hit(client: openai.OpenAI) -> None:
    block = block_size("tritium")
    prompt = fresh_prompt()
    first = client.completions.create(model="tritium", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tritium", prompt=prompt, max_tokens=2, temperature=0)
    for reply in (first, second):
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert second.usage.prompt_tokens_details.cached_tokens == expected_hit(  # type: ignore[union-attr]
        second.usage.prompt_tokens, block) > 0  # type: ignore[union-attr]

    messages = [{"role": "user", "content": fresh_prompt()}]
    chat = [client.chat.completions.create(model="tritium", messages=messages, max_tokens=2,  # type: ignore[arg-type]
                                           temperature=0) for _ in range(2)]
    usages = [c.usage for c in chat]
    assert all(u is not None and u.prompt_tokens_details is not None for u in usages)
    # the chat template's system turn is the same for every chat on this shared server: its full blocks may be
    # cached before the first call; the repeat hits the whole prompt
    hit = expected_hit(usages[1].prompt_tokens, block)  # type: ignore[union-attr]
    assert usages[0].prompt_tokens_details.cached_tokens < hit  # type: ignore[union-attr]
    assert usages[1].prompt_tokens_details.cached_tokens == hit > 0  # type: ignore[union-attr]
    streamed = list(client.chat.completions.create(
        model="tritium", messages=messages, max_tokens=2, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}))
    usage = streamed[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == hit
