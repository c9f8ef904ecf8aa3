"""Causal top-k indices for tests, benchmarks and demos.

In DeepSeek Sparse Attention the indexer picks, for every query row, the ``topk`` keys it will
attend to; causality is carried by that choice alone (``docs/conventions.md``, "Causality").
The indexer itself is out of scope, so :func:`causal_topk_indices` stands in for it with a
uniformly random choice of distinct causal keys.

Packed variable-length documents (B = 1, documents back to back, boundaries in ``cu_seqlens``)
get theirs from :func:`varlen_causal_topk_indices`: causal inside each document, never across
a boundary; :func:`cu_seqlens_from_lengths` turns document lengths into ``cu_seqlens``.
"""

from __future__ import annotations

import numbers

import numpy as np

from .checks import check_cu_seqlens

__all__ = ["causal_topk_indices", "varlen_causal_topk_indices", "cu_seqlens_from_lengths"]

# Rows drawn per step: bounds the [B, rows, max(S_kv, topk)] float32 random block (~64 MiB).
_ROW_BUDGET_ELEMS = 16 << 20
# One query row's draws at most (a few hundred MB of uniforms and ranks): 2^26 keys x batch.
_MAX_ROW_ELEMS = 1 << 26


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a positive Python int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return int(value)


def _seed_and_dtype(seed, dtype) -> None:
    """The ``seed`` (an int >= 0: numpy's seeding takes non-negative ints only) and ``dtype``
    (``"int32"`` / ``"int64"``) arguments of every helper here."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed: expected a Python int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed: expected an int >= 0, got {seed}")
    if not isinstance(dtype, str):
        raise TypeError(f"dtype: expected 'int32' or 'int64', got {type(dtype).__name__}")
    if dtype not in ("int32", "int64"):
        raise ValueError(f"dtype: expected 'int32' or 'int64', got {dtype!r}")


def _uniform_picks(rng, B: int, visible, width: int, K: int):
    """A uniform choice of ``K`` of each row's visible keys, chunk by chunk of rows: yields
    ``(s0, s1, r, pick)`` for rows ``s0 .. s1 - 1``, with ``r [B, s1 - s0, width]`` the float32
    uniforms drawn from ``rng`` and ``pick [B, s1 - s0, K]`` the keys of the ``K`` smallest
    (in no order).  Keys ``0 .. width - 1``; row ``s`` sees those ``< visible[s]``.

    One uniform per (row, key); keys a row may not see get 2.0 (> any uniform), so the ``K``
    smallest are a uniform random subset of the visible keys, padded by hidden ones.  Rows are
    drawn in chunks that bound the ``r`` block (``_ROW_BUDGET_ELEMS``); the draws do not depend
    on the chunking."""
    keys = np.arange(width)
    S = len(visible)
    step = max(1, _ROW_BUDGET_ELEMS // (B * width))
    for s0 in range(0, S, step):
        s1 = min(S, s0 + step)
        r = rng.random((B, s1 - s0, width), dtype=np.float32)
        hidden = keys[None, None, :] >= visible[None, s0:s1, None]
        r[np.broadcast_to(hidden, r.shape)] = 2.0
        if K < width:
            pick = np.argpartition(r, K - 1, axis=-1)[..., :K]
        else:
            pick = np.broadcast_to(keys, r.shape).copy()
        yield s0, s1, r, pick


def causal_topk_indices(
    batch: int,
    seq_len: int,
    seq_len_kv: int,
    topk: int,
    *,
    seed: int = 0,
    dtype: str = "int32",
) -> np.ndarray:
    """Random causal top-k key indices, as a DSA indexer would hand them to the kernels.

    Query row ``s`` sits at absolute position ``p = seq_len_kv - seq_len + s`` and may see keys
    ``0 .. p``.  Each row holds ``min(topk, p + 1)`` distinct keys drawn uniformly from those,
    in random order, followed by ``-1`` padding up to ``topk`` (only early rows, when
    ``p + 1 < topk``).  The same arguments always give the same array.

    Args:
        batch: ``B >= 1``.
        seq_len: query rows ``S >= 1``.
        seq_len_kv: key rows ``S_kv >= S``.
        topk: slots per row ``L >= 1`` (may exceed ``S_kv``; the surplus is ``-1``).
        seed: seed of ``numpy.random.default_rng``, ``>= 0``.
        dtype: ``"int32"`` or ``"int64"``.

    Returns:
        ``numpy.ndarray [B, S, topk]`` of ``dtype``.

    Raises:
        TypeError: a size or ``seed`` is not an int, or ``dtype`` is not a string.
        ValueError: a size is not positive, ``seed`` is negative, ``seq_len_kv < seq_len``, or
            ``dtype`` is not int32/int64.
    """
    B = _positive_int(batch, "batch")
    S = _positive_int(seq_len, "seq_len")
    S_kv = _positive_int(seq_len_kv, "seq_len_kv")
    L = _positive_int(topk, "topk")
    if S_kv < S:
        raise ValueError(
            f"seq_len_kv: expected seq_len_kv >= seq_len={S} (queries are the last seq_len "
            f"positions), got {S_kv}"
        )
    _seed_and_dtype(seed, dtype)
    if dtype == "int32" and S_kv > np.iinfo(np.int32).max:
        raise ValueError(f"seq_len_kv: expected at most {np.iinfo(np.int32).max} key rows for "
                         f"int32 indices, got {S_kv}")
    if B * max(S_kv, L) > _MAX_ROW_ELEMS:
        # one row needs a draw per key: refuse before allocating gigabytes
        raise ValueError(f"seq_len_kv: batch x max(seq_len_kv, topk) = {B * max(S_kv, L)} "
                         f"draws per query row is more than this helper makes "
                         f"({_MAX_ROW_ELEMS}); it is for tests and demos")

    out = np.empty((B, S, L), dtype=dtype)
    # row s sits at absolute position S_kv - S + s and sees the keys up to it
    visible = S_kv - S + np.arange(S) + 1
    for s0, s1, r, pick in _uniform_picks(np.random.default_rng(int(seed)), B, visible,
                                          max(S_kv, L), L):
        pos = visible[s0:s1] - 1  # absolute positions of these query rows
        # Order the picked keys by their random values: a uniformly random order, hidden last.
        order = np.argsort(np.take_along_axis(r, pick, axis=-1), axis=-1, kind="stable")
        pick = np.take_along_axis(pick, order, axis=-1)
        pick[pick > pos[None, :, None]] = -1
        out[:, s0:s1] = pick
    return out


def cu_seqlens_from_lengths(lengths) -> np.ndarray:
    """``cu_seqlens`` of packed documents with the given lengths: ``[0, n0, n0 + n1, ...]``.

    Args:
        lengths: a non-empty sequence of Python ints ``>= 0`` (0 = an empty document) whose sum
            is ``>= 1`` and fits int32.

    Returns:
        ``numpy.ndarray [len(lengths) + 1]`` int32.

    Raises:
        TypeError: ``lengths`` is a string or not a sequence, or an entry is not an int.
        ValueError: ``lengths`` is empty, an entry is negative, or the sum is 0 or past int32
            (the first bad entry is named).
    """
    if isinstance(lengths, (str, bytes, dict)) or not hasattr(lengths, "__len__"):
        raise TypeError(f"lengths: expected a sequence of ints, got {type(lengths).__name__}")
    if len(lengths) == 0:
        raise ValueError("lengths: expected at least one document length, got none")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"lengths[{i}]: expected a Python int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"lengths[{i}]: expected a length >= 0, got {n}")
    cu = np.concatenate([[0], np.cumsum([int(n) for n in lengths], dtype=np.int64)])
    if cu[-1] < 1 or cu[-1] > np.iinfo(np.int32).max:
        raise ValueError(
            f"lengths: expected a total of 1 .. {np.iinfo(np.int32).max} tokens (int32 "
            f"cu_seqlens), got {int(cu[-1])}"
        )
    return cu.astype(np.int32)


def varlen_causal_topk_indices(
    cu_seqlens,
    topk: int,
    *,
    seed: int = 0,
    dtype: str = "int32",
) -> np.ndarray:
    """Random per-document causal top-k indices of packed documents (B = 1).

    Row ``t`` of document ``d`` (rows ``a = cu_seqlens[d] <= t < cu_seqlens[d+1]``) may see
    the keys ``a .. t`` of its own document only: it holds ``min(topk, t - a + 1)`` distinct
    keys drawn uniformly from those, in random order, then ``-1`` padding up to ``topk``.  Each
    document's block is :func:`causal_topk_indices` of that document alone (``S = S_kv`` = its
    length), shifted by ``a``; the same arguments always give the same array.

    Args:
        cu_seqlens: ``[num_docs + 1]`` int32 boundaries (numpy array or tensor, see
            ``checks.check_cu_seqlens``): starts at 0, non-decreasing; ``S = cu_seqlens[-1]``
            must be ``>= 1``.  Empty documents are allowed.
        topk: slots per row ``L >= 1``.
        seed: seed ``>= 0``; document ``d`` draws from its own generator ``(seed, d)``.
        dtype: ``"int32"`` or ``"int64"``.

    Returns:
        ``numpy.ndarray [1, S, topk]`` of ``dtype``.

    Raises:
        TypeError: ``cu_seqlens`` not an int32 tensor/array, ``topk`` or ``seed`` not an int,
            or ``dtype`` not a string.
        ValueError: bad ``cu_seqlens`` (see ``checks.check_cu_seqlens``), ``S = 0``,
            ``topk < 1``, ``seed < 0``, or ``dtype`` not int32/int64.
    """
    cu = check_cu_seqlens(cu_seqlens)
    L = _positive_int(topk, "topk")
    _seed_and_dtype(seed, dtype)
    S = int(cu[-1])
    if S < 1:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] = S >= 1 packed rows, got {S}")

    out = np.full((1, S, L), -1, dtype=dtype)
    for d in range(cu.size - 1):
        a, b = int(cu[d]), int(cu[d + 1])
        if b == a:
            continue
        # One generator per document: its block does not depend on the other documents.
        doc_seed = int(np.random.SeedSequence([int(seed), d]).generate_state(1)[0])
        block = causal_topk_indices(1, b - a, b - a, L, seed=doc_seed, dtype="int64")
        out[:, a:b] = np.where(block >= 0, block + a, -1)
    return out


# --- DeepSeek-V4: sliding window + compressed keys ----------------------------------------------
__all__.append("window_compressed_indices")
# Largest index array window_compressed_indices makes (1 GiB of int32).
_MAX_LAYOUT_ELEMS = 1 << 28


def window_compressed_indices(
    seq_len: int,
    *,
    window: int = 128,
    ratio=None,
    compressed_topk=None,
    batch: int = 1,
    seed: int = 0,
    dtype: str = "int32",
) -> np.ndarray:
    """The key sets of DeepSeek-V4's sparse attention: a causal sliding window plus compressed keys.

    The keys are the rows of ``kv = concat(vanilla kv [S], compressed kv [S // ratio])`` along
    the sequence (``S_kv = S + S // ratio``): key ``t < S`` is token ``t``, key ``S + j`` is
    compressed group ``j`` (tokens ``j*ratio .. (j+1)*ratio - 1``).  Row ``s`` holds

    * the window: keys ``max(0, s - window + 1) .. s`` in ascending order, then ``-1`` up to
      ``window`` slots (rows ``s < window - 1`` only);
    * when ``ratio`` is set, the compressed groups it may see: group ``j`` is visible once it is
      complete, ``(j + 1) * ratio <= s + 1``, i.e. ``j < (s + 1) // ratio`` (the rule of the
      DeepSeek-V4 training code, radixark/miles ``deepseek_v4/ops/topk_idx_ref.py`` and its
      indexer mask).  With ``compressed_topk=None`` (V4's ratio-128 layers) every visible
      group is taken, ``S + 0, S + 1, ...``, in ``S // ratio`` slots; with an int (V4's ratio-4
      layers, where a learned indexer picks them) a seeded uniform choice of
      ``min(compressed_topk, visible)`` distinct visible groups stands in for the indexer, in
      ascending order, in ``compressed_topk`` slots.  Unused slots are ``-1``.

    Trailing tokens of an incomplete group (``S % ratio``) get no compressed key.  The same
    arguments always give the same array; the batch rows of a static layout are equal.

    Args:
        seq_len: tokens ``S >= 1``.
        window: sliding-window width ``>= 1`` (V4: 128).
        ratio: ``None`` (window only) or the compression ratio, an int ``>= 2`` (V4: 4, 128).
        compressed_topk: ``None`` (every visible group) or the compressed slots, an int
            ``>= 1`` (V4-Flash: 512, V4-Pro: 1024, with ratio 4); needs ``ratio``.
        batch: ``B >= 1``.
        seed: seed ``>= 0`` of the compressed choice.
        dtype: ``"int32"`` or ``"int64"``.

    Returns:
        ``numpy.ndarray [B, S, L]`` of ``dtype``, ``L = window + compressed slots``: ``window``
        (no ratio), ``window + S // ratio`` (every group) or ``window + compressed_topk``.

    Raises:
        TypeError: a size, ``ratio``, ``compressed_topk`` or ``seed`` is not an int, or
            ``dtype`` is not a string.
        ValueError: a size is not positive, ``ratio < 2``, ``compressed_topk`` without
            ``ratio``, ``seed < 0``, ``dtype`` not int32/int64, or the sizes past what int32
            indices or this helper's memory budget allow.
    """
    S = _positive_int(seq_len, "seq_len")
    W = _positive_int(window, "window")
    B = _positive_int(batch, "batch")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Integral):
            raise TypeError(f"ratio: expected None or a Python int >= 2, got "
                            f"{type(ratio).__name__}")
        if ratio < 2:
            raise ValueError(f"ratio: expected None or an int >= 2 (DeepSeek-V4: 4, 128), got "
                             f"{ratio}")
        ratio = int(ratio)
    if compressed_topk is not None:
        K = _positive_int(compressed_topk, "compressed_topk")
        if ratio is None:
            raise ValueError(f"compressed_topk: expected None without ratio (a window-only "
                             f"layer has no compressed keys), got {K}")
    _seed_and_dtype(seed, dtype)
    G = 0 if ratio is None else S // ratio  # complete groups = compressed keys
    if dtype == "int32" and S + G > np.iinfo(np.int32).max:
        raise ValueError(f"seq_len: expected S + S // ratio <= {np.iinfo(np.int32).max} key "
                         f"rows for int32 indices, got {S + G}")
    slots = G if compressed_topk is None else K
    if B * S * (W + slots) > _MAX_LAYOUT_ELEMS or B * G > _MAX_ROW_ELEMS:
        raise ValueError(f"seq_len: batch x seq_len x (window + compressed slots) = "
                         f"{B * S * (W + slots)} indices is more than this helper makes "
                         f"({_MAX_LAYOUT_ELEMS}); it is for tests, benchmarks and demos")

    out = np.full((B, S, W + slots), -1, dtype=dtype)
    rows = np.arange(S)
    # Window: W consecutive keys from max(0, s - W + 1); those past s (early rows) are -1.
    win = np.maximum(rows - W + 1, 0)[:, None] + np.arange(W)[None, :]
    out[:, :, :W] = np.where(win <= rows[:, None], win, -1)
    if ratio is None or G == 0:
        return out
    visible = (rows + 1) // ratio  # groups row s may see: 0 .. visible - 1
    if compressed_topk is None:
        grp = np.arange(G)[None, :]
        out[:, :, W:] = np.where(grp < visible[:, None], S + grp, -1)
        return out

    width = max(G, K)
    for s0, s1, _, pick in _uniform_picks(np.random.default_rng(int(seed)), B, visible, width, K):
        # Ascending visible groups, then the hidden ones as -1.
        pick = np.sort(np.where(pick < visible[None, s0:s1, None], pick, width), axis=-1)
        out[:, s0:s1, W:] = np.where(pick < width, S + pick, -1)
    return out
