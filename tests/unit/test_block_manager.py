"""BlockManager: allocation, ref counts, prefix caching and LRU reuse."""

from __future__ import annotations

from tritium.backend.core.block_manager import BlockManager
from tritium.backend.core.sequence import Sequence

from support.builders import seq


def compute_all(bm: BlockManager, s: Sequence) -> None:
    assert bm.allocate(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)


def test_allocate_and_free_returns_every_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(list(range(10)))
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 1
    assert not bm.allocate(seq(list(range(8)), "b"), 8)  # needs 2, only 1 free
    assert bm.num_free_blocks == 1  # a failed allocation takes nothing
    bm.free_sequence(s)
    assert bm.num_free_blocks == 4 and s.block_table == [] and s.num_computed_tokens == 0


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(12)), "a")
    compute_all(bm, a)
    b = seq(list(range(12)), "b")  # identical prompt: 3 full blocks, but the last token is recomputed
    assert bm.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    c = seq([*range(8), 99, 98, 97, 96, 95], "c")  # diverges in the 3rd block
    assert bm.match_prefix(c) == 8
    d = seq([1, *range(1, 12)], "d")  # differs in the first token: chained hashes must miss
    assert bm.match_prefix(d) == 0
    for s in (a, b, c):
        bm.free_sequence(s)
    assert bm.num_free_blocks == 8


def test_freed_cached_blocks_are_reused_after_unhashed_ones_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4], "a")
    compute_all(bm, a)
    bm.free_sequence(a)
    # Both blocks are cached and free; a new sequence gets the never-hashed blocks first.
    b = seq([7, 8, 9, 10], "b")
    assert bm.allocate(b, 4)
    assert not set(b.block_table) & set(a.block_table or [])
    again = seq([1, 2, 3, 4, 5], "again")
    assert bm.match_prefix(again) == 4  # still cached
    bm.free_sequence(again)
    bm.free_sequence(b)
    # Pressure: allocating all 4 blocks evicts the cached ones, and their hashes go too.
    big = seq(list(range(100, 108)), "big")
    assert bm.allocate(big, 8)
    assert bm.cached == {}
    bm.free_sequence(big)
    assert bm.num_free_blocks == 4


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5], "a")
    compute_all(bm, a)
    assert bm.match_prefix(seq([1, 2, 3, 4, 5], "b")) == 0
