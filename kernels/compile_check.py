"""Compile every kernel variant the engine launches for real NVIDIA targets without a GPU, and read ptxas'
register/spill report.

`python -m tritium.kernels.compile_check [--arch 80 90] [--json] [--jobs N] [--kernel NAME ...]` calls the host
wrappers with `tiles="gpu"` on the warm-up calls (kernels/warmup.py) of several model shapes (vocabulary
sizes included) and dtypes, records each
kernel launch instead of running it, and derives what the JIT would build from it on that GPU with
Triton's own binder (signature, constexprs, the divisible-by-16 and equal-to-1 specialization, honouring
`do_not_specialize`; num_warps, num_stages). Identical variants are compiled once (ASTSource +
triton.compile for sm_80 / sm_90), then the ptxas shipped in the triton wheel runs with -v on the PTX.
Exit status 1 if a variant fails to compile anywhere, or spills registers on sm_90 (sm_80 spills are
reported). Must run without TRITON_INTERPRET: the interpreter replaces the JIT functions the compiler
needs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
BLOCK_SIZE = 16
MAX_BLOCKS_PER_SEQ = 256


class ModelShape(NamedTuple):
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rotary_dim: int
    vocab: int = 49152

    def engine_shape(self, dtype: Any, block_size: int, max_blocks_per_seq: int) -> Any:
        """The warm-up's `EngineShape` of an engine serving this model on CPU tensors."""
        from tritium.kernels.warmup import EngineShape

        return EngineShape(self.heads, self.kv_heads, self.head_dim, self.hidden, self.intermediate, self.rotary_dim,
                           block_size, max_blocks_per_seq, dtype, vocab_size=self.vocab, quantization="int8")


# The default model and Llama/Qwen shapes covering GQA groups 1, 3, 4, 8 at head_dim 64 and 128, with their
# vocabulary sizes.
MODELS = (
    ModelShape("SmolLM2-135M", 576, 9, 3, 64, 1536, 64, 49152),
    ModelShape("Qwen1.5-0.5B", 1024, 16, 16, 64, 2816, 64, 151936),
    ModelShape("Llama-3.2-1B", 2048, 32, 8, 64, 8192, 64, 128256),
    ModelShape("TinyLlama-1.1B", 2048, 32, 4, 64, 5632, 64, 32000),
    ModelShape("Llama-2-7B", 4096, 32, 32, 128, 11008, 128, 32000),
    ModelShape("Llama-3.2-3B", 3072, 24, 8, 128, 8192, 128, 128256),
    ModelShape("Llama-3.1-8B", 4096, 32, 8, 128, 14336, 128, 128256),
    ModelShape("Qwen2.5-3B", 2048, 16, 2, 128, 11008, 128, 151936),
)


@dataclass(frozen=True)
class Launch:
    kernel: Any  # the JITFunction (or InterpretedFunction under TRITON_INTERPRET=1)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Variant:
    """One kernel binary, as the JIT builds it: equal variants are one entry of the JIT's cache."""

    module: str
    kernel: str
    arch: int
    signature: tuple[tuple[str, str], ...]  # (name, type); "constexpr" also for ints specialized to 1
    constexprs: tuple[tuple[tuple[int, ...], Any], ...]  # (argument path, value)
    attrs: tuple[tuple[tuple[int, ...], tuple[tuple[str, Any], ...]], ...]  # (path, ((attribute, value), ...))
    options: tuple[tuple[str, Any], ...]
    divisible_by_16: tuple[str, ...] = field(compare=False)
    equal_to_1: tuple[str, ...] = field(compare=False)

    def constexpr_values(self) -> dict[str, Any]:
        names = [name for name, _ in self.signature]
        return {names[path[0]]: value for path, value in self.constexprs}

    def option(self, name: str) -> Any:
        return dict(self.options)[name]


@dataclass
class CompileResult:
    kernel: str
    arch: int
    dtype: str
    constexprs: dict[str, Any]
    divisible_by_16: list[str]
    equal_to_1: list[str]
    num_warps: int
    num_stages: int
    models: list[str]
    ok: bool = False
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    error: str | None = None

    @property
    def failed(self) -> bool:
        return not self.ok or bool(self.arch == 90 and (self.spill_stores or self.spill_loads))


@contextlib.contextmanager
def recording(run: bool = False) -> Iterator[list[Launch]]:
    """Within the block, each `kernel[grid](...)` is appended to the yielded list, and only launched if `run`."""
    from triton.runtime.jit import KernelInterface

    launches: list[Launch] = []

    def getitem(self: Any, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            launches.append(Launch(self, args, kwargs))
            return self.run(*args, grid=grid, warmup=False, **kwargs) if run else None
        return launch

    with mock.patch.object(KernelInterface, "__getitem__", getitem):
        yield launches


def record_calls(model: ModelShape, dtype: torch.dtype) -> list[Launch]:
    """The kernel launches of the warm-up calls at `model` / `dtype`, made with tiles="gpu" on CPU tensors."""
    from tritium.kernels import triton_ops
    from tritium.kernels.warmup import warmup_calls

    calls = warmup_calls(model.engine_shape(dtype, BLOCK_SIZE, MAX_BLOCKS_PER_SEQ))
    with recording() as launches:
        for call in calls:
            getattr(triton_ops, call.op)(*call.args, **call.kwargs, tiles="gpu")
    return launches


class Specializer:
    """Triton's JIT binder for a CUDA target of `arch`: what `JITFunction.run` computes before compiling."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.arch = arch
        self.backend = make_backend(GPUTarget("cuda", arch, 32))
        self._binders: dict[int, tuple[Any, Any]] = {}

    def _jit(self, kernel: Any) -> tuple[Any, Any]:
        from triton.runtime.jit import JITFunction, create_function_from_signature

        if id(kernel) not in self._binders:
            jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
            self._binders[id(kernel)] = (jit, create_function_from_signature(jit.signature, jit.params, self.backend))
        return self._binders[id(kernel)]

    def variant(self, launch: Launch) -> Variant:
        from triton import knobs

        jit, binder = self._jit(launch.kernel)
        kwargs = dict(launch.kwargs)
        kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound_args, specialization, options = binder(*launch.args, **kwargs)
        options, signature, constexprs, attrs = jit._pack_args(self.backend, kwargs, bound_args, specialization,
                                                               options)
        names = jit.arg_names
        return Variant(
            module=jit.fn.__module__, kernel=jit.fn.__name__, arch=self.arch,
            signature=tuple(signature.items()),
            constexprs=tuple(constexprs.items()),
            attrs=tuple((path, tuple(tuple(a) for a in values)) for path, values in attrs.items()),
            options=tuple(sorted(options.__dict__.items())),
            divisible_by_16=tuple(names[p[0]] for p, values in attrs.items() if ["tt.divisibility", 16] in values),
            equal_to_1=tuple(names[p[0]] for p in constexprs if not jit.params[p[0]].is_constexpr),
        )


def parse_ptxas_log(log: str) -> tuple[int, int, int] | None:
    """(registers, spill store bytes, spill load bytes) from a `ptxas -v` log; None if it has no report."""
    regs = re.search(r"Used (\d+) registers", log)
    if regs is None:
        return None
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return int(regs.group(1)), int(spills.group(1)) if spills else 0, int(spills.group(2)) if spills else 0


def ptxas_report(ptx: str, arch: int, fp_fusion: bool = True) -> tuple[int, int, int]:
    """ptxas' report on `ptx`, run as Triton runs it to build the cubin (same ptxas, same flags)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(arch).path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(arch)}", str(src),
               "-o", str(Path(tmp) / "k.o")]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return parse_ptxas_log(proc.stdout + proc.stderr) or (-1, 0, 0)


def compile_variant(variant: Variant) -> tuple[int, int, int]:
    """Compile as the JIT would, for sm_`variant.arch`; returns ptxas' (registers, spill stores, spill loads)
    from that build, or from a ptxas run on its PTX when the build came from Triton's cache."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    fn = getattr(importlib.import_module(variant.module), variant.kernel)
    attrs = {path: [list(a) for a in values] for path, values in variant.attrs}
    src = ASTSource(fn=fn, signature=dict(variant.signature), constexprs=dict(variant.constexprs), attrs=attrs)
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        kernel = compile(src, target=GPUTarget("cuda", variant.arch, 32), options=dict(variant.options))
    return parse_ptxas_log(log.getvalue()) or ptxas_report(kernel.asm["ptx"], variant.arch,
                                                           variant.option("enable_fp_fusion"))


def collect(archs: list[int]) -> dict[Variant, CompileResult]:
    """Every distinct variant the model shapes × dtypes launch, with its (not yet filled) result."""
    found: dict[Variant, CompileResult] = {}
    specializers = [Specializer(arch) for arch in archs]
    for dtype_name, dtype in DTYPES.items():
        for model in MODELS:
            for launch in record_calls(model, dtype):
                for spec in specializers:
                    v = spec.variant(launch)
                    if v not in found:
                        found[v] = CompileResult(
                            v.kernel, v.arch, dtype_name, v.constexpr_values(), list(v.divisible_by_16),
                            list(v.equal_to_1), v.option("num_warps"), v.option("num_stages"), [])
                    if model.name not in found[v].models:
                        found[v].models.append(model.name)
    return found


def _compile(variant: Variant) -> tuple[tuple[int, int, int] | None, str | None]:
    try:
        return compile_variant(variant), None
    except Exception as exc:  # report every failure, keep going
        text = str(exc).strip()
        return None, f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


def run_check(archs: list[int], jobs: int, kernels: list[str] | None = None) -> list[CompileResult]:
    """Compile every variant (only those of `kernels`, kernel function names, if given)."""
    found = collect(archs)
    if kernels:
        found = {v: r for v, r in found.items() if v.kernel in kernels}
    variants = list(found)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        outcomes = list(pool.map(_compile, variants))
    for variant, (report, error) in zip(variants, outcomes, strict=True):
        result = found[variant]
        if report is not None:
            result.registers, result.spill_stores, result.spill_loads = report
            result.ok = True
        result.error = error
    return list(found.values())


def _short(constexprs: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in constexprs.items() if k != "DOT_PRECISION")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--kernel", nargs="+", metavar="NAME",
                        help="only these kernels (function names, e.g. token_bitmask_kernel)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter cannot compile for GPUs", file=sys.stderr)
        return 2
    start = time.monotonic()
    results = run_check(args.arch, args.jobs, args.kernel)
    for r in results:
        if args.json:
            print(json.dumps(asdict(r)))
        else:
            status = "FAIL" if r.failed else ("spill" if r.spill_stores or r.spill_loads else "ok")
            detail = r.error or f"{r.registers} regs, spills {r.spill_stores}/{r.spill_loads} B"
            print(f"{status:5} sm_{r.arch} {r.kernel:25} {r.dtype:4} w{r.num_warps}s{r.num_stages} "
                  f"{_short(r.constexprs):58} {detail}")
    if not results:
        print(f"no variant of {args.kernel}", file=sys.stderr)
        return 2
    failed = sum(r.failed for r in results)
    print(f"{len(results)} variants for sm_{'/sm_'.join(map(str, args.arch))} in {time.monotonic() - start:.0f} s, "
          f"{failed} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
