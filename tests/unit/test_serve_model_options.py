"""Serving a model by name without a tritonserver: `tritium serve --model` (resolved, checked before any server
starts, written into a copy of the repository), what a server reports it serves, the OpenAI endpoint's model
id that follows it, and `tritium generate --model`."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from tritium.backend.tokenizer import Tokenizer
from tritium.client.cli import generate, serve
from tritium.client.cli.main import build_parser, main
from tritium.client.openai import app as openai_app
from tritium.client.openai.app import create_app, tokenizer_folder
from tritium.client.triton import served_model as served_module
from tritium.client.triton.launcher import PACKAGE_REPOSITORY, TritonServer, free_ports
from tritium.client.triton.repository import copy_with_settings
from tritium.client.triton.served_model import (
    MODEL_PATH,
    SERVED_NAME,
    ServedModel,
    pbtxt_parameters,
    served_model_of,
)

TRITIUM_MODELS = ["postprocessing", "preprocessing", "tritium", "tritium_embed", "tritium_ids"]  # with a 1/model.json


def light_folder(dest: Path, default_model_path: Path) -> Path:
    """A model folder the light check accepts: the default model's config and tokenizer, and a weights file
    that is only a name (the check does not read weights)."""
    dest.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path / name, dest / name)
    (dest / "model.safetensors").write_bytes(b"")
    return dest


@pytest.fixture
def folder(tmp_path: Path, default_model_path: Path) -> Path:
    return light_folder(tmp_path / "my-model", default_model_path)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRITIUM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_a_folder_is_served_by_its_name_and_a_cached_one_by_the_name_given(
        folder: Path, cache: Path, default_model_path: Path) -> None:
    assert serve.served_model(serve_args()) is None
    assert serve.served_model(serve_args(f"--model={folder}")) == ServedModel("my-model", str(folder.resolve()))
    named = serve.served_model(serve_args(f"--model={folder}/", "--served-model-name=team/chat"))
    assert named == ServedModel("team/chat", str(folder.resolve()))
    cached = light_folder(cache / "models" / "org" / "tiny", default_model_path)
    assert serve.served_model(serve_args("--model=org/tiny")) == ServedModel("org/tiny", str(cached))
    assert serve.served_model(serve_args("--served-model-name=x")) == ServedModel("x", None)


def break_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


@pytest.mark.parametrize(("spoil", "reason"), [
    (lambda f: (f / "config.json").unlink(), "has no config.json"),
    (lambda f: break_config(f, architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
    (lambda f: break_config(f, hidden_act="relu"), "hidden_act 'relu'"),
    (lambda f: (f / "config.json").write_text("{not json"), "config.json cannot be read: JSONDecodeError"),
    (lambda f: (f / "tokenizer.json").unlink(), "has no tokenizer.json"),
    (lambda f: (f / "tokenizer.json").write_text("{}"), "its tokenizer cannot be read"),
    (lambda f: (f / "model.safetensors").unlink(), "has no model.safetensors"),
])
def test_a_folder_that_cannot_load_is_refused_naming_the_option_and_the_reason(
        folder: Path, cache: Path, spoil: object, reason: str) -> None:
    spoil(folder)  # type: ignore[operator]
    with pytest.raises(ValueError, match=f"--model {folder}: ") as info:
        serve.served_model(serve_args(f"--model={folder}"))
    assert reason in str(info.value)


def test_an_unknown_name_says_where_it_was_looked_for(cache: Path) -> None:
    with pytest.raises(ValueError, match=r"--model nope: no folder nope, nor a model of that name in .*cache/models"):
        serve.served_model(serve_args("--model=nope"))


def test_serve_fails_at_once_with_the_loaders_message_and_starts_no_server(
        folder: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def no_server(*_: object) -> None:
        raise AssertionError("tritonserver must not be started for a folder that cannot load")

    monkeypatch.setattr(TritonServer, "__init__", no_server)
    break_config(folder, architectures=["GPT2LMHeadModel"])
    assert main(["serve", f"--model={folder}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model {folder}: ") and "unsupported architecture" in err
    assert "Traceback" not in err


def test_the_repository_copy_names_the_model_everywhere_and_settings_only_on_the_engines(
        folder: Path, tmp_path: Path) -> None:
    served = serve.served_model(serve_args(f"--model={folder}"))
    settings, parameters = serve.repository_changes(serve_args("--quantization=int8"), PACKAGE_REPOSITORY, {}, served)
    copy = copy_with_settings(tmp_path / "repo", settings, source=PACKAGE_REPOSITORY, parameters=parameters)
    for name in TRITIUM_MODELS:
        written = json.loads((copy / name / "1" / "model.json").read_text())
        assert written["model"] == str(folder.resolve())
        assert ("quantization" in written) == (name in ("tritium", "tritium_embed", "tritium_ids"))
        config = text_format.Parse((copy / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        assert config.name == name
        assert {k: v.string_value for k, v in config.parameters.items()} == {
            SERVED_NAME: "my-model", MODEL_PATH: str(folder.resolve())}
    assert SERVED_NAME not in (copy / "tritium_ensemble" / "config.pbtxt").read_text()
    assert json.loads((PACKAGE_REPOSITORY / "tritium" / "1" / "model.json").read_text())["model"] is None
    assert SERVED_NAME not in (PACKAGE_REPOSITORY / "tritium" / "config.pbtxt").read_text()


def test_tensor_parallel_engines_get_one_kind_model_instance_and_their_size(tmp_path: Path) -> None:
    args = serve_args("--tensor-parallel-size=2")
    settings, _ = serve.repository_changes(args, PACKAGE_REPOSITORY, {}, None)
    groups = serve.engine_instance_groups(PACKAGE_REPOSITORY, args.tensor_parallel_size)
    assert sorted(groups) == ["tritium", "tritium_ids"]
    copy = copy_with_settings(tmp_path / "repo", settings, source=PACKAGE_REPOSITORY, instance_groups=groups)
    for name in TRITIUM_MODELS:
        config = text_format.Parse((copy / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        kinds = [(g.count, model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind)) for g in config.instance_group]
        engine = name in ("tritium", "tritium_ids")
        assert (kinds == [(1, "KIND_MODEL")]) == engine
        assert (json.loads((copy / name / "1" / "model.json").read_text()).get("tensor_parallel_size") == 2) == engine
    assert serve.engine_instance_groups(PACKAGE_REPOSITORY, 1) == {}


@pytest.mark.parametrize(("argv", "message"), [
    (["--tensor-parallel-size=0"], "expected an integer from 1 to 64"),
    (["--tensor-parallel-size=2", "--enable-lora"], "LoRA adapters (--lora, --enable-lora) with tensor parallelism"),
])
def test_tensor_parallel_sizes_serve_cannot_use_are_refused_before_a_server_starts(
        argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def no_server(*_: object) -> None:
        raise AssertionError("tritonserver must not be started")

    monkeypatch.setattr(TritonServer, "__init__", no_server)
    try:
        code = main(["serve", *argv])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err


def test_without_model_options_the_repository_is_served_as_it_is() -> None:
    assert serve.repository_changes(serve_args(), PACKAGE_REPOSITORY, {}, None) == ({}, {})
    settings, parameters = serve.repository_changes(serve_args("--served-model-name=chat"), PACKAGE_REPOSITORY, {},
                                                    ServedModel("chat"))
    assert settings == {} and set(parameters) == set(TRITIUM_MODELS)
    assert parameters["tritium"] == {SERVED_NAME: "chat"}


def test_parameters_survive_protobuf_text_escapes() -> None:
    value = 'a "quoted" \\ path\nwith ü'
    config = text_format.Parse(pbtxt_parameters({SERVED_NAME: value}), model_config_pb2.ModelConfig())
    assert config.parameters[SERVED_NAME].string_value == value


def test_what_a_model_config_says_it_serves() -> None:
    config = {"name": "tritium", "parameters": {SERVED_NAME: {"string_value": "chat"},
                                                MODEL_PATH: {"string_value": "/m/chat"}}}
    assert served_model_of(config) == ServedModel("chat", "/m/chat")
    assert served_model_of({"name": "tritium"}) == ServedModel()
    assert served_model_of({"parameters": {SERVED_NAME: {"string_value": ""}}}) == ServedModel()


def test_the_example_request_uses_the_chat_template_only_when_the_model_has_one(folder: Path) -> None:
    assert serve.example_request(None) == serve.EXAMPLE_REQUEST
    assert serve.example_request(ServedModel("m", str(folder))) == serve.EXAMPLE_REQUEST
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert serve.example_request(ServedModel("m", str(folder))) == serve.PLAIN_EXAMPLE_REQUEST


@pytest.fixture
def tok(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


@pytest.fixture
def http(tok: Tokenizer) -> Iterator[TestClient]:
    (port,) = free_ports(1)  # nothing listens there
    app = create_app([f"127.0.0.1:{port}"], tokenizer=tok, served_model_name="my-model", admin_key="admin")
    with TestClient(app) as client:
        yield client


def test_the_model_id_is_the_served_name_and_the_triton_name_still_works(http: TestClient) -> None:
    models = http.get("/v1/models").json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in models] == [("my-model", "my-model", None)]
    for name in ("my-model", "tritium", None):
        body = {"prompt": "Hello"} | ({"model": name} if name else {})
        assert http.post("/tokenize", json=body).status_code == 200, name
        assert http.post("/v1/completions", json=body | {"model": name or "my-model"}).status_code == 503  # no replica
    missing = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "Hello"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    render = http.post("/v1/completions/render", json={"model": "my-model", "prompt": "Hello"}).json()
    assert render[0]["model"] == "my-model"
    assert http.get("/model_info").json()["served_model_name"] == "my-model"
    admin = {"Authorization": "Bearer admin"}
    for base in ("my-model", "tritium"):
        r = http.post("/v1/load_lora_adapter", json={"lora_name": base, "lora_path": "/x"}, headers=admin)
        assert r.status_code == 400 and "base model" in r.json()["error"]["message"]


def test_the_endpoint_takes_the_tokenizer_the_upstream_reports_when_it_is_here(
        folder: Path, default_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tokenizer_folder(None, None) == default_model_path
    assert tokenizer_folder(None, ServedModel("m", str(folder))) == folder
    assert tokenizer_folder(str(folder), ServedModel("other", "/elsewhere")) == folder
    assert tokenizer_folder(None, ServedModel("m", "/not/on/this/host")) == default_model_path
    assert "/not/on/this/host" in capsys.readouterr().err


def test_upstream_model_takes_the_first_that_answers_and_warns_when_none_does(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    answers = {"b:1": ServedModel("chat", "/m/chat")}

    def read(url: str, api_key: str | None = None, model: str = "tritium", timeout: float = 5.0) -> ServedModel:
        if url not in answers:
            raise RuntimeError(f"{url}: down")
        return answers[url]

    monkeypatch.setattr(served_module, "read_served_model", read)
    assert openai_app.upstream_model(["a:1", "b:1"], "tritium", None) == ServedModel("chat", "/m/chat")
    assert openai_app.upstream_model(["a:1"], "tritium", None) is None
    assert "a:1: down" in capsys.readouterr().err


def test_generate_renders_chat_with_the_served_models_template_unless_told(
        folder: Path, cache: Path, default_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reported = ServedModel("my-model", str(folder))
    monkeypatch.setattr(served_module, "read_served_model", lambda *_args, **_kw: reported)
    parse = build_parser().parse_args
    assert generate.chat_template_folder(parse(["generate", "--chat", "hi"])) == folder
    assert generate.chat_template_folder(parse(["chat"])) == folder
    assert generate.chat_template_folder(parse(["generate", "--model", str(default_model_path), "hi"])) == \
        default_model_path
    with pytest.raises(ValueError, match="--model nope: "):
        generate.chat_template_folder(parse(["generate", "--model", "nope", "hi"]))
