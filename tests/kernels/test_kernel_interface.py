"""Both kernel modules implement the KernelOps Protocol: every op, with its parameters in order and the
same defaults (an implementation may add optional parameters after them, such as `num_splits`)."""

from __future__ import annotations

import inspect
from types import ModuleType

import pytest

from tritium.kernels import reference, triton_ops
from tritium.kernels.interface import OP_NAMES, KernelOps


@pytest.mark.parametrize("module", [reference, triton_ops], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("name", OP_NAMES)
def test_module_implements_the_protocol(module: ModuleType, name: str) -> None:
    declared = list(inspect.signature(getattr(KernelOps, name)).parameters.values())[1:]  # without self
    actual = list(inspect.signature(getattr(module, name)).parameters.values())
    assert [p.name for p in actual[: len(declared)]] == [p.name for p in declared]
    assert [p.default for p in actual[: len(declared)]] == [p.default for p in declared]
    extra = actual[len(declared):]
    assert all(p.default is not inspect.Parameter.empty for p in extra), "extra parameters must be optional"


def test_the_protocol_lists_every_op() -> None:
    methods = {n for n, v in vars(KernelOps).items() if callable(v) and not n.startswith("_")}
    assert methods == set(OP_NAMES)
