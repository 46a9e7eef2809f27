"""The Triton W8A16 GEMM (kernels/int8_gemm.py, under TRITON_INTERPRET=1) against its torch reference, at the
interpreter's small tiles and at the GPU launch's tiles (decode- and prefill-sized row counts)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tritium.backend.layers.int8_linear import Int8Linear, quantize_per_channel
from tritium.kernels import reference as ref
from tritium.kernels import triton_ops as tri
from tritium.kernels.int8_gemm import CONFIG_ROWS, int8_gemm_config
from tritium.kernels.warmup import EngineShape, warmup_calls

from support.triton_interpreter import TOL

pytestmark = pytest.mark.usefixtures("bf16_dot")  # these kernels multiply bf16 (tests/kernels/conftest.py)


def run(m: int, n: int, k: int, dtype: torch.dtype, tiles: str, strided: bool = False) -> None:
    torch.manual_seed(m * 7 + n + k)
    q, scale = quantize_per_channel(torch.randn(n, k) * 0.05)
    a = torch.randn(m, 2 * k if strided else k).to(dtype)
    if strided:
        a = a[:, :k]  # a row-strided view, like a slice of a fused projection's output
    got = tri.int8_gemm(a, q, scale, tiles=tiles)
    want = ref.int8_gemm(a, q, scale)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = TOL[dtype] * 4  # sums of up to K products
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 16), (5, 40, 48), (17, 33, 70)])
def test_small_tiles(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    run(m, n, k, dtype, "small")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 20, 40, 70])
def test_gpu_tiles(m: int, dtype: torch.dtype) -> None:
    """Decode tiles (16x64x128) for m <= 16, 32/64x64x128 up to 64 rows, prefill tiles (64x128x64; fp32 32x64x32)
    above; N and K not multiples of them."""
    run(m, 136, 192, dtype, "gpu", strided=m == 3)


def test_gpu_config_by_rows() -> None:
    assert int8_gemm_config(1).block_m == 16 and int8_gemm_config(65)[:2] == (64, 128)
    # 17-64 rows: 64-wide tiles, twice the programs of the prefill tiles on a 4096-wide layer
    assert int8_gemm_config(20)[:2] == (32, 64) and int8_gemm_config(64)[:2] == (64, 64)
    assert int8_gemm_config(64, torch.float32).block_m == 32
    # the warm-up's row counts reach every configuration
    assert len({int8_gemm_config(m) for m in CONFIG_ROWS}) == len(CONFIG_ROWS)
    assert int8_gemm_config(1, torch.float16, "small", "cpu") == (16, 16, 16, 4, 1)


def test_empty_and_mismatched() -> None:
    q, scale = quantize_per_channel(torch.randn(8, 16))
    assert tri.int8_gemm(torch.zeros(0, 16), q, scale).shape == (0, 8)
    with pytest.raises(ValueError, match="mismatch"):
        tri.int8_gemm(torch.zeros(2, 12), q, scale)


@pytest.mark.slow  # one of the fast tier's longest (~6-10 s); the full suite runs it
def test_warm_up_builds_every_quantized_projection() -> None:
    shape = EngineShape(9, 3, 64, 576, 1536, 64, 16, 4, torch.bfloat16, quantization="int8")
    calls = [c for c in warmup_calls(shape) if c.op == "int8_gemm"]
    assert len(calls) == 5 * len(CONFIG_ROWS)  # 5 projections x every tile configuration
    assert {c.args[0].shape[0] for c in calls} == set(CONFIG_ROWS)
    assert {tuple(c.args[1].shape) for c in calls} == {(256, 256), (256 + 576 % 16, 256), (256, 256 + 1536 % 16)}
    for c in calls:
        tri.int8_gemm(*c.args)
    assert not [c for c in warmup_calls(replace(shape, quantization=None)) if c.op == "int8_gemm"]


def test_int8_linear_triton_path() -> None:
    torch.manual_seed(0)
    w, b, x = torch.randn(40, 64) * 0.05, torch.randn(40), torch.randn(3, 64)
    q, scale = quantize_per_channel(w)
    got = Int8Linear(w, b, path="triton")(x)
    torch.testing.assert_close(got, ref.int8_gemm(x, q, scale) + b, atol=1e-4, rtol=1e-4)
