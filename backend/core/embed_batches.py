"""How embedding inputs are split into forward passes (docs/architecture.md, "Embeddings")."""

from __future__ import annotations


def embedding_batches(lengths: list[int], max_tokens: int, max_seqs: int, block_size: int,
                      free_blocks: int) -> list[list[int]]:
    """Indices of `lengths` in order, cut into passes of at most `max_tokens` tokens, `max_seqs` sequences and
    `free_blocks` KV blocks; an input longer than `max_tokens` runs alone. Raises ValueError naming an input whose
    blocks alone exceed `free_blocks`."""
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = blocks = 0
    for i, n in enumerate(lengths):
        need = -(-n // block_size)
        if need > free_blocks:
            raise ValueError(f"input {i} ({n} tokens) needs {need} KV blocks; {free_blocks} are free")
        if current and (tokens + n > max_tokens or len(current) == max_seqs or blocks + need > free_blocks):
            batches.append(current)
            current, tokens, blocks = [], 0, 0
        current.append(i)
        tokens += n
        blocks += need
    if current:
        batches.append(current)
    return batches
