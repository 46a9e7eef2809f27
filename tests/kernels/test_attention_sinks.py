"""Attention sinks (gpt-oss) in both attention paths under TRITON_INTERPRET=1: the torch references against
transformers' eager gpt-oss attention, and the Triton kernels against the references (small and GPU tiles, with and
without windows, decode with several splits: the merge must count each head's sink once). Every test takes the
`bf16_dot` fixture (see tests/kernels/test_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss

from tritium.kernels import reference as ref
from tritium.kernels import triton_ops as tri
from tritium.kernels.compile_check import recording

from support.builders import paged_setup
from support.triton_interpreter import TOL

pytestmark = pytest.mark.usefixtures("bf16_dot")

DTYPES = [torch.float32, torch.float16]
# Sinks around, above and far above the scores: the last (60) takes almost all the probability and, in the exp2
# domain, would overflow a denominator not rescaled to it.
SINKS = torch.tensor([-2.0, 0.5, 3.0, 60.0])


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def hf_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None,
                 scale: float) -> torch.Tensor:
    """transformers' gpt-oss eager attention of one sequence's last len(q) positions over its whole context k / v
    `[context, kv_heads, d]`; the mask is additive (dtype min where hidden), as transformers builds it."""
    heads, kv_heads = q.shape[1], k.shape[1]
    context, num_q = k.shape[0], q.shape[0]
    q_pos = torch.arange(context - num_q, context)
    mask = ref.visible_keys(q_pos, context, window)
    additive = torch.zeros(num_q, context).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    module.sinks = sinks
    module.training = False
    out, _ = modeling_gpt_oss.eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                      v.transpose(0, 1)[None], additive[None, None], scale)
    return out[0]


@pytest.mark.parametrize("window", [None, 5])
def test_references_match_transformers_eager(window: int | None) -> None:
    lens, q_lens = [20, 9], [7, 9]  # a chunk after 13 cached keys, a whole prompt
    kc, vc, tables, dense_k, dense_v = paged_setup(lens, 8, 2, 16)
    q = torch.randn(sum(q_lens), 4, 16) * 2
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = ref.prefill_attention(q, kc, vc, tables, cu, seq_lens, 0.25, None, window, None, SINKS)
    want = torch.cat([hf_attention(q[0:7], dense_k[0], dense_v[0], SINKS, window, 0.25),
                      hf_attention(q[7:16], dense_k[1], dense_v[1], SINKS, window, 0.25)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # Decode: each sequence's last query row alone.
    last = q[[6, 15]]
    got = ref.decode_attention(last, kc, vc, tables, seq_lens, 0.25, window, None, SINKS)
    want = torch.stack([hf_attention(last[i : i + 1], dense_k[i], dense_v[i], SINKS, window, 0.25)[0]
                        for i in range(2)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # The sinks take probability away: without them the output differs.
    plain = ref.decode_attention(last, kc, vc, tables, seq_lens, 0.25, window)
    assert not torch.allclose(plain, got, atol=1e-3)


def run_prefill(dtype: torch.dtype, lens: list[int], q_lens: list[int], window: int | None, tiles: str,
                head_dim: int = 32, softcap: float | None = None) -> None:
    kc, vc, tables, _, _ = paged_setup(lens, 16, 2, head_dim)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q = torch.randn(sum(q_lens), 4, head_dim).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    want = ref.prefill_attention(q.float(), kc.float(), vc.float(), tables, cu, seq_lens, scale, None, window,
                                 softcap, SINKS)
    got = tri.prefill_attention(q, kc, vc, tables, cu, seq_lens, scale, max(q_lens), window, softcap, SINKS,
                                tiles=tiles)
    close(got, want, dtype)


def run_decode(dtype: torch.dtype, lens: list[int], window: int | None, tiles: str, num_splits: int | None,
               head_dim: int = 32) -> None:
    kc, vc, tables, _, _ = paged_setup(lens, 16, 2, head_dim)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q = torch.randn(len(lens), 4, head_dim).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    want = ref.decode_attention(q.float(), kc.float(), vc.float(), tables, seq_lens, scale, window, None, SINKS)
    got = tri.decode_attention(q, kc, vc, tables, seq_lens, scale, window, None, SINKS, num_splits=num_splits,
                               tiles=tiles)
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 8, 17])
def test_prefill_sinks_small_tiles(dtype: torch.dtype, window: int | None) -> None:
    # A whole 50-token prompt, a 13-row chunk after 32 cached keys, a short prompt.
    run_prefill(dtype, [50, 45, 9], [50, 13, 9], window, "small")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 48])
def test_prefill_sinks_gpu_tiles(dtype: torch.dtype, window: int | None) -> None:
    run_prefill(dtype, [200, 90], [70, 90], window, "gpu", head_dim=64)


def test_prefill_sinks_with_softcap() -> None:
    run_prefill(torch.float32, [50, 9], [20, 9], 8, "small", softcap=5.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
def test_decode_sinks_small_tiles(dtype: torch.dtype, window: int | None, num_splits: int | None) -> None:
    # Contexts of one key, one page, one past it, many pages; 8 forced splits leave some segments empty.
    run_decode(dtype, [1, 16, 17, 300], window, "small", num_splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 100])
def test_decode_sinks_gpu_tiles(dtype: torch.dtype, window: int | None) -> None:
    run_decode(dtype, [1, 81, 300], window, "gpu", 4, head_dim=64)


def test_decode_sink_counted_once_across_splits() -> None:
    # The same query over 1 and 8 segments gives the same output; only the reduce kernel takes the sinks.
    kc, vc, tables, _, _ = paged_setup([300], 16, 2, 32)
    q = torch.randn(1, 4, 32)
    lens = torch.tensor([300], dtype=torch.int32)
    with recording(run=True) as launches:
        one = tri.decode_attention(q, kc, vc, tables, lens, 0.2, None, None, SINKS, num_splits=1, tiles="small")
        eight = tri.decode_attention(q, kc, vc, tables, lens, 0.2, None, None, SINKS, num_splits=8, tiles="small")
    torch.testing.assert_close(one, eight, atol=1e-6, rtol=1e-5)
    sink_switch = {launch.kernel.fn.__name__: launch.kwargs.get("SINKS") for launch in launches}
    assert sink_switch == {"decode_split_kernel": None, "decode_reduce_kernel": True}


def test_without_sinks_the_kernels_compile_what_they_did() -> None:
    # No sinks: the SINKS switch is off and the sinks pointer is None (a constexpr, no argument of the binary).
    kc, vc, tables, _, _ = paged_setup([20], 16, 2, 32)
    q = torch.randn(20, 4, 32)
    cu, lens = torch.tensor([0, 20], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    with recording() as launches:
        tri.prefill_attention(q, kc, vc, tables, cu, lens, 0.2, 20, tiles="small")
        tri.decode_attention(q[:1], kc, vc, tables, lens, 0.2, tiles="small")
    for launch in launches:
        names = launch.kernel.arg_names
        if "sinks_ptr" in names:
            assert launch.args[names.index("sinks_ptr")] is None and launch.kwargs["SINKS"] is False


def test_sinks_are_checked() -> None:
    kc, vc, tables, _, _ = paged_setup([4], 16, 1, 16)
    q, lens = torch.zeros(1, 2, 16), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="sinks"):
        tri.decode_attention(q, kc, vc, tables, lens, 1.0, None, None, torch.zeros(3))
    with pytest.raises(ValueError, match="sinks"):
        tri.decode_attention(q, kc, vc, tables, lens, 1.0, None, None, torch.zeros(2, dtype=torch.float16))
