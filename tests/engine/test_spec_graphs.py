"""Verification steps on the decode-graph path (model_runner.py `_prepare_verify`, decode_graphs.py): a step whose
rows are one token plus drafts pads to its bucket and a width of 1 + the most drafts, and replays that graph; its
greedy tokens equal an eager engine's, drafts accepted or rejected. CUDA graphs cannot be captured here: the graph
path runs the same padded step uncaptured on a CPU, and the Triton kernels under the interpreter."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tritium.backend import LLM, SamplingParams

from support.checkpoints import save_tiny
from support.host_transfers import counting_host_transfers

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19], [20, 21]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
NOISE = 0.6
ENGINE = {"kv_cache_bytes": 1 << 20, "max_num_seqs": 4, "max_model_len": 128}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> tuple[Path, Path]:
    """A two-layer tiny Llama, and a copy with noise on its head that drafts for it: right often, not always."""
    root = tmp_path_factory.mktemp("spec-graphs")
    target = save_tiny("llama", root / "target", default_model_path, num_hidden_layers=2)
    draft = root / "draft"
    shutil.copytree(target, draft)
    weights = next(draft.glob("*.safetensors"))
    tensors = load_file(weights)
    noise = torch.Generator().manual_seed(0)
    head = tensors["lm_head.weight"]
    tensors["lm_head.weight"] = head + NOISE * head.std() * torch.randn(head.shape, generator=noise).to(head.dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    return target, draft


def spec_engine(make_llm: Callable[..., LLM], models: tuple[Path, Path], **kwargs: object) -> LLM:
    target, draft = models
    return make_llm(str(target), speculative_config={"method": "draft_model", "model": str(draft),
                                                     "num_speculative_tokens": 3}, **ENGINE, **kwargs)


def recording_shapes(llm: LLM) -> list[tuple[int, int]]:
    """Each graph-path step's (bucket, width), recorded as it runs."""
    graphs = llm.engine.worker.runner.graphs
    run, shapes = graphs.run, []

    def recording_run(bucket: int, forward: Callable[[], torch.Tensor], lora: bool = False,
                      width: int = 1) -> torch.Tensor:
        shapes.append((bucket, width))
        return run(bucket, forward, lora=lora, width=width)

    graphs.run = recording_run  # type: ignore[method-assign]
    return shapes


def test_verification_steps_replay_their_graph_and_give_the_eager_tokens(
        make_llm: Callable[..., LLM], models: tuple[Path, Path]) -> None:
    want = [o.token_ids for o in make_llm(str(models[0]), **ENGINE).generate(PROMPTS, GREEDY)]
    eager = spec_engine(make_llm, models, enforce_eager=True)
    assert eager.engine.worker.runner.graphs.widths == []
    assert [o.token_ids for o in eager.generate(PROMPTS, GREEDY)] == want
    llm = spec_engine(make_llm, models, enforce_eager=False)
    assert llm.engine.worker.runner.graphs.widths == [2, 3, 4]
    shapes = recording_shapes(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want
    drafted = sum(o.spec_decoding.num_draft_tokens for o in outs if o.spec_decoding is not None)
    accepted = sum(o.spec_decoding.num_accepted_tokens for o in outs if o.spec_decoding is not None)
    assert 0 < accepted < drafted  # rejected drafts too: rows of fewer drafts than the width are padded
    assert max(w for _, w in shapes) > 1


def test_a_step_that_no_graph_fits_runs_eagerly(make_llm: Callable[..., LLM], models: tuple[Path, Path]) -> None:
    """4 rows x width 4 = 16 padded tokens: over a budget of 12, the step runs eagerly, with the same tokens."""
    want = [o.token_ids for o in make_llm(str(models[0]), **ENGINE).generate(PROMPTS, GREEDY)]
    llm = spec_engine(make_llm, models, enforce_eager=False, max_num_batched_tokens=12)
    assert llm.engine.worker.runner.graphs.verify_shapes() == [(4, 2), (4, 3), (2, 2), (2, 3), (2, 4), (1, 2), (1, 3),
                                                                   (1, 4)]
    shapes = recording_shapes(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert all(b * w <= 12 for b, w in shapes) and max(w for _, w in shapes) > 1


@pytest.mark.slow  # the Triton kernels under the interpreter through many steps: CI's full run
def test_verification_graphs_on_the_triton_kernels(make_llm: Callable[..., LLM], models: tuple[Path, Path]) -> None:
    """The CPU stand-in of a GPU verification step: the padded step through the Triton kernels gives the torch
    backend's tokens, and a step fetches from the device once for its tokens (the sampler) and once for the next
    drafts (the draft model); launches are attributed to kernels/, where the interpreter reads what a GPU would not."""
    want = [o.token_ids for o in make_llm(str(models[0]), **ENGINE).generate(PROMPTS, GREEDY)]
    llm = spec_engine(make_llm, models, enforce_eager=False, attention_backend="triton")
    shapes = recording_shapes(llm)
    worker = llm.engine.worker
    execute, fetches = worker.execute, []

    def counted(*args: object, **kwargs: object) -> object:
        before = len(shapes)
        with counting_host_transfers() as found:
            out = execute(*args, **kwargs)
        if any(w > 1 for _, w in shapes[before:]):
            fetches.append([f for f in found if " at kernels/" not in f])
        return out

    worker.execute = counted  # type: ignore[method-assign]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert fetches
    for found in fetches:
        assert [f.split(" at ")[1].split(":")[0] for f in found if f.startswith("tolist")].count(
            "backend/sample/sampler.py") == 1, found
        assert len(found) <= 2, found
