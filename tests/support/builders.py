"""Small builders the tests share: a scheduler sequence, paged KV caches filled with random contexts."""

from __future__ import annotations

import torch

from tritium.backend.core.sequence import Sequence
from tritium.backend.sampling_params import SamplingParams
from tritium.kernels import reference as ref


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, None, tokens, SamplingParams(max_tokens=1000), 0)


def paged_setup(lens: list[int], block_size: int, kv_heads: int, head_dim: int, seed: int = 0):
    """Random contexts written into scattered blocks; returns caches, block tables and dense K/V."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    kc = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    vc = torch.zeros_like(kc)
    tables, dense_k, dense_v = [], [], []
    for n, nb in zip(lens, blocks_per_seq, strict=True):
        table = [perm.pop() for _ in range(nb)]
        tables.append(table + [0] * (max(blocks_per_seq) - nb))
        k = torch.randn(n, kv_heads, head_dim, generator=g)
        v = torch.randn(n, kv_heads, head_dim, generator=g)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        ref.store_kv(k, v, kc, vc, slots)
        dense_k.append(k)
        dense_v.append(v)
    return kc, vc, torch.tensor(tables, dtype=torch.int32), dense_k, dense_v
