"""Engine settings of one model version: `<model>/<version>/model.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tritium.backend.config import EngineConfig

DEFAULT_MAX_PENDING_REQUESTS = 128  # twice the default max_num_seqs
DEFAULT_MAX_STREAM_INTERVAL = 16  # the most tokens a streamed response carries when sending cannot keep up


@dataclass
class ServingSettings:
    engine: EngineConfig
    request_timeout_s: float | None  # abort requests still running after this long (None: never)
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS  # beyond this many waiting, refuse ("overloaded")
    stream_interval: int = 1  # streamed responses carry at least this many tokens (the first and last excepted)
    max_stream_interval: int = DEFAULT_MAX_STREAM_INTERVAL  # ... and up to this many when sending falls behind


def _int_setting(path: Path, raw: dict[str, Any], name: str, default: int, low: int) -> int:
    value = raw.pop(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{path}: {name} must be an integer >= {low}, got {value!r}")
    return value


def load_settings(version_dir: str | Path) -> ServingSettings:
    """Read `model.json` of a version folder. `model` may be null (the embedded default), an absolute
    path, or a path relative to the version folder. Raises ValueError for unknown keys."""
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
    return ServingSettings(EngineConfig(**raw), float(timeout) if timeout is not None else None, max_pending,
                           stream_interval, max_stream_interval)


def _beside(version_dir: Path, folder: object) -> object:
    """`folder` resolved against `version_dir` when it is a relative path that exists there (else as it is)."""
    if isinstance(folder, str) and folder and not Path(folder).expanduser().is_absolute() \
            and (version_dir / folder).exists():
        return str((version_dir / folder).resolve())
    return folder
