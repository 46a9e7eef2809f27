"""gpu-check step 1: every Triton kernel against its torch reference, at GPU tiles, at realistic shapes.

On CUDA: fp16 and bf16, the default model's head layout (9 heads, 3 KV heads, head_dim 64), a Llama-8B-like one
(32 / 8 / 128) and a Gemma-3-4B-like one (8 / 4 / 256), thousands of tokens, prefill with several sequences and
chunked context, decode with contexts up to 16k; attention also with a sliding window (shorter than most contexts),
soft-capped, and both; the MLP's GELU(tanh)-and-mul next to SiLU-and-mul; rotary over three quarters of
head_dim (Phi-4-mini's 96 of 128: halves that are not powers of two). In smoke mode (CPU, TRITON_INTERPRET=1): the
default layout with a few tokens, fp32 and fp16 (the interpreter cannot run `tl.dot` on bf16), GPU tiles when the
kernels take `tiles`. Attention is compared with the reference computed in fp32 from the same inputs.

Fused MoE (kernels/fused_moe.py): 8 experts, top-2, at the layout's hidden and intermediate sizes (64 and 64 in
smoke mode), silu without biases and swiglu_oai (gpt-oss) with them.

LoRA (kernels/lora.py): the segmented shrink + expand over four adapters (rank 16, q/k/v in one launch each, as
the engine runs a fused projection) and the per-row form (a slot per row, some -1; split-K partial sums), against
the references. `time_lora` (run by step 4,
the kernel benchmark) times each form next to the base GEMM it sits beside (the module's `x @ W^T`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from tritium.client.bench.timing import kernel_ms
from tritium.client.bench.workload import paged_cache
from tritium.client.checks.report import FAIL, PASS, Outcome

# atol = rtol per dtype: output rounding plus the kernels' different summation order
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Layout:
    """A model's attention and MLP shapes."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int


DEFAULT_LAYOUT = Layout("SmolLM2-135M", 9, 3, 64, 576, 1536)
LLAMA_8B_LAYOUT = Layout("Llama-8B-like", 32, 8, 128, 4096, 14336)
GEMMA_LAYOUT = Layout("Gemma-3-4B-like", 8, 4, 256, 2560, 10240)
SOFTCAP = 5.0  # scores of random inputs reach both of the kernels' tanh ranges (Gemma 2's cap is 50)


@dataclass(frozen=True)
class Sizes:
    """How many tokens / which sequence lengths each op runs on."""

    tokens: int  # rows for the elementwise kernels and store_kv
    prefill_contexts: list[int]  # per sequence: cached tokens ...
    prefill_queries: list[int]  # ... of which the last this many are queries (fewer: chunked / prefix hit)
    decode_contexts: list[int]
    max_position: int
    window: int  # the sliding window of the windowed attention cases


GPU_SIZES = Sizes(4096, [1, 17, 300, 1000, 2053], [1, 17, 300, 128, 2053],
                  [1, 15, 16, 17, 1000, 4097, 8191, 16384], 16384, 1000)
SMOKE_SIZES = Sizes(37, [1, 17, 40], [1, 17, 9], [1, 16, 17, 50], 128, 20)


@dataclass
class Case:
    """One op on one layout and dtype: its largest error and whether it was within tolerance (or its error)."""

    op: str
    layout: str
    dtype: str
    max_abs_err: float | None = None
    ok: bool = False
    error: str | None = None


def tile_kwargs(fn: Callable[..., Any]) -> dict[str, str]:
    """`tiles="gpu"` when the kernel wrapper takes a `tiles` argument (GPU tile sizes under the interpreter
    too), else nothing (on CUDA the wrappers use GPU tiles anyway)."""
    return {"tiles": "gpu"} if "tiles" in inspect.signature(fn).parameters else {}


def _compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> tuple[float, bool]:
    tol = TOLERANCE[dtype]
    diff = (got.float() - want.float()).abs()
    ok = bool((diff <= tol + tol * want.float().abs()).all()) and not bool(got.isnan().any())
    return float(diff.max()) if diff.numel() else 0.0, ok


def paged_context(lengths: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches holding every sequence in scattered blocks (plus spare ones), and the block tables."""
    return paged_cache(lengths, kv_heads, head_dim, dtype, device, BLOCK_SIZE, spare_blocks=3)


def _store_kv(tri: Any, ref: Any, lay: Layout, sizes: Sizes, dtype: torch.dtype, device: str) -> tuple[float, bool]:
    n = sizes.tokens
    num_blocks = -(-2 * n // BLOCK_SIZE)
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, lay.kv_heads, lay.head_dim, dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(n, lay.kv_heads, lay.head_dim, device=device).to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:n]
    slots[::7] = -1  # padding rows are skipped
    k2, v2 = key_cache.clone(), value_cache.clone()
    tri.store_kv(key, value, key_cache, value_cache, slots, **tile_kwargs(tri.store_kv))
    ref.store_kv(key, value, k2, v2, slots)
    exact = torch.equal(key_cache, k2) and torch.equal(value_cache, v2)
    return float((key_cache.float() - k2.float()).abs().max()), exact


def _rms_norm(residual: bool) -> Callable[..., tuple[float, bool]]:
    def run(tri: Any, ref: Any, lay: Layout, sizes: Sizes, dtype: torch.dtype, device: str) -> tuple[float, bool]:
        x = torch.randn(sizes.tokens, lay.hidden, device=device).to(dtype)
        weight = torch.randn(lay.hidden, device=device).to(dtype)
        res = torch.randn_like(x) if residual else None
        got = tri.rms_norm(x, weight, 1e-5, res, **tile_kwargs(tri.rms_norm))
        want = ref.rms_norm(x, weight, 1e-5, res)
        if not residual:
            return _compare(got, want, dtype)
        err_out, ok_out = _compare(got[0], want[0], dtype)
        err_res, ok_res = _compare(got[1], want[1], dtype)
        return max(err_out, err_res), ok_out and ok_res
    return run


def _rotary(partial: bool) -> Callable[..., tuple[float, bool]]:
    def run(tri: Any, ref: Any, lay: Layout, sizes: Sizes, dtype: torch.dtype, device: str) -> tuple[float, bool]:
        rot_dim = 3 * lay.head_dim // 4 if partial else lay.head_dim
        inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, device=device).float() / rot_dim))
        freqs = torch.outer(torch.arange(sizes.max_position, device=device).float(), inv)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        positions = torch.randint(0, sizes.max_position, (sizes.tokens,), device=device)
        q = torch.randn(sizes.tokens, lay.heads, lay.head_dim, device=device).to(dtype)
        k = torch.randn(sizes.tokens, lay.kv_heads, lay.head_dim, device=device).to(dtype)
        q2, k2 = q.clone(), k.clone()
        tri.rotary_embedding(q, k, positions, cache, **tile_kwargs(tri.rotary_embedding))
        ref.rotary_embedding(q2, k2, positions, cache)
        err_q, ok_q = _compare(q, q2, dtype)
        err_k, ok_k = _compare(k, k2, dtype)
        return max(err_q, err_k), ok_q and ok_k
    return run


def _act_and_mul(op: str) -> Callable[..., tuple[float, bool]]:
    def run(tri: Any, ref: Any, lay: Layout, sizes: Sizes, dtype: torch.dtype, device: str) -> tuple[float, bool]:
        x = torch.randn(sizes.tokens // 2, 2 * lay.intermediate, device=device).to(dtype)
        fn = getattr(tri, op)
        return _compare(fn(x, **tile_kwargs(fn)), getattr(ref, op)(x), dtype)
    return run


def _prefill(window: bool = False, softcap: bool = False) -> Callable[..., tuple[float, bool]]:
    def run(tri: Any, ref: Any, lay: Layout, sizes: Sizes, dtype: torch.dtype, device: str) -> tuple[float, bool]:
        contexts, queries = sizes.prefill_contexts, sizes.prefill_queries
        key_cache, value_cache, table = paged_context(contexts, lay.kv_heads, lay.head_dim, dtype, device)
        q = torch.randn(sum(queries), lay.heads, lay.head_dim, device=device).to(dtype)
        cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32, device=device)
        seq_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
        scale = lay.head_dim**-0.5
        kinds = (sizes.window if window else None, SOFTCAP if softcap else None)
        got = tri.prefill_attention(q, key_cache, value_cache, table, cu, seq_lens, scale, max(queries), *kinds,
                                    **tile_kwargs(tri.prefill_attention))
        want = ref.prefill_attention(q.float(), key_cache.float(), value_cache.float(), table, cu, seq_lens, scale,
                                     None, *kinds)
        return _compare(got, want, dtype)
    return run


def _decode(window: bool = False, softcap: bool = False) -> Callable[..., tuple[float, bool]]:
    def run(tri: Any, ref: Any, lay: Layout, sizes: Sizes, dtype: torch.dtype, device: str) -> tuple[float, bool]:
        contexts = sizes.decode_contexts
        key_cache, value_cache, table = paged_context(contexts, lay.kv_heads, lay.head_dim, dtype, device)
        q = torch.randn(len(contexts), lay.heads, lay.head_dim, device=device).to(dtype)
        seq_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
        scale = lay.head_dim**-0.5
        kinds = (sizes.window if window else None, SOFTCAP if softcap else None)
        got = tri.decode_attention(q, key_cache, value_cache, table, seq_lens, scale, *kinds,
                                   **tile_kwargs(tri.decode_attention))
        want = ref.decode_attention(q.float(), key_cache.float(), value_cache.float(), table, seq_lens, scale,
                                    *kinds)
        return _compare(got, want, dtype)
    return run


LORA_RANK = 16
LORA_SLOTS = 4


def _qkv_bounds(lay: Layout) -> tuple[int, int, int, int]:
    q, kv = lay.heads * lay.head_dim, lay.kv_heads * lay.head_dim
    return 0, q, q + kv, q + 2 * kv


def _lora_inputs(lay: Layout, rows: int, dtype: torch.dtype, device: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """x [rows, hidden], the fused q/k/v stacks A [4, 3 * 16, hidden] and B [4, q + 2 kv, 16], scaling [4], and each
    row's slot (every fifth -1)."""
    x = torch.randn(rows, lay.hidden, device=device).to(dtype)
    a = (torch.randn(LORA_SLOTS, 3 * LORA_RANK, lay.hidden, device=device) * lay.hidden**-0.5).to(dtype)
    b = (torch.randn(LORA_SLOTS, _qkv_bounds(lay)[-1], LORA_RANK, device=device) * 0.25).to(dtype)
    scaling = torch.linspace(0.5, 2.0, LORA_SLOTS, device=device)
    return x, a, b, scaling, [-1 if t % 5 == 4 else t % LORA_SLOTS for t in range(rows)]


def _lora_segmented(tri: Any, ref: Any, lay: Layout, sizes: Sizes, dtype: torch.dtype,
                    device: str) -> tuple[float, bool]:
    from tritium.backend.lora.ops import lora_groups, segment_arrays

    x, a, b, scaling, slots = _lora_inputs(lay, sizes.tokens, dtype, device)
    order, segments = lora_groups(slots)
    starts, seg_slots = segment_arrays(segments)
    rows = torch.tensor(order, dtype=torch.int32, device=device)
    starts_t = torch.tensor(starts, dtype=torch.int32, device=device)
    slots_t = torch.tensor(seg_slots, dtype=torch.int32, device=device)
    max_rows = max(end - start for _, start, end in segments)
    got_buf = torch.empty(len(order), 3 * LORA_RANK, dtype=dtype, device=device)
    want_buf = torch.empty_like(got_buf)
    tri.lora_shrink(x, a, scaling, rows, starts_t, slots_t, got_buf, max_rows, 3, **tile_kwargs(tri.lora_shrink))
    ref.lora_shrink(x, a, scaling, rows, starts_t, slots_t, want_buf, max_rows, 3)
    err_buf, ok_buf = _compare(got_buf, want_buf, dtype)
    bounds = _qkv_bounds(lay)
    got = torch.randn(sizes.tokens, bounds[-1], device=device).to(dtype)
    want = got.clone()
    tri.lora_expand(want_buf, b, rows, starts_t, slots_t, got, max_rows, bounds, **tile_kwargs(tri.lora_expand))
    ref.lora_expand(want_buf, b, rows, starts_t, slots_t, want, max_rows, bounds)
    err, ok = _compare(got, want, dtype)
    return max(err_buf, err), ok_buf and ok


def _lora_rows(tri: Any, ref: Any, lay: Layout, sizes: Sizes, dtype: torch.dtype,
               device: str) -> tuple[float, bool]:
    from tritium.kernels.tiles import lora_row_splits

    rows = len(sizes.decode_contexts) * 8  # a decode batch
    x, a, b, scaling, slots = _lora_inputs(lay, rows, dtype, device)
    row_slots = torch.tensor(slots, dtype=torch.int32, device=device)
    got_parts = torch.zeros(lora_row_splits(lay.hidden), rows, 3 * LORA_RANK, device=device)
    want_parts = torch.zeros_like(got_parts)
    tri.lora_shrink_rows(x, a, scaling, row_slots, got_parts, 3, **tile_kwargs(tri.lora_shrink_rows))
    ref.lora_shrink_rows(x, a, scaling, row_slots, want_parts, 3)
    err_buf, ok_buf = _compare(got_parts.sum(0), want_parts.sum(0), torch.float32)
    bounds = _qkv_bounds(lay)
    got = torch.randn(rows, bounds[-1], device=device).to(dtype)
    want = got.clone()
    tri.lora_expand_rows(got_parts, b, row_slots, got, bounds, **tile_kwargs(tri.lora_expand_rows))
    ref.lora_expand_rows(got_parts, b, row_slots, want, bounds)
    err, ok = _compare(got, want, dtype)
    return max(err_buf, err), ok_buf and ok


MOE_EXPERTS, MOE_TOP_K = 8, 2


def _fused_moe(activation: str, bias: bool) -> Callable[..., tuple[float, bool]]:
    def run(tri: Any, ref: Any, lay: Layout, sizes: Sizes, dtype: torch.dtype, device: str) -> tuple[float, bool]:
        # the layout's hidden and intermediate sizes on CUDA, 64 and 64 under the interpreter; 8 experts, top-2
        h, inter = (lay.hidden, lay.intermediate) if device == "cuda" else (64, 64)
        e = MOE_EXPERTS
        hidden = torch.randn(sizes.tokens, h, device=device).to(dtype)
        w13 = (torch.randn(e, 2 * inter, h, device=device) * h**-0.5).to(dtype)
        w2 = (torch.randn(e, h, inter, device=device) * inter**-0.5).to(dtype)
        weights, topk_ids = torch.randn(sizes.tokens, e, device=device).softmax(-1).topk(MOE_TOP_K)
        biases = ((torch.randn(e, 2 * inter, device=device).to(dtype), torch.randn(e, h, device=device).to(dtype))
                  if bias else (None, None))
        args = (hidden, w13, w2, weights, topk_ids.to(torch.int32), activation, *biases)
        return _compare(tri.fused_moe(*args, **tile_kwargs(tri.fused_moe)), ref.fused_moe(*args), dtype)
    return run


OPS: dict[str, Callable[..., tuple[float, bool]]] = {
    "store_kv": _store_kv,
    "rms_norm": _rms_norm(residual=False),
    "rms_norm+residual": _rms_norm(residual=True),
    "rotary_embedding": _rotary(partial=False),
    "rotary_embedding (3/4 of head_dim)": _rotary(partial=True),
    "silu_and_mul": _act_and_mul("silu_and_mul"),
    "gelu_tanh_and_mul": _act_and_mul("gelu_tanh_and_mul"),
    "prefill_attention": _prefill(),
    "prefill_attention+window": _prefill(window=True),
    "prefill_attention+softcap": _prefill(softcap=True),
    "prefill_attention+window+softcap": _prefill(window=True, softcap=True),
    "decode_attention": _decode(),
    "decode_attention+window": _decode(window=True),
    "decode_attention+softcap": _decode(softcap=True),
    "decode_attention+window+softcap": _decode(window=True, softcap=True),
    "lora_segmented": _lora_segmented,
    "lora_rows": _lora_rows,
    "fused_moe": _fused_moe("silu", bias=False),
    "fused_moe swiglu_oai+bias": _fused_moe("swiglu_oai", bias=True),
}


@dataclass
class LoraTiming:
    """One module's LoRA delta next to its base GEMM: `form` "rows" (decode, a slot per row) or "segmented"
    (prefill, four adapters), milliseconds of shrink + expand and of `x @ W^T`, and their ratio."""

    layout: str
    module: str
    form: str
    rows: int
    lora_ms: float
    gemm_ms: float

    @property
    def ratio(self) -> float:
        """LoRA time / base GEMM time."""
        return self.lora_ms / self.gemm_ms if self.gemm_ms > 0 else 0.0


def time_lora(smoke: bool) -> dict[str, Any]:
    """Step 4's LoRA figures: for the qkv_proj (hidden -> q, k, v in one launch) and down_proj (intermediate ->
    hidden) of each layout, the per-row form at decode batches and the segmented form at a prefill size (rows spread
    over four rank-16 adapters, every fifth row base), in bf16 on CUDA (fp32 under the interpreter when `smoke`),
    each next to its base GEMM. Returns {"timings": [...], "max_ratio": ...}."""
    from tritium.backend.lora.ops import LoraGroups, add_lora_rows, add_lora_segments, lora_groups
    from tritium.kernels import triton_ops as tri

    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    layouts = [DEFAULT_LAYOUT] if smoke else [DEFAULT_LAYOUT, LLAMA_8B_LAYOUT]
    decode_rows, prefill_rows = ([4], 16) if smoke else ([1, 32, 256], 4096)
    tiles = {"tiles": "gpu"} if smoke else {}
    timings: list[LoraTiming] = []
    for lay in layouts:
        for module, d_in, bounds in (("qkv_proj", lay.hidden, _qkv_bounds(lay)),
                                     ("down_proj", lay.intermediate, (0, lay.hidden))):
            d_out = bounds[-1]
            a = torch.randn(LORA_SLOTS, (len(bounds) - 1) * LORA_RANK, d_in, device=device).to(dtype)
            b = torch.randn(LORA_SLOTS, d_out, LORA_RANK, device=device).to(dtype)
            w = torch.randn(d_out, d_in, device=device).to(dtype)
            scaling = torch.ones(LORA_SLOTS, device=device)
            for rows in [*decode_rows, prefill_rows]:
                x = torch.randn(rows, d_in, device=device).to(dtype)
                y = torch.zeros(rows, d_out, dtype=dtype, device=device)
                slots = [-1 if t % 5 == 4 else t % LORA_SLOTS for t in range(rows)]
                if rows == prefill_rows:
                    order, segments = lora_groups(slots)
                    groups = LoraGroups(torch.tensor(order, dtype=torch.int32, device=device), segments)
                    groups.seg_starts, groups.seg_slots = groups.device_segments()
                    form = "segmented"

                    def lora(groups: LoraGroups = groups, x: torch.Tensor = x, y: torch.Tensor = y,
                             a: torch.Tensor = a, b: torch.Tensor = b, s: torch.Tensor = scaling,
                             bounds: tuple[int, ...] = bounds) -> None:
                        add_lora_segments(y, x, groups, a, b, bounds, s, _Tiled(tri, tiles))
                else:
                    row_slots = torch.tensor(slots, dtype=torch.int32, device=device)
                    form = "rows"

                    def lora(row_slots: torch.Tensor = row_slots, x: torch.Tensor = x, y: torch.Tensor = y,
                             a: torch.Tensor = a, b: torch.Tensor = b, s: torch.Tensor = scaling,
                             bounds: tuple[int, ...] = bounds) -> None:
                        add_lora_rows(y, x, row_slots, a, b, s, _Tiled(tri, tiles), bounds)
                timings.append(LoraTiming(lay.name, module, form, rows, kernel_ms(lora, smoke),
                                          kernel_ms(lambda x=x, w=w: x @ w.t(), smoke)))
    if device == "cuda":
        torch.cuda.synchronize()
    return {"rank": LORA_RANK, "adapters": LORA_SLOTS, "dtype": str(dtype).removeprefix("torch."),
            "timings": [vars(t) | {"ratio": t.ratio} for t in timings],
            "max_ratio": max((t.ratio for t in timings), default=0.0)}


class _Tiled:
    """The LoRA ops of `ops` called with `tiles` (GPU tiles under the interpreter)."""

    def __init__(self, ops: Any, tiles: dict[str, str]) -> None:
        self.ops, self.tiles = ops, tiles

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.ops, name)
        return lambda *args: fn(*args, **self.tiles)


def check_kernels(smoke: bool) -> Outcome:
    """Run every op for every layout and dtype; each case on its own (one that raises fails alone)."""
    from tritium.kernels import reference as ref
    from tritium.kernels import triton_ops as tri

    if smoke:
        device, layouts, dtypes, sizes = "cpu", [DEFAULT_LAYOUT], [torch.float32, torch.float16], SMOKE_SIZES
    else:
        device, layouts, dtypes, sizes = ("cuda", [DEFAULT_LAYOUT, LLAMA_8B_LAYOUT, GEMMA_LAYOUT],
                                          [torch.float16, torch.bfloat16], GPU_SIZES)
    torch.manual_seed(0)
    plan = [(op, lay, dtype) for lay in layouts for dtype in dtypes for op in OPS]
    cases: list[Case] = []
    for op, lay, dtype in tqdm(plan, desc="kernels vs reference", unit="case"):
        case = Case(op, lay.name, str(dtype).removeprefix("torch."))
        try:
            case.max_abs_err, case.ok = OPS[op](tri, ref, lay, sizes, dtype, device)
        except Exception as exc:  # one broken kernel must not hide the others
            case.error = f"{type(exc).__name__}: {exc}"[:300]
        cases.append(case)
    if device == "cuda":
        torch.cuda.synchronize()
    failed = [c for c in cases if not c.ok]
    tiles = ("gpu" if tile_kwargs(tri.prefill_attention) else "gpu (the CUDA default)" if device == "cuda"
             else "the interpreter's (the kernels take no tiles argument yet)")
    worst = max((c for c in cases if c.max_abs_err is not None), key=lambda c: c.max_abs_err or 0.0, default=None)
    names = ", ".join(lay.name for lay in layouts)
    summary = (f"{len(cases) - len(failed)}/{len(cases)} cases within tolerance ({names}; "
               f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)}; tiles {tiles})")
    if failed:
        summary += "; failed: " + ", ".join(f"{c.op} {c.layout} {c.dtype}" for c in failed[:4])
    figures = {"device": device, "tiles": tiles, "tolerance": {str(k).removeprefix("torch."): v
                                                               for k, v in TOLERANCE.items()},
               "worst": f"{worst.op} {worst.layout} {worst.dtype}: {worst.max_abs_err:.2e}" if worst else None,
               "cases": [vars(c) for c in cases]}
    return Outcome(FAIL if failed else PASS, summary, figures)
