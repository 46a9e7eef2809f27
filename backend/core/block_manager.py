"""Paged KV-cache bookkeeping: blocks, ref counts, prefix caching (docs/architecture.md, "The engine step").

A freed block keeps its hash on the LRU free list until it is reused; unhashed blocks are reused first."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from tritium.backend.core.sequence import Sequence


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """16-byte hash of a full block; `parent`: the previous block's hash, or the sequence's `cache_key`."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references, cached ones included."""
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the blocks of `seq`'s longest cached prefix (it holds none yet), leaving at least one token to
        compute; returns the tokens served from the cache."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        self.prefix_queried_tokens += seq.num_tokens
        parent = seq.cache_key
        for i in range(max_blocks):
            h = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            block = self.cached.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            parent = h
        hit = len(seq.block_table) * bs
        seq.num_computed_tokens = hit
        self.prefix_hit_tokens += hit
        return hit

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Blocks for `num_new_tokens` more tokens of `seq`; False, allocating nothing, when too few are free."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            block, _ = self.free.popitem(last=False)
            old = self.hashes[block]
            if old is not None:
                self.hashes[block] = None
                if self.cached.get(old) == block:
                    del self.cached[old]
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash `seq`'s newly full blocks of computed tokens into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_key
            h = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if self.hashes[block] is None and h not in self.cached:
                self.hashes[block] = h
                self.cached[h] = block

    def trim(self, seq: Sequence, extra: int = 0) -> None:
        """Free `seq`'s blocks beyond its tokens plus `extra` positions (rejected drafts' or unused lookahead's).
        The table becomes a new list, so its device row rewrites itself."""
        keep = self.blocks_needed(seq.num_tokens + extra)
        if len(seq.block_table) <= keep:
            return
        for block in reversed(seq.block_table[keep:]):
            self._unref(block)
        seq.block_table = seq.block_table[:keep]

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None
            if self.hashes[block] is None:
                self.free.move_to_end(block, last=False)

    def free_sequence(self, seq: Sequence) -> None:
        """Drop `seq`'s blocks (tail first, so the tail is evicted first) and its computed tokens."""
        for block in reversed(seq.block_table):
            self._unref(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
