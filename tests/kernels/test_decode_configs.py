"""Decode attention's launch choices: the split count from the device's multiprocessor count, the
per-architecture configuration table and its fallback, and a tabled configuration run (interpreter)."""

from __future__ import annotations

import pytest
import torch

from tritium.kernels import reference as ref
from tritium.kernels import triton_ops as tri
from tritium.kernels.decode_attention import (
    DEFAULT_SM_COUNT,
    choose_num_splits,
    decode_config,
    multiprocessor_count,
    target_programs,
)
from tritium.kernels.decode_configs import (
    TUNED,
    DecodeConfig,
    default_decode_config,
    table_entry,
    tuned_decode_config,
)

from support.builders import paged_setup

HOPPER = (9, 0)
TABLE = {HOPPER: {64: DecodeConfig(32, 2, 3), 128: DecodeConfig(16, 8, 1)}}


def test_the_split_target_is_two_waves_of_the_multiprocessors() -> None:
    assert target_programs(132) == 264 and target_programs(108) == 216 and target_programs(0) == 2


@pytest.mark.parametrize("sm_count,num_seqs,kv_heads,expected", [
    (132, 1, 1, 64),  # one sequence: as many splits as its context allows (64k keys / 256 = 256 > 64)
    (132, 4, 8, 8),  # 32 (sequence, head) pairs: 264 / 32 -> 9 -> the choice below, 8
    (58, 4, 8, 4),  # an L4's 58 SMs: 116 / 32 -> 4 (half the H100's 8)
    (16, 1, 1, 32),  # a small GPU: 32 programs are two waves
    (132, 64, 8, 1),  # 512 pairs fill 132 SMs without splitting
])
def test_split_count_from_the_multiprocessor_count(sm_count: int, num_seqs: int, kv_heads: int,
                                                   expected: int) -> None:
    wanted = -(-target_programs(sm_count) // (num_seqs * kv_heads))
    assert choose_num_splits(num_seqs, kv_heads, 65536, 64, sm_count) == expected
    assert expected <= max(1, wanted)


def test_more_multiprocessors_never_mean_fewer_splits() -> None:
    for seqs in (1, 3, 8, 64):
        counts = [choose_num_splits(seqs, 8, 16384, 64, sm) for sm in (16, 58, 108, 132, 170)]
        assert counts == sorted(counts)


def test_off_a_gpu_the_split_target_is_an_h100s() -> None:
    assert multiprocessor_count("cpu") == DEFAULT_SM_COUNT == 132
    assert choose_num_splits(4, 8, 65536, 64) == choose_num_splits(4, 8, 65536, 64, 132)


def test_the_table_by_architecture_and_head_dim() -> None:
    assert tuned_decode_config(HOPPER, 64, TABLE) == DecodeConfig(32, 2, 3)
    assert tuned_decode_config(HOPPER, 256, TABLE) is None  # a head_dim the sweep did not run
    assert tuned_decode_config((12, 0), 64, TABLE) is None  # an architecture it did not run on
    assert tuned_decode_config(None, 64, TABLE) is None  # not a GPU
    assert all(isinstance(c, DecodeConfig) for by_dim in TUNED.values() for c in by_dim.values())


def test_an_unknown_architecture_gets_the_rule() -> None:
    # Off CUDA (the compile check, the interpreter at GPU tiles) the rule applies: 4K-element tiles, 2K in fp32.
    assert decode_config(64, torch.bfloat16, tiles="gpu", device="cpu") == default_decode_config(64, torch.bfloat16)
    assert default_decode_config(64, torch.bfloat16) == DecodeConfig(64, 4, 2)
    assert default_decode_config(128, torch.float16) == DecodeConfig(32, 4, 2)
    assert default_decode_config(64, torch.float32) == DecodeConfig(32, 4, 2)
    assert decode_config(64, torch.float16, tiles="small", device="cpu") == DecodeConfig(16, 4, 2)


def test_the_table_entry_gpu_check_prints_is_python_for_the_table() -> None:
    line = table_entry(HOPPER, TABLE[HOPPER])
    assert line == "(9, 0): {64: DecodeConfig(32, 2, 3), 128: DecodeConfig(16, 8, 1)},"
    assert eval("{" + line + "}", {"DecodeConfig": DecodeConfig}) == TABLE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_with_a_tabled_configuration(dtype: torch.dtype, head_dim: int) -> None:
    config = tuned_decode_config(HOPPER, head_dim, TABLE)
    assert config is not None and config != default_decode_config(head_dim, dtype)
    lens = [1, 31, 33, 100]  # a key tile of 32 or 16: partial tiles, several pages and splits
    kc, vc, tables, _, _ = paged_setup(lens, 16, 2, head_dim)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q = torch.randn(len(lens), 4, head_dim).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = tri.decode_attention(q, kc, vc, tables, seq_lens, head_dim**-0.5, tiles="gpu", config=config)
    want = ref.decode_attention(q.float(), kc.float(), vc.float(), tables, seq_lens, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_the_sweep_starts_with_the_current_configuration_and_tries_each_once() -> None:
    from tritium.client.bench.kernels import SWEEP_BLOCK_N, SWEEP_STAGES, SWEEP_WARPS, sweep_configs, sweep_shapes

    default = default_decode_config(128, torch.bfloat16)
    configs = sweep_configs(default)
    assert configs[0] == default and len(set(configs)) == len(configs)
    assert len(configs) == len(SWEEP_BLOCK_N) * len(SWEEP_WARPS) * len(SWEEP_STAGES)  # the default is in the grid
    grid = [(64, 64, 4096), (128, 64, 4096), (64, 1, 4096), (128, 32, 4096), (64, 64, 1024)]
    assert sweep_shapes(grid) == [(64, 64, 4096), (128, 64, 4096)]


def test_the_benchmark_measures_a_copy_and_sweeps_decode(capsys: pytest.CaptureFixture[str]) -> None:
    from tritium.client.bench.kernels import copy_bandwidth, measure_kernels

    assert copy_bandwidth("cpu", 1 << 16) > 0
    measured = measure_kernels([], [(64, 1, 64), (64, 2, 64)], smoke=True)
    assert measured.copy_gbs is not None and measured.copy_gbs > 0
    assert [(p.block_n, p.num_warps, p.num_stages) for p in measured.decode_sweep] == [(16, 4, 2), (32, 4, 1)]
    assert all(p.batch == 2 and p.tritium_gbs and p.error is None for p in measured.decode_sweep)
    assert measured.decode_best[64] in measured.decode_sweep
    assert measured.decode_table_entry is not None and measured.decode_table_entry.startswith("(0, 0): {64: ")
    assert "TUNED entry for this GPU" in capsys.readouterr().out
