"""Random checkpoints written by transformers (its own initialization) with a real tokenizer, for the benchmarks
and the GPU check: the model families at chosen shapes."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path
from typing import Any

from tritium.backend.models.random_checkpoint import CONFIG_FILES, TOKENIZER_FILES


def save_random_model(config: Any, dest: Path, tokenizer_from: Path, dtype: Any = None, device: str = "cpu") -> Path:
    """Write a model of transformers `config` (seed 0; fp32 unless `dtype`, drawn on `device`) into `dest`, with the
    tokenizer files and chat template of `tokenizer_from`. Returns `dest`."""
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model.save_pretrained(dest)
    del model
    gc.collect()
    for name in (*TOKENIZER_FILES, *CONFIG_FILES):
        if (tokenizer_from / name).exists() and name != "generation_config.json":
            shutil.copy(tokenizer_from / name, dest / name)
    return dest
