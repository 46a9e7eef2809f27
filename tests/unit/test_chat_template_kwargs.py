"""`chat_template_kwargs`: extra variables of the chat template (`enable_thinking`), through backend/tokenizer.py,
the endpoint's `/tokenize` and chat routes, and refused by name when the template cannot take them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tritium.backend.tokenizer import ChatTemplateKwargsError, Tokenizer, check_chat_template_kwargs
from tritium.client.cluster.upstream import Chunk
from tritium.client.openai.app import create_app

from support.chat_templates import NO_THINKING, TEMPLATE_SECRET, tokenizer_folder_with_template

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
TURN = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Tokenizer:
    return Tokenizer(tokenizer_folder_with_template(tmp_path_factory.mktemp("thinking"), default_model_path))


class CannedUpstream:
    """Stands in for the router: records each prompt and answers "4"."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    async def generate(self, prompt: str, sampling: dict[str, Any], want_logprobs: bool = False
                       ) -> AsyncIterator[Chunk]:
        self.prompts.append(prompt)
        yield Chunk("4", True, "stop", 9, 1, num_cached_tokens=0)


@pytest.fixture(scope="module")
def endpoint(tok: Tokenizer) -> Iterator[tuple[TestClient, CannedUpstream]]:
    app = create_app(["127.0.0.1:1"], tokenizer=tok)
    upstream = CannedUpstream()
    app.state.router.generate = upstream.generate
    with TestClient(app) as http:
        yield http, upstream


# --- backend/tokenizer.py ------------------------------------------------------------------------------------


def test_the_template_renders_with_and_without_thinking(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(MESSAGES) == TURN
    assert tok.apply_chat_template(MESSAGES, chat_template_kwargs={"enable_thinking": True}) == TURN
    assert tok.apply_chat_template(MESSAGES, chat_template_kwargs={"enable_thinking": False}) == TURN + NO_THINKING
    assert tok.user_turn("What is 2+2?", {"enable_thinking": False}) == TURN + NO_THINKING
    assert tok.apply_chat_template(MESSAGES, chat_template_kwargs={}) == TURN
    # without add_generation_prompt there is no assistant turn to open
    assert tok.apply_chat_template(MESSAGES, False, chat_template_kwargs={"enable_thinking": False}) == TURN[
        :-len("<|im_start|>assistant\n")]


@pytest.mark.parametrize("name", ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                  "raise_exception", "strftime_now", "namespace", "range"])
def test_names_the_renderer_passes_are_refused_by_name(tok: Tokenizer, name: str) -> None:
    with pytest.raises(ChatTemplateKwargsError, match=f"chat_template_kwargs: '{name}' may not be set"):
        tok.apply_chat_template(MESSAGES, chat_template_kwargs={name: 1, "enable_thinking": False})


def test_only_an_object_of_json_values_is_taken() -> None:
    assert check_chat_template_kwargs({"a": [1, {"b": None}], "c": "x", "d": 1.5}) == {"a": [1, {"b": None}],
                                                                                       "c": "x", "d": 1.5}
    with pytest.raises(ChatTemplateKwargsError, match="chat_template_kwargs must be a JSON object, got list"):
        check_chat_template_kwargs([1])
    with pytest.raises(ChatTemplateKwargsError, match="chat_template_kwargs: 'f' must hold JSON values"):
        check_chat_template_kwargs({"f": object()})


@pytest.mark.parametrize("kwargs", [{"enable_thinking": "no"}, {"thinking_budget": "many"}])
def test_a_template_failing_on_the_kwargs_names_them_and_not_its_own_words(tok: Tokenizer,
                                                                         kwargs: dict[str, Any]) -> None:
    with pytest.raises(ChatTemplateKwargsError) as err:
        tok.apply_chat_template(MESSAGES, chat_template_kwargs=kwargs)
    assert str(err.value).startswith("chat_template_kwargs:") and TEMPLATE_SECRET not in str(err.value)
    assert "many" not in str(err.value)


def test_a_template_failing_on_the_messages_still_blames_the_messages(tok: Tokenizer) -> None:
    bad = [{"role": "user", "content": None}]  # None + str inside the template
    with pytest.raises(Exception) as err:
        tok.apply_chat_template(bad, chat_template_kwargs={"enable_thinking": False})
    assert not isinstance(err.value, ChatTemplateKwargsError)


# --- the endpoint ---------------------------------------------------------------------------------------------


def _tokenize(http: TestClient, **extra: Any) -> Any:
    return http.post("/tokenize", json={"messages": MESSAGES} | extra)


def test_tokenize_renders_the_chat_both_ways(endpoint: tuple[TestClient, CannedUpstream], tok: Tokenizer) -> None:
    http, _ = endpoint
    plain = _tokenize(http)
    thinking = _tokenize(http, chat_template_kwargs={"enable_thinking": True})
    off = _tokenize(http, chat_template_kwargs={"enable_thinking": False})
    assert plain.status_code == thinking.status_code == off.status_code == 200, off.text
    assert plain.json()["tokens"] == thinking.json()["tokens"] == tok.encode(TURN, add_special_tokens=False)
    assert off.json()["tokens"] == tok.encode(TURN + NO_THINKING, add_special_tokens=False)
    assert off.json()["count"] > plain.json()["count"]


def _refusal(response: Any) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs", error
    assert TEMPLATE_SECRET not in error["message"] and "many" not in error["message"]
    return str(error["message"])


@pytest.mark.parametrize("kwargs,says", [
    ({"messages": []}, "'messages' may not be set"),
    ({"add_generation_prompt": False}, "'add_generation_prompt' may not be set"),
    ({"tools": []}, "'tools' may not be set"),
    ({"enable_thinking": "no"}, "cannot be rendered with these values"),
    ({"thinking_budget": "many"}, "cannot be rendered with these values"),
])
def test_the_endpoint_refuses_what_the_template_cannot_take_by_name(
        endpoint: tuple[TestClient, CannedUpstream], kwargs: dict[str, Any], says: str) -> None:
    http, upstream = endpoint
    sent = len(upstream.prompts)
    assert says in _refusal(_tokenize(http, chat_template_kwargs=kwargs))
    chat = {"model": "tritium", "messages": MESSAGES, "chat_template_kwargs": kwargs}
    assert says in _refusal(http.post("/v1/chat/completions", json=chat))
    assert says in _refusal(http.post("/v1/chat/completions/render", json=chat))
    assert len(upstream.prompts) == sent  # nothing went upstream


def test_chat_template_kwargs_must_be_an_object(endpoint: tuple[TestClient, CannedUpstream]) -> None:
    http, _ = endpoint
    for body in ({"model": "tritium", "messages": MESSAGES, "chat_template_kwargs": [1]},):
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and "chat_template_kwargs" in response.text
    assert _tokenize(http, chat_template_kwargs="x").status_code == 400


def test_chat_completions_send_the_rendered_prompt(endpoint: tuple[TestClient, CannedUpstream]) -> None:
    http, upstream = endpoint
    for kwargs, prompt in (({"enable_thinking": False}, TURN + NO_THINKING), (None, TURN)):
        body = {"model": "tritium", "messages": MESSAGES} | ({"chat_template_kwargs": kwargs} if kwargs else {})
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert upstream.prompts[-1] == prompt
    render = http.post("/v1/chat/completions/render", json={"model": "tritium", "messages": MESSAGES,
                                                            "chat_template_kwargs": {"enable_thinking": False}})
    assert render.status_code == 200 and render.json()["token_ids"] == http.post(
        "/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
