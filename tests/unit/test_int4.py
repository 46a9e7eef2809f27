"""int4 weight-only quantization (layers/int4_linear.py): group quantization, Int4Linear's paths against a dequantized
reference, the shapes that take the dequantize path, the packed CPU op's constraints (so a torch upgrade that
changes them shows here), and the CUDA refusal (no GPU needed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tritium.backend import EngineConfig
from tritium.backend.config import check_quantization, check_quantization_device
from tritium.backend.layers.int4_linear import (
    GROUP_SIZES,
    INT4_PATHS,
    Int4Linear,
    dequantize_groups,
    packable,
    quantize_groups,
)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> torch.Tensor:
    q, scale, zero = quantize_groups(w, group_size)
    return F.linear(x, dequantize_groups(q, scale, zero, w.shape[1], torch.float32), bias)


def test_group_quantization_round_trips() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.logspace(-3, 0, 48)[:, None]  # rows of very different ranges
    w[5] = 0
    w[6, :32] = 0.25  # a constant group
    w[7] += 3.0  # groups far from zero
    q, scale, zero = quantize_groups(w, 32)
    assert q.dtype == torch.uint8 and q.shape == (48, 96) and scale.shape == zero.shape == (48, 3)
    assert int(q.max()) == 15 and int(q.min()) == 0
    assert bool((scale.to(torch.bfloat16).float() == scale).all())  # bf16 values: every path multiplies the same
    deq = dequantize_groups(q, scale, zero, 96, torch.float32)
    assert bool((deq[5] == 0).all()) and bool((deq[6, :32] == 0.25).all())
    err = (deq - w).abs().reshape(48, 3, 32)
    # half a step, plus the bf16 rounding of the zero point (which can push the extremes past the codes)
    bound = scale / 2 + zero.abs() * 2**-8
    assert bool((err <= bound[..., None] + 1e-7).all())
    assert float(err.mean()) < float(scale.mean()) / 3


def test_partial_group_pads_with_the_last_weight() -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 40)
    q, scale, zero = quantize_groups(w, 32)
    assert q.shape == (16, 64) and scale.shape == (16, 2)
    assert bool((q[:, 40:] == q[:, 39:40]).all())  # the padding does not widen the last group's range
    deq = dequantize_groups(q, scale, zero, 40, torch.float32)
    assert deq.shape == (16, 40) and float((deq - w).abs().max()) <= float(scale.max())


@pytest.mark.parametrize("path", INT4_PATHS)
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize(("n", "k", "group_size"), [(96, 64, 32), (192, 576, 32), (576, 1536, 64), (48, 256, 128)])
def test_int4_linear_paths_match_dequantized_reference(path: str, rows: int, n: int, k: int, group_size: int) -> None:
    torch.manual_seed(0)
    w, b, x = torch.randn(n, k) * 0.05, torch.randn(n), torch.randn(rows, k)
    want = reference(x, w, b, group_size)
    layer = Int4Linear(w, b, path=path, group_size=group_size)
    got = layer(x)
    assert layer.path == path and got.dtype == torch.float32 and got.shape == (rows, n)
    tol = 2e-2 if path == "cpu_bf16" else 1e-4  # bf16 activations
    torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=tol)


@pytest.mark.parametrize(("n", "k"), [(40, 64), (96, 80), (96, 33), (8, 8)])  # N % 16, K % 32, odd K, both
def test_shapes_the_packed_op_cannot_take_use_dequant(n: int, k: int) -> None:
    torch.manual_seed(0)
    w, x = torch.randn(n, k), torch.randn(3, k)
    assert not packable(n, k, 32)
    layer = Int4Linear(w, None)
    assert layer.path == "dequant" and "path=dequant" in repr(layer)
    torch.testing.assert_close(layer(x), reference(x, w, None, 32), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="needs out_features % 16 == 0"):
        Int4Linear(w, None, path="cpu_bf16")


def test_packable_shapes_use_the_packed_op_on_vector_cpus() -> None:
    layer = Int4Linear(torch.randn(64, 128), None)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert layer.path == "cpu_bf16"
        assert layer.qweight.shape == (64, 64) and layer.scales_and_zeros.shape == (4, 64, 2)


def test_out_dtype_and_bf16_input() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(64, 64), torch.randn(2, 64)
    head = Int4Linear(w, None, out_dtype=torch.float32)
    got = head(x.to(torch.bfloat16))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference(x, w, None, 32), atol=0.05 * float(got.abs().max()), rtol=0.05)
    assert Int4Linear(w, None)(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("group_size", [16, 48, 512, 0])
def test_unsupported_group_size_is_refused(group_size: int) -> None:
    with pytest.raises(ValueError, match=r"group_size must be one of \(32, 64, 128, 256\)"):
        Int4Linear(torch.randn(16, 64), None, group_size=group_size)


def test_packed_op_constraints() -> None:
    """What torch 2.13's packed int4 CPU op accepts (layers/int4_linear.py `packable`): it raises outside, never returns
    a wrong result; scales must be in the activations' dtype."""
    pack, mm = torch._convert_weight_to_int4pack_for_cpu, torch.ops.aten._weight_int4pack_mm_for_cpu
    q = torch.randint(0, 16, (24, 64), dtype=torch.int32)
    with pytest.raises(RuntimeError, match="N to be dividable by 16"):
        pack(q, 1)
    with pytest.raises(RuntimeError, match="K to be dividable by 2"):
        pack(torch.randint(0, 16, (16, 33), dtype=torch.int32), 1)
    packed = pack(torch.randint(0, 16, (16, 80), dtype=torch.int32), 1)
    sz = torch.ones(3, 16, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="K to be divisible by qGroupSize"):
        mm(torch.randn(1, 80, dtype=torch.bfloat16), packed, 32, sz)
    packed = pack(torch.randint(0, 16, (16, 64), dtype=torch.int32), 1)
    with pytest.raises(RuntimeError, match="qGroupSize to be 32, 64, 128 or 256"):
        mm(torch.randn(1, 64, dtype=torch.bfloat16), packed, 16, torch.ones(4, 16, 2, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="expected scalar type"):
        mm(torch.randn(1, 64, dtype=torch.bfloat16), packed, 32, torch.ones(2, 16, 2))
    assert all(packable(16, g, g) for g in GROUP_SIZES) and not packable(16, 576, 128)


def test_int4_is_refused_on_cuda_by_name() -> None:
    check_quantization("int4")
    check_quantization_device("int4", torch.device("cpu"))
    check_quantization_device("int8", torch.device("cuda"))
    check_quantization_device(None, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"'int4' is implemented for CPUs only .*'int8' is the weight-only "
                                         r"scheme on CUDA"):
        check_quantization_device("int4", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="implemented for CPUs only"):
        EngineConfig(quantization="int4", device="cuda")
    with pytest.raises(ValueError, match="runs on CPUs only"):
        Int4Linear(torch.randn(16, 64, device="meta"), None)
