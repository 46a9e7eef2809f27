"""Decode steps with adapter rows on the decode-graph path (decode_graphs.py, model_runner.py): each bucket keeps a
LoRA graph beside its base graph, a LoRA decode step stages one slot per padded row (-1 for base and padding
rows) first in the staging buffer, so at the same offsets as the captured step, and its tokens equal an eager
engine's. CUDA graphs cannot be captured here: the graph path runs the same padded buffers eagerly on a CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tritium.backend import LLM, SamplingParams
from tritium.backend.model_config import ModelConfig
from tritium.backend.worker.decode_graphs import DecodeGraphs

from support.checkpoints import save_tiny
from support.lora import write_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18]]
NAMES: list[str | None] = ["a", None, "b", "a"]


class StandInCapture:
    """GraphCapture's interface: 'captures' by running the forward once; the replay hands back that output."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        return (lambda: None), forward()


def test_each_bucket_keeps_a_lora_graph_beside_the_base_one() -> None:
    graphs = DecodeGraphs([2, 4], torch.device("cpu"), StandInCapture())  # type: ignore[arg-type]
    for bucket in (4, 2):
        graphs.capture(bucket, lambda b=bucket: torch.full((b,), 1.0))
        graphs.capture(bucket, lambda b=bucket: torch.full((b,), 2.0), lora=True)
    assert graphs.captured() == [(2, 1, False), (2, 1, True), (4, 1, False), (4, 1, True)]
    assert graphs.run(4, lambda: torch.zeros(1)).tolist() == [1.0] * 4
    assert graphs.run(4, lambda: torch.zeros(1), lora=True).tolist() == [2.0] * 4


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> tuple[Path, dict[str, str]]:
    """A one-layer tiny Llama and two adapters on it (rank 8 on attention, rank 16 on all seven modules)."""
    root = tmp_path_factory.mktemp("lora-graphs")
    path = save_tiny("llama", root / "model", default_model_path, num_hidden_layers=1)
    cfg = ModelConfig.from_folder(path)
    adapters = {"a": write_adapter(root / "a", cfg, 8, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=1),
                "b": write_adapter(root / "b", cfg, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"), seed=2)}
    return path, {name: str(folder) for name, folder in adapters.items()}


def generate(make_llm: Callable[..., LLM], one_layer: tuple[Path, dict[str, str]], **kwargs: object
             ) -> tuple[list[list[int]], list[tuple[bool, list[int]]]]:
    """The batch's tokens, and per decode step on the graph path: (LoRA graph?, the row slots it read)."""
    path, modules = one_layer
    llm = make_llm(str(path), enable_lora=True, lora_modules=modules, kv_cache_bytes=1 << 20, max_num_seqs=4,
                   **kwargs)
    runner = llm.engine.worker.runner
    seen: list[tuple[bool, list[int]]] = []
    run = runner.graphs.run

    def recording_run(bucket: int, forward: Callable[[], torch.Tensor], lora: bool = False,
                      width: int = 1) -> torch.Tensor:
        seen.append((lora, runner.staging.device_buffer[:bucket].tolist() if lora else []))
        return run(bucket, forward, lora=lora, width=width)

    runner.graphs.run = recording_run
    outputs = llm.generate(PROMPTS, GREEDY, lora_name=NAMES)
    return [o.token_ids for o in outputs], seen


def test_lora_decode_steps_replay_their_buckets_lora_graph(
        make_llm: Callable[..., LLM], one_layer: tuple[Path, dict[str, str]]) -> None:
    eager, none = generate(make_llm, one_layer, enforce_eager=True)
    assert none == []
    tokens, seen = generate(make_llm, one_layer, enforce_eager=False)
    assert tokens == eager
    lora_steps = [slots for lora, slots in seen if lora]
    assert lora_steps and all(len(slots) == 4 for slots in lora_steps)  # bucket 4: row slots first, padded
    for slots in lora_steps:  # two adapters in two slots: rows of "a" share one, the base row is -1
        assert slots.count(-1) >= 1 and len({s for s in slots if s >= 0}) <= 2


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
def test_the_triton_kernels_serve_lora_steps_as_the_torch_ops_do(
        make_llm: Callable[..., LLM], one_layer: tuple[Path, dict[str, str]]) -> None:
    """The triton attention backend (interpreter) runs kernels/lora.py: segmented for prefill, per row on the
    decode-graph path; fp32 tokens equal the torch backend's."""
    want, _ = generate(make_llm, one_layer, enforce_eager=True)
    got, seen = generate(make_llm, one_layer, enforce_eager=False, attention_backend="triton")
    assert any(lora for lora, _ in seen)
    assert got == want


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
def test_a_lora_engine_serves_only_kernel_variants_its_warm_up_launched(
        make_llm: Callable[..., LLM], one_layer: tuple[Path, dict[str, str]]) -> None:
    """The LoRA kernels an engine launches while serving (eager prefill and mixed steps, decode graphs) are all
    among those its warm-up built, as the JIT keys them on sm_90: nothing compiles mid-serving."""
    from tritium.kernels.compile_check import Specializer, recording

    path, modules = one_layer
    with recording(run=True) as warm:
        llm = make_llm(str(path), enable_lora=True, lora_modules=modules, kv_cache_bytes=1 << 20, max_num_seqs=4,
                       attention_backend="triton", enforce_eager=False)
    with recording(run=True) as served:
        llm.generate(PROMPTS, GREEDY, lora_name=NAMES)
    spec = Specializer(90)
    warmed = {spec.variant(launch) for launch in warm}
    lora = {spec.variant(launch) for launch in served if launch.kernel.fn.__name__.startswith("lora_")}
    assert {v.kernel for v in lora} == {"lora_shrink_kernel", "lora_expand_kernel", "lora_shrink_rows_kernel",
                                        "lora_expand_rows_kernel"}
    assert lora <= warmed, sorted({(v.kernel, v.equal_to_1, v.divisible_by_16) for v in lora - warmed})


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
def test_a_lora_decode_step_launches_two_lora_kernels_per_projection_and_fetches_once(
        make_llm: Callable[..., LLM], one_layer: tuple[Path, dict[str, str]]) -> None:
    """The CPU stand-in of a GPU LoRA decode step (triton backend, graph path): per layer one shrink and one expand
    per fused projection (q/k/v, o, gate/up, down: 8; one launch per module took 14), and one host fetch per step,
    the sampler's (launches are attributed to kernels/, where the interpreter reads tensors a GPU would not)."""
    from tritium.kernels.compile_check import recording

    from support.host_transfers import counting_host_transfers

    path, modules = one_layer
    llm = make_llm(str(path), enable_lora=True, lora_modules=modules, kv_cache_bytes=1 << 20, max_num_seqs=4,
                   attention_backend="triton", enforce_eager=False)
    worker, runner = llm.engine.worker, llm.engine.worker.runner
    steps: list[tuple[bool, list[str], list[str]]] = []  # (a LoRA decode graph?, its launches, its host fetches)
    step, run = worker.execute, runner.graphs.run
    lora_step = [False]

    def recording_run(bucket: int, forward: Callable[[], torch.Tensor], lora: bool = False,
                      width: int = 1) -> torch.Tensor:
        lora_step[0] = lora
        return run(bucket, forward, lora=lora, width=width)

    def counted_step(*args: object, **kwargs: object) -> object:
        lora_step[0] = False
        with recording(run=True) as launches, counting_host_transfers() as found:
            out = step(*args, **kwargs)
        names = [launch.kernel.fn.__name__ if hasattr(launch.kernel, "fn") else launch.kernel.__name__
                 for launch in launches]
        steps.append((lora_step[0], names, [f for f in found if " at kernels/" not in f]))
        return out

    runner.graphs.run = recording_run
    worker.execute = counted_step
    llm.generate(PROMPTS, GREEDY, lora_name=NAMES)
    decode = [(names, fetches) for lora, names, fetches in steps if lora]
    assert decode
    layers = ModelConfig.from_folder(path).num_hidden_layers
    for names, fetches in decode:
        lora_launches = [n for n in names if n.startswith("lora_")]
        assert len(lora_launches) == 8 * layers, lora_launches
        assert lora_launches.count("lora_shrink_rows_kernel") == 4 * layers
        assert len(fetches) == 1 and fetches[0].startswith("tolist at backend/sample/sampler.py"), fetches
