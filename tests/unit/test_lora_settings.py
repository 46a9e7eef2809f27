"""model.json's LoRA settings: EngineConfig's fields, validated naming the field; adapter folders may be
relative to the version folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tritium.backend.config import EngineConfig
from tritium.backend.serving.settings import load_settings


def test_lora_is_off_by_default() -> None:
    config = EngineConfig()
    assert not config.enable_lora and config.max_loras == 4 and config.max_lora_rank == 16
    assert config.lora_modules is None


def test_model_json_takes_the_lora_fields(tmp_path: Path) -> None:
    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    (tmp_path / "model.json").write_text(json.dumps({
        "enable_lora": True, "max_loras": 2, "max_lora_rank": 32,
        "lora_modules": {"sql": "adapters/sql", "abs": "/elsewhere/abs"}}))
    engine = load_settings(tmp_path).engine
    assert engine.enable_lora and engine.max_loras == 2 and engine.max_lora_rank == 32
    assert engine.lora_modules == {"sql": str((tmp_path / "adapters" / "sql").resolve()), "abs": "/elsewhere/abs"}


@pytest.mark.parametrize(("settings", "message"), [
    ({"enable_lora": "yes"}, "enable_lora must be true or false"),
    ({"enable_lora": True, "max_loras": 0}, "max_loras must be an integer in [1, 256]"),
    ({"enable_lora": True, "max_lora_rank": 1.5}, "max_lora_rank must be an integer in [1, 256]"),
    ({"enable_lora": True, "lora_modules": ["a"]}, "lora_modules must map adapter names to folders"),
    ({"enable_lora": True, "lora_modules": {"a": 3}}, "lora_modules must map adapter names to folders"),
    ({"lora_modules": {"a": "/x"}}, "lora_modules needs enable_lora: true"),
])
def test_bad_lora_settings_name_the_field(tmp_path: Path, settings: dict[str, object], message: str) -> None:
    (tmp_path / "model.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        load_settings(tmp_path)
