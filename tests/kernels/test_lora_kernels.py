"""The Triton LoRA shrink / expand kernels (kernels/lora.py, under TRITON_INTERPRET=1) against their torch
references (kernels/reference.py) and the engine's host-segment ops (backend/lora/ops.py): GPU tiles on small
shapes, mixed slots, rows of no adapter untouched, y a strided column slice of a fused output, ranks 8, 16, 64 and
256."""

from __future__ import annotations

import os

import pytest
import torch

from tritium.backend.lora.ops import LoraGroups, add_lora, add_lora_rows, lora_groups
from tritium.kernels import reference as ref
from tritium.kernels import triton_ops as tri
from tritium.kernels.lora import lora_config, rank_tile

from support.triton_interpreter import TOL

pytestmark = pytest.mark.usefixtures("bf16_dot")  # these kernels multiply bf16 (tests/kernels/conftest.py)

SLOTS, IN, OUT = 3, 40, 24
# rows 1 and 5 have no adapter; slots out of order, one slot unused
TOKEN_SLOTS = [2, -1, 0, 2, 0, -1, 2]


def stacks(rank: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [slots, max_rank, in], B [slots, out, max_rank] and scaling, the last slot's rank 8 zero-padded (as
    LoraStacks holds a smaller adapter)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(SLOTS, rank, IN, generator=gen) * 0.2
    b = torch.randn(SLOTS, OUT, rank, generator=gen) * 0.2
    a[2, 8:], b[2, :, 8:] = 0, 0
    return a.to(dtype), b.to(dtype), torch.tensor([0.5, 2.0, 1.25])


def fused_output(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused [T, 8 + OUT + 16] output and its strided column slice y [T, OUT]."""
    fused = torch.randn(len(TOKEN_SLOTS), 8 + OUT + 16).to(dtype)
    return fused, fused[:, 8 : 8 + OUT]


def segments(token_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    rows, segs = lora_groups(token_slots)
    starts = torch.tensor([s for _, s, _ in segs] + [segs[-1][2]], dtype=torch.int32)
    return (torch.tensor(rows, dtype=torch.int32), starts, torch.tensor([s for s, _, _ in segs], dtype=torch.int32),
            max(e - s for _, s, e in segs))


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype] * 4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rank", [8, 16, 64, 256])
def test_segmented_kernels_match_the_references(rank: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rank)
    a, b, scaling = stacks(rank, dtype, rank)
    x = torch.randn(len(TOKEN_SLOTS), IN).to(dtype)
    rows, starts, slots, max_rows = segments(TOKEN_SLOTS)
    got_buf, want_buf = torch.zeros(len(rows), rank, dtype=dtype), torch.zeros(len(rows), rank, dtype=dtype)
    tri.lora_shrink(x, a, scaling, rows, starts, slots, got_buf, max_rows, tiles="gpu")
    ref.lora_shrink(x, a, scaling, rows, starts, slots, want_buf, max_rows)
    close(got_buf, want_buf, dtype)
    fused, y = fused_output(dtype)
    want_fused = fused.clone()
    tri.lora_expand(want_buf, b, rows, starts, slots, y, max_rows, tiles="gpu")
    ref.lora_expand(want_buf, b, rows, starts, slots, want_fused[:, 8 : 8 + OUT], max_rows)
    close(fused, want_fused, dtype)
    untouched = [1, 5]
    assert torch.equal(fused[untouched], want_fused[untouched])  # rows of no adapter
    assert torch.equal(fused[:, :8], want_fused[:, :8]) and torch.equal(fused[:, 8 + OUT :], want_fused[:, 8 + OUT :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rank", [8, 16, 64, 256])
def test_per_row_kernels_match_the_references(rank: int, dtype: torch.dtype) -> None:
    a, b, scaling = stacks(rank, dtype, 100 + rank)
    x = torch.randn(len(TOKEN_SLOTS), IN).to(dtype)
    row_slots = torch.tensor(TOKEN_SLOTS, dtype=torch.int32)
    got_buf = torch.full((len(TOKEN_SLOTS), rank), 7.0, dtype=dtype)
    want_buf = got_buf.clone()
    tri.lora_shrink_rows(x, a, scaling, row_slots, got_buf, tiles="gpu")
    ref.lora_shrink_rows(x, a, scaling, row_slots, want_buf)
    close(got_buf, want_buf, dtype)
    assert bool((got_buf[[1, 5]] == 7.0).all())  # rows of no adapter: not written
    fused, y = fused_output(dtype)
    want_fused = fused.clone()
    tri.lora_expand_rows(want_buf, b, row_slots, y, tiles="gpu")
    ref.lora_expand_rows(want_buf, b, row_slots, want_fused[:, 8 : 8 + OUT])
    close(fused, want_fused, dtype)
    assert torch.equal(fused[[1, 5]], want_fused[[1, 5]])
    assert torch.equal(fused[:, :8], want_fused[:, :8]) and torch.equal(fused[:, 8 + OUT :], want_fused[:, 8 + OUT :])


def test_the_engine_ops_dispatch_to_the_kernels_and_agree_with_the_host_segments() -> None:
    """backend/lora/ops.py: add_lora with the Triton ops (device segments) and add_lora_rows (per-row slots, the
    decode-graph form) give the host-segment reference's result, fp32."""
    a, b, scaling = stacks(16, torch.float32, 7)
    x = torch.randn(len(TOKEN_SLOTS), IN)
    rows, segs = lora_groups(TOKEN_SLOTS)
    groups = LoraGroups(torch.tensor(rows, dtype=torch.int32), segs)
    want = torch.randn(len(TOKEN_SLOTS), 8 + OUT)
    got_seg, got_rows, got_ref_rows = want.clone(), want.clone(), want.clone()
    add_lora(want[:, 8:], x, groups, a, b, scaling)
    add_lora(got_seg[:, 8:], x, groups, a, b, scaling, kernels=tri)
    slots = torch.tensor(TOKEN_SLOTS, dtype=torch.int32)
    add_lora_rows(got_rows[:, 8:], x, slots, a, b, scaling, kernels=tri)
    add_lora_rows(got_ref_rows[:, 8:], x, slots, a, b, scaling)
    for got in (got_seg, got_rows, got_ref_rows):
        close(got, want, torch.float32)


def test_launch_configurations() -> None:
    assert rank_tile(8) == 16 and rank_tile(16) == 16 and rank_tile(17) == 32 and rank_tile(256) == 256
    assert lora_config(16, per_row=False).block_m == 32 and lora_config(16, False, torch.float32).block_m == 16
    row = lora_config(64, per_row=True)
    assert row.block_r * row.block_k == 4096 and row.block_r * row.block_n <= 4096
    assert lora_config(8, True, torch.float16, "small", "cpu") == (16, 16, 16, 16, 4, 1)


def test_shape_mismatch_is_refused() -> None:
    a, _, scaling = stacks(16, torch.float32, 1)
    with pytest.raises(ValueError, match="lora shrink"):
        tri.lora_shrink_rows(torch.zeros(2, IN + 1), a, scaling, torch.zeros(2, dtype=torch.int32),
                             torch.zeros(2, 16))


def test_the_device_check_compares_and_times_the_lora_kernels() -> None:
    """gpu-check step 1's LoRA cases pass under the interpreter, and step 4's timing (smoke) gives every module
    and form a LoRA time and a base GEMM time."""
    from tritium.client.checks.kernels import DEFAULT_LAYOUT, OPS, SMOKE_SIZES, time_lora

    for op in ("lora_segmented", "lora_rows"):
        err, ok = OPS[op](tri, ref, DEFAULT_LAYOUT, SMOKE_SIZES, torch.float32, "cpu")
        assert ok, (op, err)
    timed = time_lora(smoke=True)
    assert {(t["module"], t["form"]) for t in timed["timings"]} == {
        (m, f) for m in ("q_proj", "down_proj") for f in ("rows", "segmented")}
    assert all(t["lora_ms"] > 0 and t["gemm_ms"] > 0 and t["ratio"] > 0 for t in timed["timings"])


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="captures a CUDA graph: needs a GPU and TRITON_INTERPRET=0")
def test_a_captured_graph_sees_slots_and_weights_written_after_capture() -> None:
    """The decode graphs' premise, on a GPU: a graph of the per-row shrink / expand captured over empty slots and
    all-base rows replays with the adapters written into the stacks and the row slots staged afterwards."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    a, b, scaling = (t.to(dev) for t in stacks(16, dtype, 3))
    a_live, b_live, scaling_live = torch.zeros_like(a), torch.zeros_like(b), torch.zeros_like(scaling)
    x = torch.randn(len(TOKEN_SLOTS), IN, device=dev).to(dtype)
    y = torch.zeros(len(TOKEN_SLOTS), OUT, device=dev, dtype=dtype)
    row_slots = torch.full((len(TOKEN_SLOTS),), -1, dtype=torch.int32, device=dev)
    add_lora_rows(y, x, row_slots, a_live, b_live, scaling_live, kernels=tri)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora_rows(y, x, row_slots, a_live, b_live, scaling_live, kernels=tri)
    a_live.copy_(a), b_live.copy_(b), scaling_live.copy_(scaling)
    row_slots.copy_(torch.tensor(TOKEN_SLOTS, dtype=torch.int32))
    y.zero_()
    graph.replay()
    want = torch.zeros_like(y)
    add_lora_rows(want, x, row_slots, a, b, scaling)
    close(y, want, dtype)
    assert bool((y[[1, 5]] == 0).all())
