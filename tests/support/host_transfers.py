"""Counting what would make the host wait on CUDA, on a CPU: every Tensor method that moves values to the host
(item, tolist, cpu, numpy, truth and number conversions) and every copy to a device that is not non_blocking,
each attributed to the innermost tritium frame that made it."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import tritium.backend
import tritium.kernels

FETCHES = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
ROOTS = [Path(m.__file__).resolve().parent for m in (tritium.backend, tritium.kernels)]


def _caller() -> str | None:
    """The innermost frame in tritium's engine or kernels, as `backend/sample/sampler.py:LINE`; None
    outside them."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename).resolve()
        for root in ROOTS:
            if path.is_relative_to(root):
                return f"{root.name}/{path.relative_to(root)}:{frame.lineno}"
    return None


def _blocking_copy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a `Tensor.to` call names a device and does not ask for non_blocking (on CUDA: a wait)."""
    to_device = "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args)
    return to_device and not (kwargs.get("non_blocking") or any(a is True for a in args))


@contextmanager
def counting_host_transfers() -> Iterator[list[str]]:
    """Yields the list that collects, for each host fetch or blocking copy made from tritium's engine, its
    method and frame."""
    found: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in (*FETCHES, "to")}

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            where = _caller()
            if where is not None and (name != "to" or _blocking_copy(args, kwargs)):
                found.append(f"{name} at {where}")
            return method(self, *args, **kwargs)
        return counted

    for name, method in originals.items():
        setattr(torch.Tensor, name, wrap(name, method))
    try:
        yield found
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
