"""The whole engine through the Triton kernels (interpreter) gives the torch backend's greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tritium.backend import LLM, SamplingParams

from support.checkpoints import save_tiny


@pytest.fixture(scope="module")
def micro_llama(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("micro"), default_model_path, num_hidden_layers=2,
                      hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)


def run(llm: LLM) -> list[list[int]]:
    """A batch that mixes a chunked prefill, plain prefills, decodes and a prefix-cache hit."""
    engine = llm.engine
    shared = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 + 8
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("long", None, params, prompt_token_ids=[*shared, 7, 8])
    engine.add_request("short", None, params, prompt_token_ids=[5, 6, 7])
    outputs: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        steps += 1
        if steps == 3:  # "long" has its blocks cached by now; this one reuses them
            engine.add_request("hit", None, params, prompt_token_ids=[*shared, 9, 10, 11])
            engine.add_request("late", None, params, prompt_token_ids=[11, 12])
    assert engine.block_manager.prefix_hit_tokens >= 32
    return [outputs[k] for k in ("long", "short", "hit", "late")]


@pytest.mark.slow
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graph-path"])
def test_triton_backend_matches_torch_backend(make_llm: Callable[..., LLM], micro_llama: Path,
                                              enforce_eager: bool) -> None:
    """With enforce_eager False the decode steps run padded to their bucket (3 sequences as 4) on the static
    buffers, through the Triton kernels, as a CUDA graph would replay them."""
    kwargs = dict(kv_cache_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=20)
    torch_llm = make_llm(str(micro_llama), attention_backend="torch", enforce_eager=True, **kwargs)
    triton_llm = make_llm(str(micro_llama), attention_backend="triton", enforce_eager=enforce_eager, **kwargs)
    info = triton_llm.engine.worker_info
    assert info.attention_backend == "triton"
    assert info.graph_buckets == ([] if enforce_eager else [1, 2, 4])
    assert run(triton_llm) == run(torch_llm)
