"""kernels/warmup.py: the warm-up runs with both ops modules, and the kernel variants serving steps launch
(any token count, batch, block-table width, decode split count) are all among the warm-up's, as the JIT
would key them on an sm_90 GPU: after warm-up, nothing compiles while serving."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tritium.backend import LLM, SamplingParams
from tritium.kernels import reference, triton_ops
from tritium.kernels.compile_check import MODELS, WIDE_MODELS, Launch, ModelShape, Specializer, Variant, recording
from tritium.kernels.decode_attention import SPLIT_CHOICES
from tritium.kernels.token_bitmask import apply_token_bitmask
from tritium.kernels.warmup import EngineShape, warm_up, warmup_calls

from support.checkpoints import save_tiny

TINY = EngineShape(num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=64, intermediate_size=128, rotary_dim=32,
                   block_size=16, max_blocks_per_seq=4, dtype=torch.float32, vocab_size=1000)


def test_warm_up_with_the_reference_ops() -> None:
    assert warm_up(reference, TINY) == 9  # seven ops (rms_norm twice, the token bitmask twice), decode once


def test_warm_up_with_the_triton_ops_under_the_interpreter() -> None:
    assert warm_up(triton_ops, TINY) == 8 + len(SPLIT_CHOICES)


# Gemma 2's kinds: sliding and full layers, both soft-capped; GELU; and q/k norm (Gemma 3's, Qwen3's).
GEMMA = replace(TINY, windows=(None, 8), softcap=30.0, activation="gelu_tanh_and_mul", qk_norm=True)


@pytest.mark.parametrize("ops", [reference, triton_ops], ids=["reference", "triton"])
def test_warm_up_launches_each_attention_kind_the_activation_and_the_qk_norm(ops) -> None:  # type: ignore[no-untyped-def]
    splits = len(SPLIT_CHOICES) if ops is triton_ops else 1
    assert warm_up(ops, GEMMA) == 10 + 2 * splits  # prefill twice, rms_norm a third time
    calls = warmup_calls(GEMMA)
    attention = {(c.op, c.kwargs["sliding_window"], c.kwargs["softcap"]) for c in calls if "attention" in c.op}
    assert attention == {(op, w, 30.0) for op in ("prefill_attention", "decode_attention") for w in (None, 8)}
    assert {c.op for c in calls} >= {"gelu_tanh_and_mul"} and "silu_and_mul" not in {c.op for c in calls}
    assert [c.args[0].shape for c in calls if c.op == "rms_norm"][-1] == (2 * 4, 32)  # q's rows of head_dim


def test_the_warm_up_applies_the_token_bitmask_at_the_vocab_size() -> None:
    calls = [c for c in warmup_calls(TINY) if c.op == "apply_token_bitmask"]
    assert [c.args[2].dtype for c in calls] == [torch.int32, torch.int64]
    assert all(c.args[0].shape[1] == 1000 and c.args[0].dtype == torch.float32 for c in calls)
    assert all(c.args[1].shape[1] == 32 and c.args[1].dtype == torch.int32 for c in calls)
    assert EngineShape(4, 2, 32, 64, 128, 32, 16, 4, torch.float32).vocab_size == 49152  # the default model's
    assert triton_ops.apply_token_bitmask is apply_token_bitmask


def engine_step(model: ModelShape, dtype: torch.dtype, decode_lens: list[int], prefill: list[tuple[int, int]],
                fused: bool = True) -> None:
    """The op calls of one layer of one engine step (tiles="gpu", as on CUDA): decode rows first, then
    prefill chunks given as (query tokens, context length). Like the engine's, the int32 step inputs are
    views at any offset of one staging buffer."""
    block = 16
    nd = len(decode_lens)
    q_lens = [q for q, _ in prefill]
    n = nd + sum(q_lens)
    staging = torch.zeros(4 * n + 3 * len(prefill) + 16, dtype=torch.int32)
    offset = 1

    def stage(count: int) -> torch.Tensor:
        nonlocal offset
        offset += count + 1
        return staging[offset - count - 1 : offset - 1]

    h, kvh, d = model.heads, model.kv_heads, model.head_dim
    x = torch.zeros(n, model.hidden, dtype=dtype)
    weight = torch.ones(model.hidden, dtype=dtype)
    triton_ops.rms_norm(x, weight, 1e-5, tiles="gpu")
    triton_ops.rms_norm(x, weight, 1e-5, x.clone(), tiles="gpu")
    qkv = torch.zeros(n, (h + 2 * kvh) * d, dtype=dtype)
    q = qkv[:, : h * d].view(n, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(n, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(n, kvh, d)
    if not fused:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if model.qk_norm:  # per head, on rows of head_dim (copies of the views)
        triton_ops.rms_norm(q.reshape(n * h, d), weight[:d], 1e-6, tiles="gpu")
        triton_ops.rms_norm(k, weight[:d], 1e-6, tiles="gpu")
    cos_sin_cache = torch.zeros(4096, model.rotary_dim)
    triton_ops.rotary_embedding(q, k, stage(n), cos_sin_cache, tiles="gpu")
    key_cache = torch.zeros(64, block, kvh, d, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    triton_ops.store_kv(k, v, key_cache, value_cache, stage(n), tiles="gpu")
    table = torch.zeros(8, 600, dtype=torch.int32)  # the engine's persistent block-table rows
    sinks = torch.zeros(h) if model.sinks else None  # a layer's parameter (gpt-oss)
    if nd:
        width = max(-(-c // block) for c in decode_lens)
        tables = table.index_select(0, torch.zeros(nd, dtype=torch.int64))[:, :width]
        seq_lens = stage(nd)
        seq_lens.copy_(torch.tensor(decode_lens))
        for window in model.windows:
            triton_ops.decode_attention(q[:nd], key_cache, value_cache, tables, seq_lens, 0.1, window, model.softcap,
                                        sinks, tiles="gpu")
    if prefill:
        width = max(-(-c // block) for _, c in prefill)
        tables = table.index_select(0, torch.zeros(len(prefill), dtype=torch.int64))[:, :width]
        cu = stage(len(prefill) + 1)
        cu.copy_(torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]))
        seq_lens = stage(len(prefill))
        seq_lens.copy_(torch.tensor([c for _, c in prefill]))
        for window in model.windows:
            triton_ops.prefill_attention(q[nd:], key_cache, value_cache, tables, cu, seq_lens, 0.1, max(q_lens),
                                         window, model.softcap, sinks, tiles="gpu")
    getattr(triton_ops, model.activation)(torch.zeros(n, 2 * model.intermediate, dtype=dtype), tiles="gpu")
    # Structured output: some of the step's sampled rows constrained, their logits rows staged like the
    # other step inputs (int32) or given as int64; the bitmask is as wide as the grammar engine's tokenizer
    # (not always V / 32) and may be rows of a persistent buffer.
    num_seqs = nd + len(prefill)
    logits = torch.zeros(num_seqs, model.vocab)
    bitmasks = torch.zeros(num_seqs + 1, model.vocab // 32 - 3, dtype=torch.int32)
    for count in {1, num_seqs}:
        rows = stage(count)
        rows.copy_(torch.arange(count))
        apply_token_bitmask(logits, bitmasks[1 : 1 + count], rows, tiles="gpu")
        apply_token_bitmask(logits, torch.zeros(count, -(-model.vocab // 32), dtype=torch.int32),
                            torch.arange(count), tiles="gpu")


def variants(launches: list[Launch]) -> set[Variant]:
    spec = Specializer(90)
    return {spec.variant(launch) for launch in launches}


# The default model, Llama-2-7B, and the families with kernels of their own: Gemma 3 and 2 (windows, caps, GELU,
# head_dim 256), Qwen3 (q/k norm at head_dim 128), Phi-4-mini (rotary over 96 features), gpt-oss-20b (sinks).
@pytest.mark.parametrize("model", [MODELS[0], MODELS[4], *WIDE_MODELS[1:]], ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_serving_launches_nothing_the_warm_up_did_not_compile(model: ModelShape, dtype: torch.dtype) -> None:
    with recording() as warm:
        for call in warmup_calls(model.engine_shape(dtype, block_size=16, max_blocks_per_seq=8)):
            getattr(triton_ops, call.op)(*call.args, **call.kwargs, tiles="gpu")
    with recording() as serving:
        engine_step(model, dtype, [1], [])  # one token: counts and the block-table width equal 1
        engine_step(model, dtype, [], [(1, 1)])
        engine_step(model, dtype, [], [(16, 16), (32, 32)])  # counts that are multiples of 16
        engine_step(model, dtype, [5, 17, 33], [(17, 40)])  # a mixed batch: q[nd:] starts mid-tensor
        engine_step(model, dtype, [4000] * 5, [])  # long contexts: several splits
        engine_step(model, dtype, [300, 9000], [], fused=False)
        engine_step(model, dtype, [30] * 64, [(100, 300)], fused=False)
        for splits in SPLIT_CHOICES[1:]:
            engine_step(model, dtype, [splits * 256], [])
    warmed = variants(warm)
    served = variants(serving)
    assert served <= warmed, sorted({(v.kernel, v.equal_to_1, v.divisible_by_16) for v in served - warmed})
    reduce_splits = {v.constexpr_values()["SPLITS"] for v in served if v.kernel == "decode_reduce_kernel"}
    assert {1, 2, 4, 8} <= reduce_splits <= set(SPLIT_CHOICES)  # 32 KV heads fill the GPU with 8 splits


def test_an_engine_serves_only_variants_its_warm_up_launched(
    make_llm: Callable[..., LLM], tmp_path: Path, default_model_path: Path
) -> None:
    # The real engine through the Triton kernels (interpreter: tiles "auto" is "small" on both sides).
    path = save_tiny("llama", tmp_path, default_model_path, num_hidden_layers=1, hidden_size=64,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    with recording(run=True) as warm:  # the engine's own warm-up, at start
        llm = make_llm(str(path), attention_backend="triton", kv_cache_bytes=1 << 20, max_num_seqs=4,
                       max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [list(range(100, 140)), [5], [6, 7, 8], list(range(200, 217))]
    with recording(run=True) as served:
        llm.generate(prompts, params)
    assert {v.kernel for v in variants(warm)} >= {"decode_reduce_kernel", "prefill_attention_kernel"}
    new = variants(served) - variants(warm)
    assert not new, sorted({(v.kernel, v.equal_to_1, v.divisible_by_16) for v in new})


# A mixture-of-experts engine (8 experts, top-2; sizes past 256 that the warm-up's dummy weights shrink): fused_moe
# once per tile configuration, and serving at any token count builds nothing more.
MOE = replace(TINY, hidden_size=400, num_experts=8, moe_top_k=2, moe_intermediate=296, moe_activation="swiglu_oai",
              moe_bias=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_moe_engine_warms_up_each_fused_moe_tile_configuration(dtype: torch.dtype) -> None:
    shape = replace(MOE, dtype=dtype)
    calls = [c for c in warmup_calls(shape) if c.op == "fused_moe"]
    assert [c.args[0].shape[0] for c in calls] == [1, 65]  # 1 and 17 rows per expert: 16- and 64-row blocks
    assert all(c.kwargs["activation"] == "swiglu_oai" and c.kwargs["w13_bias"] is not None for c in calls)
    assert not [c for c in warmup_calls(TINY) if c.op == "fused_moe"]
    for c in calls:
        assert reference.fused_moe(*c.args, **c.kwargs).shape == c.args[0].shape
    with recording() as warm:
        for c in calls:
            triton_ops.fused_moe(*c.args, **c.kwargs, tiles="gpu")
    g = torch.Generator().manual_seed(0)
    w13 = torch.zeros(8, 2 * 296, 400, dtype=dtype)
    w2 = torch.zeros(8, 400, 296, dtype=dtype)
    biases = {"w13_bias": torch.zeros(8, 2 * 296, dtype=dtype), "w2_bias": torch.zeros(8, 400, dtype=dtype)}
    with recording() as serving:
        for tokens in (1, 2, 16, 17, 64, 65, 300):
            topk_ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)]).to(torch.int32)
            weights = torch.rand(tokens, 2, generator=g)
            triton_ops.fused_moe(torch.zeros(tokens, 400, dtype=dtype), w13, w2, weights, topk_ids, "swiglu_oai",
                                 **biases, tiles="gpu")
    assert {v.kernel for v in variants(warm)} == {"moe_gate_up_kernel", "moe_down_kernel"}
    assert len(variants(warm)) == 4  # two kernels x two tile configurations
    assert variants(serving) <= variants(warm)
