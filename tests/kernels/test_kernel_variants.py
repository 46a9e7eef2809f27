"""The kernel variants of Gemma, Qwen3 and Phi-4 (under TRITON_INTERPRET=1) against the torch references: sliding
windows and soft-capped scores in both attention kernels, GELU(tanh)-and-mul, rotary over a dim whose half is not a
power of two. Every test takes the `bf16_dot` fixture (see tests/kernels/test_kernels.py).

Windows must save work, not only mask it: the prefill cases poison (NaN) every cache page before the first key tile
any query's window reaches, so a kernel that visited one would return NaN; the decode cases check the split count and
which segments hold keys."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tritium.kernels import reference as ref
from tritium.kernels import triton_ops as tri
from tritium.kernels.compile_check import recording
from tritium.kernels.prefill_attention import prefill_config

from support.builders import paged_setup
from support.triton_interpreter import TOL

pytestmark = pytest.mark.usefixtures("bf16_dot")


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def poison_pages(cache: torch.Tensor, table: torch.Tensor, keys: int) -> None:
    """NaN into every page of one sequence's `table` that holds only keys below `keys`."""
    page = cache.shape[1]
    for j in range(keys // page):
        cache[int(table[j])] = float("nan")


def run_prefill(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, lens: list[int], q_lens: list[int],
                window: int | None, softcap: float | None, tiles: str, q_scale: float = 1.0,
                block_size: int = 16) -> None:
    kc, vc, tables, _, _ = paged_setup(lens, block_size, kv_heads, head_dim)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q = (torch.randn(sum(q_lens), heads, head_dim) * q_scale).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    want = ref.prefill_attention(q.float(), kc.float(), vc.float(), tables, cu, seq_lens, scale, None, window,
                                 softcap)
    if window is not None:  # no query tile may visit a key tile wholly before its first row's window
        block_n = prefill_config(head_dim, dtype, tiles, "cpu").block_n
        for i, (context, queries) in enumerate(zip(lens, q_lens, strict=True)):
            first_tile = max(context - queries - window + 1, 0) // block_n * block_n
            poison_pages(kc, tables[i], first_tile)
            poison_pages(vc, tables[i], first_tile)
    got = tri.prefill_attention(q, kc, vc, tables, cu, seq_lens, scale, max(q_lens), window, softcap, tiles=tiles)
    close(got, want, dtype)


def run_decode(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, lens: list[int], window: int | None,
               softcap: float | None, tiles: str, num_splits: int | None = None, q_scale: float = 1.0) -> None:
    kc, vc, tables, _, _ = paged_setup(lens, 16, kv_heads, head_dim)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q = (torch.randn(len(lens), heads, head_dim) * q_scale).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    want = ref.decode_attention(q.float(), kc.float(), vc.float(), tables, seq_lens, scale, window, softcap)
    if window is not None:  # keys before the window are never read
        for i, context in enumerate(lens):
            for pos in range(max(context - window, 0)):
                kc[tables[i, pos // 16], pos % 16] = float("nan")
                vc[tables[i, pos // 16], pos % 16] = float("nan")
    got = tri.decode_attention(q, kc, vc, tables, seq_lens, scale, window, softcap, num_splits=num_splits,
                               tiles=tiles)
    close(got, want, dtype)


DTYPES = [torch.float32, torch.float16]
CHUNKED = {"lens": [50, 45, 9], "q_lens": [50, 13, 9]}  # a whole prompt, a chunk after 32 cached keys, a short one


# 16x16 tiles on 16-key pages: windows of one key, inside a tile, a tile (block edge), one past it, the whole
# 50-key context, longer than any context.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [1, 7, 16, 17, 50, 64])
def test_prefill_window_small_tiles(dtype: torch.dtype, window: int) -> None:
    run_prefill(dtype, 4, 2, 32, **CHUNKED, window=window, softcap=None, tiles="small")


# GPU tiles (fp16 128x64, fp32 32x32 at head_dim 64): a 70-query chunk after 130 cached keys, so the first key
# tiles are skipped; windows starting mid-tile, at a tile edge, spanning two tiles.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [48, 64, 100])
def test_prefill_window_gpu_tiles(dtype: torch.dtype, window: int) -> None:
    run_prefill(dtype, 4, 2, 64, [200, 90], [70, 90], window=window, softcap=None, tiles="gpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("tiles", ["small", "gpu"])
def test_prefill_softcap(dtype: torch.dtype, window: int | None, tiles: str) -> None:
    # Scores up to ~10 against a cap of 5: both of tanh's ranges, saturation included.
    run_prefill(dtype, 4, 2, 32, **CHUNKED, window=window, softcap=5.0, tiles=tiles, q_scale=4.0)


@pytest.mark.parametrize("window,softcap", [(33, None), (None, 50.0), (33, 50.0)])
def test_prefill_head_dim_256_gpu_tiles(window: int | None, softcap: float | None) -> None:
    # Gemma: 64x32 tiles of 256 features, GQA 4 (Gemma 3 1B), one chunk after cached keys.
    run_prefill(torch.float16, 4, 1, 256, [80, 40], [30, 40], window=window, softcap=softcap, tiles="gpu",
                q_scale=3.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [1, 15, 16, 17, 64, 300, 1000])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_window_small_tiles(dtype: torch.dtype, window: int, num_splits: int | None) -> None:
    # Contexts of one key, one page, one past it, four pages, one past, many; windows at and around page edges.
    run_decode(dtype, 4, 2, 32, [1, 16, 17, 64, 65, 300], window, None, "small", num_splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [48, 64, 100])
@pytest.mark.parametrize("num_splits", [None, 4])
def test_decode_window_gpu_tiles(dtype: torch.dtype, window: int, num_splits: int | None) -> None:
    run_decode(dtype, 3, 1, 64, [1, 64, 81, 300], window, None, "gpu", num_splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("tiles", ["small", "gpu"])
def test_decode_softcap(dtype: torch.dtype, window: int | None, tiles: str) -> None:
    run_decode(dtype, 4, 2, 32, [1, 40, 100, 300], window, 5.0, tiles, q_scale=4.0)


@pytest.mark.parametrize("window,softcap", [(100, None), (None, 50.0), (100, 50.0)])
def test_decode_head_dim_256_gpu_tiles(window: int | None, softcap: float | None) -> None:
    run_decode(torch.float16, 4, 1, 256, [1, 40, 300], window, softcap, "gpu", q_scale=3.0)


def split_launch(lens: list[int], width: int, window: int | None, num_splits: int | None = None) -> dict[str, Any]:
    """The decode split kernel's arguments (by name, after it ran) for one KV head over a block table `width`
    pages wide."""
    kc, vc, tables, _, _ = paged_setup(lens, 16, 1, 32)
    wide = torch.zeros(len(lens), width, dtype=torch.int32)
    wide[:, : tables.shape[1]] = tables
    q = torch.randn(len(lens), 2, 32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    with recording(run=True) as launches:
        got = tri.decode_attention(q, kc, vc, wide, seq_lens, 0.2, window, num_splits=num_splits, tiles="small")
    close(got, ref.decode_attention(q, kc, vc, tables, seq_lens, 0.2, window), torch.float32)
    (split,) = [launch for launch in launches if launch.kernel.fn.__name__ == "decode_split_kernel"]
    return dict(zip(split.kernel.arg_names, split.args, strict=False)) | split.kwargs


def test_decode_splits_cover_only_the_window() -> None:
    # A 2,048-key block table: 8 splits of 256 keys for full attention, one for a 256-key window.
    assert split_launch([300], 128, None)["num_splits"] == 8
    assert split_launch([300], 128, 256)["num_splits"] == 1
    assert split_launch([300], 128, 600)["num_splits"] == 2
    # Forced to 4 splits, a 40-key window of a 300-key context (keys 260-299, in the tiles from 256) spreads over
    # the first three segments (16 keys each); the last has none. Segments over the whole context would leave the
    # first ones empty instead.
    lse = split_launch([300], 128, 40, num_splits=4)["partial_lse_ptr"]
    assert torch.isfinite(lse[0, :, :3]).all() and torch.isneginf(lse[0, :, 3]).all()


def test_window_and_cap_are_checked() -> None:
    q, kc = torch.zeros(1, 2, 16), torch.zeros(1, 16, 1, 16)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="sliding_window"):
        tri.decode_attention(q, kc, kc, table, lens, 1.0, 0)
    with pytest.raises(ValueError, match="softcap"):
        tri.prefill_attention(q, kc, kc, table, torch.tensor([0, 1], dtype=torch.int32), lens, 1.0, 1, None, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gelu_tanh_and_mul(dtype: torch.dtype) -> None:
    x = (torch.randn(13, 2 * 1152) * 3).to(dtype)
    x[0, :8] = torch.tensor([-100.0, -20.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 100.0]).to(dtype)  # tails and zero
    close(tri.gelu_tanh_and_mul(x), ref.gelu_tanh_and_mul(x), dtype)
    wide = x.view(13, 2, 1152)  # [..., 2d] with leading dims, as the MLP passes it
    assert tri.gelu_tanh_and_mul(wide).shape == (13, 2, 576)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim,rot_dim", [(128, 96), (64, 40), (64, 64)])
def test_rotary_partial_dim_not_a_power_of_two(dtype: torch.dtype, head_dim: int, rot_dim: int) -> None:
    # Phi-4-mini: 96 of 128 features rotate (halves of 48); the rest must not change.
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(300).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    pos = torch.tensor([0, 1, 5, 299, 17])
    qkv = torch.randn(5, (3 + 2) * head_dim).to(dtype)  # 3 query heads, 1 KV head (and v) of a fused output
    q, k = qkv[:, : 3 * head_dim].view(5, 3, head_dim), qkv[:, 3 * head_dim : 4 * head_dim].view(5, 1, head_dim)
    before = qkv.clone()
    q2, k2 = q.clone(), k.clone()
    tri.rotary_embedding(q, k, pos, cache)
    ref.rotary_embedding(q2, k2, pos, cache)
    close(q, q2, dtype)
    close(k, k2, dtype)
    unrotated = [c for h in range(4) for c in range(h * head_dim + rot_dim, (h + 1) * head_dim)]
    assert torch.equal(qkv[:, unrotated], before[:, unrotated])
    assert torch.equal(qkv[:, 4 * head_dim :], before[:, 4 * head_dim :])  # v
