"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from support.triton_interpreter import upcast_bf16_dot


@pytest.fixture
def bf16_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's bf16 dot upcast to fp32 for one test; a module whose kernels multiply bf16 takes it for
    every test with `pytestmark = pytest.mark.usefixtures("bf16_dot")`."""
    upcast_bf16_dot(monkeypatch)
