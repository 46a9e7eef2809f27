"""The fused MoE kernel (kernels/fused_moe.py, under TRITON_INTERPRET=1) against the torch reference, and the
alignment it runs on (kernels/moe_align.py) against hand-worked arrays; its tiles (kernels/moe_configs.py)."""

from __future__ import annotations

import os

import pytest
import torch

from tritium.kernels import reference as ref
from tritium.kernels import triton_ops as tri
from tritium.kernels.moe_align import max_padded_rows, moe_align_block_size
from tritium.kernels.moe_configs import (
    INTERPRETER_CONFIG,
    MoeConfig,
    config_row_counts,
    default_moe_config,
    moe_config,
    rows_per_expert,
    table_entry,
    tuned_moe_config,
)

from support.triton_interpreter import TOL

pytestmark = pytest.mark.usefixtures("bf16_dot")  # the GEMMs multiply bf16 (tests/kernels/conftest.py)

S = 8  # the sentinel of the hand-worked examples: T * K = 4 * 2


def ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def test_alignment_of_a_hand_worked_batch() -> None:
    # pairs (t * 2 + k -> expert): 0->2 1->0 2->2 3->3 4->0 5->2 6->2 7->2; experts 1 and 4 get none, expert 2 more
    # than a block (5 rows: two blocks of 4), experts 0 and 3 less than one
    sorted_ids, expert_ids, total = moe_align_block_size(ids([[2, 0], [2, 3], [0, 2], [2, 2]]), 4, 5)
    assert max_padded_rows(8, 4, 5) == 23  # 8 pairs + at most 5 experts x 3 padding rows: 6 blocks
    assert sorted_ids.tolist() == [1, 4, S, S,  0, 2, 5, 6,  7, S, S, S,  3, S, S, S,  S, S, S, S,  S, S, S, S]
    assert expert_ids.tolist() == [0, 2, 2, 3, -1, -1]
    assert total.tolist() == [16]
    assert sorted_ids.dtype == expert_ids.dtype == total.dtype == torch.int32


def test_alignment_of_one_token_and_of_blocks_filled_exactly() -> None:
    sorted_ids, expert_ids, total = moe_align_block_size(ids([[3]]), 16, 8)  # T = 1, K = 1: sentinel 1
    assert sorted_ids.tolist() == [0] + [1] * 15 and expert_ids.tolist() == [3] and total.tolist() == [16]
    # every pair on expert 1, exactly two blocks of 2 rows: no padding; room for 4 + 3 x 1 padding rows, so two
    # spare blocks past the end
    sorted_ids, expert_ids, total = moe_align_block_size(ids([[1], [1], [1], [1]]), 2, 3)
    assert sorted_ids.tolist() == [0, 1, 2, 3, 4, 4, 4, 4]
    assert expert_ids.tolist() == [1, 1, -1, -1] and total.tolist() == [4]


def test_alignment_groups_every_pair_once_by_expert() -> None:
    torch.manual_seed(0)
    topk = torch.stack([torch.randperm(16)[:4] for _ in range(37)]).int()
    sorted_ids, expert_ids, total = moe_align_block_size(topk, 16, 16)
    used = sorted_ids[: int(total)].view(-1, 16)
    flat = topk.reshape(-1)
    real = used[used < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))
    for block, expert in zip(used, expert_ids[: used.shape[0]], strict=True):
        rows = block[block < flat.numel()].long()
        assert rows.numel() > 0 and bool((flat[rows] == expert).all())
    assert bool((expert_ids[used.shape[0]:] == -1).all()) and bool((sorted_ids[int(total):] == flat.numel()).all())


def moe_inputs(num_tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
               bias: bool, routing: torch.Tensor | None = None, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Random weights scaled to keep activations near 1; top-k of random router logits unless `routing` is given."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, experts, generator=g)
    weights, topk = logits.softmax(-1).topk(top_k)
    if routing is not None:
        topk = routing
    return {
        "hidden": torch.randn(num_tokens, hidden, generator=g).to(dtype),
        "w13": (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype),
        "w2": (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype),
        "topk_weights": weights,
        "topk_ids": topk.to(torch.int32),
        "w13_bias": torch.randn(experts, 2 * inter, generator=g).to(dtype) if bias else None,
        "w2_bias": torch.randn(experts, hidden, generator=g).to(dtype) if bias else None,
    }


def check(inputs: dict[str, torch.Tensor | None], activation: str, tiles: str) -> None:
    got = tri.fused_moe(**inputs, activation=activation, tiles=tiles)  # type: ignore[arg-type]
    want = ref.fused_moe(**inputs, activation=activation)  # type: ignore[arg-type]
    hidden = inputs["hidden"]
    assert hidden is not None and got.dtype == hidden.dtype and got.shape == hidden.shape
    assert not got.isnan().any()
    tol = 4 * TOL[hidden.dtype]  # sums over H and I products, then over K
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("tiles", ["small", "gpu"])
def test_matches_the_reference(dtype: torch.dtype, activation: str, bias: bool, tiles: str) -> None:
    # 24 tokens over 8 experts, top-2: about 6 rows an expert, some over one 16-row block at random
    check(moe_inputs(24, 48, 40, 8, 2, dtype, bias, seed=1), activation, tiles)


# Routings by hand: expert 0 gets no token, 1 one, 2 more than a 16-row block (and more than the GPU tiles' 16 at
# decode size); every token on the same expert; most experts idle; one token.
ROUTINGS = {
    "idle_one_many": torch.tensor([[2, 1]] + [[2, 3]] * 19),
    "all_same_expert": torch.tensor([[5]] * 33),
    "most_idle": torch.tensor([[6, 7]] * 5),
    "one_token": torch.tensor([[4, 0, 7, 2]]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("routing", ROUTINGS, ids=str)
@pytest.mark.parametrize("tiles", ["small", "gpu"])
def test_routings(dtype: torch.dtype, routing: str, tiles: str) -> None:
    topk = ROUTINGS[routing]
    check(moe_inputs(topk.shape[0], 32, 64, 8, topk.shape[1], dtype, bias=True, routing=topk), "silu", tiles)


def test_gpu_tiles_for_prefill_sized_rows() -> None:
    # 72 tokens, top-2 over 4 experts: 36 rows an expert, the 64-row configuration (grouped row blocks)
    inputs = moe_inputs(72, 32, 32, 4, 2, torch.float16, bias=False, seed=2)
    assert moe_config(rows_per_expert(72, 2, 4), torch.float16, "gpu", "cpu").block_m == 64
    check(inputs, "swiglu_oai", "gpu")


@pytest.mark.parametrize("group_m", [1, 2, 4])
def test_grouped_program_order_covers_every_tile(group_m: int) -> None:
    # 80 pairs over 4 experts: 9 row blocks of 16 (the last group partial) x 3 column blocks of GEMM 1 (I = 48),
    # 2 of GEMM 2 (H = 32)
    inputs = moe_inputs(40, 32, 48, 4, 2, torch.float32, bias=True, seed=3)
    got = tri.fused_moe(**inputs, config=MoeConfig(16, 16, 16, group_m, 4, 1))  # type: ignore[arg-type]
    want = ref.fused_moe(**inputs)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, atol=4e-5, rtol=4e-5)


def test_empty_batch_and_bad_arguments() -> None:
    inputs = moe_inputs(3, 32, 32, 4, 2, torch.float32, bias=False)
    empty = {k: v[:0] if k in ("hidden", "topk_weights", "topk_ids") and v is not None else v
             for k, v in inputs.items()}
    assert tri.fused_moe(**empty).shape == (0, 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unsupported MoE activation"):
        tri.fused_moe(**inputs, activation="gelu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mismatch"):
        tri.fused_moe(**{**inputs, "w2_bias": torch.zeros(4, 31)})  # type: ignore[arg-type]


def test_configs_by_rows_per_expert() -> None:
    assert rows_per_expert(1, 8, 128) == 1 and rows_per_expert(512, 8, 128) == 32 and rows_per_expert(5, 2, 4) == 3
    assert default_moe_config(16, torch.bfloat16).block_m == 16 and default_moe_config(17, torch.bfloat16).block_m == 64
    assert default_moe_config(17, torch.float32).block_m == 32
    assert moe_config(100, torch.float16, "small", "cpu") == INTERPRETER_CONFIG
    assert moe_config(100, torch.float16, "gpu", "cpu") == default_moe_config(100, torch.float16)
    assert config_row_counts(None, torch.bfloat16) == [1, 17]
    table = {(9, 0): {4: MoeConfig(16, 32, 64, 1, 4, 4), 32: MoeConfig(32, 64, 64, 8, 4, 3),
                      128: MoeConfig(64, 128, 64, 8, 8, 3)}}
    picks = [tuned_moe_config((9, 0), rows, table) for rows in (1, 4, 5, 32, 33, 1000)]
    assert [p.block_m if p else None for p in picks] == [16, 16, 32, 32, 64, 64]
    assert config_row_counts((9, 0), torch.bfloat16, table) == [1, 5, 33]
    assert config_row_counts((9, 0), torch.float32, table) == [1, 17]  # fp32 always takes the default rule
    assert tuned_moe_config((8, 0), 1, table) is None and tuned_moe_config(None, 1, table) is None
    assert table_entry((9, 0), {4: MoeConfig(16, 32, 64, 1, 4, 4)}) == \
        "(9, 0): {4: MoeConfig(16, 32, 64, 1, 4, 4)},"


def test_the_sweep_starts_with_the_current_configuration_and_fits_its_rows() -> None:
    from tritium.client.bench.moe import sweep_configs

    default = default_moe_config(1, torch.bfloat16)
    decode = sweep_configs(1, default)
    assert decode[0] == default and len(set(decode)) == len(decode)
    assert {c.block_m for c in decode} == {16} and {c.group_m for c in decode} == {1}
    prefill = sweep_configs(32, default_moe_config(32, torch.bfloat16))
    assert {c.block_m for c in prefill} == {16, 32, 64} and {c.group_m for c in prefill if c.block_m > 16} == {8}


def test_the_moe_benchmark_and_the_gpu_check_sweep_run_in_smoke_mode(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from tritium.client.bench.moe import moe_sweep_figures, run_moe_benchmark

    report = run_moe_benchmark(out_dir=tmp_path, smoke=True)
    assert (tmp_path / "moe.json").is_file() and (tmp_path / "moe.png").stat().st_size > 1000
    assert [p["batch"] for p in report["points"]] == [1, 8]
    assert all(p["triton_ms"] > 0 and p["reference_ms"] > 0 and p["max_abs_err"] < 1e-4 for p in report["points"])
    assert [tuple(p["config"]) for p in report["sweep"]] == [(16, 32, 32, 1, 4, 2), (16, 16, 16, 1, 4, 1),
                                                            (16, 32, 16, 1, 4, 1)]  # the default first
    assert all(p["ms"] and p["error"] is None for p in report["sweep"])
    assert report["table_entry"].startswith("(0, 0): {4: MoeConfig(16, ")  # 8 tokens x top-2 / 4 experts
    assert "TUNED entry for this GPU" in capsys.readouterr().out
    figures = moe_sweep_figures(smoke=True)
    assert figures["points"] == 3 and list(figures["best"]) == [4] and figures["table_entry"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_the_moe_benchmark_needs_cuda(capsys) -> None:  # type: ignore[no-untyped-def]
    from tritium.client.cli.main import main

    assert main(["bench", "moe"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_gpu_check_compares_fused_moe_with_the_reference() -> None:
    from tritium.client.checks.kernels import DEFAULT_LAYOUT, OPS, SMOKE_SIZES

    for op in ("fused_moe", "fused_moe swiglu_oai+bias"):
        err, ok = OPS[op](tri, ref, DEFAULT_LAYOUT, SMOKE_SIZES, torch.float16, "cpu")
        assert ok, (op, err)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a GPU and TRITON_INTERPRET=0")
def test_no_host_sync_on_cuda() -> None:
    inputs = {k: v.cuda() if v is not None else None
              for k, v in moe_inputs(40, 64, 64, 8, 2, torch.bfloat16, bias=True).items()}
    tri.fused_moe(**inputs)  # type: ignore[arg-type]  # compiles first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tri.fused_moe(**inputs)  # type: ignore[arg-type]
    finally:
        torch.cuda.set_sync_debug_mode("default")
