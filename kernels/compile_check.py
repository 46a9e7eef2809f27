"""Compile every kernel variant the engine launches for real NVIDIA targets without a GPU, and read ptxas'
register/spill report and the shared memory each needs.

`python -m tritium.kernels.compile_check [--arch 80 86 89 90] [--full] [--json] [--jobs N] [--kernel NAME ...]`
calls the host wrappers with `tiles="gpu"` on the warm-up calls (kernels/warmup.py) of several model shapes
(vocabulary sizes included), dtypes and block sizes, records each kernel launch instead of running it, and
derives what the JIT would build from it on that GPU with Triton's own binder (signature, constexprs, the
divisible-by-16 and equal-to-1 specialization, honouring `do_not_specialize`; num_warps, num_stages).
Identical variants are compiled once (ASTSource + triton.compile), then the ptxas shipped in the triton wheel
runs with -v on the PTX.

Coverage (`coverage`): the eight MODELS (GQA 1/3/4/8, head_dim 64/128) in fp16, bf16 and fp32 at block size
16; in bf16 also head_dim 32 and 256 (WIDE_MODELS) and block sizes 8-128 at head_dim 128; the MoE models' fused_moe
(MOE_MODELS) and LoRA ranks 64 and 256 (LORA_RANK_MODELS) in bf16 and fp16; `--full` takes every
model, dtype and block size, sm_86/sm_89 compiled too (1,832 variants: five times the compiles).

Shared memory: each variant's `shared` (the compiled kernel's metadata: what the launch asks for) is compared
with the architecture's opt-in maximum per block (SHARED_MEMORY_LIMIT). sm_86 and sm_89 lower like sm_80
(same MMA and pipelining paths: identical variants need the same shared memory and registers), so their
variants that equal an sm_80 one are not compiled again but take its figures (`derived_from`); one of them,
the one needing the most shared memory, is compiled for real as a check of that, and `--full` compiles
them all.

Exit status 1 if a variant fails to compile anywhere, needs more shared memory than its architecture gives a
block, or spills registers on sm_90 (other spills are reported). Must run without TRITON_INTERPRET: the
interpreter replaces the JIT functions the compiler needs.
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
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
BLOCK_SIZE = 16
BLOCK_SIZES = (8, 16, 32, 64, 128)
MAX_BLOCKS_PER_SEQ = 256
ARCHS = (80, 86, 89, 90)
# Opt-in shared memory per block, bytes (CUDA C++ Programming Guide, technical specifications per compute
# capability: 163 KB, 99 KB, 99 KB, 227 KB); Triton asks for the opt-in when a kernel needs more than 48 KB.
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
# Architectures Triton's NVIDIA backend lowers exactly like another one (the same MMA version and cp.async
# pipelining; only limits differ): a variant identical but for the architecture needs the same shared memory.
SAME_LOWERING = {86: 80, 89: 80}
# Compile options that differ between those twins without changing these kernels: the target name, and the fp8
# types (sm_89 adds fp8e4nv; no kernel here uses fp8).
ARCH_OPTIONS = ("arch", "supported_fp8_dtypes")


class ModelShape(NamedTuple):
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rotary_dim: int
    vocab: int = 49152
    windows: tuple[int | None, ...] = (None,)  # the layers' attention: None full, an int a sliding window
    softcap: float | None = None
    activation: str = "silu_and_mul"
    qk_norm: bool = False
    sinks: bool = False  # attention sinks in every layer (gpt-oss)
    experts: int = 0  # a mixture-of-experts MLP's experts (0: a dense MLP), top_k of them per token
    top_k: int = 0
    moe_intermediate: int = 0
    moe_activation: str = "silu"
    moe_bias: bool = False
    lora_rank: int = 16  # the LoRA stacks' max_lora_rank

    def engine_shape(self, dtype: Any, block_size: int, max_blocks_per_seq: int) -> Any:
        """The warm-up's `EngineShape` of an engine serving this model on CPU tensors."""
        from tritium.kernels.warmup import EngineShape

        return EngineShape(self.heads, self.kv_heads, self.head_dim, self.hidden, self.intermediate, self.rotary_dim,
                           block_size, max_blocks_per_seq, dtype, vocab_size=self.vocab, quantization="int8",
                           lora_rank=self.lora_rank, windows=self.windows, softcap=self.softcap,
                           activation=self.activation, qk_norm=self.qk_norm, sinks=self.sinks,
                           num_experts=self.experts, moe_top_k=self.top_k, moe_intermediate=self.moe_intermediate,
                           moe_activation=self.moe_activation, moe_bias=self.moe_bias)


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
# head_dim 32 (a made-up GQA-4 shape with Llama-3.2-1B's other sizes) and the families with their own kernel
# variants: Gemma 3 (head_dim 256, sliding and full layers, GELU, q/k norm), Gemma 2 (and soft-capped attention;
# head_dim 256 and 128), Qwen3 (head_dim 128 with a smaller hidden size, GQA 2, q/k norm), Phi-4-mini (rotary over
# 96 of 128 features), gpt-oss-20b (attention sinks, sliding 128 and full layers); compiled in bf16 and fp16 by
# default and in every dtype by --full.
WIDE_MODELS = (
    ModelShape("head_dim-32", 2048, 64, 16, 32, 8192, 32, 128256),
    ModelShape("Gemma-3-1B", 1152, 4, 1, 256, 6912, 256, 262144, (None, 512), None, "gelu_tanh_and_mul", True),
    ModelShape("Gemma-2-9B", 3584, 16, 8, 256, 14336, 256, 256000, (None, 4096), 50.0, "gelu_tanh_and_mul"),
    ModelShape("Gemma-2-27B", 4608, 32, 16, 128, 36864, 128, 256000, (None, 4096), 50.0, "gelu_tanh_and_mul"),
    ModelShape("Qwen3-0.6B", 1024, 16, 8, 128, 3072, 128, 151936, qk_norm=True),
    ModelShape("Phi-4-mini", 3072, 24, 8, 128, 8192, 96, 200064),
    ModelShape("gpt-oss-20b", 2880, 64, 8, 64, 2880, 64, 201088, (None, 128), sinks=True),
)
WIDE_DTYPES = ("bf16", "fp16")
# Mixture-of-experts models (fused_moe, in WIDE_DTYPES): 128 experts top-8 of 768 (Qwen3-30B-A3B), 8 top-2 of
# 14336 (Mixtral-8x7B), 128 top-4 of 2880 with swiglu_oai and biases (gpt-oss-120b: over 2^31 weight elements).
MOE_MODELS = (
    ModelShape("Qwen3-30B-A3B", 2048, 32, 4, 128, 6144, 128, 151936, qk_norm=True, experts=128, top_k=8,
               moe_intermediate=768),
    ModelShape("Mixtral-8x7B", 4096, 32, 8, 128, 14336, 128, 32000, experts=8, top_k=2, moe_intermediate=14336),
    ModelShape("gpt-oss-120b", 2880, 64, 8, 64, 2880, 64, 201088, (None, 128), sinks=True, experts=128, top_k=4,
               moe_intermediate=2880, moe_activation="swiglu_oai", moe_bias=True),
)
# The model at which the default run compiles block sizes other than BLOCK_SIZE (in bf16): head_dim 128, GQA 4,
# the attention tiles that need the most shared memory.
BLOCK_SIZE_MODEL = MODELS[6]
# LoRA's shrink and expand at the big ranks people serve (64, 256), on that model, in bf16 and fp16.
LORA_RANK_MODELS = tuple(BLOCK_SIZE_MODEL._replace(name=f"{BLOCK_SIZE_MODEL.name} LoRA r{r}", lora_rank=r)
                         for r in (64, 256))


@dataclass(frozen=True)
class Case:
    """One engine configuration whose warm-up launches the check records."""

    model: ModelShape
    dtype: str  # a key of DTYPES
    block_size: int


def coverage(full: bool = False) -> list[Case]:
    """The engine configurations the check compiles: see the module docstring."""
    if full:
        return [Case(m, d, b) for b in BLOCK_SIZES for d in DTYPES for m in (*MODELS, *WIDE_MODELS, *MOE_MODELS)]
    cases = [Case(m, d, BLOCK_SIZE) for d in DTYPES for m in MODELS]
    cases += [Case(m, d, BLOCK_SIZE) for d in WIDE_DTYPES for m in (*WIDE_MODELS, *MOE_MODELS, *LORA_RANK_MODELS)]
    cases += [Case(BLOCK_SIZE_MODEL, "bf16", b) for b in BLOCK_SIZES if b != BLOCK_SIZE]
    return cases


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
    shared_limit: int
    ok: bool = False
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared: int | None = None  # bytes of shared memory a launch asks for
    async_copies: int | None = None  # cp.async instructions in the PTX (sm_80+ software-pipelined loads)
    derived_from: int | None = None  # the architecture whose build gave these figures, when not compiled for this one
    error: str | None = None

    @property
    def failed(self) -> bool:
        """True when the variant did not compile, needs more shared memory than its architecture gives a block,
        or spills on sm_90."""
        over = self.shared is not None and self.shared > self.shared_limit
        return not self.ok or over or bool(self.arch == 90 and (self.spill_stores or self.spill_loads))


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


def record_calls(model: ModelShape, dtype: torch.dtype, block_size: int = BLOCK_SIZE) -> list[Launch]:
    """The kernel launches of the warm-up calls at `model` / `dtype` / `block_size`, made with tiles="gpu" on CPU
    tensors."""
    from tritium.kernels import triton_ops
    from tritium.kernels.warmup import warmup_calls

    calls = warmup_calls(model.engine_shape(dtype, block_size, MAX_BLOCKS_PER_SEQ))
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
            equal_to_1=tuple(names[p[0]] for p, value in constexprs.items()  # (a None argument is constexpr too)
                             if not jit.params[p[0]].is_constexpr and value == 1),
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


class Build(NamedTuple):
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int  # bytes
    async_copies: int  # cp.async instructions in the PTX


def compile_variant(variant: Variant) -> Build:
    """Compile as the JIT would, for sm_`variant.arch`; returns ptxas' registers and spills from that build (or
    from a ptxas run on its PTX when the build came from Triton's cache) and the shared memory it needs."""
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
    report = parse_ptxas_log(log.getvalue()) or ptxas_report(kernel.asm["ptx"], variant.arch,
                                                             variant.option("enable_fp_fusion"))
    return Build(*report, int(kernel.metadata.shared), kernel.asm["ptx"].count("cp.async"))


def collect(archs: Iterable[int], cases: Iterable[Case] | None = None) -> dict[Variant, CompileResult]:
    """Every distinct variant the `cases` (default: `coverage()`) launch on each of `archs`, with its (not yet
    filled) result."""
    found: dict[Variant, CompileResult] = {}
    specializers = [Specializer(arch) for arch in archs]
    for case in coverage() if cases is None else cases:
        for launch in record_calls(case.model, DTYPES[case.dtype], case.block_size):
            for spec in specializers:
                v = spec.variant(launch)
                if v not in found:
                    found[v] = CompileResult(
                        v.kernel, v.arch, case.dtype, v.constexpr_values(), list(v.divisible_by_16),
                        list(v.equal_to_1), v.option("num_warps"), v.option("num_stages"), [],
                        SHARED_MEMORY_LIMIT.get(v.arch, 0))
                if case.model.name not in found[v].models:
                    found[v].models.append(case.model.name)
    return found


def twin_key(variant: Variant) -> tuple[Any, ...]:
    """What `variant` is apart from its architecture: equal for a variant and its twin on a SAME_LOWERING
    architecture."""
    options = tuple((k, v) for k, v in variant.options if k not in ARCH_OPTIONS)
    return variant.module, variant.kernel, variant.signature, variant.constexprs, variant.attrs, options


def derive(found: dict[Variant, CompileResult], arch: int, base: int) -> tuple[list[Variant], list[Variant]]:
    """Split the `arch` variants of `found` into those to compile and those that equal a `base` variant but for
    the architecture (their results are to be copied from it); the one of the latter whose base needs the most
    shared memory is moved to the former, to check that the figures carry over (see `check_derived`)."""
    mine = [v for v in found if v.arch == arch]
    bases = {twin_key(v): v for v in found if v.arch == base}
    derived = [v for v in mine if twin_key(v) in bases and found[bases[twin_key(v)]].shared is not None]
    if derived:
        probe = max(derived, key=lambda v: found[bases[twin_key(v)]].shared or 0)
        derived.remove(probe)
    return [v for v in mine if v not in derived], derived


def check_derived(found: dict[Variant, CompileResult], arch: int, base: int) -> None:
    """Fill the results of `arch` variants not compiled from their `base` twins; mark a compiled one whose shared
    memory differs from its twin's as failed (the derivation would then not hold)."""
    bases = {twin_key(v): v for v in found if v.arch == base}
    for v in (v for v in found if v.arch == arch and twin_key(v) in bases):
        mine, twin = found[v], found[bases[twin_key(v)]]
        if not mine.ok and mine.error is None:
            mine.ok, mine.registers, mine.error = twin.ok, twin.registers, twin.error
            mine.spill_stores, mine.spill_loads, mine.shared = twin.spill_stores, twin.spill_loads, twin.shared
            mine.async_copies = twin.async_copies
            mine.derived_from = base
        elif mine.ok and mine.shared != twin.shared:
            mine.ok = False
            mine.error = f"needs {mine.shared} B of shared memory where sm_{base} needs {twin.shared} B"


def _compile(variant: Variant) -> tuple[Build | None, str | None]:
    try:
        return compile_variant(variant), None
    except Exception as exc:  # report every failure, keep going
        text = str(exc).strip()
        return None, f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


def _build(found: dict[Variant, CompileResult], variants: list[Variant], pool: ProcessPoolExecutor) -> None:
    for variant, (build, error) in zip(variants, pool.map(_compile, variants), strict=True):
        result = found[variant]
        if build is not None:
            result.registers, result.spill_stores, result.spill_loads, result.shared, result.async_copies = build
            result.ok = True
        result.error = error


def run_check(archs: list[int], jobs: int, kernels: list[str] | None = None, full: bool = False) -> list[CompileResult]:
    """Compile every variant of `coverage(full)` for `archs` (only those of `kernels`, kernel function names or
    jit module names, if given). Without `full`, an architecture of SAME_LOWERING whose twin is in `archs` is
    derived from it."""
    found = collect(archs, coverage(full))
    if kernels:
        found = {v: r for v, r in found.items() if v.kernel in kernels or v.module.rsplit(".", 1)[-1] in kernels}
    twins = {} if full else {a: b for a, b in SAME_LOWERING.items() if a in archs and b in archs}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        _build(found, [v for v in found if v.arch not in twins], pool)
        later = [derive(found, arch, base)[0] for arch, base in twins.items()]
        _build(found, [v for vs in later for v in vs], pool)
    for arch, base in twins.items():
        check_derived(found, arch, base)
    return list(found.values())


def _short(constexprs: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in constexprs.items() if k != "DOT_PRECISION")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=sorted(SHARED_MEMORY_LIMIT))
    parser.add_argument("--full", action="store_true",
                        help="every model, dtype and block size, and sm_86/sm_89 compiled rather than derived")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--kernel", nargs="+", metavar="NAME",
                        help="only these kernels (function names, e.g. token_bitmask_kernel, or the jit module "
                             "that holds them, e.g. fused_moe)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter cannot compile for GPUs", file=sys.stderr)
        return 2
    start = time.monotonic()
    results = run_check(args.arch, args.jobs, args.kernel, args.full)
    for r in results:
        if args.json:
            print(json.dumps(asdict(r)))
        else:
            status = "FAIL" if r.failed else ("spill" if r.spill_stores or r.spill_loads else "ok")
            detail = r.error or (f"{r.registers} regs, spills {r.spill_stores}/{r.spill_loads} B, "
                                 f"smem {r.shared}/{r.shared_limit} B, cp.async {r.async_copies}"
                                 + (f" (as sm_{r.derived_from})" if r.derived_from else ""))
            print(f"{status:5} sm_{r.arch} {r.kernel:25} {r.dtype:4} w{r.num_warps}s{r.num_stages} "
                  f"{_short(r.constexprs):58} {detail}")
    if not results:
        print(f"no variant of {args.kernel}", file=sys.stderr)
        return 2
    failed = sum(r.failed for r in results)
    derived = sum(r.derived_from is not None for r in results)
    print(f"{len(results)} variants for sm_{'/sm_'.join(map(str, args.arch))} ({derived} derived, not compiled) in "
          f"{time.monotonic() - start:.0f} s, {failed} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
