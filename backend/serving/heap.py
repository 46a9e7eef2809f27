"""Give the C heap's free pages back to the OS when the engine goes idle: batches of changing shapes leave freed
pages in glibc's arenas, and RSS would ratchet up after every burst (docs/performance.md#soak)."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def heap_trimmer() -> Callable[[], None]:
    """A function that calls glibc's malloc_trim(0); a no-op where there is no glibc."""
    try:
        malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    malloc_trim.argtypes = [ctypes.c_size_t]

    def trim_heap() -> None:
        malloc_trim(0)

    return trim_heap
