"""An engine on a CPU sets its intra-op thread count once: num_threads, else sized to the host (threads.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tritium.backend import LLM, SamplingParams
from tritium.backend.config import EngineConfig
from tritium.backend.engine import LLMEngine
from tritium.backend.worker.threads import usable_cores


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_num_threads_sets_torch_threads_and_is_logged(make_llm: Callable[..., LLM], tiny_llama_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tritium.backend.worker.threads"):
        llm = make_llm(str(tiny_llama_path), kv_cache_bytes=8 << 20, num_threads=1, device="cpu")
    assert torch.get_num_threads() == 1
    threads = llm.engine.worker_info.threads
    assert threads is not None and threads.count == 1
    assert any("1 intra-op threads, num_threads is set" in r.getMessage() and "usable cores" in r.getMessage()
               for r in caplog.records)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_an_engine_uses_every_usable_core(tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), kv_cache_bytes=8 << 20, device="cpu"))
    expected = usable_cores().count
    threads = engine.worker_info.threads
    assert threads is not None and threads.count == expected
    assert torch.get_num_threads() == expected
