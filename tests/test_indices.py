"""attn/indices.py: causal top-k indices, per document for packed batches too."""

from __future__ import annotations

import numpy as np
import pytest

from paddlefleet.tilelang_ops.attn import indices as indices_mod
from paddlefleet.tilelang_ops.attn.indices import (
    causal_topk_indices,
    cu_seqlens_from_lengths,
    varlen_causal_topk_indices,
)


def check_rows(idx, S, S_kv, topk, rows=None):
    """Every row: distinct keys in [0, p], -1 only as trailing padding, exactly min(topk, p+1)."""
    B = idx.shape[0]
    for b in range(B):
        for s in range(S) if rows is None else rows:
            row = idx[b, s]
            p = S_kv - S + s
            n = min(topk, p + 1)
            keys = row[:n]
            assert (keys >= 0).all() and (keys <= p).all(), (b, s, row)
            assert len(np.unique(keys)) == n, (b, s, row)
            assert (row[n:] == -1).all(), (b, s, row)


@pytest.mark.parametrize(
    "B,S,S_kv,topk",
    [(1, 8, 8, 3), (2, 5, 9, 4), (2, 6, 6, 6), (1, 4, 10, 16), (3, 7, 20, 7), (1, 1, 1, 1)],
)
def test_causal_distinct_padded(B, S, S_kv, topk):
    idx = causal_topk_indices(B, S, S_kv, topk, seed=7)
    assert idx.shape == (B, S, topk) and idx.dtype == np.int32
    check_rows(idx, S, S_kv, topk)


def test_many_chunks(monkeypatch):
    """The generator draws rows in chunks; a tiny budget (one row per chunk) keeps every rule."""
    monkeypatch.setattr(indices_mod, "_ROW_BUDGET_ELEMS", 1)
    idx = causal_topk_indices(2, 9, 12, 5, seed=3)
    check_rows(idx, 9, 12, 5)


def test_full_size_rows():
    """The benchmark shape (S=4096, S_kv=8192, topk=2048): checked on a sample of rows."""
    S, S_kv, topk = 4096, 8192, 2048
    idx = causal_topk_indices(1, S, S_kv, topk, seed=0)
    assert idx.shape == (1, S, topk)
    check_rows(idx, S, S_kv, topk, rows=[0, 1, 2047, 4095])
    assert (idx >= 0).all()  # every row sees >= 4097 keys: no padding


def test_early_rows_pad_with_minus_one():
    idx = causal_topk_indices(1, 8, 8, 4, seed=1)
    # Row s sees s + 1 keys: rows 0..2 are short.
    for s in range(3):
        assert sorted(idx[0, s, : s + 1]) == list(range(s + 1))
        assert (idx[0, s, s + 1 :] == -1).all()


def test_seed_and_dtype():
    a = causal_topk_indices(2, 16, 32, 8, seed=5)
    np.testing.assert_array_equal(a, causal_topk_indices(2, 16, 32, 8, seed=5))
    assert not np.array_equal(a, causal_topk_indices(2, 16, 32, 8, seed=6))
    b = causal_topk_indices(2, 16, 32, 8, seed=5, dtype="int64")
    assert b.dtype == np.int64
    np.testing.assert_array_equal(a, b)


def test_keys_are_uniform_and_order_is_random():
    """Each visible key of a row is chosen with probability topk / (p + 1), and the first slot
    is not biased towards small keys (the kernels must not rely on sorted indices)."""
    B, S, S_kv, topk = 400, 1, 16, 4  # one row per batch, 16 visible keys
    idx = causal_topk_indices(B, S, S_kv, topk, seed=11)
    counts = np.bincount(idx.reshape(-1), minlength=S_kv)
    expected = B * topk / S_kv  # 100 per key
    # Binomial(400, 1/4) sd ~ 8.7; +-40 is > 4.5 sd (a fixed seed makes this deterministic).
    assert np.abs(counts - expected).max() < 40, counts
    first = np.bincount(idx[:, 0, 0], minlength=S_kv)  # 25 expected per key, sd ~4.8
    assert np.abs(first - B / S_kv).max() < 22, first
    assert not (np.diff(idx[:, 0, :], axis=-1) > 0).all()  # not sorted


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        (dict(batch=0), ValueError, "^batch: expected a positive int, got 0"),
        (dict(seq_len=-1), ValueError, "^seq_len: expected a positive int, got -1"),
        (dict(topk=2.0), TypeError, "^topk: expected a positive Python int, got float"),
        (dict(seq_len_kv=True), TypeError, "^seq_len_kv: expected a positive Python int, got bool"),
        (dict(seq_len=9, seq_len_kv=8), ValueError, "^seq_len_kv: expected seq_len_kv >= seq_len=9"),
        (dict(seed=1.5), TypeError, "^seed: expected a Python int, got float"),
        (dict(seed=-1), ValueError, "^seed: expected an int >= 0, got -1"),
        (dict(dtype="int16"), ValueError, "^dtype: expected 'int32' or 'int64', got 'int16'"),
        (dict(dtype=np.int32), TypeError, "^dtype: expected 'int32' or 'int64', got type"),
    ],
)
def test_bad_arguments(kwargs, exc, pattern):
    args = dict(batch=1, seq_len=4, seq_len_kv=8, topk=2)
    args.update({k: v for k, v in kwargs.items() if k in args})
    extra = {k: v for k, v in kwargs.items() if k not in args}
    with pytest.raises(exc, match=pattern):
        causal_topk_indices(
            args["batch"], args["seq_len"], args["seq_len_kv"], args["topk"], **extra
        )


# --- packed documents ------------------------------------------------------------------------
def test_cu_seqlens_from_lengths():
    cu = cu_seqlens_from_lengths([100, 412, 0, 1])
    assert cu.dtype == np.int32
    np.testing.assert_array_equal(cu, [0, 100, 512, 512, 513])
    np.testing.assert_array_equal(cu_seqlens_from_lengths((7,)), [0, 7])


@pytest.mark.parametrize(
    "lengths,exc,pattern",
    [
        ([], ValueError, "^lengths: expected at least one document length, got none"),
        ("12", TypeError, "^lengths: expected a sequence of ints, got str"),
        (5, TypeError, "^lengths: expected a sequence of ints, got int"),
        ([3, 2.0], TypeError, r"^lengths\[1\]: expected a Python int, got float"),
        ([3, 4, -1], ValueError, r"^lengths\[2\]: expected a length >= 0, got -1"),
        ([0, 0], ValueError, "^lengths: expected a total of 1 .. 2147483647 tokens.*got 0"),
        ([2**31 - 1, 1], ValueError, "^lengths: expected a total of 1 .. 2147483647.*2147483648"),
    ],
)
def test_cu_seqlens_from_lengths_errors(lengths, exc, pattern):
    with pytest.raises(exc, match=pattern):
        cu_seqlens_from_lengths(lengths)


def check_documents(idx, cu, topk):
    """Every row's keys lie in its own document, causal there: the rules of check_rows on
    each document's block, shifted to start at 0."""
    assert idx.shape == (1, int(cu[-1]), topk)
    for d in range(len(cu) - 1):
        a, b = int(cu[d]), int(cu[d + 1])
        block = idx[:, a:b]
        shifted = np.where(block >= 0, block - a, -1)
        check_rows(shifted, b - a, b - a, topk)


@pytest.mark.parametrize(
    "lengths,topk",
    [([1, 23, 0, 7, 2, 40], 8), ([5], 5), ([3, 3, 3], 16), ([1, 1, 1, 1], 1), ([0, 9, 0], 4),
     ([200, 3, 61], 32)],
)
def test_varlen_rows_stay_in_their_document(rng, lengths, topk):
    cu = cu_seqlens_from_lengths(lengths)
    seed = int(rng.integers(1 << 30))
    idx = varlen_causal_topk_indices(cu, topk, seed=seed)
    assert idx.dtype == np.int32
    check_documents(idx, cu, topk)
    # The first row of every non-empty document sees only itself.
    for d in range(len(lengths)):
        if lengths[d]:
            a = int(cu[d])
            assert idx[0, a, 0] == a and (idx[0, a, 1:] == -1).all()


def test_varlen_one_document_is_causal_topk_shape_and_rules(rng):
    """With one document the rules are those of causal_topk_indices (S = S_kv)."""
    S, topk = 30, 6
    idx = varlen_causal_topk_indices(np.array([0, S], np.int32), topk, seed=3)
    check_rows(idx, S, S, topk)


def test_varlen_seed_dtype_and_tensor_input():
    paddle = pytest.importorskip("paddle")
    cu = cu_seqlens_from_lengths([12, 5, 30])
    a = varlen_causal_topk_indices(cu, 8, seed=4)
    np.testing.assert_array_equal(a, varlen_causal_topk_indices(cu, 8, seed=4))
    assert not np.array_equal(a, varlen_causal_topk_indices(cu, 8, seed=5))
    b = varlen_causal_topk_indices(cu, 8, seed=4, dtype="int64")
    assert b.dtype == np.int64
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, varlen_causal_topk_indices(paddle.to_tensor(cu), 8, seed=4))
    # A document's block depends on its own length and position, not on the others' lengths.
    c = varlen_causal_topk_indices(cu_seqlens_from_lengths([12, 9, 30]), 8, seed=4)
    np.testing.assert_array_equal(a[:, :12], c[:, :12])


@pytest.mark.parametrize(
    "cu,kwargs,exc,pattern",
    [
        ([0, 4, 9], {}, TypeError, "^cu_seqlens: expected an int32 paddle.Tensor, torch.Tensor or "
                                   "numpy.ndarray"),
        (np.array([0, 4, 9]), {}, TypeError, "^cu_seqlens: expected dtype int32, got int64"),
        (np.array([2, 4, 9], np.int32), {}, ValueError,
         r"^cu_seqlens: expected cu_seqlens\[0\] == 0, got 2"),
        (np.array([0, 4, 3, 9], np.int32), {}, ValueError,
         r"^cu_seqlens: expected non-decreasing values, got cu_seqlens\[2\]=3 < cu_seqlens\[1\]=4"),
        (np.array([0], np.int32), {}, ValueError, r"^cu_seqlens: expected 1 dim \[num_docs \+ 1\]"),
        (np.array([0, 0], np.int32), {}, ValueError, "^cu_seqlens: expected cu_seqlens.-1. = S >= 1"),
        (np.array([0, 4], np.int32), dict(topk=0), ValueError, "^topk: expected a positive int"),
        (np.array([0, 4], np.int32), dict(seed=-2), ValueError, "^seed: expected an int >= 0"),
        (np.array([0, 4], np.int32), dict(seed=1.0), TypeError, "^seed: expected a Python int"),
        (np.array([0, 4], np.int32), dict(dtype="int8"), ValueError,
         "^dtype: expected 'int32' or 'int64', got 'int8'"),
    ],
)
def test_varlen_bad_arguments(cu, kwargs, exc, pattern):
    args = dict(topk=4)
    args.update(kwargs)
    topk = args.pop("topk")
    with pytest.raises(exc, match=pattern):
        varlen_causal_topk_indices(cu, topk, **args)


def test_sizes_it_cannot_make_are_refused_before_allocating():
    """A break-it session OOM-killed the process with seq_len_kv = 2^31 + 5: refuse instead."""
    with pytest.raises(ValueError, match="seq_len_kv: expected at most 2147483647"):
        causal_topk_indices(1, 1, 2**31 + 5, 1)
    with pytest.raises(ValueError, match="seq_len_kv: batch x max"):
        causal_topk_indices(1, 1, 2**31 + 5, 1, dtype="int64")
    with pytest.raises(TypeError, match="lengths"):
        cu_seqlens_from_lengths({1: 2})


# --- DeepSeek-V4: window + compressed keys ---------------------------------------------------
from paddlefleet.tilelang_ops.attn.indices import window_compressed_indices  # noqa: E402


def test_window_only_exact():
    idx = window_compressed_indices(5, window=3)
    assert idx.shape == (1, 5, 3) and idx.dtype == np.int32
    np.testing.assert_array_equal(
        idx[0], [[0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, 3], [2, 3, 4]])


def test_every_group_exact():
    """ratio 2, S = 6: groups j = 0, 1, 2 are keys 6, 7, 8; row s sees j < (s + 1) // 2."""
    idx = window_compressed_indices(6, window=3, ratio=2, batch=2, dtype="int64")
    assert idx.shape == (2, 6, 6) and idx.dtype == np.int64
    expected = [
        [0, -1, -1, -1, -1, -1],
        [0, 1, -1, 6, -1, -1],
        [0, 1, 2, 6, -1, -1],
        [1, 2, 3, 6, 7, -1],
        [2, 3, 4, 6, 7, -1],
        [3, 4, 5, 6, 7, 8],
    ]
    np.testing.assert_array_equal(idx[0], expected)
    np.testing.assert_array_equal(idx[1], expected)


def test_incomplete_last_group_has_no_key():
    """S = 7, ratio 3: two complete groups (keys 7, 8); token 6 belongs to none."""
    idx = window_compressed_indices(7, window=2, ratio=3)
    np.testing.assert_array_equal(idx[0], [
        [0, -1, -1, -1], [0, 1, -1, -1], [1, 2, 7, -1], [2, 3, 7, -1], [3, 4, 7, -1],
        [4, 5, 7, 8], [5, 6, 7, 8],
    ])


def test_topk_at_least_visible_takes_every_group_exact():
    """ratio 4, compressed_topk 3 >= the 2 groups of S = 9: no choice left, padded to 3."""
    idx = window_compressed_indices(9, window=2, ratio=4, compressed_topk=3, seed=5)
    np.testing.assert_array_equal(idx[0], [
        [0, -1, -1, -1, -1], [0, 1, -1, -1, -1], [1, 2, -1, -1, -1], [2, 3, 9, -1, -1],
        [3, 4, 9, -1, -1], [4, 5, 9, -1, -1], [5, 6, 9, -1, -1], [6, 7, 9, 10, -1],
        [7, 8, 9, 10, -1],
    ])


def loop_layout(S, window, ratio, topk_picks=None):
    """The rule written row by row: window keys, then visible groups (or a row's picks)."""
    rows = []
    for s in range(S):
        win = [t for t in range(max(0, s - window + 1), s + 1)]
        win += [-1] * (window - len(win))
        comp = []
        if ratio is not None:
            comp = [S + j for j in range(S // ratio) if (j + 1) * ratio <= s + 1]
            comp += [-1] * (S // ratio - len(comp))
        rows.append(win + comp)
    return np.array(rows)


@pytest.mark.parametrize("S,window,ratio", [(300, 128, 128), (64, 16, 4), (40, 128, None),
                                            (17, 1, 5)])
def test_static_layout_matches_the_row_rule(S, window, ratio):
    idx = window_compressed_indices(S, window=window, ratio=ratio)
    np.testing.assert_array_equal(idx[0], loop_layout(S, window, ratio))


def test_ratio_128_rows():
    """V4's C128 layer at S = 512: row 126 sees no group, row 127 group 0, row 511 all four."""
    S = 512
    idx = window_compressed_indices(S, ratio=128)
    assert idx.shape == (1, S, 128 + 4)
    np.testing.assert_array_equal(idx[0, 126, 128:], [-1] * 4)
    np.testing.assert_array_equal(idx[0, 127, 128:], [S, -1, -1, -1])
    np.testing.assert_array_equal(idx[0, 511, 128:], [S, S + 1, S + 2, S + 3])
    np.testing.assert_array_equal(idx[0, 511, :128], np.arange(384, 512))


@pytest.mark.parametrize("chunked", [False, True])
def test_chosen_groups_are_distinct_visible_sorted(monkeypatch, chunked):
    if chunked:  # one row per draw step keeps every rule
        monkeypatch.setattr(indices_mod, "_ROW_BUDGET_ELEMS", 1)
    S, W, ratio, K, B = 200, 8, 4, 6, 3
    idx = window_compressed_indices(S, window=W, ratio=ratio, compressed_topk=K, batch=B, seed=9)
    assert idx.shape == (B, S, W + K)
    static = loop_layout(S, W, None)
    for b in range(B):
        np.testing.assert_array_equal(idx[b, :, :W], static)
        for s in range(S):
            n = min(K, (s + 1) // ratio)
            comp = idx[b, s, W:]
            assert (comp[n:] == -1).all(), (b, s, comp)
            keys = comp[:n]
            assert (np.diff(keys) > 0).all(), (b, s, comp)
            assert (keys >= S).all() and ((keys - S + 1) * ratio <= s + 1).all(), (b, s, comp)
    assert not np.array_equal(idx[0], idx[1])  # each batch row draws its own


def test_chosen_groups_are_uniform_and_seeded():
    """A row that sees 16 groups takes each with probability 4 / 16."""
    B, S, ratio, K = 400, 64, 4, 4  # the last row sees 16 groups
    idx = window_compressed_indices(S, window=1, ratio=ratio, compressed_topk=K, batch=B, seed=2)
    counts = np.bincount(idx[:, -1, 1:].reshape(-1) - S, minlength=16)
    # Binomial(400, 1/4) per group: mean 100, sd ~ 8.7; +-40 is > 4.5 sd (fixed seed).
    assert np.abs(counts - 100).max() < 40, counts
    again = window_compressed_indices(S, window=1, ratio=ratio, compressed_topk=K, batch=B, seed=2)
    np.testing.assert_array_equal(idx, again)
    other = window_compressed_indices(S, window=1, ratio=ratio, compressed_topk=K, batch=B, seed=3)
    assert not np.array_equal(idx, other)
    wide = window_compressed_indices(S, window=1, ratio=ratio, compressed_topk=K, batch=B, seed=2,
                                     dtype="int64")
    assert wide.dtype == np.int64
    np.testing.assert_array_equal(idx, wide)


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        (dict(seq_len=0), ValueError, "^seq_len: expected a positive int, got 0"),
        (dict(window=0), ValueError, "^window: expected a positive int, got 0"),
        (dict(window=2.0), TypeError, "^window: expected a positive Python int, got float"),
        (dict(batch=True), TypeError, "^batch: expected a positive Python int, got bool"),
        (dict(ratio=1), ValueError, "^ratio: expected None or an int >= 2"),
        (dict(ratio=4.0), TypeError, "^ratio: expected None or a Python int >= 2, got float"),
        (dict(ratio=4, compressed_topk=0), ValueError, "^compressed_topk: expected a positive"),
        (dict(compressed_topk=4), ValueError, "^compressed_topk: expected None without ratio"),
        (dict(seed=-1), ValueError, "^seed: expected an int >= 0, got -1"),
        (dict(seed=1.0), TypeError, "^seed: expected a Python int, got float"),
        (dict(dtype="int8"), ValueError, "^dtype: expected 'int32' or 'int64', got 'int8'"),
        (dict(dtype=np.int64), TypeError, "^dtype: expected 'int32' or 'int64', got type"),
        (dict(seq_len=2**31 - 10, ratio=4), ValueError, "^seq_len: expected S . S // ratio <= "),
        (dict(seq_len=1 << 24, dtype="int64"), ValueError, "^seq_len: batch x seq_len x"),
    ],
)
def test_window_compressed_bad_arguments(kwargs, exc, pattern):
    args = dict(seq_len=16)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        window_compressed_indices(args.pop("seq_len"), **args)
