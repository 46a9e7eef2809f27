"""LoRA through Triton's doors, end to end on one real tritonserver: adapters from multi_lora.json and
model.json, `lora_name` on the text model (sampling_parameters and request parameter), the ids model and the
ensemble (input and forwarded request parameter), refusals by name, runtime load/unload/list with the admin key,
and the LoRA metrics."""

from __future__ import annotations

import json
import queue
import re
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from tritium.backend import LLM, SamplingParams
from tritium.backend.model_config import ModelConfig
from tritium.client.triton.repository import copy_with_settings, write_multi_lora

from support.lora import write_adapter
from support.serving import Served, grpc_stream, http_generate, start_serve, wait_for

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox jumps over the lazy dog while"
MAX_TOKENS = 8
TEXT_KEY = "text-model-key"  # tritium's model.json admin_key
ENV_KEY = "env-admin-key"  # $TRITIUM_ADMIN_KEY of the server: tritium_ids has no admin_key of its own
ADAPTERS = {"sql": (8, ("q_proj", "v_proj", "o_proj"), 1), "chat": (16, ("gate_proj", "up_proj", "down_proj"), 2),
            "extra": (4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 3)}


@dataclass
class LoraServer:
    served: Served
    adapters: dict[str, Path]
    local: LLM


@pytest.fixture(scope="module")
def lora(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraServer]:
    root = tmp_path_factory.mktemp("lora-server")
    cfg = ModelConfig.from_folder(tiny_llama_path)
    adapters = {name: write_adapter(root / "adapters" / name, cfg, rank, targets, seed, std=0.3)
                for name, (rank, targets, seed) in ADAPTERS.items()}
    common = {"model": str(tiny_llama_path), "kv_cache_bytes": 32 << 20}
    engine = common | {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    repo = copy_with_settings(root / "repo", {
        "tritium": engine | {"lora_modules": {"chat": str(adapters["chat"])}, "admin_key": TEXT_KEY,
                             "max_num_seqs": 1},
        "tritium_ids": engine | {"lora_modules": {"chat": str(adapters["chat"])}},
        "preprocessing": {"model": str(tiny_llama_path)}, "postprocessing": {"model": str(tiny_llama_path)}})
    # multi_lora.json with a folder relative to the version folder (the vLLM backend's file)
    version = repo / "tritium" / "1"
    (version / "adapters").mkdir()
    (version / "adapters" / "sql").symlink_to(adapters["sql"], target_is_directory=True)
    write_multi_lora(version, {"sql": "adapters/sql"})
    write_multi_lora(repo / "tritium_ids" / "1", {"sql": str(adapters["sql"])})
    local = LLM(str(tiny_llama_path), enable_lora=True, kv_cache_bytes=32 << 20,
                lora_modules={name: str(folder) for name, folder in adapters.items()})
    served = start_serve(f"--model-repository={repo}", env={"TRITIUM_ADMIN_KEY": ENV_KEY})
    yield LoraServer(served, adapters, local)
    served.stop()
    assert not served.leftovers()


def greedy(lora: LoraServer, name: str | None) -> tuple[str, list[int]]:
    out = lora.local.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                              lora_name=name)[0]
    return out.text, list(out.token_ids)


def generate(lora: LoraServer, body: dict[str, Any], model: str = "tritium") -> requests.Response:
    return http_generate(lora.served.http, body, model=model)


def text_body(**extra: Any) -> dict[str, Any]:
    return {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "exclude_input_in_output": True, **extra}


def admin(lora: LoraServer, action: dict[str, Any], key: str | None, model: str = "tritium") -> requests.Response:
    body: dict[str, Any] = {"lora_admin": json.dumps(action)}
    body |= {"text_input": ""} if model == "tritium" else {"input_ids": [0]}
    if key is not None:
        body["admin_key"] = key
    return http_generate(lora.served.http, body, model=model)


def grpc_ids(url: str, model: str, inputs: dict[str, Any], parameters: dict[str, Any] | None = None,
             ) -> tuple[list[dict[str, Any]], list[str]]:
    """One streamed gRPC request with typed inputs (name -> numpy array); every response's outputs and errors."""
    import tritonclient.grpc as grpcclient

    types = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32", np.dtype(bool): "BOOL",
             np.dtype(object): "BYTES"}
    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), types[array.dtype])
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    outputs: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        client.async_stream_infer(model, tensors, parameters=parameters, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                errors.append(str(error))
                break
            response = result.get_response()
            outputs.append({o.name: result.as_numpy(o.name) for o in response.outputs})
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    return outputs, errors


def ids_inputs(ids: list[int], **extra: np.ndarray) -> dict[str, np.ndarray]:
    return {"input_ids": np.array(ids, dtype=np.int32), "max_tokens": np.array([MAX_TOKENS], dtype=np.int32),
            "temperature": np.array([0.0], dtype=np.float32), **extra}


def test_the_text_model_runs_each_adapter_named_either_way(lora: LoraServer) -> None:
    base = greedy(lora, None)[0]
    for name in (None, "sql", "chat"):
        expected = greedy(lora, name)[0]
        assert name is None or expected != base, f"{name} changes nothing: the fixture is too weak"
        sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        if name is not None:
            sampling["lora_name"] = name
        streamed = grpc_stream(lora.served.grpc, PROMPT, sampling)
        assert not streamed.errors and "".join(streamed.texts) == expected, name
        resp = generate(lora, text_body(**({"lora_name": name} if name else {})))
        assert resp.status_code == 200 and resp.json()["text_output"] == expected, (name, resp.text)


def test_the_ids_model_and_the_ensemble_run_the_adapter(lora: LoraServer) -> None:
    text, ids = greedy(lora, "sql")
    prompt_ids = lora.local.tokenizer.encode(PROMPT)
    sql = np.array([b"sql"], dtype=object)
    for inputs, parameters in ((ids_inputs(prompt_ids, lora_name=sql), None),
                               (ids_inputs(prompt_ids), {"lora_name": "sql"})):
        outputs, errors = grpc_ids(lora.served.grpc, "tritium_ids", inputs, parameters)
        assert not errors
        assert [t for o in outputs if "output_ids" in o for t in o["output_ids"].tolist()] == ids
    assert ids != greedy(lora, None)[1]
    ensemble = {"text_input": np.array([PROMPT.encode()], dtype=object),
                "max_tokens": np.array([MAX_TOKENS], dtype=np.int32), "temperature": np.array([0.0], dtype=np.float32)}
    # the ensemble's lora_name input, and a request parameter (Triton passes it on to tritium_ids)
    for inputs, parameters in ((ensemble | {"lora_name": sql}, None), (ensemble, {"lora_name": "sql"})):
        outputs, errors = grpc_ids(lora.served.grpc, "tritium_ensemble", inputs, parameters)
        assert not errors
        assert "".join(b"".join(o["text_output"].reshape(-1)).decode() for o in outputs if "text_output" in o) \
            == text, parameters
    resp = generate(lora, {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "lora_name": "sql"},
                    model="tritium_ensemble")
    assert resp.status_code == 200 and resp.json()["text_output"] == text, resp.text


def test_an_unknown_adapter_is_refused_naming_it(lora: LoraServer) -> None:
    for model, body in (("tritium", text_body(lora_name="nope")),
                        ("tritium_ensemble", {"text_input": PROMPT, "lora_name": "nope"})):
        resp = generate(lora, body, model=model)
        assert resp.status_code == 400 and "unknown LoRA adapter 'nope' (loaded: chat, sql)" in resp.text, resp.text
    streamed = grpc_stream(lora.served.grpc, PROMPT, {"max_tokens": 2, "lora_name": ""})
    assert streamed.errors and "lora_name must be a non-empty string" in streamed.errors[0]
    _, errors = grpc_ids(lora.served.grpc, "tritium_ids", ids_inputs([1, 2, 3]), {"lora_name": "nope"})
    assert errors and "unknown LoRA adapter 'nope'" in errors[0]
    resp = generate(lora, text_body(admin_key=TEXT_KEY))
    assert resp.status_code == 400 and "admin_key is only used with lora_admin" in resp.text


def test_admin_loads_lists_and_unloads_adapters_with_the_key(lora: LoraServer) -> None:
    listed = admin(lora, {"action": "list"}, None)
    assert listed.status_code == 200, listed.text
    report = json.loads(listed.json()["text_output"])
    assert report["max_loras"] == 2 and [a["name"] for a in report["adapters"]] == ["chat", "sql"]
    assert report["adapters"][1] | {"path": ""} == {"name": "sql", "path": "", "rank": 8,
                                                    "targets": ["q_proj", "v_proj", "o_proj"]}
    assert report["adapters"][1]["path"].endswith("sql")
    load = {"action": "load", "lora_name": "extra", "lora_path": str(lora.adapters["extra"])}
    for key, why in ((None, "admin_key"), ("wrong", "admin_key"), (ENV_KEY, "admin_key")):
        refused = admin(lora, load, key)  # the env key is not tritium's: its model.json key wins
        assert refused.status_code == 400 and refused.text.count("forbidden:") == 1 and why in refused.text
        assert "wrong" not in refused.text and ENV_KEY not in refused.text and TEXT_KEY not in refused.text
    assert generate(lora, text_body(lora_name="extra")).status_code == 400
    loaded = admin(lora, load, TEXT_KEY)
    assert loaded.status_code == 200, loaded.text
    assert [a["name"] for a in json.loads(loaded.json()["text_output"])["adapters"]] == ["chat", "extra", "sql"]
    resp = generate(lora, text_body(lora_name="extra"))
    assert resp.status_code == 200 and resp.json()["text_output"] == greedy(lora, "extra")[0]
    again = admin(lora, load, TEXT_KEY)
    assert again.status_code == 400 and "'extra' is loaded already" in again.text
    bad = admin(lora, {"action": "load", "lora_name": "bad", "lora_path": "/no/such/adapter"}, TEXT_KEY)
    assert bad.status_code == 400 and "/no/such/adapter" in bad.text and "Traceback" not in bad.text
    unloaded = admin(lora, {"action": "unload", "lora_name": "extra"}, TEXT_KEY)
    assert unloaded.status_code == 200, unloaded.text
    assert [a["name"] for a in json.loads(unloaded.json()["text_output"])["adapters"]] == ["chat", "sql"]
    gone = generate(lora, text_body(lora_name="extra"))
    assert gone.status_code == 400 and "unknown LoRA adapter 'extra'" in gone.text
    malformed = admin(lora, {"action": "reload"}, TEXT_KEY)
    assert malformed.status_code == 400 and "lora_admin.action must be one of" in malformed.text
    # tritium_ids has no admin_key in model.json: $TRITIUM_ADMIN_KEY is its key
    assert admin(lora, load, TEXT_KEY, model="tritium_ids").status_code == 400
    ids_loaded = admin(lora, load, ENV_KEY, model="tritium_ids")
    assert ids_loaded.status_code == 200, ids_loaded.text
    assert "extra" in [a["name"] for a in json.loads(ids_loaded.json()["text_output"])["adapters"]]
    outputs, errors = grpc_ids(lora.served.grpc, "tritium_ids", ids_inputs(lora.local.tokenizer.encode(PROMPT)),
                               {"lora_name": "extra"})
    assert not errors
    assert [t for o in outputs if "output_ids" in o for t in o["output_ids"].tolist()] == greedy(lora, "extra")[1]


def scrape(served: Served) -> str:
    return urllib.request.urlopen(served.metrics, timeout=5).read().decode()


def series(text: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """The series of metric `name` whose labels include `labels`: (all its labels, value)."""
    found = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            raw, value = line[len(name) + 1:].rsplit("} ", 1)
            got = dict(re.findall(r'(\w+)="([^"]*)"', raw))
            if labels.items() <= got.items():
                found.append((got, float(value)))
    return found


def total(served: Served, adapter: str) -> float:
    return sum(v for _, v in series(scrape(served), "tritium_lora_requests_total", model="tritium",
                                    lora_name=adapter))


def current(served: Served) -> dict[str, str]:
    """The labels of tritium's newest tritium_lora_requests_info series ({} when there is none)."""
    info = series(scrape(served), "tritium_lora_requests_info", model="tritium")
    return max(info, key=lambda s: s[1])[0] if info else {}


def test_metrics_count_requests_per_adapter_and_show_running_and_waiting_adapters(lora: LoraServer) -> None:
    import tritonclient.grpc as grpcclient

    served = lora.served
    before = total(served, "sql")
    for _ in range(3):
        assert generate(lora, text_body(lora_name="sql", max_tokens=2)).status_code == 200
    assert wait_for(lambda: total(served, "sql") == before + 3, 10), scrape(served)
    # tritium runs one sequence at a time (max_num_seqs 1): a long "chat" request runs, a "sql" one waits
    clients, errors = [], []
    try:
        for name in ("chat", "sql"):
            client = grpcclient.InferenceServerClient(served.grpc)
            client.start_stream(callback=lambda result, error: errors.append(error) if error else None)
            sampling = json.dumps({"max_tokens": 900, "ignore_eos": True, "lora_name": name})
            inputs = []
            for key, value in (("text_input", "Once"), ("sampling_parameters", sampling)):
                tensor = grpcclient.InferInput(key, [1], "BYTES")
                tensor.set_data_from_numpy(np.array([value.encode()], dtype=object))
                inputs.append(tensor)
            stream = grpcclient.InferInput("stream", [1], "BOOL")
            stream.set_data_from_numpy(np.array([True]))
            client.async_stream_infer("tritium", [*inputs, stream])
            clients.append(client)
            if name == "chat":  # running before the second one arrives
                assert wait_for(lambda: current(served).get("running_lora_adapters") == "chat", 20, 0.05), \
                    scrape(served)
        assert wait_for(lambda: current(served).get("waiting_lora_adapters") == "sql", 20, 0.05), scrape(served)
        assert current(served)["running_lora_adapters"] == "chat"
    finally:
        for client in clients:
            threading.Thread(target=client.stop_stream, kwargs={"cancel_requests": True}, daemon=True).start()
    info = series(scrape(served), "tritium_lora_requests_info", model="tritium")
    assert {s["max_lora"] for s, _ in info} == {"2"}
    assert len([v for _, v in info if v > 0]) == 1, info  # earlier label sets are set to 0

    def idle() -> bool:
        now = [s for s, v in series(scrape(served), "tritium_lora_requests_info", model="tritium") if v > 0]
        return len(now) == 1 and now[0]["running_lora_adapters"] == "" == now[0]["waiting_lora_adapters"]

    assert wait_for(idle, 30), scrape(served)
    assert not [e for e in errors if "cancel" not in str(e).lower()], errors
