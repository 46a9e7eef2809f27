"""Shared fixtures: real checkpoints (the converted default model, tiny random ones made with
transformers) and a block-accounting check after every test that builds an engine."""

from __future__ import annotations

import os

# Triton kernels run through the interpreter on this CPU; the flag must be set before they are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# xdist workers share the host's cores: each worker's OpenMP threads must fit its share, or every torch op's
# barrier waits on a thread the other worker preempted (the engine tier ran ~3x slower at 2 threads x 2 workers).
# Set before torch is imported; the engine and the servers the tests start honour OMP_NUM_THREADS.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _share = len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, _share))

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tritium.backend import LLM
from tritium.backend.models.registry import ensure_default_model

from support.checkpoints import save_tiny
from support.serving import Served, start_serve


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




@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"), default_model_path)


@pytest.fixture(scope="session")
def tiny_llama_sharded_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("tiny-llama-sharded"), default_model_path, shard=True)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return save_tiny("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), default_model_path)


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
        assert not engine.worker.held_requests(), "the worker holds state of finished requests"
        llm.shutdown()  # a tensor-parallel engine's rank processes end here


TIERS = ("unit", "kernels", "engine", "server")
NOT_BATCH_INVARIANT = (
    "batch_invariant: the same tokens alone or in a batch hold on a CPU only; on CUDA (the engines' 'auto' device "
    "here) cuBLAS algorithms and decode split counts vary with the batch, so near-ties can flip (docs/kernels.md; "
    "gpu-check's parity step compares batched greedy tokens with the bf16 top-k rule instead)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The folder sets a test's tier: tests/<tier>/ marks it `<tier>`; a server test is also `slow` (it starts a
    tritonserver), so `-m "not slow"` is the inner loop without servers. Where the engines would run on CUDA,
    tests marked `batch_invariant` (exact tokens alone vs in a batch) are skipped with the reason."""
    root = Path(__file__).parent
    on_cuda = torch.cuda.is_available()
    for item in items:
        tier = Path(item.fspath).relative_to(root).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
            if tier == "server":
                item.add_marker(pytest.mark.slow)
        if on_cuda and item.get_closest_marker("batch_invariant") is not None:
            item.add_marker(pytest.mark.skip(reason=NOT_BATCH_INVARIANT))
