"""LoRA adapters on the tiny Llama: transformers parity with the adapter merged, mixed batches (base and three
adapters) under preemption and prefix hits, reloads, waiting for a slot, run-time unload, refusals."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tritium.backend import LLM, SamplingParams
from tritium.backend.lora.adapter import LoraAdapterError
from tritium.backend.model_config import ModelConfig

from support.hf_reference import hf_greedy
from support.lora import merge_adapter, write_adapter

TEXTS = ["The quick brown fox jumps over the lazy dog while the cat sleeps",
         "Once upon a time in a land far away, there lived a king who had three daughters and a dog",
         "def add(a, b):", "Hi"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# name -> (rank, targets, seed, use_rslora)
ADAPTERS = {
    "attn8": (8, ("q_proj", "k_proj", "v_proj", "o_proj"), 1, False),
    "mlp16": (16, ("gate_proj", "up_proj", "down_proj"), 2, False),
    "all8": (8, ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "k_proj"), 3, True),
}
Names = list[str | None]


@pytest.fixture(scope="module")
def adapters(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    cfg = ModelConfig.from_folder(tiny_llama_path)
    folders = {name: write_adapter(root / name, cfg, rank, targets, seed, use_rslora=rslora)
               for name, (rank, targets, seed, rslora) in ADAPTERS.items()}
    folders["attn8-v2"] = write_adapter(root / "attn8-v2", cfg, 8, ADAPTERS["attn8"][1], seed=11)
    return folders


@pytest.fixture(scope="module")
def prompts(tiny_llama_path: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama_path), kv_cache_bytes=1 << 20)
    return [llm.tokenizer.encode(t) for t in TEXTS]


def lora_llm(make_llm: Callable[..., LLM], path: Path, adapters: dict[str, Path], **kwargs: object) -> LLM:
    modules = {name: str(adapters[name]) for name in ADAPTERS}
    return make_llm(str(path), enable_lora=True, lora_modules=modules, **{"kv_cache_bytes": 4 << 20, **kwargs})


@pytest.fixture(scope="module")
def solo(tiny_llama_path: Path, adapters: dict[str, Path],
         prompts: list[list[int]]) -> dict[str | None, list[list[int]]]:
    """Each prompt's tokens alone, per adapter (None: the base model), no prefix cache."""
    modules = {name: str(adapters[name]) for name in ADAPTERS}
    llm = LLM(str(tiny_llama_path), enable_lora=True, lora_modules=modules, kv_cache_bytes=4 << 20,
              enable_prefix_caching=False)
    return {name: [llm.generate([p], GREEDY, lora_name=name)[0].token_ids for p in prompts]
            for name in [None, *ADAPTERS]}


def test_adapters_match_transformers_with_the_adapter_merged(
        tiny_llama_path: Path, adapters: dict[str, Path], prompts: list[list[int]],
        solo: dict[str | None, list[list[int]]], tmp_path: Path) -> None:
    assert solo[None] == hf_greedy(tiny_llama_path, prompts, 10)
    for name in ADAPTERS:
        merged = merge_adapter(tiny_llama_path, adapters[name], tmp_path / name)
        assert solo[name] == hf_greedy(merged, prompts, 10), name
        assert solo[name] != solo[None], f"{name} changes nothing: the fixture is too weak"


def mixed(prompts: list[list[int]]) -> tuple[list[list[int]], Names]:
    names: Names = [None, *ADAPTERS]
    pairs = [(p, n) for i, p in enumerate(prompts) for n in names[i % 4:] + names[: i % 4]]
    return [p for p, _ in pairs], [n for _, n in pairs]


def expected(solo: dict[str | None, list[list[int]]], prompts: list[list[int]], batch: list[list[int]],
             names: Names) -> list[list[int]]:
    return [solo[n][prompts.index(p)] for p, n in zip(batch, names, strict=True)]


@pytest.mark.batch_invariant
def test_a_mixed_batch_gives_each_request_its_solo_tokens(
        make_llm: Callable[..., LLM], tiny_llama_path: Path, adapters: dict[str, Path], prompts: list[list[int]],
        solo: dict[str | None, list[list[int]]]) -> None:
    batch, names = mixed(prompts)
    # enforce_eager=False: decode steps on the graph path's buckets, those with adapter rows on the LoRA graph path
    llm = lora_llm(make_llm, tiny_llama_path, adapters, enforce_eager=False, block_size=8)
    assert [o.token_ids for o in llm.generate(batch, GREEDY, lora_name=names)] == expected(solo, prompts, batch, names)
    hits = llm.engine.block_manager.prefix_hit_tokens
    again = llm.generate(batch, GREEDY, lora_name=names)  # every full prompt block now comes from the cache
    assert llm.engine.block_manager.prefix_hit_tokens > hits
    assert [o.token_ids for o in again] == expected(solo, prompts, batch, names)
    chunked = lora_llm(make_llm, tiny_llama_path, adapters, max_num_seqs=3, max_num_batched_tokens=7)
    assert [o.token_ids for o in chunked.generate(batch, GREEDY, lora_name=names)] == \
        expected(solo, prompts, batch, names)


@pytest.mark.batch_invariant
@pytest.mark.parametrize("kernel", [True, False])
def test_decode_rows_laid_out_by_adapter_give_each_request_its_solo_tokens(
        make_llm: Callable[..., LLM], tiny_llama_path: Path, adapters: dict[str, Path], prompts: list[list[int]],
        solo: dict[str | None, list[list[int]]], kernel: bool) -> None:
    """Eager decode steps put their rows in windows by adapter: packed for the CPU kernel, evenly with base rows
    as fillers for the torch form (as on a machine where the kernel cannot be built), which takes the padded
    form when there are too few (the second batch: adapters only, in uneven numbers)."""
    llm = lora_llm(make_llm, tiny_llama_path, adapters)
    runner = llm.engine.worker.runner
    assert runner.cpu_lora is not None, "the CPU LoRA kernel must build on the test machine"
    if not kernel:
        runner.cpu_lora = None
    batch, names = mixed(prompts)
    assert [o.token_ids for o in llm.generate(batch, GREEDY, lora_name=names)] == expected(solo, prompts, batch, names)
    only = [(p, n) for p, n in zip(batch, names, strict=True) if n is not None][1:]
    batch, names = [p for p, _ in only], [n for _, n in only]
    assert len(set(names)) > 1 and len({names.count(n) for n in set(names)}) > 1  # uneven
    assert [o.token_ids for o in llm.generate(batch, GREEDY, lora_name=names)] == expected(solo, prompts, batch, names)


@pytest.mark.batch_invariant
def test_a_mixed_batch_under_preemption(make_llm: Callable[..., LLM], tiny_llama_path: Path,
                                        adapters: dict[str, Path], prompts: list[list[int]],
                                        solo: dict[str | None, list[list[int]]]) -> None:
    batch, names = mixed(prompts)
    llm = lora_llm(make_llm, tiny_llama_path, adapters, block_size=8, kv_cache_bytes=8 * 8 * 768, max_model_len=64)
    assert [o.token_ids for o in llm.generate(batch, GREEDY, lora_name=names)] == expected(solo, prompts, batch, names)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.lora is not None and llm.engine.lora.num_pinned() == 0  # every slot released


@pytest.mark.batch_invariant
def test_one_slot_two_adapters_in_flight_all_finish(make_llm: Callable[..., LLM], tiny_llama_path: Path,
                                                    adapters: dict[str, Path], prompts: list[list[int]],
                                                    solo: dict[str | None, list[list[int]]]) -> None:
    llm = lora_llm(make_llm, tiny_llama_path, adapters, max_loras=1)
    batch, names = mixed(prompts)
    assert [o.token_ids for o in llm.generate(batch, GREEDY, lora_name=names)] == expected(solo, prompts, batch, names)
    assert llm.engine.lora is not None and llm.engine.lora.num_pinned() == 0


def test_a_reload_under_the_same_name_never_hits_the_old_blocks(
        make_llm: Callable[..., LLM], tiny_llama_path: Path, adapters: dict[str, Path],
        prompts: list[list[int]], solo: dict[str | None, list[list[int]]], tmp_path: Path) -> None:
    llm = lora_llm(make_llm, tiny_llama_path, adapters, block_size=8)
    long = prompts[1]  # several full blocks
    assert llm.generate([long], GREEDY, lora_name="attn8")[0].token_ids == solo["attn8"][1]
    llm.unload_lora("attn8")
    llm.load_lora("attn8", adapters["attn8-v2"])
    new = llm.generate([long], GREEDY, lora_name="attn8")[0].token_ids
    merged = merge_adapter(tiny_llama_path, adapters["attn8-v2"], tmp_path / "v2")
    assert new == hf_greedy(merged, [long], 10)[0] != solo["attn8"][1]


def test_unload_lets_running_requests_finish(make_llm: Callable[..., LLM], tiny_llama_path: Path,
                                             adapters: dict[str, Path], prompts: list[list[int]],
                                             solo: dict[str | None, list[list[int]]]) -> None:
    llm = lora_llm(make_llm, tiny_llama_path, adapters, max_loras=2)
    engine = llm.engine
    engine.add_request("running", None, GREEDY, prompt_token_ids=prompts[0], lora_name="mlp16")
    engine.add_request("queued", None, GREEDY, prompt_token_ids=prompts[2], lora_name="mlp16")
    engine.step()
    llm.unload_lora("mlp16")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'mlp16'"):
        engine.add_request("late", None, GREEDY, prompt_token_ids=prompts[0], lora_name="mlp16")
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert final == {"running": solo["mlp16"][0], "queued": solo["mlp16"][2]}
    assert engine.lora is not None and "mlp16" not in engine.lora.resident()


def test_bad_names_and_adapters_are_refused(make_llm: Callable[..., LLM], tiny_llama_path: Path,
                                            adapters: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(LoraAdapterError, match="mlp16: rank 16 exceeds max_lora_rank 8"):  # at start
        lora_llm(make_llm, tiny_llama_path, adapters, max_lora_rank=8)
    llm = make_llm(str(tiny_llama_path), enable_lora=True, max_lora_rank=8, kv_cache_bytes=1 << 20,
                   lora_modules={"attn8": str(adapters["attn8"])})
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        llm.generate(["Hi"], GREEDY, lora_name="nope")
    with pytest.raises(ValueError, match="got 1 lora names for 2 prompts"):
        llm.generate(["Hi", "there"], GREEDY, lora_name=["attn8"])
    with pytest.raises(LoraAdapterError, match="rank 16 exceeds max_lora_rank 8"):
        llm.load_lora("big", adapters["mlp16"])
    with pytest.raises(ValueError, match="'attn8' is loaded already"):
        llm.load_lora("attn8", adapters["attn8-v2"])
    with pytest.raises(ValueError, match="unknown LoRA adapter 'gone'"):
        llm.unload_lora("gone")
    assert not llm.engine.requests
    base = make_llm(str(tiny_llama_path), kv_cache_bytes=1 << 20)
    assert base.engine.lora is None and base.engine.worker_info.lora_stacks is None
    with pytest.raises(ValueError, match="enable_lora is off"):
        base.generate(["Hi"], GREEDY, lora_name="attn8")
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        LLM(str(tiny_llama_path), lora_modules={"a": str(adapters["attn8"])})
    with pytest.raises(ValueError, match="max_loras must be an integer in"):
        LLM(str(tiny_llama_path), enable_lora=True, max_loras=0)
