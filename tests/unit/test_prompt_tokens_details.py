"""`usage.prompt_tokens_details.cached_tokens`: the engine's prefix-cache hit (the final chunk's
`num_cached_tokens`), counted once per prompt as `prompt_tokens` is, always present, streamed or not."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from tritium.backend.tokenizer import Tokenizer
from tritium.client.cluster.upstream import Chunk
from tritium.client.openai.app import create_app

# prompt -> (prompt tokens, cached tokens) the canned engine reports
PROMPTS = {"alpha": (40, 32), "beta": (20, 0)}


class CannedUpstream:
    """Answers each prompt with two chunks, the counts on the last; the cached count differs per sample (a
    later sample may hit what an earlier one cached), so that summing every choice would show."""

    def __init__(self) -> None:
        self.samples: dict[str, int] = {}

    async def generate(self, prompt: str, sampling: dict[str, Any], want_logprobs: bool = False
                       ) -> AsyncIterator[Chunk]:
        key = next((k for k in PROMPTS if k in prompt), "beta")
        sample = self.samples.get(key, 0)
        self.samples[key] = sample + 1
        tokens, cached = PROMPTS[key]
        yield Chunk("Hel", False)
        later = tokens - 1 if cached else 0  # what a later sample of a prompt with a cached head finds
        yield Chunk("lo", True, "length", tokens, 2, num_cached_tokens=cached if sample == 0 else later)


@pytest.fixture
def client(default_model_path: Path) -> Iterator[openai.OpenAI]:
    app = create_app(["127.0.0.1:1"], tokenizer=Tokenizer(default_model_path))
    app.state.router.generate = CannedUpstream().generate
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


def _stream_usage(client: openai.OpenAI, route: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = client._client.post(f"{client.base_url}{route}", json=body | {  # type: ignore[attr-defined]
        "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status_code == 200, resp.text
    events = [json.loads(e.removeprefix("data: ")) for e in resp.text.split("\n\n") if e and e != "data: [DONE]"]
    assert events[-1]["choices"] == []
    assert all("usage" not in e for e in events[:-1])
    return dict(events[-1]["usage"])


def test_chat_usage_reports_the_cached_prompt_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "alpha"}]
    whole = client.chat.completions.create(model="tritium", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert whole.usage is not None and whole.usage.prompt_tokens == 40
    assert whole.usage.prompt_tokens_details is not None and whole.usage.prompt_tokens_details.cached_tokens == 32
    usage = _stream_usage(client, "chat/completions", {"model": "tritium", "messages": messages, "max_tokens": 2})
    assert usage["prompt_tokens_details"] == {"cached_tokens": 39}  # the canned engine's second sample
    assert usage["prompt_tokens"] == 40


def test_completions_count_cached_tokens_once_per_prompt_and_report_zero(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tritium", prompt=["alpha", "beta"], max_tokens=2, n=2)
    assert whole.usage is not None and whole.usage.prompt_tokens == 60 and whole.usage.completion_tokens == 8
    # sample 0 of each prompt counts, as for prompt_tokens: 32 + 0
    assert whole.usage.prompt_tokens_details is not None and whole.usage.prompt_tokens_details.cached_tokens == 32
    none_cached = client.completions.create(model="tritium", prompt="beta", max_tokens=2)
    assert none_cached.usage is not None and none_cached.usage.prompt_tokens_details is not None
    assert none_cached.usage.prompt_tokens_details.cached_tokens == 0  # present, 0: as OpenAI reports it
    usage = _stream_usage(client, "completions", {"model": "tritium", "prompt": "alpha", "max_tokens": 2})
    assert usage["prompt_tokens_details"] == {"cached_tokens": 39}
