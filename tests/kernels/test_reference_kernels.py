"""The torch reference kernels against dense, obviously-correct computations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tritium.kernels import reference as ref

from support.builders import paged_setup


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [nq, H, D] as the last nq positions of k/v [n, KVH, D]; plain softmax(QK^T)V, causal."""
    nq, n = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(n - nq, n)[:, None]
    scores = scores.masked_fill(torch.arange(n)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_attention_matches_dense(heads: int, kv_heads: int, block_size: int) -> None:
    lens = [1, block_size, block_size + 1, 45]
    q_lens = [1, block_size, 3, 45]  # seq 2 is a prefix-cache hit / chunk: queries only at the end
    kc, vc, tables, ks, vs = paged_setup(lens, block_size, kv_heads, 32)
    g = torch.Generator().manual_seed(1)
    qs = [torch.randn(n, heads, 32, generator=g) for n in q_lens]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = ref.prefill_attention(torch.cat(qs), kc, vc, tables, cu, torch.tensor(lens, dtype=torch.int32), 0.17)
    expected = torch.cat([dense_attention(q, k, v, 0.17) for q, k, v in zip(qs, ks, vs, strict=True)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_decode_attention_matches_dense(heads: int, kv_heads: int) -> None:
    lens = [1, 16, 17, 100]
    kc, vc, tables, ks, vs = paged_setup(lens, 16, kv_heads, 64)
    q = torch.randn(len(lens), heads, 64)
    out = ref.decode_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    expected = torch.cat([dense_attention(q[i : i + 1], ks[i], vs[i], 0.125) for i in range(len(lens))])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_store_kv_skips_negative_slots() -> None:
    kc = torch.zeros(2, 4, 1, 2)
    vc = torch.zeros_like(kc)
    k = torch.arange(6.0).reshape(3, 1, 2)
    ref.store_kv(k, -k, kc, vc, torch.tensor([5, -1, 0]))
    assert kc.view(8, 1, 2)[5].tolist() == [[0.0, 1.0]]
    assert kc.view(8, 1, 2)[0].tolist() == [[4.0, 5.0]]
    assert vc.view(8, 1, 2)[0].tolist() == [[-4.0, -5.0]]
    assert int((kc != 0).sum()) == 3  # row 1 (slot -1) went nowhere


def test_rms_norm_with_and_without_residual() -> None:
    x, r, w = torch.randn(5, 8), torch.randn(5, 8), torch.randn(8)
    expected = w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6), expected)
    normed, resid = ref.rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(resid, x + r)
    torch.testing.assert_close(normed, ref.rms_norm(x + r, w, 1e-6))


def test_rotary_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_dim, positions = 16, torch.tensor([0, 3, 7, 100])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(128).float(), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    q, k = torch.randn(4, 3, head_dim), torch.randn(4, 1, head_dim)
    emb = torch.cat([freqs, freqs], dim=-1)[positions]
    eq, ek = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=1)
    ref.rotary_embedding(q, k, positions, cache)
    torch.testing.assert_close(q, eq)
    torch.testing.assert_close(k, ek)


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    torch.testing.assert_close(ref.silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


@pytest.mark.parametrize("window", [1, 15, 16, 40])
def test_windowed_decode_reads_only_the_blocks_holding_the_window(window: int) -> None:
    """The CPU path's decode with a window: pages wholly before each sequence's window are poisoned (NaN) and
    never read, and the result is the dense window's attention."""
    lens = [3, 37, 90, 64]
    kc, vc, tables, dense_k, dense_v = paged_setup(lens, 16, 2, 32, seed=3)
    used = [-(-n // 16) for n in lens]
    spare = (set(range(kc.shape[0])) - {int(b) for i, n in enumerate(used) for b in tables[i, :n]}).pop()
    for i, n in enumerate(used):
        tables[i, n:] = spare  # the padding points at a page no sequence owns (paged_setup's is block 0)
    q = torch.randn(len(lens), 4, 32)
    want = torch.stack([dense_attention(q[i : i + 1], dense_k[i][-window:], dense_v[i][-window:], 32**-0.5)[0]
                        for i in range(len(lens))])
    for i, n in enumerate(lens):
        for page in range(max(n - window, 0) // 16):
            kc[tables[i, page]] = float("nan")
            vc[tables[i, page]] = float("nan")
    got = ref.decode_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), 32**-0.5, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
