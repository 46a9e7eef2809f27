"""What the benchmarks (and gpu-check) send: prompt sets, request lists, schemas and kernel inputs.

Every builder is deterministic for its seed, so two runs (or a benchmark and a check) send the same thing.
Token-id prompts use the default tokenizer's ordinary tokens (ids from FIRST_NORMAL_ID up; below are its
special tokens); text prompts are built from them or from plain words.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tritium.backend.tokenizer import Tokenizer

DEFAULT_VOCAB = 49152  # the default model's (SmolLM2-135M) vocabulary
FIRST_NORMAL_ID = 17  # its first id that is not a special token
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards"]
QUESTIONS = ["What is {a} plus {b}?", "Name {a} colours and {b} animals.", "Count from {a} to {b}.",
             "Why is {a} smaller than {b}?", "Write {a} words about the number {b}."]
KV_BLOCK_SIZE = 16

# Kernel shapes: (head_dim, batch, seqlen) for prefill, (head_dim, batch, context) for decode.
PREFILL_GRID = [(hd, b, s) for hd in (64, 128) for b, s in
                ((1, 512), (1, 1024), (1, 2048), (1, 4096), (1, 8192), (4, 2048), (16, 1024))]
DECODE_GRID = [(hd, b, c) for hd in (64, 128) for b in (1, 8, 32, 64, 128) for c in (1024, 4096)]
SMOKE_PREFILL_GRID = [(64, 1, 32), (64, 1, 64)]
SMOKE_DECODE_GRID = [(64, 1, 64), (64, 2, 64)]


# ---------------------------------------------------------------- token-id and text prompts


def random_token_prompts(n: int, lo: int, hi: int, vocab: int = DEFAULT_VOCAB, first_normal_id: int = FIRST_NORMAL_ID,
                         seed: int = 0) -> list[list[int]]:
    """`n` prompts of random ordinary token ids, lengths spread evenly over [lo, hi] (torch's generator,
    seeded: the same ids on every machine)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = [round(lo + (hi - lo) * i / max(1, n - 1)) for i in range(n)]
    return [torch.randint(first_normal_id, vocab, (n_tok,), generator=g).tolist() for n_tok in lengths]


def random_text(tokenizer: Tokenizer, tokens: int, rng: random.Random) -> str:
    """The decoded text of `tokens` random ordinary tokens drawn from `rng`."""
    return tokenizer.decode([rng.randrange(FIRST_NORMAL_ID, tokenizer.vocab_size) for _ in range(tokens)])


def synthetic_prompts(n: int, input_len: int, seed: int = 0) -> list[str]:
    """`n` text prompts of about `input_len` tokens of the default tokenizer (random ordinary tokens)."""
    from tritium.backend.models.registry import resolve_model
    from tritium.backend.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(None))
    rng = random.Random(seed)
    return [random_text(tokenizer, input_len, rng) for _ in range(n)]


def group_prefixes(tokenizer: Tokenizer, groups: int, prefix_tokens: int, seed: int) -> list[str]:
    """`groups` "system" texts of ~`prefix_tokens` random ordinary tokens, each naming its group first."""
    rng = random.Random(seed)
    return [f"System notes for team {seed}-{g}.\n{random_text(tokenizer, prefix_tokens, rng)}\n" for g in range(groups)]


def shared_prefix_prompts(prefixes: list[str], n: int, seed: int) -> list[str]:
    """Prompt i: prefix i % len(prefixes) + a short question unique to i (groups interleave in send order)."""
    rng = random.Random(seed + 10_000)
    prompts = []
    for i in range(n):
        question = rng.choice(QUESTIONS).format(a=rng.randrange(2, 99), b=rng.randrange(100, 999))
        prompts.append(f"{prefixes[i % len(prefixes)]}Question {i}: {question}\nAnswer:")
    return prompts


@dataclass
class SharedPrefixWorkload:
    """`num_requests` streamed completions of `output_len` tokens at `concurrency`, prompts in `groups` groups
    sharing a prefix of ~`prefix_tokens` tokens (`model`: the model folder, None for the default model)."""

    model: str | None = None
    concurrency: int = 16
    num_requests: int = 64
    output_len: int = 32
    prefix_tokens: int = 256
    groups: int = 4

    def prompts(self, tokenizer: Tokenizer, seed: int, groups: int | None = None, n: int | None = None) -> list[str]:
        """The prompts for `seed`: `n` (default num_requests) of them over `groups` (default self.groups)
        prefixes drawn for that seed."""
        prefixes = group_prefixes(tokenizer, groups or self.groups, self.prefix_tokens, seed)
        return shared_prefix_prompts(prefixes, self.num_requests if n is None else n, seed)


def big_prompt(kib: int, salt: int) -> str:
    """About `kib` KiB of plain words, different for each `salt` (a prompt whose tokenization is the work)."""
    words, size, i = [], 0, salt
    while size < kib * 1024:
        word = WORDS[i % len(WORDS)] + str(i % 97)
        words.append(word)
        size += len(word) + 1
        i += 7
    return " ".join(words)


# ---------------------------------------------------------------- structured output


def json_schema_prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    """Token ids of `n` chat-templated requests; request i asks for a JSON object of schema
    i % len(SCHEMAS) (bench/schemas.py) and nothing else."""
    from tritium.client.bench.schemas import SCHEMAS

    prompts = []
    for i in range(n):
        subject = SCHEMAS[i % len(SCHEMAS)][0].replace("_", " ")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a JSON object describing a {subject}. Reply with the JSON only."}],
            True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def wide_schema(kib: int, tag: str) -> dict[str, Any]:
    """About `kib` KiB of schema: optional string properties named apart by `tag` (the shape whose compiled
    grammar is largest per byte)."""
    n = kib * 1024 // 40
    return {"type": "object", "properties": {f"p{tag}_{i:05d}_xxxx": {"type": "string"} for i in range(n)}}


def nested_schema(kib: int, tag: str) -> dict[str, Any]:
    """About `kib` KiB of schema: objects of ten integers (two required), named apart by `tag` (slow to
    compile)."""
    n = kib * 1024 // 340
    fields = {f"a{k}": {"type": "integer"} for k in range(10)}
    return {"type": "object", "properties": {f"o{tag}_{i}": {"type": "object", "properties": fields,
                                                              "required": ["a0", "a1"]} for i in range(n)}}


# ---------------------------------------------------------------- kernels


def kernel_grids(smoke: bool) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """The kernel benchmark's (prefill, decode) shapes: tiny ones for the interpreter when `smoke`."""
    return (SMOKE_PREFILL_GRID, SMOKE_DECODE_GRID) if smoke else (PREFILL_GRID, DECODE_GRID)


def paged_cache(lengths: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
                block_size: int = KV_BLOCK_SIZE, spare_blocks: int = 0,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key cache, value cache, block tables): random K/V caches of shape [blocks, block_size, kv_heads,
    head_dim] holding every sequence of `lengths` (plus `spare_blocks` unused blocks), its blocks scattered
    by a permutation; table row i lists sequence i's blocks (int32, zero-padded)."""
    import torch

    blocks = [-(-n // block_size) for n in lengths]
    total = sum(blocks) + spare_blocks
    key_cache = torch.randn(total, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    perm = torch.randperm(total, device=device).to(torch.int32)
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[start : start + n]
        start += n
    return key_cache, value_cache, table
