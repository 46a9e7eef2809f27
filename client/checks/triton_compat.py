"""Triton 3.6's interpreter under numpy 2: a loaded scalar used as a `range` bound is a one-element array, and
its `__index__` calls `int()` on it, which numpy 2 refuses ("only 0-dimensional arrays can be converted").
Triton 3.7 squeezes the array first; `patch_interpreter` does the same on older releases."""

from __future__ import annotations

from typing import Any


def patch_interpreter() -> bool:
    """Make the interpreter's tensors index through a squeezed array, as Triton 3.7 does; returns True when
    it patched (an interpreter without the 3.6 code is left alone)."""
    import inspect

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "tritium_patched", False):
        return False
    if "int(self.handle.data)" not in inspect.getsource(original):
        return False

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.tritium_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
    return True
