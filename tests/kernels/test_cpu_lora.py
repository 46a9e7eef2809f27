"""The CPU LoRA kernel (kernels/cpu/lora_windows.cpp) against the windowed torch form it replaces
(backend/lora/windows.py): several window layouts, module subsets, column offsets and strided rows; rows outside
the windows' adapter rows are not touched; operands it cannot read are refused, not misread. The first run on a
machine builds the kernel (~40 s; `make setup` does it ahead)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tritium.backend.lora.adapter import MODULES, LoraAdapter, module_shapes
from tritium.backend.lora.weights import FUSED, LoraBatch, LoraStacks
from tritium.backend.lora.windows import LoraWindows, add_lora_windows, plan_windows
from tritium.kernels.cpu_lora import CpuLora, build_cpu_lora, load_cpu_lora

from support.lora import SMALL_CONFIG


@pytest.fixture(scope="module")
def native() -> CpuLora:
    module = load_cpu_lora()
    assert module is not None, "the CPU LoRA kernel must build on the test machine (gcc and ninja are there)"
    return module


def stacks(g: torch.Generator, slots: int, rank: int, d_in: int, outs: list[int]
           ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A fused projection's A [slots, modules * rank, in] and each module's B as the torch form holds it: a
    [slots, out, rank] view of a rank-major [slots, rank, out] tensor."""
    a = torch.randn(slots, len(outs) * rank, d_in, generator=g)
    bs = [torch.randn(slots, rank, n, generator=g).transpose(1, 2) for n in outs]
    return a, bs


@pytest.mark.parametrize("packed", [False, True])  # the torch form's layout, the kernel's own
@pytest.mark.parametrize(("row_slots", "present"), [
    ([1, -1, 0, 1, -1, 0, 1, -1, -1], [True, True, True]),   # slots a range, fillers, rows past the windows
    ([3, 0, 3, 0, 2, -1, 2, -1], [True, False, True]),      # slots with a gap, a module left out
    ([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [False, True, False]),  # one window, no filler
    ([2, 0, 2, 1, 2, 0, 2, 1, 2], [True, True, True]),  # no row of no adapter: only packed windows fit
])
def test_kernel_equals_the_torch_form(native: CpuLora, row_slots: list[int], present: list[bool],
                                      packed: bool) -> None:
    g = torch.Generator().manual_seed(0)
    plan = plan_windows(row_slots, packed)
    if plan is None:
        assert not packed
        return
    windows = plan[1]
    rank, d_in, outs = 16, 72, [96, 24, 40]  # 72 and 40: column blocks and rows that are not multiples of 16
    a, bs = stacks(g, 4, rank, d_in, outs)
    starts = [0, 96, 120]
    slices = [(b, s, s + n) if keep else None for b, s, n, keep in zip(bs, starts, outs, present, strict=True)]
    wide = torch.randn(len(row_slots), d_in + 8, generator=g)
    x = wide[:, 4 : 4 + d_in]  # rows with a stride of their own
    fused = torch.randn(len(row_slots), 170, generator=g)
    y = fused[:, 5:165]  # the projection's output as a column slice of a wider tensor
    scaling = torch.tensor([0.5, 2.0, 1.5, 0.25])
    expected = fused.clone()
    add_lora_windows(expected[:, 5:165], x, windows, a, slices, scaling)
    add_lora_windows(y, x, windows, a, slices, scaling, native)
    torch.testing.assert_close(fused, expected, rtol=1e-4, atol=1e-4)  # sums in another order: ~1e-5 apart
    adapter_rows = [start + i for start, n in zip(windows.starts, windows.counts, strict=True) for i in range(n)]
    others = [t for t in range(len(row_slots)) if t not in adapter_rows]
    assert torch.equal(fused[others], expected[others])  # fillers and rows past the windows: bit for bit
    assert torch.equal(fused[:, :5], expected[:, :5]) and torch.equal(fused[:, 165:], expected[:, 165:])


def test_a_row_of_the_step_does_not_change_another_rows_result(native: CpuLora) -> None:
    """A row's products are the same whatever the other rows hold (no request can change another's tokens)."""
    g = torch.Generator().manual_seed(1)
    a, bs = stacks(g, 2, 8, 32, [48])
    windows = LoraWindows([0, 1], [3, 2], 3)
    x = torch.randn(7, 32, generator=g)
    y1, y2 = torch.zeros(7, 48), torch.zeros(7, 48)
    native.lora_windows(y1, x, a, [bs[0].transpose(1, 2)], [0], windows.slots, windows.starts, windows.counts, 3,
                        torch.ones(2))
    x2 = x.clone()
    x2[[1, 4]] = float("nan")  # another row of the same window, a row of the other window
    native.lora_windows(y2, x2, a, [bs[0].transpose(1, 2)], [0], windows.slots, windows.starts, windows.counts, 3,
                        torch.ones(2))
    assert torch.equal(y1[[0, 2, 3]], y2[[0, 2, 3]])
    assert torch.equal(y2[5:], torch.zeros(2, 48))  # the filler and the row past the windows


def test_operands_it_cannot_read_are_refused(native: CpuLora) -> None:
    g = torch.Generator().manual_seed(2)
    a, bs = stacks(g, 2, 8, 32, [48])
    b = bs[0].transpose(1, 2)
    x, y = torch.randn(4, 32, generator=g), torch.zeros(4, 48)
    with pytest.raises(RuntimeError, match="float32"):
        native.lora_windows(y, x.double(), a, [b], [0], [0], [0], [2], 2, torch.ones(2))
    with pytest.raises(RuntimeError, match="contiguous"):
        native.lora_windows(y, x, a, [bs[0]], [0], [0], [0], [2], 2, torch.ones(2))  # B not rank-major
    with pytest.raises(RuntimeError, match="more rows"):
        native.lora_windows(y, x, a, [b], [0], [0, 1], [0, 3], [2, 2], 2, torch.ones(2))
    with pytest.raises(RuntimeError, match="apart"):
        native.lora_windows(y, x, a, [b], [0], [0, 1], [0, 1], [2, 2], 2, torch.ones(2))
    with pytest.raises(RuntimeError, match="outside y"):
        native.lora_windows(y, x, a, [b], [10], [0], [0], [2], 2, torch.ones(2))
    with pytest.raises(RuntimeError, match="bad window"):
        native.lora_windows(y, x, a, [b], [0], [5], [0], [2], 2, torch.ones(2))

def test_a_decode_step_over_the_stacks_equals_the_torch_form(native: CpuLora) -> None:
    """LoraBatch in windows over rank-major stacks, every fused projection of every layer: the kernel (the
    stacks' own slices for adapters of every module; a subset of modules through the checked path) against
    the torch form."""
    shapes = module_shapes(SMALL_CONFIG)
    stacks = LoraStacks(SMALL_CONFIG, 4, 16, torch.float32, torch.device("cpu"), b_rank_major=True)
    g = torch.Generator().manual_seed(3)
    for slot, (rank, targets) in ((0, (16, MODULES)), (2, (8, MODULES)), (3, (8, ("q_proj", "down_proj")))):
        weights = {(layer, m): (torch.randn(rank, shapes[m][0], generator=g), torch.randn(shapes[m][1], rank,
                                                                                          generator=g))
                   for layer in range(SMALL_CONFIG.num_hidden_layers) for m in targets}
        stacks.write(slot, LoraAdapter(f"a{slot}", Path("."), rank, 0.5 + slot, weights))
    for row_slots, packed in (([2, -1, 0, 2, 0, -1, -1], False), ([3, 0, -1, 3, 0, -1], False),
                              ([3, 0, 3, 2, 0, 3, -1], True)):
        plan = plan_windows(row_slots, packed)
        assert plan is not None
        for layer in range(SMALL_CONFIG.num_hidden_layers):
            for proj, modules in FUSED.items():
                x = torch.randn(len(row_slots), shapes[modules[0]][0], generator=g)
                y = torch.randn(len(row_slots), sum(shapes[m][1] for m in modules), generator=g)
                expected = y.clone()
                LoraBatch(None, stacks, windows=plan[1]).apply(layer, proj, x, expected)
                LoraBatch(None, stacks, windows=plan[1], native=native).apply(layer, proj, x, y)
                torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # a failed build still compiles torch's headers first: ~30 s
def test_a_kernel_that_does_not_build_leaves_the_torch_form(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("#include <torch/extension.h>\nthis is not C++;\n")
    assert build_cpu_lora("tritium_test_broken", broken, tmp_path) is None
    assert "could not be built" in caplog.text and "the torch form" in caplog.text
