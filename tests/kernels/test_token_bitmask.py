"""apply_token_bitmask: the plain-torch reference against a loop over the definition, and the Triton kernel
(under TRITON_INTERPRET=1, set by conftest.py) against the reference, bit for bit.

Logits are compared through their integer bits, so NaN payloads, -0.0 and infinities count too: allowed
tokens and untouched rows must keep their exact bits.
"""

from __future__ import annotations

import pytest
import torch

from tritium.kernels import reference as ref
from tritium.kernels.token_bitmask import BLOCK_W
from tritium.kernels.token_bitmask import apply_token_bitmask as tri_apply

NEG_INF = float("-inf")
BITS = {4: torch.int32, 2: torch.int16, 8: torch.int64}


def naive_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The definition: token t of logits row rows[r] stays iff bit t % 32 of word t // 32 of bitmask row r
    is set (t < 32 * W); otherwise it becomes -inf."""
    words = bitmask.tolist()
    for r, row in enumerate(rows.tolist()):
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= len(words[r]) or not (words[r][w] >> (t % 32)) & 1:
                logits[row, t] = NEG_INF


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(BITS[x.element_size()])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    diff = (bits(actual) != bits(expected)).nonzero().tolist()
    assert not diff, f"{len(diff)} logits differ, first at {diff[:5]}"


def make_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random logits with special values sprinkled in: -0.0, +-inf, NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    flat = x.view(-1)
    picks = torch.randperm(flat.numel(), generator=g)[: 4 * 4]
    for i, value in enumerate((-0.0, float("inf"), NEG_INF, float("nan"))):
        flat[picks[4 * i : 4 * i + 4]] = value
    return x


def make_bitmask(rows: int, words: int, seed: int = 0) -> torch.Tensor:
    """Random int32 words (every bit pattern, the sign bit included); row 0 allows nothing, row 1 everything."""
    g = torch.Generator().manual_seed(seed + 1)
    m = torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int64, generator=g).to(torch.int32)
    if rows > 0:
        m[0] = 0
    if rows > 1:
        m[1] = -1
    return m


# (vocab, words): V not a multiple of 32 with 32W > V; 32W < V (the tail past the bitmask is masked);
# 32W == V; a bitmask far shorter than the vocabulary.
SHAPES = [(100, 4), (100, 3), (96, 3), (70, 1)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("vocab,words", SHAPES)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
def test_reference_matches_the_definition(vocab: int, words: int, dtype: torch.dtype) -> None:
    logits = make_logits(7, vocab, dtype)
    bitmask = make_bitmask(4, words)
    rows = torch.tensor([5, 0, 3, 6])  # a subset, out of order
    expected = logits.clone()
    naive_apply(expected, bitmask, rows)
    actual = logits.clone()
    ref.apply_token_bitmask(actual, bitmask, rows)
    assert_same_bits(actual, expected)
    assert bool((actual[5] == NEG_INF).all())  # bitmask row 0 allows nothing
    assert_same_bits(actual[0, : 32 * words], logits[0, : 32 * words])  # row 1 allows every packed token


@pytest.mark.parametrize("chunk", [64, 1 << 20])
def test_reference_runs_of_rows_and_chunks(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    # Runs of consecutive rows are updated as one view; a chunk of 64 tokens unpacks one bitmask row at a time.
    monkeypatch.setattr(ref, "_MASK_CHUNK", chunk)
    logits = make_logits(10, 50, torch.float32)
    bitmask = make_bitmask(8, 2)
    rows = torch.tensor([3, 4, 5, 0, 1, 9, 7, 8], dtype=torch.int32)
    expected = logits.clone()
    naive_apply(expected, bitmask, rows)
    actual = logits.clone()
    ref.apply_token_bitmask(actual, bitmask, rows)
    assert_same_bits(actual, expected)


def test_reference_strided_inputs_and_duplicate_rows() -> None:
    logits = make_logits(40, 6, torch.float32).t()  # [6, 40], tokens strided
    bitmask = make_bitmask(5, 4)[:, ::2]  # [5, 2], words strided
    rows = torch.tensor([2, 2, 0, 5, 1])  # row 2 twice: both masks apply
    expected = logits.clone()
    naive_apply(expected, bitmask, rows)
    actual = logits.clone()
    ref.apply_token_bitmask(actual, bitmask, rows)
    assert_same_bits(actual, expected)
    dense = logits.contiguous()
    ref.apply_token_bitmask(dense, bitmask, rows)
    assert_same_bits(dense, expected)


# The Triton kernel: V > 32 * BLOCK_W so rows span several programs, with the same cases as above.
VOCAB = 32 * BLOCK_W * 2 + 37
TRITON_SHAPES = [(VOCAB, -(-VOCAB // 32)), (VOCAB, VOCAB // 32 - 20), (VOCAB, VOCAB // 32 + 40), (VOCAB, 1)]


@pytest.mark.parametrize("vocab,words", TRITON_SHAPES, ids=["tail_word", "short_mask", "long_mask", "one_word"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_matches_the_reference(vocab: int, words: int, dtype: torch.dtype) -> None:
    logits = make_logits(6, vocab, dtype)
    bitmask = make_bitmask(4, words)
    rows = torch.tensor([4, 1, 5, 0], dtype=torch.int32)
    expected = logits.clone()
    ref.apply_token_bitmask(expected, bitmask, rows)
    actual = logits.clone()
    tri_apply(actual, bitmask, rows)
    assert_same_bits(actual, expected)
    assert bool((actual[4] == NEG_INF).all())
    for untouched in (2, 3):
        assert_same_bits(actual[untouched], logits[untouched])


def test_triton_fp16_int64_rows_permutation_and_staging_views() -> None:
    # Every row, permuted, as int64; then int32 rows read from a view at an odd offset of a staging buffer,
    # with a bitmask that is a slice of a bigger one and logits rows with a padded stride.
    vocab, words = 2100, 66
    logits = make_logits(3, vocab, torch.float16, seed=3)
    bitmask = make_bitmask(3, words, seed=3)
    rows = torch.tensor([2, 0, 1])
    expected = logits.clone()
    ref.apply_token_bitmask(expected, bitmask, rows)
    actual = logits.clone()
    tri_apply(actual, bitmask, rows)
    assert_same_bits(actual, expected)

    padded = torch.zeros(5, vocab + 44)
    padded[:, :vocab] = make_logits(5, vocab, torch.float32, seed=4)
    logits = padded[:, :vocab]
    staging = torch.zeros(16, dtype=torch.int32)
    staging[7:9] = torch.tensor([3, 1], dtype=torch.int32)
    big = make_bitmask(5, words, seed=4)
    expected = logits.clone()
    ref.apply_token_bitmask(expected, big[3:5], staging[7:9])
    before = padded.clone()
    tri_apply(logits, big[3:5], staging[7:9])
    assert_same_bits(logits, expected)
    assert_same_bits(padded[:, vocab:], before[:, vocab:])  # the padding past V is not written


@pytest.mark.parametrize("apply", [ref.apply_token_bitmask, tri_apply], ids=["reference", "triton"])
def test_no_rows_is_a_no_op(apply) -> None:  # type: ignore[no-untyped-def]
    logits = make_logits(3, 100, torch.float32)
    before = logits.clone()
    apply(logits, torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert_same_bits(logits, before)


@pytest.mark.parametrize("apply", [ref.apply_token_bitmask, tri_apply], ids=["reference", "triton"])
def test_untouched_rows_and_allowed_tokens_keep_their_bits(apply) -> None:  # type: ignore[no-untyped-def]
    # Logits of random bit patterns (NaNs with payloads, subnormals, -0.0 ...), everything allowed in row 3,
    # nothing in row 0; rows 1, 2 and 4 are not listed.
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(-(2**31), 2**31, (5, 300), dtype=torch.int64, generator=g).to(torch.int32)
    logits = raw.view(torch.float32)
    before = logits.clone()
    bitmask = torch.stack([torch.zeros(10, dtype=torch.int32), torch.full((10,), -1, dtype=torch.int32)])
    apply(logits, bitmask, torch.tensor([0, 3]))
    assert bool((logits[0] == NEG_INF).all())
    for row in (1, 2, 3, 4):
        assert_same_bits(logits[row], before[row])


def test_triton_duplicate_rows_get_both_masks() -> None:
    logits = make_logits(2, 200, torch.float32)
    bitmask = make_bitmask(3, 7, seed=5)
    rows = torch.tensor([1, 0, 1])
    expected = logits.clone()
    naive_apply(expected, bitmask, rows)
    actual = logits.clone()
    tri_apply(actual, bitmask, rows)
    assert_same_bits(actual, expected)


def test_triton_checks_tiles_and_inputs() -> None:
    logits = torch.zeros(2, 64)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="tiles"):
        tri_apply(logits, bitmask, torch.zeros(1, dtype=torch.int32), tiles="big")
    with pytest.raises(AssertionError, match="int32"):
        tri_apply(logits, bitmask.long(), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(AssertionError, match="bitmask rows"):
        tri_apply(logits, bitmask, torch.zeros(2, dtype=torch.int32))
    for tiles in ("gpu", "small"):
        tri_apply(logits, bitmask, torch.zeros(1, dtype=torch.int32), tiles=tiles)
        assert bool((logits[0] == NEG_INF).all()) and bool((logits[1] == 0).all())
