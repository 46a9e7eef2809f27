"""The Triton kernels (under TRITON_INTERPRET=1) against the torch references.

bf16: the interpreter holds bf16 as raw bits and `tl.dot` on them is garbage, so the `bf16_dot`
fixture (autouse) patches its dot to upcast bf16 operands to fp32 (all other bf16 math in the kernels is
done after an explicit cast to fp32, which the interpreter converts correctly).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_reference_kernels import paged_setup
from triton.runtime import interpreter

from tritium.kernels import reference as ref
from tritium.kernels import triton_ops as tri

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def bf16_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        def up(x):  # type: ignore[no-untyped-def]
            if x.dtype.scalar == interpreter.tl.bfloat16:
                data = interpreter._convert_float(x.data, x.dtype.scalar, interpreter.tl.float32, None)
                return interpreter.TensorHandle(data.view(np.float32), interpreter.tl.float32)
            return x
        return original(self, up(a), up(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


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
                lens: list[int], q_lens: list[int]) -> None:
    kc, vc, tables, _, _ = paged_setup(lens, block_size, kv_heads, head_dim)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q = torch.randn(sum(q_lens), heads, head_dim).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    got = tri.prefill_attention(q, kc, vc, tables, cu, seq_lens, scale)
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


def run_decode(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
               lens: list[int], num_splits: int | None) -> None:
    kc, vc, tables, _, _ = paged_setup(lens, block_size, kv_heads, head_dim)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    got = tri.decode_attention(q, kc, vc, tables, seq_lens, scale, num_splits=num_splits)
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


def test_kernel_benchmark_script_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tritium.client.bench_kernels import run_kernel_benchmark

    report = run_kernel_benchmark(out_dir=str(tmp_path), smoke=True)
    assert (tmp_path / "kernels.json").is_file() and (tmp_path / "kernels.png").stat().st_size > 1000
    assert all(p["tritium_tflops"] > 0 for p in report["prefill"])
    assert all(d["tritium_gbs"] > 0 and d["torch_gather_gbs"] > 0 for d in report["decode"])
