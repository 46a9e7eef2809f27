"""Shared fixtures: real checkpoints (the converted default model, tiny random ones made with
transformers) and a block-accounting check after every test that builds an engine."""

from __future__ import annotations

import os

# Triton kernels run through the interpreter on this CPU; the flag must be set before they are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from serve_helpers import Served, start_serve

from tritium.backend import LLM
from tritium.backend.models.registry import ensure_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def server() -> Iterator[Served]:
    """One `tritium serve` of the default model repository, shared by the end-to-end modules. When the
    session ends, no stub process and no shared memory segment may be left."""
    served = start_serve()
    yield served
    served.stop()
    assert not served.leftovers(), "stubs or shared memory segments left behind"


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return ensure_default_model(progress=False)


def _save_tiny(kind: str, dest: Path, tokenizer_from: Path, shard: bool = False, **overrides: object) -> Path:
    import transformers

    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.2,
    )
    common.update(overrides)
    if kind == "llama":
        config = transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=10000.0, **common)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(tie_word_embeddings=False, sliding_window=None, **common)
        cls = transformers.MistralForCausalLM
    else:
        config = transformers.Qwen2Config(tie_word_embeddings=True, rope_theta=1000000.0, **common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(1234)
    model = cls(config).eval()
    model.save_pretrained(dest, max_shard_size="2MB" if shard else "5GB")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, dest / name)
    return dest


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return _save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"), default_model_path)


@pytest.fixture(scope="session")
def tiny_llama_sharded_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return _save_tiny("llama", tmp_path_factory.mktemp("tiny-llama-sharded"), default_model_path, shard=True)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return _save_tiny("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), default_model_path)


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """Build LLMs; after the test, every one of them must have all its KV blocks free and no
    request left (no leaks, aborts included)."""
    made: list[LLM] = []

    def factory(*args: object, **kwargs: object) -> LLM:
        llm = LLM(*args, **kwargs)  # type: ignore[arg-type]
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        engine = llm.engine
        while engine.has_unfinished_requests() and not engine.requests:
            engine.step()  # deliver pending abort outputs
        assert not engine.requests, f"requests left in the engine: {list(engine.requests)}"
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
        assert all(r == 0 for r in bm.ref_counts)
        assert engine.runner.block_tables.rows_in_use == 0, "block-table rows leaked"
