"""Compile every kernel for real NVIDIA targets without a GPU, and read ptxas' register/spill report.

`python -m tritium.kernels.compile_check [--arch 80 90] [--json]` builds each kernel for each dtype and
head size it claims (ASTSource + triton.compile for sm_80 / sm_90), then runs the ptxas shipped in the
triton wheel with -v on the PTX. Exit status 1 if a kernel fails to compile, or spills registers on
sm_90 in a configuration the engine uses (bf16/fp16, head_dim 64/128, block_size 16).
Must run without TRITON_INTERPRET (the interpreter replaces the JIT functions).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DTYPES = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}
HEAD_DIMS = (64, 128, 256)
ENGINE_DTYPES = ("fp16", "bf16")
ENGINE_HEAD_DIMS = (64, 128)


@dataclass
class KernelConfig:
    kernel: str
    dtype: str
    head_dim: int | None
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2

    @property
    def used_by_engine(self) -> bool:
        return self.dtype in ENGINE_DTYPES and (self.head_dim is None or self.head_dim in ENGINE_HEAD_DIMS)


@dataclass
class CompileResult:
    kernel: str
    dtype: str
    head_dim: int | None
    arch: int
    ok: bool
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    used_by_engine: bool = False
    error: str | None = None


def _sig(names: str, types: str) -> dict[str, str]:
    return dict(zip(names.split(), types.split(), strict=True))


def configs() -> Iterator[KernelConfig]:
    import torch

    from tritium.kernels.decode_attention import MIN_ROWS, decode_config
    from tritium.kernels.elementwise import store_kv_rows
    from tritium.kernels.prefill_attention import prefill_config
    torch_dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    for dt in DTYPES:
        p = f"*{dt}"
        yield KernelConfig("store_kv_kernel", dt, None, _sig(
            "key_ptr value_ptr key_cache_ptr value_cache_ptr slot_ptr num_tokens stride_key stride_value",
            f"{p} {p} {p} {p} *i64 i32 i32 i32"), {"ROW": 192, "BLOCK_T": store_kv_rows(256), "BLOCK_ROW": 256})
        for residual in (False, True):
            yield KernelConfig("rms_norm_kernel", dt, None, _sig(
                "x_ptr residual_ptr weight_ptr out_ptr residual_out_ptr num_rows hidden stride_x stride_residual eps",
                f"{p} {p} {p} {p} {p} i32 i32 i32 i32 fp32"),
                {"HAS_RESIDUAL": residual, "BLOCK_R": 1, "BLOCK_H": 4096})
        yield KernelConfig("silu_and_mul_kernel", dt, None, _sig(
            "x_ptr out_ptr num_rows d stride_x", f"{p} {p} i32 i32 i32"), {"BLOCK_R": 4, "BLOCK_D": 1024})
        for hd in HEAD_DIMS:
            yield KernelConfig("rotary_kernel", dt, hd, _sig(
                "q_ptr k_ptr pos_ptr cache_ptr num_tokens num_heads num_kv_heads stride_qt stride_qh stride_kt "
                "stride_kh stride_cache", f"{p} {p} *i64 *fp32 i32 i32 i32 i32 i32 i32 i32 i32"),
                {"HALF": hd // 2, "BLOCK_T": 1, "BLOCK_QH": 32, "BLOCK_KH": 8})
            block_m, block_n, warps, stages = prefill_config(hd, torch_dtypes[dt])
            precision = "ieee" if dt == "fp32" else "tf32"
            decode_block_n, decode_warps = decode_config(hd, torch_dtypes[dt])
            for group in (1, 8):
                yield KernelConfig("prefill_attention_kernel", dt, hd, _sig(
                    "q_ptr k_cache_ptr v_cache_ptr block_tables_ptr cu_seqlens_ptr seq_lens_ptr out_ptr scale_log2e "
                    "stride_qt stride_qh stride_ot stride_oh stride_cache_block stride_cache_pos stride_bt",
                    f"{p} {p} {p} *i32 *i32 *i32 {p} fp32 i32 i32 i32 i32 i32 i32 i32"),
                    {"GROUP": group, "HEAD_DIM": hd, "BLOCK_M": block_m, "BLOCK_N": block_n,
                     "PAGE": 16, "DOT_PRECISION": precision}, warps, stages)
                yield KernelConfig("decode_split_kernel", dt, hd, _sig(
                    "q_ptr k_cache_ptr v_cache_ptr block_tables_ptr seq_lens_ptr partial_out_ptr partial_lse_ptr "
                    "scale_log2e keys_per_split num_heads num_splits stride_qs stride_qh stride_cache_block "
                    "stride_cache_pos stride_bt",
                    f"{p} {p} {p} *i32 *i32 *fp32 *fp32 fp32 i32 i32 i32 i32 i32 i32 i32 i32"),
                    {"GROUP": group, "ROWS": max(MIN_ROWS, group), "HEAD_DIM": hd,
                     "BLOCK_N": decode_block_n, "PAGE": 16, "DOT_PRECISION": precision}, decode_warps)
            yield KernelConfig("decode_reduce_kernel", dt, hd, _sig(
                "partial_out_ptr partial_lse_ptr out_ptr num_heads num_splits stride_os stride_oh",
                f"*fp32 *fp32 {p} i32 i32 i32 i32"), {"HEAD_DIM": hd, "SPLITS": 16})


def _kernel_fn(name: str) -> Any:
    from tritium.kernels import decode_attention, elementwise, prefill_attention

    for module in (elementwise, prefill_attention, decode_attention):
        if hasattr(module, name):
            return getattr(module, name)
    raise KeyError(name)


def ptxas_report(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from `ptxas -v` on `ptx`."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    suffix = "a" if arch == 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [str(ptxas), "-v", f"--gpu-name=sm_{arch}{suffix}", str(src), "-o", str(Path(tmp) / "k.o")]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    log = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (int(regs.group(1)) if regs else -1,
            int(spills.group(1)) if spills else 0, int(spills.group(2)) if spills else 0)


def compile_one(cfg: KernelConfig, arch: int) -> CompileResult:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    result = CompileResult(cfg.kernel, cfg.dtype, cfg.head_dim, arch, ok=False, used_by_engine=cfg.used_by_engine)
    try:
        fn = _kernel_fn(cfg.kernel)
        signature = dict(cfg.signature)
        for name in cfg.constexprs:
            signature[name] = "constexpr"
        ordered = {name: signature[name] for name in fn.arg_names}
        # What the JIT specializes at launch on the engine's tensors: 16-byte aligned pointers and
        # strides that are multiples of 16 (everything but the block-table width).
        aligned = [i for i, name in enumerate(fn.arg_names) if ordered[name].startswith("*")
                   or (name.startswith("stride_") and name != "stride_bt")]
        attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
        src = ASTSource(fn=fn, signature=ordered, constexprs=cfg.constexprs, attrs=attrs)
        kernel = compile(src, target=GPUTarget("cuda", arch, 32),
                         options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        result.registers, result.spill_stores, result.spill_loads = ptxas_report(kernel.asm["ptx"], arch)
        result.ok = True
    except Exception as exc:  # report every failure, keep going
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return result


def _run(args: tuple[KernelConfig, int]) -> CompileResult:
    return compile_one(*args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter cannot compile for GPUs", file=sys.stderr)
        return 2
    work = [(cfg, arch) for cfg in configs() for arch in args.arch]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_run, work))
    failed = False
    for r in results:
        bad = not r.ok or (r.arch == 90 and r.used_by_engine and (r.spill_stores or r.spill_loads))
        failed |= bool(bad)
        if args.json:
            print(json.dumps(asdict(r)))
        else:
            status = "FAIL" if bad else "ok"
            detail = r.error or f"{r.registers} regs, spills {r.spill_stores}/{r.spill_loads} B"
            print(f"{status:4} sm_{r.arch} {r.kernel:26} {r.dtype:5} hd={r.head_dim or '-':<4} {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
