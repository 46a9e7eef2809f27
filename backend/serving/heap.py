"""Give the C heap's free pages back to the OS when the engine goes idle.

Batches of changing shapes leave freed-but-kept pages in glibc's malloc arenas; without a trim the
process' RSS ratchets up after every burst of load even though nothing is live (measured in the soak).
"""

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
