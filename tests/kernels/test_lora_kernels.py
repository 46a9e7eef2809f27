"""The Triton LoRA shrink / expand kernels (kernels/lora.py, under TRITON_INTERPRET=1) against their torch
references (kernels/reference.py) and the engine's host-segment ops (backend/lora/ops.py): GPU tiles on small
shapes, mixed slots, rows of no adapter untouched, y a strided column slice of a fused output, ranks 8, 16, 64 and
256."""

from __future__ import annotations

import os
from itertools import pairwise

import pytest
import torch

from tritium.backend.lora.ops import LoraGroups, add_lora, add_lora_fused, add_lora_rows, add_lora_segments, lora_groups
from tritium.kernels import reference as ref
from tritium.kernels import triton_ops as tri
from tritium.kernels.lora import lora_config, rank_tile
from tritium.kernels.tiles import lora_row_splits

from support.triton_interpreter import TOL

pytestmark = pytest.mark.usefixtures("bf16_dot")  # these kernels multiply bf16 (tests/kernels/conftest.py)

SLOTS, IN, OUT = 3, 40, 24
BOUNDS = (0, 24, 32, 40)  # a fused projection of three modules: q 24 columns, k and v 8 each
# rows 1 and 5 have no adapter; slots out of order, one slot unused
TOKEN_SLOTS = [2, -1, 0, 2, 0, -1, 2]


def stacks(rank: int, dtype: torch.dtype, seed: int, modules: int = 1) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """A [slots, modules * max_rank, in], B [slots, out, max_rank] (out: OUT for one module, else BOUNDS' width) and
    scaling, the last slot's rank 8 zero-padded (as LoraStacks holds a smaller adapter)."""
    gen = torch.Generator().manual_seed(seed)
    out = OUT if modules == 1 else BOUNDS[-1]
    a = torch.randn(SLOTS, modules, rank, IN, generator=gen) * 0.2
    b = torch.randn(SLOTS, out, rank, generator=gen) * 0.2
    a[2, :, 8:], b[2, :, 8:] = 0, 0
    return a.view(SLOTS, modules * rank, IN).to(dtype), b.to(dtype), torch.tensor([0.5, 2.0, 1.25])


def fused_output(dtype: torch.dtype, width: int = OUT) -> tuple[torch.Tensor, torch.Tensor]:
    """A wider [T, 8 + width + 16] output and its strided column slice y [T, width]."""
    fused = torch.randn(len(TOKEN_SLOTS), 8 + width + 16).to(dtype)
    return fused, fused[:, 8 : 8 + width]


def segments(token_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    rows, segs = lora_groups(token_slots)
    starts = torch.tensor([s for _, s, _ in segs] + [segs[-1][2]], dtype=torch.int32)
    return (torch.tensor(rows, dtype=torch.int32), starts, torch.tensor([s for s, _, _ in segs], dtype=torch.int32),
            max(e - s for _, s, e in segs))


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype] * 4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def assert_untouched(got: torch.Tensor, want: torch.Tensor, width: int) -> None:
    """Rows of no adapter and the columns around y are exactly as they were."""
    assert torch.equal(got[[1, 5]], want[[1, 5]])
    assert torch.equal(got[:, :8], want[:, :8]) and torch.equal(got[:, 8 + width :], want[:, 8 + width :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rank", [8, 16, 64, 256])
@pytest.mark.parametrize("modules", [1, 3])
def test_segmented_kernels_match_the_references(rank: int, dtype: torch.dtype, modules: int) -> None:
    torch.manual_seed(rank)
    a, b, scaling = stacks(rank, dtype, rank, modules)
    bounds = BOUNDS if modules == 3 else None
    x = torch.randn(len(TOKEN_SLOTS), IN).to(dtype)
    rows, starts, slots, max_rows = segments(TOKEN_SLOTS)
    got_buf = torch.zeros(len(rows), modules * rank, dtype=dtype)
    want_buf = torch.zeros_like(got_buf)
    tri.lora_shrink(x, a, scaling, rows, starts, slots, got_buf, max_rows, modules, tiles="gpu")
    ref.lora_shrink(x, a, scaling, rows, starts, slots, want_buf, max_rows, modules)
    close(got_buf, want_buf, dtype)
    fused, y = fused_output(dtype, b.shape[1])
    want_fused = fused.clone()
    tri.lora_expand(want_buf, b, rows, starts, slots, y, max_rows, bounds, tiles="gpu")
    ref.lora_expand(want_buf, b, rows, starts, slots, want_fused[:, 8 : 8 + b.shape[1]], max_rows, bounds)
    close(fused, want_fused, dtype)
    assert_untouched(fused, want_fused, b.shape[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rank", [8, 16, 64, 256])
@pytest.mark.parametrize(("modules", "splits", "tiles"), [(1, 1, "gpu"), (3, 3, "small"), (3, 2, "gpu")])
def test_per_row_kernels_match_the_references(rank: int, dtype: torch.dtype, modules: int, splits: int,
                                              tiles: str) -> None:
    """The split-K shrink's partial sums add up to the reference's product (3 splits of 16, 16 and 8 columns with
    the small tiles; GPU tiles leave later splits empty, and they must hold zeros), and the expand adds them."""
    a, b, scaling = stacks(rank, dtype, 100 + rank, modules)
    bounds = BOUNDS if modules == 3 else None
    x = torch.randn(len(TOKEN_SLOTS), IN).to(dtype)
    row_slots = torch.tensor(TOKEN_SLOTS, dtype=torch.int32)
    got = torch.full((splits, len(TOKEN_SLOTS), modules * rank), 7.0)
    want = got.clone()
    tri.lora_shrink_rows(x, a, scaling, row_slots, got, modules, tiles=tiles)
    ref.lora_shrink_rows(x, a, scaling, row_slots, want, modules)
    active = [t for t, s in enumerate(TOKEN_SLOTS) if s >= 0]
    close(got[:, active].sum(0), want[:, active].sum(0), dtype)
    if splits > 1 and tiles == "small":
        assert bool((got[1, active] != 0).any())  # the second split did part of the work
    assert bool((got[:, [1, 5]] == 7.0).all())  # rows of no adapter: not written
    fused, y = fused_output(dtype, b.shape[1])
    want_fused = fused.clone()
    tri.lora_expand_rows(got, b, row_slots, y, bounds, tiles=tiles)
    ref.lora_expand_rows(got, b, row_slots, want_fused[:, 8 : 8 + b.shape[1]], bounds)
    close(fused, want_fused, dtype)
    assert_untouched(fused, want_fused, b.shape[1])


def test_the_per_row_kernels_give_the_same_bits_every_run() -> None:
    """No atomics: the split-K partial sums are added in a fixed order."""
    a, b, scaling = stacks(16, torch.float32, 5, 3)
    x = torch.randn(len(TOKEN_SLOTS), IN)
    row_slots = torch.tensor(TOKEN_SLOTS, dtype=torch.int32)
    outs = []
    for _ in range(2):
        partials = torch.zeros(3, len(TOKEN_SLOTS), 48)
        y = torch.zeros(len(TOKEN_SLOTS), BOUNDS[-1])
        tri.lora_shrink_rows(x, a, scaling, row_slots, partials, 3, tiles="small")
        tri.lora_expand_rows(partials, b, row_slots, y, BOUNDS, tiles="small")
        outs.append(y)
    assert torch.equal(outs[0], outs[1])


def test_the_engine_ops_dispatch_to_the_kernels_and_agree_with_the_host_segments() -> None:
    """backend/lora/ops.py: a fused projection's modules through the Triton ops (device segments: add_lora_segments;
    per-row slots, the decode-graph form: add_lora_rows) and add_lora_rows' torch form give the torch host-segment
    form's result (add_lora_fused), fp32."""
    a, b, scaling = stacks(16, torch.float32, 7, 3)
    x = torch.randn(len(TOKEN_SLOTS), IN)
    rows, segs = lora_groups(TOKEN_SLOTS)
    groups = LoraGroups(torch.tensor(rows, dtype=torch.int32), segs)
    want = torch.randn(len(TOKEN_SLOTS), 8 + BOUNDS[-1])
    got_seg, got_rows, got_ref_rows, got_one = want.clone(), want.clone(), want.clone(), want.clone()
    slices = [(b[:, lo:hi], 8 + lo, 8 + hi) for lo, hi in pairwise(BOUNDS)]
    add_lora_fused(want, x, groups, a, slices, scaling)
    add_lora_segments(got_seg[:, 8:], x, groups, a, b, BOUNDS, scaling, tri)
    slots = torch.tensor(TOKEN_SLOTS, dtype=torch.int32)
    add_lora_rows(got_rows[:, 8:], x, slots, a, b, scaling, tri, BOUNDS)
    add_lora_rows(got_ref_rows[:, 8:], x, slots, a, b, scaling, None, BOUNDS)
    add_lora(got_one[:, 8:32], x, groups, a[:, :16], b[:, :24], scaling, kernels=tri)  # one module: q alone
    for got in (got_seg, got_rows, got_ref_rows):
        close(got, want, torch.float32)
    close(got_one[:, :32], want[:, :32], torch.float32)


def test_split_counts() -> None:
    assert [lora_row_splits(k) for k in (64, 255, 256, 2048, 4096, 14336)] == [1, 1, 1, 8, 16, 32]


def test_bad_bounds_are_refused() -> None:
    _, b, _ = stacks(16, torch.float32, 1, 3)
    row_slots = torch.zeros(2, dtype=torch.int32)
    partials, y = torch.zeros(1, 2, 48), torch.zeros(2, BOUNDS[-1])
    for bounds in ((0, 24, 24, 40), (0, 24, 32, 39), (1, 24, 32, 40), (0, 10, 20, 30, 40)):
        with pytest.raises(ValueError, match="lora expand"):
            tri.lora_expand_rows(partials, b, row_slots, y, bounds)
    with pytest.raises(ValueError, match="lora expand"):  # two modules' ranks in partials, three bounds
        tri.lora_expand_rows(torch.zeros(1, 2, 32), b, row_slots, y, BOUNDS)


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
                             torch.zeros(1, 2, 16))


def test_the_device_check_compares_and_times_the_lora_kernels() -> None:
    """gpu-check step 1's LoRA cases pass under the interpreter, and step 4's timing (smoke) gives every module
    and form a LoRA time and a base GEMM time."""
    from tritium.client.checks.kernels import DEFAULT_LAYOUT, OPS, SMOKE_SIZES, time_lora

    for op in ("lora_segmented", "lora_rows"):
        err, ok = OPS[op](tri, ref, DEFAULT_LAYOUT, SMOKE_SIZES, torch.float32, "cpu")
        assert ok, (op, err)
    timed = time_lora(smoke=True)
    assert {(t["module"], t["form"]) for t in timed["timings"]} == {
        (m, f) for m in ("qkv_proj", "down_proj") for f in ("rows", "segmented")}
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


def test_a_fused_projection_is_two_launches_that_read_nothing_on_the_host() -> None:
    """add_lora_rows over q/k/v with the kernels: one shrink (a program per row, module and split) and one expand,
    and no host read (a CUDA graph captures it)."""
    from tritium.kernels.compile_check import recording

    from support.host_transfers import counting_host_transfers

    a, b, scaling = stacks(16, torch.float32, 9, 3)
    x, y = torch.randn(len(TOKEN_SLOTS), IN), torch.zeros(len(TOKEN_SLOTS), BOUNDS[-1])
    with recording() as launches, counting_host_transfers() as found:
        add_lora_rows(y, x, torch.tensor(TOKEN_SLOTS, dtype=torch.int32), a, b, scaling, tri, BOUNDS)
    assert [launch.kernel.__name__ for launch in launches] == ["lora_shrink_rows_kernel", "lora_expand_rows_kernel"]
    assert found == []
