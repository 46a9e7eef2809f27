"""tritium_embed's parsing and queue with a stand-in engine, the endpoint's input rules, and which models
`tritium serve` loads."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from tritium.backend.serving.embed_model import EmbedJob, EmbedQueue, parse_embed_inputs
from tritium.backend.serving.jobs import ErrorKind
from tritium.client.openai.embeddings import EmbeddingRequest, embedding_inputs, encode_vector
from tritium.client.triton.launcher import startup_models
from tritium.client.triton.repository import PACKAGE_REPOSITORY


class FakeEngine:
    class tokenizer:
        @staticmethod
        def encode(text: str) -> list[int]:
            return [len(w) for w in text.split()]

    def __init__(self, fail_together: bool = False) -> None:
        self.fail_together = fail_together
        self.calls: list[int] = []

    def check_embedding_input(self, ids: list[int], name: str) -> None:
        if any(t >= 100 for t in ids):
            raise ValueError(f"{name}: token ids must be in [0, 100)")

    def embed(self, prompts: list[list[int]]) -> torch.Tensor:
        self.calls.append(len(prompts))
        if self.fail_together and len(prompts) > 1:
            raise RuntimeError("boom")
        if any(p == [13] for p in prompts):
            raise RuntimeError("this one fails alone")
        return torch.tensor([[float(sum(p)), float(len(p))] for p in prompts])


def _job(replies: dict[str, Any], name: str, text: str | None = None, ids: list[int] | None = None) -> EmbedJob:
    def reply(vector: Any, tokens: int, error: str | None, kind: ErrorKind) -> None:
        replies[name] = (None if vector is None else list(vector), tokens, error, kind)

    return EmbedJob(name, text, ids, reply)


def test_no_request_fails_another() -> None:
    engine, replies = FakeEngine(), {}
    queue = EmbedQueue(engine, 8)  # type: ignore[arg-type]
    queue.run_batch([_job(replies, "a", text="ab cde"), _job(replies, "b", ids=[1, 200]), _job(replies, "c", ids=[7])])
    assert engine.calls == [2]  # the valid ones together
    assert replies["a"][:3] == ([5.0, 2.0], 2, None)
    assert replies["c"][:3] == ([7.0, 1.0], 1, None)
    assert replies["b"][2].startswith("invalid request: input_ids: token ids must be in") and \
        replies["b"][3] is ErrorKind.INVALID
    engine, replies = FakeEngine(fail_together=True), {}
    EmbedQueue(engine, 8).run_batch([_job(replies, "x", ids=[1]), _job(replies, "y", ids=[13])])  # type: ignore[arg-type]
    assert replies["x"][0] == [1.0, 1.0] and replies["y"][2].startswith("the embedding forward pass failed")


def test_overload_is_refused_at_once() -> None:
    replies: dict[str, Any] = {}
    queue = EmbedQueue(FakeEngine(), 1)  # type: ignore[arg-type]  # not started: jobs wait
    queue.submit(_job(replies, "a", ids=[1]))
    queue.submit(_job(replies, "b", ids=[1]))
    assert "a" not in replies and replies["b"][2].startswith("overloaded:") and replies["b"][3] is ErrorKind.OVERLOADED


def test_parse_inputs() -> None:
    assert parse_embed_inputs({"text_input": np.array([b"hi"], dtype=object), "input_ids": None}) == ("hi", None)
    assert parse_embed_inputs({"text_input": None, "input_ids": np.array([1, 2], dtype=np.int32)}) == (None, [1, 2])
    with pytest.raises(ValueError, match="exactly one of text_input and input_ids"):
        parse_embed_inputs({"text_input": None, "input_ids": None})
    with pytest.raises(ValueError, match="text_input must not be empty"):
        parse_embed_inputs({"text_input": np.array([b""], dtype=object), "input_ids": None})


def test_endpoint_inputs_and_base64() -> None:
    assert embedding_inputs("a") == ["a"]
    assert embedding_inputs([1, 2]) == [[1, 2]]
    assert embedding_inputs([[1], [2, 3]]) == [[1], [2, 3]]
    with pytest.raises(ValueError, match=r"input\[1\] must not be empty"):
        embedding_inputs(["a", ""])
    # what the fuzzer sent: ids past INT32, a lone surrogate; both refused naming the input (a 400, not a 500)
    with pytest.raises(ValueError, match=r"input\[1\]: token ids must be integers in \[0, 2147483648\)"):
        embedding_inputs([[1], [-262315, 46624]])
    with pytest.raises(ValueError, match=r"input\[0\] cannot be sent as UTF-8"):
        embedding_inputs(["\ud800"])
    with pytest.raises(ValidationError):  # booleans are not token ids
        EmbeddingRequest(input=[[False]])
    encoded = encode_vector(np.array([1.5, -2.0], dtype=np.float32), "base64")
    assert isinstance(encoded, str)
    assert np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist() == [1.5, -2.0]


def test_tritium_embed_loads_only_when_asked(tmp_path: Path) -> None:
    default = startup_models(PACKAGE_REPOSITORY, [])
    assert "tritium_embed" not in default and {"tritium", "tritium_ids"} <= set(default)
    assert "tritium_embed" in startup_models(PACKAGE_REPOSITORY, ["tritium_embed"])
