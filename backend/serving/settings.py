"""Settings of one model version: `<model>/<version>/model.json` (docs/serving.md#engine-settings)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tritium.backend.config import EngineConfig

DEFAULT_MAX_PENDING_REQUESTS = 128  # twice the default max_num_seqs
MULTI_LORA_FILE = "multi_lora.json"  # beside model.json: {"adapter name": "folder"} (the vLLM backend's file)
DEFAULT_MAX_STREAM_INTERVAL = 16  # the most tokens a streamed response carries when sending cannot keep up


@dataclass
class ServingSettings:
    engine: EngineConfig
    request_timeout_s: float | None  # abort requests still running after this long (None: never)
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS  # beyond this many waiting, refuse ("overloaded")
    stream_interval: int = 1  # streamed responses carry at least this many tokens (the first and last excepted)
    max_stream_interval: int = DEFAULT_MAX_STREAM_INTERVAL  # ... and up to this many when sending falls behind
    admin_key: str | None = None  # runtime LoRA load/unload (lora_admin requests) need it; None: TRITIUM_ADMIN_KEY


def _int_setting(path: Path, raw: dict[str, Any], name: str, default: int, low: int) -> int:
    value = raw.pop(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{path}: {name} must be an integer >= {low}, got {value!r}")
    return value


def load_settings(version_dir: str | Path) -> ServingSettings:
    """Read `model.json` (and `multi_lora.json`) of a version folder; relative model and adapter folders are taken
    in it. Raises ValueError naming the setting (unknown keys too) or the bad file."""
    version_dir = Path(version_dir)
    path = version_dir / "model.json"
    raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    timeout = raw.pop("request_timeout_s", None)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < float("inf")):
        raise ValueError(f"{path}: request_timeout_s must be a number of seconds > 0 (or null: no limit), "
                         f"got {timeout!r}")
    max_pending = _int_setting(path, raw, "max_pending_requests", DEFAULT_MAX_PENDING_REQUESTS, 1)
    stream_interval = _int_setting(path, raw, "stream_interval", 1, 1)
    max_stream_interval = _int_setting(path, raw, "max_stream_interval",
                                       max(DEFAULT_MAX_STREAM_INTERVAL, stream_interval), stream_interval)
    admin_key = raw.pop("admin_key", None)
    if admin_key is not None and (not isinstance(admin_key, str) or not admin_key):
        raise ValueError(f"{path}: admin_key must be a non-empty string (or null), got a {type(admin_key).__name__}")
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    model = raw.get("model")
    if model and not Path(model).expanduser().is_absolute() and (version_dir / model).exists():
        raw["model"] = str((version_dir / model).resolve())
    modules = raw.get("lora_modules")
    if isinstance(modules, dict):  # adapter folders, like the model's, may be relative to the version folder
        raw["lora_modules"] = {name: _beside(version_dir, folder) for name, folder in modules.items()}
    spec = raw.get("speculative_config")
    if isinstance(spec, dict) and "model" in spec:  # a draft model's folder, like the model's
        raw["speculative_config"] = {**spec, "model": _beside(version_dir, spec["model"])}
    _add_multi_lora(version_dir, raw)
    return ServingSettings(EngineConfig(**raw), float(timeout) if timeout is not None else None, max_pending,
                           stream_interval, max_stream_interval, admin_key)


def _add_multi_lora(version_dir: Path, raw: dict[str, Any]) -> None:
    """Raises ValueError when the file is not `{"name": "folder"}`, `enable_lora` is not true, or a name is in
    both files."""
    path = version_dir / MULTI_LORA_FILE
    if not path.is_file():
        return
    try:
        adapters = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(adapters, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                                  for k, v in adapters.items()):
        raise ValueError(f"{path} must hold an object of adapter names to adapter folders ({{\"name\": \"/path\"}})")
    if raw.get("enable_lora") is not True:
        raise ValueError(f"{path} names LoRA adapters but enable_lora is not true in model.json; set "
                         "\"enable_lora\": true (and max_loras, max_lora_rank) or remove the file")
    modules = raw.get("lora_modules") or {}
    if not isinstance(modules, dict):
        return  # EngineConfig refuses it by name
    both = sorted(set(modules) & set(adapters))
    if both:
        raise ValueError(f"LoRA adapter name(s) {', '.join(both)} are in both {path.name} and model.json "
                         "lora_modules; name each adapter once")
    raw["lora_modules"] = {**modules, **{name: _beside(version_dir, folder) for name, folder in adapters.items()}}


def _beside(version_dir: Path, folder: object) -> object:
    """`folder` resolved against `version_dir` when it is a relative path that exists there (else as it is)."""
    if isinstance(folder, str) and folder and not Path(folder).expanduser().is_absolute() \
            and (version_dir / folder).exists():
        return str((version_dir / folder).resolve())
    return folder
