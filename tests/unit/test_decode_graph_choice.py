"""Which engines run decode steps through CUDA graphs: only those whose forward can be captured."""

from __future__ import annotations

import pytest

from tritium.backend.worker.decode_graphs import use_decode_graphs


@pytest.mark.parametrize(
    "device,backend,enforce_eager,expected",
    [
        ("cuda", "triton", None, True),
        ("cuda", "triton", False, True),
        ("cuda", "triton", True, False),
        # the torch reference syncs with the host (masks, .max() on the host): never captured on CUDA
        ("cuda", "torch", None, False),
        ("cuda", "torch", False, False),
        ("cuda", "torch", True, False),
        # a CPU captures nothing: enforce_eager=False runs the padded graph path eagerly
        ("cpu", "torch", None, False),
        ("cpu", "torch", False, True),
        ("cpu", "triton", False, True),
        ("cpu", "torch", True, False),
    ],
)
def test_graphs_only_where_the_forward_can_be_captured(device: str, backend: str, enforce_eager: bool | None,
                                                       expected: bool) -> None:
    use, why = use_decode_graphs(device, backend, enforce_eager)
    assert use is expected
    assert why


def test_the_reason_names_the_backend_that_cannot_be_captured() -> None:
    use, why = use_decode_graphs("cuda", "torch", False)
    assert not use and "torch attention backend" in why and "CUDA graph" in why
