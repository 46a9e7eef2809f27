"""LoRA at Triton's doors, without a server: `lora_name` in requests, `lora_admin` actions and their key, and
`multi_lora.json` beside model.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tritium.backend.serving.lora_admin import (
    DISABLED,
    WRONG_KEY,
    AdminRefused,
    LoraAdminAction,
    check_admin_key,
    configured_admin_key,
    parse_admin_action,
)
from tritium.backend.serving.request import parse_lora_name, parse_text_request
from tritium.backend.serving.settings import load_settings


def _inputs(sampling: dict[str, object] | None = None) -> dict[str, np.ndarray | None]:
    inputs: dict[str, np.ndarray | None] = {"text_input": np.array([b"Hello"], dtype=object)}
    if sampling is not None:
        inputs["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=object)
    return inputs


def test_lora_name_comes_from_sampling_parameters_or_a_request_parameter() -> None:
    assert parse_text_request(_inputs(), {}).lora_name is None
    from_json = parse_text_request(_inputs({"lora_name": "sql", "max_tokens": 3}), {})
    assert from_json.lora_name == "sql" and from_json.params.max_tokens == 3
    assert parse_text_request(_inputs(), {"lora_name": "chat"}).lora_name == "chat"
    assert parse_text_request(_inputs({"lora_name": "sql"}), {"lora_name": "chat"}).lora_name == "chat"
    assert parse_text_request(_inputs({"lora_name": None}), {}).lora_name is None


@pytest.mark.parametrize("value", ["", 3, ["a"], b"\xff"])
def test_a_lora_name_that_is_not_a_non_empty_string_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="lora_name"):
        parse_lora_name(value)


def test_lora_name_of_a_bytes_tensor_element() -> None:
    assert parse_lora_name(np.array([b"sql"], dtype=object)[0]) == "sql"


@pytest.mark.parametrize(("raw", "expected"), [
    ('{"action": "list"}', LoraAdminAction("list")),
    ('{"action": "unload", "lora_name": "a"}', LoraAdminAction("unload", "a")),
    ('{"action": "load", "lora_name": "a", "lora_path": "/x"}', LoraAdminAction("load", "a", "/x")),
])
def test_admin_actions_parse(raw: str, expected: LoraAdminAction) -> None:
    assert parse_admin_action(raw) == expected


@pytest.mark.parametrize(("raw", "message"), [
    ("{", "must be a JSON object"),
    ("[1]", "must be a JSON object, got list"),
    ('{"action": "reload"}', "action must be one of load, unload, list"),
    ('{"action": "load", "lora_name": "a"}', "needs lora_path as a non-empty string"),
    ('{"action": "unload", "lora_name": ""}', "needs lora_name as a non-empty string"),
    ('{"action": "list", "lora_name": "a"}', "takes no lora_name"),
    (3, "must be a JSON object in a string"),
])
def test_bad_admin_actions_name_the_rule(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_admin_action(raw)


def test_load_and_unload_need_the_configured_key_and_list_does_not() -> None:
    load = LoraAdminAction("load", "a", "/x")
    check_admin_key(load, "s3cret", "s3cret")
    check_admin_key(LoraAdminAction("list"), None, None)
    for given in (None, "wrong", "s3cret ", 42):
        with pytest.raises(AdminRefused) as refused:
            check_admin_key(load, given, "s3cret")
        assert str(refused.value) == WRONG_KEY and "s3cret" not in str(refused.value)
    with pytest.raises(AdminRefused, match=r"set admin_key in model\.json"):
        check_admin_key(LoraAdminAction("unload", "a"), "anything", None)
    assert DISABLED.startswith("forbidden:") and WRONG_KEY.startswith("forbidden:")


def test_the_admin_key_is_model_json_s_else_the_environment_s() -> None:
    assert configured_admin_key("m", {"TRITIUM_ADMIN_KEY": "e"}) == "m"
    assert configured_admin_key(None, {"TRITIUM_ADMIN_KEY": "e"}) == "e"
    assert configured_admin_key(None, {"TRITIUM_ADMIN_KEY": ""}) is None
    assert configured_admin_key(None, {}) is None


def _version(tmp_path: Path, settings: dict[str, object], multi_lora: object | None = None) -> Path:
    (tmp_path / "model.json").write_text(json.dumps(settings))
    if multi_lora is not None:
        (tmp_path / "multi_lora.json").write_text(multi_lora if isinstance(multi_lora, str) else json.dumps(multi_lora))
    return tmp_path


def test_multi_lora_json_adds_adapters_resolved_beside_it(tmp_path: Path) -> None:
    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    settings = load_settings(_version(tmp_path, {"enable_lora": True, "lora_modules": {"a": "/abs/a"},
                                                 "admin_key": "k"},
                                      {"sql": "adapters/sql", "chat": "/abs/chat"}))
    assert settings.engine.lora_modules == {"a": "/abs/a", "sql": str((tmp_path / "adapters" / "sql").resolve()),
                                            "chat": "/abs/chat"}
    assert settings.admin_key == "k"
    (tmp_path / "plain").mkdir()
    assert load_settings(_version(tmp_path / "plain", {})).admin_key is None


@pytest.mark.parametrize(("settings", "multi_lora", "message"), [
    ({}, {"sql": "/x"}, "names LoRA adapters but enable_lora is not true in model.json"),
    ({"enable_lora": False}, {}, "enable_lora is not true"),
    ({"enable_lora": True, "lora_modules": {"sql": "/y"}}, {"sql": "/x"}, "sql are in both multi_lora.json and"),
    ({"enable_lora": True}, ["sql"], "must hold an object of adapter names to adapter folders"),
    ({"enable_lora": True}, {"sql": 3}, "must hold an object of adapter names to adapter folders"),
    ({"enable_lora": True}, "{", "is not JSON"),
    ({"admin_key": 7}, None, "admin_key must be a non-empty string"),
])
def test_bad_multi_lora_settings_are_refused_at_load(tmp_path: Path, settings: dict[str, object],
                                                     multi_lora: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_settings(_version(tmp_path, settings, multi_lora))
