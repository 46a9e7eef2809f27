"""tritium_embed on a real tritonserver (tritonclient) and `/v1/embeddings` through the official `openai` client,
equal to the in-process vectors."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from tritium.backend import LLM
from tritium.client.cluster.embed import EMBED_MODEL, embed_inputs

from support.serving import Served, openai_client, start_serve

pytestmark = pytest.mark.slow
TEXTS = ["Hello world", "The capital of France is Paris.", "a",
         "Embeddings pool the final hidden states of a prompt into one vector."]


@pytest.fixture(scope="module")
def triton() -> Iterator[Served]:
    served = start_serve("--model-control=explicit", "--load-model=tritium", f"--load-model={EMBED_MODEL}")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(triton: Served) -> Iterator[openai.OpenAI]:
    with openai_client([triton.grpc]) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def expected(default_model_path: Path) -> dict[str, list[float]]:
    llm = LLM(str(default_model_path), device="cpu", dtype="float32", kv_cache_bytes=64 << 20, max_model_len=512)
    try:
        ids = [llm.tokenizer.encode(t) for t in TEXTS]
        vectors = llm.engine.embed(ids)
        return {t: v.tolist() for t, v in zip(TEXTS, vectors, strict=True)} | {
            "ids": llm.engine.embed([ids[1]])[0].tolist(), "ntokens": [float(len(i)) for i in ids]}
    finally:
        llm.shutdown()


def _infer(url: str, item: str | list[int]) -> tuple[np.ndarray | None, int | None, str | None]:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    try:
        result = client.infer(EMBED_MODEL, embed_inputs(item))
    except InferenceServerException as exc:
        return None, None, str(exc)
    finally:
        client.close()
    return result.as_numpy("embedding"), int(result.as_numpy("num_input_tokens")[0]), None


def test_tritonclient_batch_with_a_bad_input(triton: Served, expected: dict[str, list[float]]) -> None:
    """Requests sent together: each valid one gets its vector, the bad one its own error naming the input."""
    items: list[str | list[int]] = [*TEXTS, [0, 10**6]]
    with ThreadPoolExecutor(len(items)) as pool:
        results = list(pool.map(lambda item: _infer(triton.grpc, item), items))
    for i, text in enumerate(TEXTS):
        vector, tokens, error = results[i]
        assert error is None and vector is not None
        assert tokens == int(expected["ntokens"][i])
        np.testing.assert_allclose(vector, expected[text], rtol=1e-4, atol=1e-4)
        assert abs(float(np.linalg.norm(vector)) - 1) < 1e-4  # "last", normalised: vLLM's defaults
    assert results[-1][2] is not None and "input_ids: token ids must be in" in results[-1][2]


def test_openai_client_float_and_base64(client: openai.OpenAI, expected: dict[str, list[float]]) -> None:
    out = client.embeddings.create(model="tritium", input=TEXTS, encoding_format="float")
    assert [d.index for d in out.data] == list(range(len(TEXTS)))
    for d, text in zip(out.data, TEXTS, strict=True):
        torch.testing.assert_close(torch.tensor(d.embedding), torch.tensor(expected[text]), rtol=1e-4, atol=1e-4)
    assert out.usage.prompt_tokens == out.usage.total_tokens == int(sum(expected["ntokens"]))
    assert out.model == "tritium"
    raw = client.embeddings.with_raw_response.create(model="tritium", input=TEXTS[1], encoding_format="base64")
    encoded = raw.http_response.json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    np.testing.assert_allclose(decoded, expected[TEXTS[1]], rtol=1e-4, atol=1e-4)
    # the openai client decodes base64 itself when it asked for floats by default
    default = client.embeddings.create(model="tritium", input=TEXTS[1])
    np.testing.assert_allclose(default.data[0].embedding, expected[TEXTS[1]], rtol=1e-4, atol=1e-4)


def test_openai_token_ids_dimensions_and_refusals(client: openai.OpenAI, expected: dict[str, list[float]],
                                                 default_model_path: Path) -> None:
    from tritium.backend.tokenizer import Tokenizer

    ids = Tokenizer(default_model_path).encode(TEXTS[1])
    out = client.embeddings.create(model="tritium", input=[ids, ids], dimensions=len(expected["ids"]))
    for d in out.data:
        np.testing.assert_allclose(d.embedding, expected["ids"], rtol=1e-4, atol=1e-4)
    with pytest.raises(openai.BadRequestError, match="dimensions must be 576"):
        client.embeddings.create(model="tritium", input="hi", dimensions=64)
    with pytest.raises(openai.BadRequestError, match=r"input\[1\] must not be empty"):
        client.embeddings.create(model="tritium", input=["hi", ""])
    with pytest.raises(openai.BadRequestError, match="token ids must be in"):
        client.embeddings.create(model="tritium", input=[[1, 2, 10**7]])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")
