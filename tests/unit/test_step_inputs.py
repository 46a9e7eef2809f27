"""The CUDA code paths on a CPU: step inputs staged in one buffer and copied once, block tables kept on the
device and updated incrementally, decode steps padded to graph buckets, sampling on the logits' device
with one fetch of the sampled ids per step and nothing else that would sync a device."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tritium.backend import LLM
from tritium.backend.config import EngineConfig
from tritium.backend.core.sequence import Sequence
from tritium.backend.engine import LLMEngine
from tritium.backend.models.random_checkpoint import write_random_llama
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.worker.block_tables import DeviceBlockTables
from tritium.backend.worker.decode_graphs import graph_buckets
from tritium.backend.worker.staging import StagingBuffer, StagingOverflow


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("random-llama"), default_model_path)


def test_staging_round_trips_ints_and_floats_in_one_buffer() -> None:
    st = StagingBuffer(16, torch.device("cpu"))
    st.begin()
    ids = st.put([5, 6, 7], pad_to=5, fill=-1)
    temps = st.put_floats([0.5, 2.0])
    st.upload()
    assert st.ints(ids).tolist() == [5, 6, 7, -1, -1]
    assert st.floats(temps).tolist() == [0.5, 2.0]
    st.begin()
    assert st.put([1]) == slice(0, 1)  # every step starts at the front: a graph's views stay valid
    with pytest.raises(StagingOverflow):
        st.put(list(range(16)))


def _seq(request_id: str, table: list[int]) -> Sequence:
    seq = Sequence(request_id, None, [1, 2, 3], SamplingParams(), 0)
    seq.block_table = table
    return seq


def test_block_tables_send_only_new_blocks_and_rewrite_a_replaced_table() -> None:
    tables = DeviceBlockTables(max_seqs=2, max_blocks_per_seq=4, device=torch.device("cpu"))
    a, b = _seq("a", [7, 3]), _seq("b", [9])
    row_a, row_b = tables.row(a), tables.row(b)
    assert tables.take_updates() == ([row_a * 4, row_a * 4 + 1, row_b * 4], [7, 3, 9])
    a.block_table.append(5)
    assert tables.row(a) == row_a
    assert tables.take_updates() == ([row_a * 4 + 2], [5])
    tables.row(a)
    assert tables.take_updates() == ([], [])
    a.block_table = [11]  # preempted and readmitted: a new list
    tables.row(a)
    index, value = tables.take_updates()
    assert (index, value) == ([row_a * 4], [11])
    tables.apply(torch.tensor(index, dtype=torch.int32), torch.tensor(value, dtype=torch.int32))
    assert tables.tensor[row_a, 0] == 11 and tables.tensor[tables.padding_row].eq(0).all()
    tables.release("b")
    c = _seq("c", [1])
    assert tables.row(c) == row_b  # b's row is reused
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        tables.row(_seq("d", [2]))


def test_graph_buckets() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ]


PROMPTS = ["Once upon a time", "The capital of France is", "1 2 3 4 5", "def main():", "Hello there, how"]


def test_the_graph_path_gives_the_eager_tokens(make_llm: Callable[..., LLM], random_llama: Path) -> None:
    """Decode steps padded to buckets (5 sequences run as 8, then 4, 2, 1 as they finish) on the static
    buffers give exactly the tokens of eager steps, greedy and seeded alike."""
    texts = {}
    for eager in (True, False):
        llm = make_llm(str(random_llama), enforce_eager=eager, max_num_seqs=8)
        assert bool(llm.engine.worker_info.graph_buckets) == (not eager)
        texts[eager] = [o.token_ids for o in llm.generate(PROMPTS, _mixed_params())]
    assert texts[False] == texts[True]


class SyncCounter:
    """Counts the calls that would make a host wait for a device, or build a tensor from host data."""

    NAMES = ("item", "tolist", "cpu", "numpy")
    BUILDERS = ("tensor", "as_tensor", "from_numpy", "asarray")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        self.active = False
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        for name in self.BUILDERS:
            monkeypatch.setattr(torch, name, self._wrap(name, getattr(torch, name)))

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def counted(*args: object, **kwargs: object) -> object:
            if self.active:
                self.counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    def __enter__(self) -> SyncCounter:
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False


@pytest.fixture
def free_model_engine(random_llama: Path) -> Iterator[LLMEngine]:
    """An engine whose model forward costs nothing (zeros of the right shape): what is left is the step's
    own host work."""
    engine = LLMEngine(EngineConfig(model=str(random_llama), max_num_seqs=8, enforce_eager=False))
    hidden = torch.zeros(1024, engine.model_config.hidden_size)
    runner = engine.worker.runner
    runner.forward = lambda step: hidden[: step.num_tokens]  # type: ignore[method-assign]
    yield engine
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.step()


def test_a_decode_step_makes_one_fetch_and_builds_no_host_tensors(free_model_engine: LLMEngine,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    engine = free_model_engine
    for i, params in enumerate(_mixed_params()):
        params.max_tokens = 50
        engine.add_request(f"r{i}", PROMPTS[i], params)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.requests.values()):
        engine.step()  # prefills
    counter = SyncCounter(monkeypatch)
    steps = 5
    with counter:
        for _ in range(steps):
            outputs = engine.step()
            assert len(outputs) == 5 and not any(o.finished for o in outputs)
    assert counter.counts == Counter({"tolist": steps}), counter.counts  # the sampled ids, once a step


def test_the_sync_counter_sees_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = SyncCounter(monkeypatch)
    with counter:
        torch.tensor([1, 2]).sum().item()
    assert counter.counts == Counter({"tensor": 1, "item": 1})
