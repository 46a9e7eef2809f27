"""LoRA adapters through `tritium openai` (the official `openai` client) in front of a real tritonserver started
with `tritium serve --lora`: /v1/models, `model: "<adapter>"` against the in-process engine, vLLM's runtime
load/unload routes behind the admin key, and `vllm:lora_requests_info` on the endpoint's /metrics."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests

from tritium.backend import LLM, SamplingParams
from tritium.backend.model_config import ModelConfig

from support.lora import write_adapter
from support.serving import API_KEY as KEY
from support.serving import Served, start_openai_with, start_serve, wait_for

pytestmark = pytest.mark.slow
ADMIN = "sk-tritium-admin-test"
PROMPT = "Once upon a time, in a small village,"
TOKENS = 12
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {"sql": (8, ALL, 1), "poem": (4, ("q_proj", "v_proj", "down_proj"), 2)}  # name -> rank, targets, seed


@pytest.fixture(scope="module")
def adapters(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("openai-lora")
    cfg = ModelConfig.from_folder(default_model_path)
    return {name: write_adapter(root / name, cfg, rank, targets, seed, std=0.05)
            for name, (rank, targets, seed) in ADAPTERS.items()}


@pytest.fixture(scope="module")
def reference(default_model_path: Path, adapters: dict[str, Path]) -> dict[str | None, str]:
    """The greedy text of PROMPT per adapter (None: the base model) from the in-process engine (a small KV cache,
    dropped once the texts are made: the served engine needs the memory)."""
    llm = LLM(str(default_model_path), enable_lora=True, lora_modules={k: str(v) for k, v in adapters.items()},
              kv_cache_bytes=16 << 20, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    texts = {name: llm.generate([PROMPT], params, lora_name=name)[0].text for name in [None, *adapters]}
    del llm
    gc.collect()
    return texts


@pytest.fixture(scope="module")
def triton(adapters: dict[str, Path], reference: dict[str | None, str]) -> Iterator[Served]:
    served = start_serve("--model-control=explicit", "--load-model=tritium", f"--lora=sql={adapters['sql']}",
                         f"--api-key={KEY}", f"--admin-key={ADMIN}")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def base(triton: Served) -> Iterator[str]:
    proc, url = start_openai_with([triton.grpc], f"--upstream-metrics={triton.metrics}", f"--admin-key={ADMIN}",
                                  api_key=KEY)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)


def admin_post(base: str, route: str, body: dict[str, str], key: str | None = ADMIN) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return requests.post(f"{base}/{route}", json=body, headers=headers, timeout=120)


def greedy(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def test_models_lists_the_adapters_with_the_base_as_parent(client: openai.OpenAI, adapters: dict[str, Path]) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tritium", "sql"}
    assert models["sql"].parent == "tritium" and models["sql"].root == str(adapters["sql"].resolve())
    assert models["tritium"].parent is None


def test_an_adapter_gives_the_in_process_engines_greedy_text(client: openai.OpenAI,
                                                             reference: dict[str | None, str]) -> None:
    assert reference["sql"] != reference[None]
    assert greedy(client, "sql") == reference["sql"]
    assert greedy(client, "tritium") == reference[None]
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference["sql"]
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "sql" and chat.usage.completion_tokens > 0
    with pytest.raises(openai.NotFoundError) as info:
        greedy(client, "nope")
    assert info.value.code == "model_not_found"


def test_runtime_load_then_serve_then_unload(client: openai.OpenAI, base: str, adapters: dict[str, Path],
                                             reference: dict[str | None, str]) -> None:
    root = base.removesuffix("/v1")
    body = {"lora_name": "poem", "lora_path": str(adapters["poem"])}
    loaded = admin_post(root, "v1/load_lora_adapter", body)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'poem' added successfully."
    assert {m.id for m in client.models.list().data} == {"tritium", "sql", "poem"}
    assert greedy(client, "poem") == reference["poem"]
    again = admin_post(root, "v1/load_lora_adapter", body)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = admin_post(root, "v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(adapters["poem"].parent)})
    assert bad.status_code == 400 and "Traceback" not in bad.text and "127.0.0.1" not in bad.text
    assert "bad" not in {m.id for m in client.models.list().data}
    gone = admin_post(root, "v1/unload_lora_adapter", {"lora_name": "poem"})
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'poem' removed successfully."
    with pytest.raises(openai.NotFoundError):
        greedy(client, "poem")
    assert admin_post(root, "v1/unload_lora_adapter", {"lora_name": "poem"}).status_code == 404


def test_the_runtime_routes_refuse_a_missing_or_wrong_key_and_the_api_key(base: str) -> None:
    root = base.removesuffix("/v1")
    for key in (None, "wrong", KEY):
        r = admin_post(root, "v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}, key)
        assert r.status_code == 401, (key, r.text)
        assert admin_post(root, "v1/unload_lora_adapter", {"lora_name": "sql"}, key).status_code == 401
    assert "sql" in requests.get(f"{base}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text


def test_lora_requests_info_shows_max_lora_and_the_running_adapter(client: openai.OpenAI, base: str) -> None:
    metrics = base.removesuffix("/v1") + "/metrics"
    done = threading.Event()

    def long_request() -> None:
        try:
            for _ in client.completions.create(model="sql", prompt=PROMPT, max_tokens=200, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
                pass
        finally:
            done.set()

    def info() -> str:
        text = requests.get(metrics, timeout=10).text
        return next(line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{"))

    threading.Thread(target=long_request, daemon=True).start()
    seen = wait_for(lambda: 'running_lora_adapters="sql"' in info() or done.is_set(), 120, 0.2)
    line = info()
    assert seen and not done.is_set(), "the adapter never showed as running"
    assert 'max_lora="4"' in line and 'running_lora_adapters="sql"' in line, line
    assert done.wait(300)

    def counted() -> bool:  # the upstream's per-adapter counter, passed through
        lines = requests.get(metrics, timeout=10).text.splitlines()
        return any(line.startswith("tritium_lora_requests_total{") and 'lora_name="sql"' in line
                   and float(line.rsplit(" ", 1)[1]) >= 1 for line in lines)

    assert wait_for(counted, 10)
