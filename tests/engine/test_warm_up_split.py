"""Warm-up prefills of max_num_batched_tokens tokens when that exceeds max_model_len: split into sequences
that fit a block-table row; a step whose rows need more columns than a row has is refused in staging."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tritium.backend import LLM, SamplingParams
from tritium.backend.worker.model_runner import split_tokens, warm_up_prefills


def test_warm_up_prefills_fit_max_model_len() -> None:
    assert warm_up_prefills(1024, 2048, 64, cuda=True) == [[1], [64], [1024]]
    assert warm_up_prefills(1024, 2048, 64, cuda=False) == [[1]]
    assert warm_up_prefills(1000, 256, 64, cuda=True) == [[1], [64], [256, 256, 256, 232]]
    assert warm_up_prefills(1024, 100, 4, cuda=True) == [[1], [64], [100, 100, 100, 100]]  # max_num_seqs rows
    assert warm_up_prefills(8, 1, 8, cuda=True) == [[1], [1] * 8]
    assert split_tokens(2, 1) == [1, 1] and split_tokens(5, 5) == [5]


@pytest.fixture
def short(make_llm: Callable[..., LLM], tiny_llama_path: Path) -> LLM:
    # max_num_batched_tokens (512) > max_model_len (128): the CUDA warm-up's largest prefill is 4 sequences
    return make_llm(str(tiny_llama_path), kv_cache_bytes=16 << 20, max_model_len=128, max_num_batched_tokens=512)


def test_an_engine_whose_token_budget_exceeds_max_model_len_starts_and_generates(short: LLM) -> None:
    runner = short.engine.worker.runner
    for prefill in warm_up_prefills(512, runner.max_model_len, runner.max_num_seqs, cuda=True):  # as on CUDA
        logits = runner.execute(runner._dummy_step(num_decode=0, prefill=prefill))
        assert logits.shape[0] == 1 and bool(logits.isfinite().all())
    outs = short.generate(["Once upon a time", "hello"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8]


def test_staging_refuses_a_step_wider_than_a_block_table_row(short: LLM) -> None:
    runner = short.engine.worker.runner
    width = runner.block_tables.width
    with pytest.raises(RuntimeError, match=rf"prefill rows need {width + 1} block-table columns; a row has {width}"):
        runner._dummy_step(num_decode=0, prefill=[runner.max_model_len + 1])
    out = short.generate("still serving", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
