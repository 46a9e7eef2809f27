"""The LoRA shrink / expand reference: rows grouped by slot, fused-projection slices, base rows untouched; the
fused form (one shrink for q/k/v or gate/up) against the per-module one, and LoraBatch over the slot stacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tritium.backend.lora.adapter import MODULES, LoraAdapter, module_shapes
from tritium.backend.lora.ops import LoraGroups, add_lora, add_lora_fused, lora_groups
from tritium.backend.lora.weights import FUSED, LoraBatch, LoraStacks
from tritium.backend.lora.windows import plan_windows

from support.lora import SMALL_CONFIG


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


def fused_weights(g: torch.Generator, slots: int, rank: int, d_in: int, outs: list[int],
                  targets: dict[int, set[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A [slots, len(outs) * rank, in] and each module's B, zero for a (slot, module) not in `targets`."""
    a = torch.randn(slots, len(outs) * rank, d_in, generator=g)
    bs = [torch.randn(slots, out, rank, generator=g) for out in outs]
    for slot in range(slots):
        for j in range(len(outs)):
            if j not in targets.get(slot, set()):
                a[slot, j * rank : (j + 1) * rank] = 0
                bs[j][slot] = 0
    return a, bs


# q/k/v-like slices; slot 1 targets only q and v, slot 3 only k; slot 2 is unused in the second case (the stacks
# are then gathered, not sliced); rank 8 and 16; base rows in the first, none in the third
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("token_slots", [[0, -1, 1, 3, 1, 2, -1, 0, 3, 1, 2], [3, 1, -1, 0, 3, 3, -1, 1],
                                         [1, 1, 0, 3, 2, 0]])
def test_fused_form_matches_the_per_module_form(rank: int, token_slots: list[int]) -> None:
    g = torch.Generator().manual_seed(rank)
    outs, d_in, rows = [12, 4, 4], 10, len(token_slots)
    targets = {0: {0, 1, 2}, 1: {0, 2}, 2: {0, 1, 2}, 3: {1}}
    a, bs = fused_weights(g, 4, rank, d_in, outs, targets)
    scaling = torch.tensor([0.5, 2.0, 1.0, 1.5])
    x = torch.randn(rows, d_in, generator=g)
    y = torch.randn(rows, sum(outs), generator=g)
    expected, looped = y.clone(), y.clone()
    starts = [0, 12, 16, 20]
    for j in range(3):
        add_lora(expected[:, starts[j] : starts[j + 1]], x, groups(token_slots), a[:, j * rank : (j + 1) * rank],
                 bs[j], scaling)
        for t, s in enumerate(token_slots):
            if s >= 0:
                looped[t, starts[j] : starts[j + 1]] += scaling[s] * (x[t] @ a[s, j * rank : (j + 1) * rank].t()) \
                    @ bs[j][s].t()
    add_lora_fused(y, x, groups(token_slots), a, [(bs[j], starts[j], starts[j + 1]) for j in range(3)], scaling)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(y, looped)
    base = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(y[base], looped[base])  # base rows keep their values exactly


def test_fused_form_skips_a_module_and_leaves_its_columns() -> None:
    g = torch.Generator().manual_seed(3)
    a, bs = fused_weights(g, 2, 4, 6, [5, 3], {0: {0, 1}, 1: {0, 1}})
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 8, generator=g)
    before = y.clone()
    add_lora_fused(y, x, groups([1, -1, 0, 0, 1]), a, [None, (bs[1], 5, 8)], torch.ones(2))
    assert torch.equal(y[:, :5], before[:, :5])
    torch.testing.assert_close(y[0, 5:], before[0, 5:] + (x[0] @ a[1, 4:].t()) @ bs[1][1].t())


def test_a_broken_adapter_row_cannot_reach_base_rows() -> None:
    """Base rows read a padding place of the padded product: it is zeroed, NaN or not, so they stay exact."""
    g = torch.Generator().manual_seed(4)
    a, bs = fused_weights(g, 2, 4, 6, [5], {0: {0}, 1: {0}})
    x, y = torch.randn(6, 6, generator=g), torch.randn(6, 5, generator=g)
    x[5] = float("nan")  # the last row of slot 0's segment: its padding place repeats it
    before = y.clone()
    add_lora_fused(y, x, groups([0, -1, 1, 1, -1, 0]), a, [(bs[0], 0, 5)], torch.ones(2))
    assert torch.equal(y[[1, 4]], before[[1, 4]])
    assert torch.isnan(y[5]).all() and not torch.isnan(y[[0, 2, 3]]).any()


def random_adapter(name: str, rank: int, targets: tuple[str, ...], scaling: float, seed: int) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(SMALL_CONFIG)
    weights = {(layer, m): (torch.randn(rank, shapes[m][0], generator=g), torch.randn(shapes[m][1], rank, generator=g))
               for layer in range(SMALL_CONFIG.num_hidden_layers) for m in targets}
    return LoraAdapter(name, Path(name), rank, scaling, weights)


MIXED = [1, -1, 0, 3, 0, 1, -1, 3, 1]


@pytest.mark.parametrize(("b_rank_major", "form", "token_slots"), [
    (False, "groups", MIXED), (True, "groups", MIXED),
    (True, "windows", MIXED),
    (True, "windows", [1, -1, 1, 1, -1]),  # only the adapter of every module: the stacks' own slices serve
    (True, "windows+groups", MIXED),  # a mixed step: decode rows in windows, then prefill rows grouped
])
def test_lora_batch_over_the_stacks_matches_each_adapter_per_row(b_rank_major: bool, form: str,
                                                                 token_slots: list[int]) -> None:
    """Adapters of ranks 8 and 16 targeting some of q/k/v and gate/up (one only o_proj, one every module) plus
    base rows, every fused projection of every layer, against each row's own adapter applied module by module;
    B stored as the kernels read it and as the torch form reads it (rank-major); rows grouped by slot, laid out
    in windows (a decode step of the torch form), or both (decode rows in windows, prefill rows after them)."""
    stacks = LoraStacks(SMALL_CONFIG, 4, 16, torch.float32, torch.device("cpu"), b_rank_major=b_rank_major)
    assert (stacks.b[0]["q_proj"].stride(1) == 1) == b_rank_major
    adapters = [random_adapter("qv", 8, ("q_proj", "v_proj", "up_proj"), 2.0, 0),
                random_adapter("all", 16, MODULES, 0.5, 1),
                random_adapter("o", 8, ("o_proj",), 1.0, 2)]
    for slot, adapter in zip((0, 1, 3), adapters, strict=True):
        stacks.write(slot, adapter)
    assert [stacks.covers_all(slot) for slot in range(4)] == [False, True, False, False]
    assert stacks.a[0]["k_proj"].data_ptr() == stacks.a_fused[0]["qkv_proj"][:, 16:].data_ptr()  # a view
    plan = plan_windows(token_slots)
    assert plan is not None
    prefill = [0, 0, -1, 3, 1, 1, -1] if form == "windows+groups" else []
    if form != "groups":
        token_slots = [token_slots[i] for i in plan[0]]
    decode_rows = len(token_slots)
    token_slots = token_slots + prefill
    of_slot = {0: adapters[0], 1: adapters[1], 3: adapters[2]}
    shapes, g = module_shapes(SMALL_CONFIG), torch.Generator().manual_seed(5)
    for layer in range(SMALL_CONFIG.num_hidden_layers):
        if form == "groups":
            batch = LoraBatch(groups(token_slots), stacks)
        elif form == "windows":
            batch = LoraBatch(None, stacks, windows=plan[1])
        else:
            batch = LoraBatch(groups([-1] * decode_rows + prefill), stacks, windows=plan[1])
        for proj, modules in FUSED.items():
            x = torch.randn(len(token_slots), shapes[modules[0]][0], generator=g)
            y = torch.randn(len(token_slots), sum(shapes[m][1] for m in modules), generator=g)
            expected = y.clone()
            for module, start, end in stacks.slices[proj]:
                for t, s in enumerate(token_slots):
                    adapter = of_slot.get(s)
                    if adapter is not None and (layer, module) in adapter.weights:
                        wa, wb = adapter.weights[(layer, module)]
                        expected[t, start:end] += adapter.scaling * (x[t] @ wa.t()) @ wb.t()
            batch.apply(layer, proj, x, y)
            torch.testing.assert_close(y, expected)
            base = [t for t, s in enumerate(token_slots) if s < 0]
            assert torch.equal(y[base], expected[base])
