"""Triton model repositories: the packaged one, and copies of its models with their own `model.json`.

The launcher serves `PACKAGE_REPOSITORY`; benchmarks and tests that need other settings write a repository
here, never by hand, so what they serve is the packaged model with only the settings they name changed.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PACKAGE_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
_IGNORE = shutil.ignore_patterns("__pycache__")
# One instance whose engine places its devices itself: a tensor-parallel engine's ranks on cuda:0..N-1.
MODEL_INSTANCE_GROUP = "instance_group [ { count: 1, kind: KIND_MODEL } ]"
_INSTANCE_GROUP = re.compile(r"^[ \t]*instance_group\s*:?\s*\[", re.MULTILINE)


def packaged_settings(model: str = "tritium", version: int = 1) -> dict[str, Any]:
    """The packaged model's `model.json` (version `version`) as a dict."""
    return json.loads((PACKAGE_REPOSITORY / model / str(version) / "model.json").read_text(encoding="utf-8"))


def write_model(repository: Path, settings: Mapping[str, Any] | None = None, *, name: str = "tritium",
                source: str = "tritium", versions: Mapping[int, Mapping[str, Any]] | None = None) -> Path:
    """Copy the packaged model `source` into `repository/name` and return that folder.

    `settings` update version 1's `model.json` (None keeps it as packaged). `versions` ({number: settings})
    writes those versions instead, each a copy of version 1 with its settings applied over the packaged ones,
    and a version policy that serves all of them. config.pbtxt names the model `name`.
    """
    dest = repository / name
    src = PACKAGE_REPOSITORY / source
    dest.mkdir(parents=True, exist_ok=True)
    config = (src / "config.pbtxt").read_text(encoding="utf-8").replace(f'name: "{source}"', f'name: "{name}"', 1)
    if versions is not None and len(versions) > 1:
        config = config.replace("latest: { num_versions: 1 }", "all: {}")
    (dest / "config.pbtxt").write_text(config, encoding="utf-8")
    base = packaged_settings(source)
    for version, overrides in (versions or {1: settings or {}}).items():
        folder = dest / str(version)
        shutil.copytree(src / "1", folder, ignore=_IGNORE, dirs_exist_ok=True)
        (folder / "model.json").write_text(json.dumps(base | dict(overrides), indent=2), encoding="utf-8")
    return dest


def one_model_repository(dest: Path, settings: Mapping[str, Any] | None = None, name: str = "tritium") -> Path:
    """A repository at `dest` holding only the packaged text model (as `name`) with `settings` applied."""
    write_model(dest, settings, name=name)
    return dest


def write_multi_lora(version_dir: Path, adapters: Mapping[str, str]) -> Path:
    """Write `multi_lora.json` ({adapter name: folder}, the vLLM backend's file; folders may be relative to
    `version_dir`) into a model's version folder; the model's `model.json` needs `enable_lora`. Returns the file."""
    path = version_dir / "multi_lora.json"
    path.write_text(json.dumps(dict(adapters), indent=2), encoding="utf-8")
    return path


def with_instance_group(config: str, group: str) -> str:
    """config.pbtxt text `config` with its instance_group replaced by `group` (added when it has none)."""
    found = _INSTANCE_GROUP.search(config)
    if found is None:
        return config + ("" if config.endswith("\n") else "\n") + group + "\n"
    depth = 0
    for end in range(found.end() - 1, len(config)):  # from its "[" to the matching "]" (gpus: [...] nest)
        depth += {"[": 1, "]": -1}.get(config[end], 0)
        if depth == 0:
            return config[:found.start()] + group + config[end + 1:]
    raise ValueError(f"config.pbtxt: its instance_group has no closing ']': {config[found.start():][:80]!r}")


def copy_with_settings(dest: Path, overrides: Mapping[str, Mapping[str, Any]],
                       source: Path = PACKAGE_REPOSITORY,
                       parameters: Mapping[str, Mapping[str, str]] | None = None,
                       instance_groups: Mapping[str, str] | None = None) -> Path:
    """A copy of the whole repository `source` at `dest`, each named model's version-1 `model.json` updated
    with its overrides ({model: settings}), its `config.pbtxt` given the string `parameters` named for it
    ({model: {key: value}}) and its instance_group replaced by the one named for it ({model: "instance_group
    [...]"}); models not named are copied as they are."""
    from tritium.client.triton.served_model import pbtxt_parameters

    shutil.copytree(source, dest, ignore=_IGNORE, dirs_exist_ok=True)
    for model, settings in overrides.items():
        path = dest / model / "1" / "model.json"
        path.write_text(json.dumps(json.loads(path.read_text(encoding="utf-8")) | dict(settings), indent=2),
                        encoding="utf-8")
    for model, params in (parameters or {}).items():
        config = dest / model / "config.pbtxt"
        text = config.read_text(encoding="utf-8")
        config.write_text(text + ("" if text.endswith("\n") else "\n") + pbtxt_parameters(params), encoding="utf-8")
    for model, group in (instance_groups or {}).items():
        config = dest / model / "config.pbtxt"
        config.write_text(with_instance_group(config.read_text(encoding="utf-8"), group), encoding="utf-8")
    return dest
