"""Every kernel variant the engine launches compiles for sm_80 and sm_90 without a GPU, none spills on sm_90,
and none needs more shared memory than sm_80, sm_86, sm_89 or sm_90 gives a block (see
tritium.kernels.compile_check); the variants are derived from the host wrappers with Triton's own binder."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from tritium.kernels import triton_ops
from tritium.kernels.compile_check import (
    ARCHS,
    BLOCK_SIZES,
    MODELS,
    SHARED_MEMORY_LIMIT,
    Case,
    Specializer,
    check_derived,
    collect,
    derive,
    recording,
    twin_key,
)
from tritium.kernels.decode_attention import SPLIT_CHOICES
from tritium.kernels.token_bitmask import apply_token_bitmask

KERNELS = {"store_kv_kernel", "rms_norm_kernel", "rotary_kernel", "silu_and_mul_kernel", "gelu_tanh_and_mul_kernel",
           "prefill_attention_kernel", "decode_split_kernel", "decode_reduce_kernel", "token_bitmask_kernel",
           "int8_gemm_kernel",  # the W8A16 GEMM: the check builds every model shape as an int8 engine too
           "lora_shrink_kernel", "lora_expand_kernel", "lora_shrink_rows_kernel",  # and as a LoRA engine (rank 16)
           "lora_expand_rows_kernel",
           "moe_gate_up_kernel", "moe_down_kernel"}  # fused_moe, for the MoE models
MOE = {"moe_gate_up_kernel", "moe_down_kernel"}
DTYPES = ("fp16", "bf16", "fp32")
# dtype, head_dim, GQA group: the eight models in every dtype, the wide ones (head_dim 32, Gemma 3 and 2, Qwen3,
# Phi-4-mini) in bf16 and fp16
WIDE = ("bf16", "fp16")
ATTENTION = (set(itertools.product(DTYPES, (64, 128), (1, 3, 4, 8)))
             | {(d, *shape) for d in WIDE for shape in ((32, 4), (256, 4), (256, 2), (128, 2), (128, 3))})
REDUCE = set(itertools.product(DTYPES, (64, 128), SPLIT_CHOICES)) | set(itertools.product(WIDE, (32, 256),
                                                                                          SPLIT_CHOICES))
# (head_dim, group, WINDOW, SOFTCAP) of the windowed or capped variants: Gemma 3 1B (sliding), Gemma 2 9B and 27B
# (capped, full and sliding), gpt-oss-20b (sliding)
KINDS = {(d, *kind) for d in WIDE for kind in ((256, 4, True, False), (256, 2, False, True), (256, 2, True, True),
                                               (128, 2, False, True), (128, 2, True, True), (64, 8, True, False))}
# (kernel, head_dim, group or split count, WINDOW) of the variants with attention sinks: gpt-oss-20b's (GQA 8, full and
# sliding; the decode merge at every split count)
SINK_KINDS = ({(d, "prefill_attention_kernel", 64, 8, window) for d in WIDE for window in (False, True)}
              | {(d, "decode_reduce_kernel", 64, splits, None) for d in WIDE for splits in SPLIT_CHOICES})


def assert_covered(results: list[dict[str, Any]], arch: int) -> None:
    mine = [r for r in results if r["arch"] == arch]
    assert {r["kernel"] for r in mine} == KERNELS
    for kernel in ("prefill_attention_kernel", "decode_split_kernel"):
        built = {(r["dtype"], r["constexprs"]["HEAD_DIM"], r["constexprs"]["GROUP"]) for r in mine
                 if r["kernel"] == kernel}
        assert built == ATTENTION, (kernel, ATTENTION - built)
    built = {(r["dtype"], r["constexprs"]["HEAD_DIM"], r["constexprs"]["SPLITS"]) for r in mine
             if r["kernel"] == "decode_reduce_kernel"}
    assert built == REDUCE, REDUCE - built
    for kernel in ("prefill_attention_kernel", "decode_split_kernel"):
        c = "constexprs"
        kinds = {(r["dtype"], r[c]["HEAD_DIM"], r[c]["GROUP"], r[c]["WINDOW"], r[c]["SOFTCAP"]) for r in mine
                 if r["kernel"] == kernel and (r[c]["WINDOW"] or r[c]["SOFTCAP"])}
        assert kinds == KINDS, (kernel, KINDS ^ kinds)
    sinks = {(r["dtype"], r["kernel"], r["constexprs"]["HEAD_DIM"],
              r["constexprs"].get("GROUP", r["constexprs"].get("SPLITS")), r["constexprs"].get("WINDOW"))
             for r in mine if r["constexprs"].get("SINKS")}
    assert sinks == SINK_KINDS, SINK_KINDS ^ sinks
    halves = {(r["constexprs"]["HALF"], r["constexprs"]["BLOCK_HALF"]) for r in mine if r["kernel"] == "rotary_kernel"}
    assert (48, 64) in halves and all(h == b for h, b in halves - {(48, 64)})  # Phi-4-mini's rotary, padded
    assert {r["dtype"] for r in mine if r["kernel"] == "gelu_tanh_and_mul_kernel"} == set(WIDE)
    for kernel in ("prefill_attention_kernel", "decode_split_kernel"):
        pages = {r["constexprs"]["PAGE"] for r in mine if r["kernel"] == kernel and r["dtype"] == "bf16"
                 and r["constexprs"]["HEAD_DIM"] == 128 and r["constexprs"]["GROUP"] == 4}
        assert pages == set(BLOCK_SIZES), (kernel, pages)
    smol = {r["kernel"] for r in mine if "SmolLM2-135M" in r["models"]}
    assert smol == KERNELS - {"gelu_tanh_and_mul_kernel"} - MOE  # Gemma's MLP, the experts
    bitmask = [r for r in mine if r["kernel"] == "token_bitmask_kernel"]
    assert len(bitmask) == 2  # int32 and int64 rows; fp32 logits of every vocabulary size (all multiples of 16)
    int8 = {(r["dtype"], r["constexprs"]["BLOCK_M"], r["constexprs"]["BLOCK_N"]) for r in mine
            if r["kernel"] == "int8_gemm_kernel"}
    # every tile configuration of kernels/int8_gemm.py: 16x64, 32x64 and 64x64 (decode batches), 64x128; fp32 two
    assert int8 == {(d, m, n) for d in ("fp16", "bf16") for m, n in ((16, 64), (32, 64), (64, 64), (64, 128))} | \
        {("fp32", 16, 64), ("fp32", 32, 64)}, int8
    lora = {(r["kernel"], r["dtype"]) for r in mine if r["kernel"].startswith("lora_")}
    assert lora == {(k, d) for k in KERNELS if k.startswith("lora_") for d in DTYPES}, lora
    # Qwen3-30B-A3B (top-8), Mixtral (top-2): silu; gpt-oss-120b (top-4): swiglu_oai with biases; decode- and
    # prefill-sized tiles
    moe = {(r["dtype"], r["constexprs"]["TOP_K"], r["constexprs"]["ACTIVATION"], r["constexprs"]["HAS_BIAS"],
            r["constexprs"]["BLOCK_M"]) for r in mine if r["kernel"] == "moe_gate_up_kernel"}
    assert moe == {(d, *kind, m) for d in WIDE for kind in ((8, "silu", False), (2, "silu", False),
                                                            (4, "swiglu_oai", True)) for m in (16, 64)}, moe
    assert {r["dtype"] for r in mine if r["kernel"] in MOE} == set(WIDE)


def test_the_check_covers_kernels_dtypes_head_dims_groups_and_splits() -> None:
    results = [
        {"arch": r.arch, "kernel": r.kernel, "dtype": r.dtype, "constexprs": r.constexprs, "models": r.models}
        for r in collect([80, 90]).values()
    ]
    for arch in (80, 90):
        assert_covered(results, arch)


def test_shared_memory_limits_are_the_opt_in_maxima_per_block() -> None:
    # CUDA C++ Programming Guide: 163 KB on 8.0, 99 KB on 8.6 and 8.9, 227 KB on 9.0
    assert SHARED_MEMORY_LIMIT == {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
    assert set(ARCHS) == set(SHARED_MEMORY_LIMIT)


@pytest.mark.parametrize("arch", [86, 89])
def test_sm86_and_sm89_variants_are_derived_from_sm80_twins_but_one(arch: int) -> None:
    found = collect([80, arch], [Case(MODELS[0], "bf16", 16)])
    for i, v in enumerate(v for v in found if v.arch == 80):
        found[v].ok, found[v].shared, found[v].registers = True, 1000 * (i + 1), 32
    to_build, derived = derive(found, arch, 80)
    assert len(to_build) == 1 and len(derived) == sum(v.arch == arch for v in found) - 1
    (probe,) = to_build
    (twin,) = (found[v] for v in found if v.arch == 80 and twin_key(v) == twin_key(probe))
    assert twin.shared == max(r.shared or 0 for r in found.values())  # the one needing the most is built
    found[probe].ok, found[probe].shared = True, twin.shared
    check_derived(found, arch, 80)
    assert all(found[v].ok and found[v].derived_from == 80 for v in derived)
    assert found[probe].derived_from is None and not found[probe].failed
    found[probe].shared = twin.shared + 16  # a build for sm_86 that differed would fail the check
    check_derived(found, arch, 80)
    assert found[probe].failed and "shared memory" in (found[probe].error or "")
    over = found[derived[0]]
    over.shared = over.shared_limit + 1
    assert over.failed


def test_rms_norm_specialization_is_derived_from_the_wrapper() -> None:
    weight = torch.ones(576, dtype=torch.bfloat16)
    with recording() as launches:
        for rows in (1, 16, 17):
            triton_ops.rms_norm(torch.zeros(rows, 576, dtype=torch.bfloat16), weight, 1e-5, tiles="gpu")
    assert len(launches) == 3
    variants = {Specializer(90).variant(launch) for launch in launches}
    assert len(variants) == 1  # 1, 16 and 17 rows: one binary
    (v,) = variants
    signature = dict(v.signature)
    assert signature["num_rows"] == "i32" and signature["hidden"] == "i32" and signature["x_ptr"] == "*bf16"
    assert "num_rows" not in v.divisible_by_16 and v.equal_to_1 == ()
    assert {"hidden", "stride_x", "x_ptr", "out_ptr", "weight_ptr"} <= set(v.divisible_by_16)
    assert v.constexpr_values() == {"HAS_RESIDUAL": False, "BLOCK_R": 4, "BLOCK_H": 1024}
    assert v.option("num_warps") == 4 and v.option("arch") == "sm90"


def test_attention_variants_take_any_window_and_cap_without_compiling_again() -> None:
    # One binary per kernel and (window?, cap?) kind, whatever the window (1, a multiple of 16, large) or the cap.
    q, cache = torch.zeros(3, 4, 64, dtype=torch.bfloat16), torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    table, cu = torch.zeros(3, 4, dtype=torch.int32), torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    lens = cu[1:]
    kinds = [(None, None), *((w, c) for w in (None, 1, 16, 4096, 131072) for c in (None, 30.0, 50.0))]
    with recording() as launches:
        for window, cap in kinds:
            triton_ops.prefill_attention(q, cache, cache, table, cu, lens, 0.125, 1, window, cap, tiles="gpu")
            triton_ops.decode_attention(q, cache, cache, table, lens, 0.125, window, cap, tiles="gpu")
    spec = Specializer(90)
    variants = {spec.variant(launch) for launch in launches if launch.kernel.fn.__name__ != "decode_reduce_kernel"}
    by_kind = {(v.kernel, v.constexpr_values()["WINDOW"], v.constexpr_values()["SOFTCAP"]) for v in variants}
    assert len(variants) == len(by_kind) == 8
    for v in variants:
        assert dict(v.signature)["window"] == "i32" and dict(v.signature)["cap_in"] == "fp32"
        assert "window" not in v.divisible_by_16 and v.equal_to_1 == ()


def test_token_bitmask_specialization_is_derived_from_the_wrapper() -> None:
    # Any row count, rows read from views at any offset of a staging buffer, bitmasks of any width taken
    # from any row of a persistent buffer: one binary per rows dtype.
    staging = torch.zeros(64, dtype=torch.int32)
    bitmasks = torch.zeros(64, 1571, dtype=torch.int32)
    logits = torch.zeros(33, 49152)
    with recording() as launches:
        for count, offset, words in ((1, 0, 1536), (16, 1, 1571), (17, 3, 1000), (32, 16, 1)):
            apply_token_bitmask(logits, bitmasks[offset : offset + count, :words], staging[offset : offset + count],
                                tiles="gpu")
    assert len(launches) == 4
    variants = {Specializer(90).variant(launch) for launch in launches}
    assert len(variants) == 1
    (v,) = variants
    signature = dict(v.signature)
    assert signature["logits_ptr"] == "*fp32" and signature["rows_ptr"] == "*i32" and signature["num_words"] == "i32"
    assert set(v.divisible_by_16) == {"logits_ptr", "vocab", "stride_logits"} and v.equal_to_1 == ()
    assert v.constexpr_values() == {"BLOCK_W": 64}
    assert v.option("num_warps") == 4


@pytest.mark.slow
def test_all_kernels_compile_without_spills_within_shared_memory() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tritium.kernels.compile_check", "--json"],
                          env=env, capture_output=True, text=True, timeout=900)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failures = [r for r in results if not r["ok"]]
    assert not failures, failures[:3]
    spills = [r for r in results if r["arch"] == 90 and (r["spill_stores"] or r["spill_loads"])]
    assert not spills, spills[:3]
    over = [r for r in results if r["shared"] > r["shared_limit"]]
    assert not over, over[:3]
    assert proc.returncode == 0, proc.stderr[-2000:]
    for arch in ARCHS:
        assert_covered(results, arch)
    assert all(r["registers"] > 0 for r in results)
    for arch in (86, 89):  # derived from sm_80 but one, compiled to check the derivation
        assert [r["derived_from"] for r in results if r["arch"] == arch].count(None) == 1
