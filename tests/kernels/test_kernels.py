"""The Triton kernels (under TRITON_INTERPRET=1) against the torch references.

bf16: the interpreter holds bf16 as raw bits and `tl.dot` on them is garbage, so every test here takes the
`bf16_dot` fixture (tests/kernels/conftest.py), which upcasts bf16 operands of its dot to fp32.
"""

from __future__ import annotations

import pytest
import torch

from tritium.kernels import reference as ref
from tritium.kernels import triton_ops as tri

from support.builders import paged_setup
from support.triton_interpreter import TOL

pytestmark = pytest.mark.usefixtures("bf16_dot")


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype: torch.dtype) -> None:
    kc = torch.zeros(6, 16, 3, 64, dtype=dtype)
    vc = torch.zeros_like(kc)
    k, v = torch.randn(7, 3, 64).to(dtype), torch.randn(7, 3, 64).to(dtype)
    slots = torch.tensor([17, -1, 0, 95, 40, -1, 33])
    kc2, vc2 = kc.clone(), vc.clone()
    tri.store_kv(k, v, kc, vc, slots)
    ref.store_kv(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, with_residual: bool) -> None:
    x, w = torch.randn(19, 576).to(dtype), torch.randn(576).to(dtype)
    r = torch.randn(19, 576).to(dtype) if with_residual else None
    got, want = tri.rms_norm(x, w, 1e-5, r), ref.rms_norm(x, w, 1e-5, r)
    if with_residual:
        close(got[0], want[0], dtype)
        if dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 where GPUs round to nearest
            close(got[1], want[1], dtype)
        else:
            assert torch.equal(got[1], want[1])
    else:
        close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 1)])
def test_rotary_embedding(dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int) -> None:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(300).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    pos = torch.tensor([0, 1, 5, 299, 17])
    q, k = torch.randn(5, heads, head_dim).to(dtype), torch.randn(5, kv_heads, head_dim).to(dtype)
    q2, k2 = q.clone(), k.clone()
    tri.rotary_embedding(q, k, pos, cache)
    ref.rotary_embedding(q2, k2, pos, cache)
    close(q, q2, dtype)
    close(k, k2, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = torch.randn(13, 2 * 1536).to(dtype)
    close(tri.silu_and_mul(x), ref.silu_and_mul(x), dtype)


def run_prefill(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
                lens: list[int], q_lens: list[int], tiles: str = "auto") -> None:
    kc, vc, tables, _, _ = paged_setup(lens, block_size, kv_heads, head_dim)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q = torch.randn(sum(q_lens), heads, head_dim).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    got = tri.prefill_attention(q, kc, vc, tables, cu, seq_lens, scale, max(q_lens), tiles=tiles)
    want = ref.prefill_attention(q.float(), kc.float(), vc.float(), tables, cu, seq_lens, scale)
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (3, 1), (8, 1)])
def test_prefill_attention_gqa_and_dtypes(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    # single token; exactly one block; one past a block; a prefix-cache hit (queries only at the end)
    run_prefill(dtype, heads, kv_heads, 64, 16, lens=[1, 16, 17, 40], q_lens=[1, 16, 17, 5])


@pytest.mark.parametrize("head_dim", [32, 128, 256])
def test_prefill_attention_head_dims(head_dim: int) -> None:
    run_prefill(torch.float16, 2, 1, head_dim, 16, lens=[9, 33], q_lens=[9, 3])


@pytest.mark.parametrize("block_size", [32, 64])
def test_prefill_attention_block_sizes(block_size: int) -> None:
    run_prefill(torch.float32, 4, 2, 64, block_size, lens=[block_size + 3, 20], q_lens=[7, 20])


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_query_tile_order_is_a_permutation_longest_first(block_m: int) -> None:
    # The kernel's slot -> tile mapping, as plain Python: every grid width the wrapper can launch for a longest
    # run of up to 400 rows, every sequence length up to it. Each tile exactly once, the last one first.
    from tritium.kernels.jit.prefill_attention import query_tile

    for grid_rows in range(1, 401):
        slots = -(-grid_rows // block_m)
        for rows in range(grid_rows + 1):
            tiles = [query_tile.fn(slot, rows, block_m) for slot in range(slots)]
            run = [t for t in tiles if t >= 0]
            assert run == list(range(-(-rows // block_m) - 1, -1, -1)), (grid_rows, rows)
            assert tiles[len(run):] == [t for t in tiles if t < 0]


def test_prefill_attention_many_query_tiles() -> None:
    # 16-row tiles: 7, 1, 5 and 3 tiles per sequence (GQA 2), a chunk after cached keys, a tile count that is not
    # the grid's: every tile of every sequence must be computed once.
    run_prefill(torch.float32, 4, 2, 64, 16, lens=[50, 20, 60, 24], q_lens=[50, 7, 40, 24])


def run_decode(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
               lens: list[int], num_splits: int | None, tiles: str = "auto") -> None:
    kc, vc, tables, _, _ = paged_setup(lens, block_size, kv_heads, head_dim)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    got = tri.decode_attention(q, kc, vc, tables, seq_lens, scale, num_splits=num_splits, tiles=tiles)
    want = ref.decode_attention(q.float(), kc.float(), vc.float(), tables, seq_lens, scale)
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (3, 1), (8, 1)])
def test_decode_attention_gqa_and_dtypes(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    run_decode(dtype, heads, kv_heads, 64, 16, lens=[1, 16, 17, 50], num_splits=None)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_decode_attention_several_splits(num_splits: int) -> None:
    # 5 splits over 64 keys leaves empty segments for the short sequences: they must weigh nothing.
    run_decode(torch.float32, 4, 2, 64, 16, lens=[3, 64, 49], num_splits=num_splits)


@pytest.mark.parametrize("head_dim,block_size", [(128, 32), (256, 64), (32, 16)])
def test_decode_attention_shapes(head_dim: int, block_size: int) -> None:
    run_decode(torch.float16, 2, 1, head_dim, block_size, lens=[block_size + 1, 5], num_splits=2)


# tiles="gpu": the tiles, warps and stages of a GPU launch (prefill 128x64 at head_dim 64 in fp16/bf16, 32x32
# in fp32; decode 64 keys, 32 in fp32), so the row tiles span GQA groups and the key tiles span four pages.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,lens,q_lens", [
    (2, 2, [140, 70], [140, 23]),  # group 1: 140 rows = two 128-row tiles; a chunk of 23 after 47 cached
    (3, 1, [50, 90, 5], [50, 41, 5]),  # group 3: 150 and 123 rows; a chunk starting mid-page
    (4, 1, [37, 33], [37, 1]),  # group 4: 148 rows; one query row after 32 cached (a decode-like chunk)
], ids=["group1", "group3", "group4"])
def test_prefill_attention_gpu_tiles(dtype: torch.dtype, heads: int, kv_heads: int, lens: list[int],
                                     q_lens: list[int]) -> None:
    run_prefill(dtype, heads, kv_heads, 64, 16, lens=lens, q_lens=q_lens, tiles="gpu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,num_splits", [(3, 1, None), (4, 1, 4), (2, 2, 8)])
def test_decode_attention_gpu_tiles(dtype: torch.dtype, heads: int, kv_heads: int, num_splits: int | None) -> None:
    # Contexts of one key, one tile, a partial tile, several pages and splits; 8 splits leave empty ones.
    run_decode(dtype, heads, kv_heads, 64, 16, lens=[1, 64, 81, 300], num_splits=num_splits, tiles="gpu")


def test_attention_gpu_tiles_head_dim_128() -> None:
    # prefill 128x64 with two stages, decode 32-key tiles
    run_prefill(torch.bfloat16, 4, 2, 128, 16, lens=[70, 40], q_lens=[70, 9], tiles="gpu")
    run_decode(torch.bfloat16, 4, 2, 128, 16, lens=[33, 100], num_splits=None, tiles="gpu")


def test_decode_split_count_is_always_a_choice() -> None:
    from tritium.kernels.decode_attention import SPLIT_CHOICES, choose_num_splits

    seen = {choose_num_splits(seqs, kv, ctx, 64) for seqs in (1, 2, 3, 7, 64, 256) for kv in (1, 2, 3, 8, 32)
            for ctx in (16, 256, 257, 1000, 4096, 32768, 131072)}
    assert seen == set(SPLIT_CHOICES)


def test_unknown_tiles_value_is_refused() -> None:
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="tiles"):
        tri.silu_and_mul(x, tiles="big")
    with pytest.raises(ValueError, match="tiles"):
        tri.decode_attention(torch.randn(1, 2, 16), torch.zeros(1, 16, 1, 16), torch.zeros(1, 16, 1, 16),
                             torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0, tiles="big")


def fused_qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """q, k, v as the engine has them: non-contiguous views into one `[tokens, (heads + 2 kv_heads) * d]`."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    return (qkv[:, :q_size].view(tokens, heads, head_dim),
            qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim),
            qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim))


@pytest.mark.parametrize("ops", [ref, tri], ids=["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_take_views_of_a_fused_qkv(ops, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    heads, kv_heads, d, block = 6, 2, 32, 16
    lens, q_lens = [20, 9], [20, 4]
    tokens = sum(q_lens)
    q, k, v = fused_qkv(tokens, heads, kv_heads, d, dtype)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    qc, kc, vc = q.clone(), k.clone(), v.clone()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(64).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.tensor([*range(20), *range(5, 9)])
    ops.rotary_embedding(q, k, positions, cos_sin)
    ops.rotary_embedding(qc, kc, positions, cos_sin)
    assert torch.equal(q, qc) and torch.equal(k, kc)  # the views (so qkv) were rotated in place

    key_cache = torch.zeros(5, block, kv_heads, d, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    key_cache2, value_cache2 = key_cache.clone(), value_cache.clone()
    tables = torch.tensor([[3, 1], [0, 0]], dtype=torch.int32)
    slots = torch.tensor([3 * block + i for i in range(16)] + [block + i for i in range(4)] + [5, 6, 7, 8])
    ops.store_kv(k, v, key_cache, value_cache, slots)
    ops.store_kv(kc, vc, key_cache2, value_cache2, slots)
    assert torch.equal(key_cache, key_cache2) and torch.equal(value_cache, value_cache2)

    cu = torch.tensor([0, 20, 24], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = ops.prefill_attention(q, key_cache, value_cache, tables, cu, seq_lens, d**-0.5, 20)
    want = ops.prefill_attention(qc, key_cache, value_cache, tables, cu, seq_lens, d**-0.5, 20)
    assert got.shape == q.shape
    torch.testing.assert_close(got, want)
    # Decode rows come first in a mixed batch: q[:n] is still a view with the fused row stride.
    got = ops.decode_attention(q[:2], key_cache, value_cache, tables, seq_lens, d**-0.5)
    want = ops.decode_attention(q[:2].contiguous(), key_cache, value_cache, tables, seq_lens, d**-0.5)
    torch.testing.assert_close(got, want)
    got = ops.decode_attention(q[1:2], key_cache, value_cache, tables[1:], seq_lens[1:], d**-0.5)
    torch.testing.assert_close(got, ops.decode_attention(q[1:2].contiguous(), key_cache, value_cache, tables[1:],
                                                         seq_lens[1:], d**-0.5))

    wide = torch.randn(3, 2 * 96).to(dtype)[:, :96]  # rows with a stride larger than the row
    weight = torch.randn(96).to(dtype)
    torch.testing.assert_close(ops.rms_norm(wide, weight, 1e-6), ops.rms_norm(wide.contiguous(), weight, 1e-6))


def test_kernel_benchmark_script_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tritium.client.bench.kernels import run_kernel_benchmark

    report = run_kernel_benchmark(out_dir=str(tmp_path), smoke=True)
    assert (tmp_path / "kernels.json").is_file() and (tmp_path / "kernels.png").stat().st_size > 1000
    assert all(p["tritium_tflops"] > 0 for p in report["prefill"])
    assert all(d["tritium_gbs"] > 0 and d["torch_gather_gbs"] > 0 for d in report["decode"])


@pytest.mark.parametrize("tiles", ["small", "gpu"])
def test_decode_attention_wide_block_table(tiles: str) -> None:
    """A CUDA graph's decode reads block tables as wide as max_model_len: the split count follows that width,
    and each sequence spreads its shorter context over the splits (segments of at least 256 keys)."""
    lens = [1, 300, 700, 90]
    kc, vc, tables, _, _ = paged_setup(lens, 16, 1, 64)
    wide = torch.zeros(len(lens), 128, dtype=torch.int32)  # room for 2,048 keys
    wide[:, : tables.shape[1]] = tables
    q = torch.randn(len(lens), 3, 64)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = tri.decode_attention(q, kc, vc, wide, seq_lens, 0.125, tiles=tiles)
    close(got, ref.decode_attention(q, kc, vc, tables, seq_lens, 0.125), torch.float32)
