"""The model a tritium server serves by name (`tritium serve --model`): resolved and checked before tritonserver
starts, named in the served models' config.pbtxt parameters, and read back from a running server by the
clients (`tritium openai`, `tritium generate`, `tritium chat`) through Triton's model-config API. The engine
is imported only by what checks a folder, so that the clients start fast."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVED_NAME = "served_model_name"  # config.pbtxt parameter: the served model's name (the OpenAI model id)
MODEL_PATH = "model_path"  # config.pbtxt parameter: its folder, on the server's host


@dataclass(frozen=True)
class ServedModel:
    """What a server says it serves: its name and folder (None when its repository does not say)."""

    name: str | None = None
    folder: str | None = None

    def parameters(self) -> dict[str, str]:
        """The config.pbtxt parameters that name it."""
        found = ((SERVED_NAME, self.name), (MODEL_PATH, self.folder))
        return {key: value for key, value in found if value is not None}

    def local_folder(self) -> Path | None:
        """Its folder when that exists on this host too."""
        return Path(self.folder) if self.folder is not None and Path(self.folder).is_dir() else None


def check_model_folder(folder: Path) -> None:
    """Read what the engine would read first, without the weights: config.json (the architecture and checkpoint
    features), the tokenizer and the names of the weight files. Raises ModelFolderError with the loader's
    message (a malformed config.json or tokenizer.json too)."""
    from tritium.backend.model_config import ModelConfig, ModelFolderError
    from tritium.backend.models.loader import weight_files
    from tritium.backend.tokenizer import Tokenizer

    try:
        ModelConfig.from_folder(folder)
    except ModelFolderError:
        raise
    except (KeyError, ValueError, TypeError) as exc:  # a config.json that is no JSON or lacks a field
        raise ModelFolderError(f"{folder / 'config.json'} cannot be read: {type(exc).__name__}: {exc}") from None
    try:
        Tokenizer(folder)
    except ModelFolderError:
        raise
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ModelFolderError(f"model folder {folder}: its tokenizer cannot be read: {exc}") from None
    weight_files(folder)


def resolve_served_model(model: str, served_name: str | None = None) -> ServedModel:
    """`model` (a Hugging Face folder, or a folder's name under the cache's models/) resolved to an absolute
    folder and checked (`check_model_folder`), named `served_name`, else as given for a name in the cache, else
    by the folder's name. Raises ModelFolderError naming what does not load."""
    from tritium.backend.model_config import ModelFolderError
    from tritium.backend.models.registry import DEFAULT_MODEL, cache_dir, resolve_model

    given = Path(model).expanduser()
    cached = cache_dir() / "models"
    if model not in ("default", DEFAULT_MODEL) and not given.is_dir() and not (cached / model).is_dir():
        raise ModelFolderError(f"no folder {model}, nor a model of that name in {cached} (`tritium models` lists "
                               "them)")
    folder = resolve_model(model, progress=True).resolve()
    check_model_folder(folder)
    by_path = given.is_dir() or model == "default"
    return ServedModel(served_name or (folder.name if by_path else model), str(folder))


def served_model_of(config: Mapping[str, Any]) -> ServedModel:
    """The served model a Triton model config (JSON, as the model-config API returns it) names."""
    params = config.get("parameters") or {}

    def value(key: str) -> str | None:
        entry = params.get(key)
        text = entry.get("string_value") if isinstance(entry, dict) else None
        return text if isinstance(text, str) and text else None

    return ServedModel(value(SERVED_NAME), value(MODEL_PATH))


def read_served_model(url: str, api_key: str | None = None, model: str = "tritium",
                      timeout: float = 5.0) -> ServedModel:
    """What the Triton model `model` at `url` (gRPC host:port, or http://host:port) says it serves. Raises
    RuntimeError when the server does not answer or does not serve `model`."""
    if url.startswith(("http://", "https://")):
        request = urllib.request.Request(f"{url.rstrip('/')}/v2/models/{urllib.parse.quote(model, safe='')}/config",
                                         headers={"x-api-key": api_key} if api_key else {})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return served_model_of(json.loads(resp.read()))
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"{url}: model {model}'s config: {exc}") from None
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    headers = {"triton-grpc-protocol-x-api-key": api_key} if api_key else None
    try:
        reply = client.get_model_config(model, headers=headers, as_json=True, client_timeout=timeout)
    except InferenceServerException as exc:
        raise RuntimeError(f"{url}: model {model}'s config: {exc}") from None
    finally:
        client.close()
    return served_model_of(reply.get("config", {}))


def pbtxt_parameters(parameters: Mapping[str, str]) -> str:
    """`parameters` as config.pbtxt lines (string values, protobuf text escapes)."""
    def quoted(text: str) -> str:
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
        return f'"{escaped}"'

    return "".join(f"parameters {{ key: {quoted(key)} value: {{ string_value: {quoted(value)} }} }}\n"
                   for key, value in parameters.items())
