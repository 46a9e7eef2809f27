"""The LoRA shrink / expand reference: rows grouped by slot, fused-projection slices, base rows untouched."""

from __future__ import annotations

import pytest
import torch

from tritium.backend.lora.ops import LoraGroups, add_lora, lora_groups


def groups(token_slots: list[int]) -> LoraGroups:
    rows, segments = lora_groups(token_slots)
    return LoraGroups(torch.tensor(rows, dtype=torch.int32), segments)


def test_lora_groups_sorts_rows_by_slot() -> None:
    assert lora_groups([-1, 2, 0, 2, -1, 0]) == ([2, 5, 1, 3], [(0, 0, 2), (2, 2, 4)])
    assert lora_groups([-1, -1]) == ([], [])


# Several segments of unequal lengths take the padded batched form; one segment the per-segment matmuls.
@pytest.mark.parametrize("token_slots", [[-1, 0, 2, 2, -1, 1, 0, 2, -1], [-1, 1, 1, -1, 1, -1, -1, 1, -1]])
def test_add_lora_matches_a_per_row_loop(token_slots: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    slots, rank, d_in, d_out, rows = 3, 4, 16, 24, 9
    x = torch.randn(rows, d_in, generator=g)
    a = torch.randn(slots, rank, d_in, generator=g)
    b = torch.randn(slots, d_out, rank, generator=g)
    scaling = torch.tensor([0.5, 2.0, 1.5])
    y = torch.randn(rows, d_out, generator=g)
    expected = y.clone()
    for t, s in enumerate(token_slots):
        if s >= 0:
            expected[t] += scaling[s] * (x[t] @ a[s].t()) @ b[s].t()
    add_lora(y, x, groups(token_slots), a, b, scaling)
    torch.testing.assert_close(y, expected)


def test_add_lora_writes_a_column_slice_in_place_and_leaves_the_rest() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, generator=g)
    fused = torch.randn(5, 30, generator=g)
    before = fused.clone()
    a, b = torch.randn(2, 4, 8, generator=g), torch.randn(2, 10, 4, generator=g)
    add_lora(fused[:, 10:20], x, groups([1, -1, 0, -1, 1]), a, b, torch.ones(2))
    assert torch.equal(fused[:, :10], before[:, :10]) and torch.equal(fused[:, 20:], before[:, 20:])
    assert torch.equal(fused[[1, 3]], before[[1, 3]])  # base rows untouched
    torch.testing.assert_close(fused[2, 10:20], before[2, 10:20] + (x[2] @ a[0].t()) @ b[0].t())


def test_no_adapter_rows_change_nothing() -> None:
    y = torch.randn(3, 6)
    before = y.clone()
    add_lora(y, torch.randn(3, 4), groups([-1, -1, -1]), torch.randn(1, 2, 4), torch.randn(1, 6, 2), torch.ones(1))
    assert torch.equal(y, before)


def test_add_lora_with_a_subset_of_the_segments_touches_only_their_rows() -> None:
    """A module only some adapters target gets the step's rows but a subset of its segments (lora/weights.py)."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 5, generator=g)
    a, b = torch.randn(3, 2, 8, generator=g), torch.randn(3, 5, 2, generator=g)
    rows, segments = lora_groups([0, 1, 2, 0, 2, 1])
    subset = LoraGroups(torch.tensor(rows, dtype=torch.int32), [s for s in segments if s[0] != 1])
    expected = y.clone()
    for t in (0, 3, 2, 4):
        s = [0, 1, 2, 0, 2, 1][t]
        expected[t] += (x[t] @ a[s].t()) @ b[s].t()
    add_lora(y, x, subset, a, b, torch.ones(3))
    torch.testing.assert_close(y, expected)
    assert torch.equal(y[[1, 5]], expected[[1, 5]])
