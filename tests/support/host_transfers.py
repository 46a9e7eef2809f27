"""Counting what would make the host wait on CUDA, on a CPU: every Tensor method that moves values to the host
(item, tolist, cpu, numpy, truth and number conversions) and every copy to a device that is not non_blocking,
each attributed to the innermost tritium frame that made it."""

from __future__ import annotations

import contextlib
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


def _to_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args)


def _blocking_copy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a `Tensor.to` call names a device and does not ask for non_blocking (on CUDA: a wait)."""
    return _to_device(args, kwargs) and not (kwargs.get("non_blocking") or any(a is True for a in args))


@contextmanager
def _counting(names: tuple[str, ...],
              counts: Callable[[str, tuple[Any, ...], dict[str, Any]], bool]) -> Iterator[list[str]]:
    """Yields the list that collects, for each call of a Tensor method in `names` made from tritium's engine that
    `counts(name, args, kwargs)`, its method and frame."""
    found: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            where = _caller()
            if where is not None and counts(name, args, kwargs):
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


def counting_host_transfers() -> contextlib.AbstractContextManager[list[str]]:
    """Each host fetch or blocking copy made from tritium's engine, as its method and frame."""
    return _counting((*FETCHES, "to"), lambda name, args, kwargs: name != "to" or _blocking_copy(args, kwargs))


def counting_uploads() -> contextlib.AbstractContextManager[list[str]]:
    """Each copy to a device made from tritium's engine (`Tensor.to` naming a device, blocking or not, and
    `Tensor.copy_`), as its method and frame. On a CPU these are the copies that would cross to a GPU."""
    return _counting(("to", "copy_"), lambda name, args, kwargs: name == "copy_" or _to_device(args, kwargs))
