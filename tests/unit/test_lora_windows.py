"""The windowed torch form of a decode step's LoRA (lora/windows.py): the runner's row order, products added in
place for each window's rows only, fillers and rows past the windows exact, against a per-row loop."""

from __future__ import annotations

import pytest
import torch

from tritium.backend.lora.windows import LoraWindows, add_lora_windows, plan_windows


def test_plan_puts_each_slot_at_its_window_start_and_fills_gaps_with_base_rows() -> None:
    order, windows = plan_windows([2, -1, 0, 2, -1, 0, 0, -1]) or ([], None)
    assert windows is not None and (windows.slots, windows.counts, windows.length) == ([0, 2], [3, 2], 3)
    assert order == [2, 5, 6, 0, 3, 1, 4, 7]  # slot 0's rows, slot 2's and a filler, the base rows left
    assert windows.starts == [0, 3] and windows.even


@pytest.mark.parametrize("row_slots", [[-1, -1], [0, 0, 0, 1], [1, 1, 1, 0, 2, -1]])
def test_no_plan_without_adapter_rows_or_with_too_few_fillers(row_slots: list[int]) -> None:
    assert plan_windows(row_slots) is None


def reference(y: torch.Tensor, x: torch.Tensor, row_slots: list[int], a: torch.Tensor, b: torch.Tensor,
              scaling: torch.Tensor, start: int, end: int) -> torch.Tensor:
    expected = y.clone()
    for t, s in enumerate(row_slots):
        if s >= 0:
            expected[t, start:end] += scaling[s] * (x[t] @ a[s].t()) @ b[s].t()
    return expected


# slots as a range (the stacks are sliced) and with a gap (gathered); with and without fillers
@pytest.mark.parametrize("row_slots", [[1, -1, 0, 1, -1, 0, 1, -1, -1], [2, 0, -1, 2, 0, -1], [3, 0, 3, 0]])
def test_windows_match_a_per_row_loop_and_leave_other_rows_exact(row_slots: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    plan = plan_windows(row_slots)
    assert plan is not None
    order, windows = plan
    laid_out = [row_slots[i] for i in order]
    slots, rank, d_in = 4, 4, 12
    x = torch.randn(len(laid_out), d_in, generator=g)
    a = torch.randn(slots, rank, d_in, generator=g)
    b = torch.randn(slots, 10, rank, generator=g)
    scaling = torch.tensor([0.5, 2.0, 1.5, 1.0])
    fused = torch.randn(len(laid_out), 30, generator=g)  # the module's output is columns 10:20 of a fused one
    expected = reference(fused, x, laid_out, a, b, scaling, 10, 20)
    add_lora_windows(fused, x, windows, a, [(b, 10, 20)], scaling)
    torch.testing.assert_close(fused, expected)
    base = [t for t, s in enumerate(laid_out) if s < 0]
    assert torch.equal(fused[base], expected[base])


def test_fused_modules_each_take_their_rank_slice_and_a_none_module_is_skipped() -> None:
    g = torch.Generator().manual_seed(1)
    laid_out, windows = [0, 0, 1, -1], LoraWindows([0, 1], [2, 1], 2)
    x = torch.randn(4, 6, generator=g)
    a = torch.randn(2, 3 * 4, 6, generator=g)  # three modules' A side by side
    bs = [torch.randn(2, n, 4, generator=g) for n in (5, 3, 3)]
    y = torch.randn(4, 11, generator=g)
    expected = y.clone()
    for j, (start, end) in ((0, (0, 5)), (2, (8, 11))):
        expected = reference(expected, x, laid_out, a[:, 4 * j : 4 * (j + 1)], bs[j], torch.ones(2), start, end)
    add_lora_windows(y, x, windows, a, [(bs[0], 0, 5), None, (bs[2], 8, 11)], torch.ones(2))
    torch.testing.assert_close(y, expected)
    assert torch.equal(y[:, 5:8], expected[:, 5:8])


def test_a_broken_row_cannot_reach_a_filler_or_a_row_past_the_windows() -> None:
    g = torch.Generator().manual_seed(2)
    windows = LoraWindows([0, 1], [2, 1], 2)  # rows: slot 0, slot 0, slot 1, filler, base
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 7, generator=g)
    x[0] = float("nan")
    x[3] = float("inf")  # the filler's own row, which no adapter reads for it
    before = y.clone()
    add_lora_windows(y, x, windows, torch.randn(2, 4, 6, generator=g), [(torch.randn(2, 7, 4, generator=g), 0, 7)],
                     torch.ones(2))
    assert torch.equal(y[3:], before[3:])
    assert torch.isnan(y[0]).all() and not torch.isnan(y[1:]).any()


def test_packed_windows_put_each_slot_right_after_the_previous_one() -> None:
    order, windows = plan_windows([1, 0, 1, 1, 0, 2], packed=True) or ([], None)
    assert windows is not None and (windows.slots, windows.counts, windows.starts) == ([0, 1, 2], [2, 3, 1], [0, 2, 5])
    assert order == [1, 4, 0, 2, 3, 5] and not windows.even


def test_packed_windows_in_torch_match_a_per_row_loop() -> None:
    """The torch form of packed windows (the CPU kernel's layout, when the kernel cannot take the operands)."""
    g = torch.Generator().manual_seed(3)
    plan = plan_windows([1, 0, 1, 1, 0, -1, 2], packed=True)
    assert plan is not None
    order, windows = plan
    laid_out = [[1, 0, 1, 1, 0, -1, 2][i] for i in order]
    a, b = torch.randn(3, 4, 8, generator=g), torch.randn(3, 6, 4, generator=g)
    x, y = torch.randn(7, 8, generator=g), torch.randn(7, 6, generator=g)
    scaling = torch.tensor([1.0, 0.5, 2.0])
    expected = reference(y, x, laid_out, a, b, scaling, 0, 6)
    add_lora_windows(y, x, windows, a, [(b, 0, 6)], scaling)
    torch.testing.assert_close(y, expected)
    assert torch.equal(y[6], expected[6])  # the base row, last
