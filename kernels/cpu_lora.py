"""The CPU LoRA kernel (kernels/cpu/lora_windows.cpp): built with torch's C++ extension tools at first use, once
per machine and CPU capability (cached under torch's extensions folder, `$TORCH_EXTENSIONS_DIR` or
~/.cache/torch_extensions), then loaded in milliseconds.

It runs the shrink and expand of one fused projection for a decode step laid out in windows
(backend/lora/windows.py, whose torch form is its reference and its fallback). The build takes ~40 s and needs a
C++ compiler; where it fails, `load_cpu_lora` says why once and returns None, and the engine runs the torch form.
The flags name the instruction set torch itself dispatches to on this CPU (never -march=native), and so does the
module's name: a cache shared by machines of different CPUs never hands one a binary it cannot run. It is built
with -fopenmp because at::parallel_for's OpenMP form is inline (compiled here); its libgomp.so.1 resolves to the
one torch has already loaded (same soname), so the kernel and torch share one thread pool.
"""

from __future__ import annotations

import logging
import os
import shutil
from functools import cache
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "lora_windows.cpp"
_ISA_FLAGS = {"AVX512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma"],
              "AVX2": ["-mavx2", "-mfma"]}


class CpuLora(Protocol):
    def lora_windows(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor | None],
                     col_starts: list[int], slots: list[int], starts: list[int], counts: list[int], length: int,
                     scaling: torch.Tensor) -> None:
        """See kernels/cpu/lora_windows.cpp."""
        ...


def cpu_capability() -> str:
    """The instruction set torch dispatches to on this CPU ("AVX512", "AVX2", "DEFAULT", ...)."""
    return str(torch.backends.cpu.get_cpu_capability())


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH: where it is not there, add the folder of the pip package's (a dependency),
    which a server that does not activate the virtual environment would not have on PATH."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


@cache
def load_cpu_lora() -> CpuLora | None:
    """The built kernel module, or None (logged once, with why) where it cannot be built or loaded here."""
    return build_cpu_lora(f"tritium_lora_windows_{cpu_capability().lower()}", SOURCE)


def build_cpu_lora(name: str, source: Path, build_directory: Path | None = None) -> CpuLora | None:
    """Build (or load, when torch's cache has it) module `name` from `source` for this CPU; None, logged, where
    that fails."""
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        module: CpuLora = load(name=name, sources=[str(source)],
                               extra_cflags=["-O3", "-fopenmp", *_ISA_FLAGS.get(cpu_capability(), [])],
                               extra_ldflags=["-fopenmp"],
                               build_directory=None if build_directory is None else str(build_directory),
                               verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch form serves instead
        first = str(e).splitlines()[0] if str(e) else ""
        log.warning("the CPU LoRA kernel could not be built (%s: %s); LoRA decode steps run the torch form",
                    type(e).__name__, first)
        return None
    return module


if __name__ == "__main__":  # `make setup` builds it ahead, so that no engine start waits for the compiler
    print("CPU LoRA kernel:", "built" if load_cpu_lora() is not None else "not available (the torch form serves)")
