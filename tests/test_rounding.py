"""The exact dKV mode's round-half-to-even without FRND (``sparse_bwd.main``'s ``rint``):
``x + copysign(2^23, x) - copysign(2^23, x)`` in fp32 for ``|x| < 2^23``, ``x`` above.  The
kernel's exactness proof needs it to equal ``rint`` on every fp32 (but for the sign of a zero
result, which adds nothing to an accumulator that starts at +0): checked here in numpy fp32,
whose adds round to nearest even as ``__fadd_rn`` does."""

import numpy as np

LIMIT = np.float32(2.0**23)


def fast_rint(x):
    x = np.asarray(x, np.float32)
    m = np.where(x < 0, -LIMIT, LIMIT).astype(np.float32)
    with np.errstate(invalid="ignore"):
        r = (x + m).astype(np.float32) - m
    return np.where(np.abs(x) < LIMIT, r, x).astype(np.float32)


def _same(a, b):
    # equal values (zeros of either sign equal), NaN where NaN
    return np.array_equal(a, b, equal_nan=True)


def test_fast_rint_equals_rint_on_random_values():
    rng = np.random.default_rng(1)
    for scale in (1e-3, 1.0, 3.0, 1e3, 1e6, 4e6, 8.3e6, 1.7e7, 1e12):
        x = (rng.standard_normal(200_000) * scale).astype(np.float32)
        assert _same(fast_rint(x), np.rint(x)), scale


def test_fast_rint_ties_go_to_even_up_to_the_limit():
    k = np.concatenate([np.arange(-2000, 2000), 2**22 + np.arange(-2000, 2000),
                        2**23 - 1 - np.arange(0, 2000)]).astype(np.float64)
    x = (k + 0.5).astype(np.float32)  # exact in fp32 below 2^23
    assert np.all(x.astype(np.float64) == k + 0.5)
    assert _same(fast_rint(x), np.rint(x))
    assert _same(fast_rint(-x), np.rint(-x))


def test_fast_rint_edges():
    x = np.array([0.0, -0.0, 0.49999997, 0.5, 1.5, 2.5, -0.5, -1.5, 2.0**23 - 0.5, 2.0**23,
                  -(2.0**23), 2.0**24 + 2, np.inf, -np.inf, np.nan, 1e-45, -1e-45],
                 np.float32)
    assert _same(fast_rint(x), np.rint(x))
