"""Runtime LoRA load / unload / list through the Triton request parameter `lora_admin`
(docs/lora.md#runtime-load-and-unload-through-triton)."""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tritium.backend.engine import LLMEngine

ADMIN_PARAMETER = "lora_admin"
KEY_PARAMETER = "admin_key"
ADMIN_KEY_ENV = "TRITIUM_ADMIN_KEY"
ACTIONS = {"load": ("lora_name", "lora_path"), "unload": ("lora_name",), "list": ()}  # action -> its fields
DISABLED = "forbidden: runtime LoRA updates are disabled: set admin_key in model.json"
WRONG_KEY = "forbidden: lora_admin load/unload needs the request parameter admin_key with the model's admin key"


class AdminRefused(Exception):
    """A load/unload without the right admin key (or with none configured); the message says which."""


@dataclass(frozen=True)
class LoraAdminAction:
    action: str
    lora_name: str | None = None
    lora_path: str | None = None

    @property
    def changes_state(self) -> bool:
        """Whether it loads or unloads (and so needs the admin key)."""
        return self.action != "list"


def parse_admin_action(raw: Any) -> LoraAdminAction:
    """A `lora_admin` parameter's action (JSON text). Raises ValueError naming the field and the rule."""
    if not isinstance(raw, str):
        raise ValueError(f"{ADMIN_PARAMETER} must be a JSON object in a string, got {type(raw).__name__}")
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        raise ValueError(f"{ADMIN_PARAMETER} must be a JSON object, got text that is not JSON") from None
    if not isinstance(value, dict):
        raise ValueError(f"{ADMIN_PARAMETER} must be a JSON object, got {type(value).__name__}")
    action = value.get("action")
    if action not in ACTIONS:
        raise ValueError(f"{ADMIN_PARAMETER}.action must be one of {', '.join(ACTIONS)}, got {action!r}")
    wanted = ACTIONS[action]
    extra = sorted(set(value) - {"action", *wanted})
    if extra:
        raise ValueError(f"{ADMIN_PARAMETER}: action {action!r} takes no {', '.join(extra)}")
    for name in wanted:
        field = value.get(name)
        if not isinstance(field, str) or not field:
            raise ValueError(f"{ADMIN_PARAMETER}: action {action!r} needs {name} as a non-empty string")
    return LoraAdminAction(action, value.get("lora_name"), value.get("lora_path"))


def configured_admin_key(model_key: str | None, environ: Mapping[str, str]) -> str | None:
    """The key load/unload need: model.json's `admin_key`, else `$TRITIUM_ADMIN_KEY`, else None (disabled)."""
    return model_key or environ.get(ADMIN_KEY_ENV) or None


def check_admin_key(action: LoraAdminAction, given: Any, configured: str | None) -> None:
    """Raises AdminRefused when `action` loads or unloads and `given` is not the `configured` key (compared in
    constant time), or none is configured."""
    if not action.changes_state:
        return
    if configured is None:
        raise AdminRefused(DISABLED)
    if not isinstance(given, str) or not hmac.compare_digest(given.encode("utf-8"), configured.encode("utf-8")):
        raise AdminRefused(WRONG_KEY)


def run_admin_action(engine: LLMEngine, action: LoraAdminAction, version_dir: Path) -> str:
    """Engine thread only. Returns `lora_report`'s JSON after the action; a relative `lora_path` is taken in
    `version_dir`. Raises ValueError with the engine's message."""
    if action.action == "load":
        assert action.lora_name is not None and action.lora_path is not None
        folder = Path(action.lora_path).expanduser()
        engine.load_lora(action.lora_name, folder if folder.is_absolute() else version_dir / folder)
    elif action.action == "unload":
        assert action.lora_name is not None
        engine.unload_lora(action.lora_name)
    return json.dumps(lora_report(engine))


def lora_report(engine: LLMEngine) -> dict[str, Any]:
    """`{"adapters": [{"name", "path", "rank", "targets"}], "max_loras": N}`: the adapters requests may name now
    (sorted by name; targets in the model's module order) and the device slots (0 when LoRA is off)."""
    from tritium.backend.lora.adapter import MODULES

    if engine.lora is None:
        return {"adapters": [], "max_loras": 0}
    adapters = []
    for name, adapter in sorted(engine.lora.adapters.items()):
        modules = {module for _, module in adapter.weights}
        adapters.append({"name": name, "path": str(adapter.folder), "rank": adapter.rank,
                         "targets": [m for m in MODULES if m in modules]})
    return {"adapters": adapters, "max_loras": engine.lora.max_loras}
