"""attn/adapter.py: every op of both backends on CPU (torch tests skip where it is absent)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import Framework
from paddlefleet.tilelang_ops.attn.adapter import framework_of, is_tensor, ops_for, type_name


def test_framework_detection(fw):
    x = fw.t(np.zeros(2, np.float32))
    name = fw.name
    assert framework_of(x) == name and is_tensor(x)
    assert framework_of(np.zeros(2)) is None and not is_tensor([1.0]) and not is_tensor(None)
    ops = ops_for(x, None, x)
    assert ops.name == name and ops_for(x) is ops  # one cached backend per framework


def test_type_name_says_which_library():
    assert type_name(np.zeros(2)) == "numpy.ndarray"
    assert type_name([1.0]) == "list" and type_name(None) == "None" and type_name(2.0) == "float"
    paddle = pytest.importorskip("paddle")
    assert type_name(paddle.zeros([1])) == "paddle.Tensor"
    torch = pytest.importorskip("torch")
    assert type_name(torch.zeros(1)) == "torch.Tensor"


def test_ops_for_errors(fw):
    x = fw.t(np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="expected a paddle.Tensor or torch.Tensor, got numpy.ndarray"):
        ops_for(x, np.zeros(2))
    with pytest.raises(TypeError, match="all tensors must come from one framework, got no tensors"):
        ops_for(None)


def test_mixed_frameworks():
    pytest.importorskip("paddle")
    pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"one framework, got \['paddle', 'torch'\]"):
        ops_for(Framework("paddle").t(np.zeros(1)), Framework("torch").t(np.zeros(1)))


def test_queries_and_dtype_names(fw, rng):
    a = rng.standard_normal((2, 3, 4))
    ops = ops_for(fw.t(a))
    for np_dt, name in [(np.float32, "float32"), (np.float64, "float64"), (np.int32, "int32"),
                        (np.int64, "int64"), (np.bool_, "bool"), (np.float16, "float16")]:
        assert ops.dtype(fw.t(a.astype(np_dt))) == name
    assert ops.dtype(fw.bf16(a)) == "bfloat16"
    t = fw.t(a)
    assert ops.shape(t) == (2, 3, 4) and all(type(s) is int for s in ops.shape(t))
    assert ops.device_kind(t) == "cpu"
    assert ops.is_contiguous(t)
    tt = t.transpose([0, 2, 1]) if fw.name == "paddle" else t.transpose(1, 2)
    c = ops.contiguous(tt)
    assert ops.is_contiguous(c)
    np.testing.assert_array_equal(ops.to_numpy(c), a.transpose(0, 2, 1))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "bfloat16"])
def test_creation(fw, dtype):
    like = fw.t(np.ones(1, np.float32))
    ops = ops_for(like)
    for t in (ops.empty((2, 3), dtype, like), ops.zeros((2, 3), dtype, like),
              ops.full((2, 3), 7, dtype, like)):
        assert ops.dtype(t) == dtype and ops.shape(t) == (2, 3)
        assert ops.device_kind(t) == "cpu"
    as_f32 = lambda t: ops.to_numpy(ops.cast(t, "float32"))  # noqa: E731 (bf16 has no numpy)
    np.testing.assert_array_equal(as_f32(ops.zeros((2, 3), dtype, like)), 0)
    np.testing.assert_array_equal(as_f32(ops.full((2, 3), 7, dtype, like)), 7)
    assert ops.shape(ops.zeros([], dtype, like)) == ()


def test_numpy_round_trip(fw, rng):
    like = fw.t(np.ones(1, np.float32))
    ops = ops_for(like)
    for a in (rng.standard_normal((3, 2)), rng.integers(-5, 5, (4,)).astype(np.int32)):
        t = ops.from_numpy(a, like)
        assert ops.dtype(t) == a.dtype.name
        np.testing.assert_array_equal(ops.to_numpy(t), a)


def test_numpy_edge_cases(fw, rng):
    """bf16 comes back as exact float32 values (Paddle's own .numpy() would give raw uint16
    bits); reversed and read-only numpy arrays are accepted."""
    like = fw.t(np.ones(1, np.float32))
    ops = ops_for(like)
    x = fw.bf16([1.0, -2.5, 3.140625])
    got = ops.to_numpy(x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [1.0, -2.5, 3.140625])
    a = rng.standard_normal(6)
    ro = a.copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(ops.to_numpy(ops.from_numpy(a[::-1], like)), a[::-1])
    np.testing.assert_array_equal(ops.to_numpy(ops.from_numpy(ro, like)), a)


def test_bf16_layout_ops(fw, rng):
    """Cast, concat, slice and reshape on bf16 work on CPU (Paddle's CPU build has no bf16 math,
    so the reference casts first; these are the ops it runs before casting)."""
    a = rng.standard_normal((2, 3, 8)).astype(np.float32)
    x = fw.bf16(a)
    ops = ops_for(x)
    a16 = fw.f32(x)  # the bf16-rounded values
    assert np.abs(a16 - a).max() <= np.abs(a).max() * 2.0**-8 and np.abs(a16 - a).max() > 0
    cat = ops.concat([x, x[:, :1]], axis=1)
    assert ops.dtype(cat) == "bfloat16" and ops.shape(cat) == (2, 4, 8)
    np.testing.assert_array_equal(fw.f32(cat), np.concatenate([a16, a16[:, :1]], axis=1))
    sl = x[:, 1:, :5]
    np.testing.assert_array_equal(fw.f32(sl), a16[:, 1:, :5])
    r = ops.reshape(x, (6, 8))
    assert ops.dtype(r) == "bfloat16"
    np.testing.assert_array_equal(fw.f32(r), a16.reshape(6, 8))
    up = ops.cast(x, "float64")
    assert ops.dtype(up) == "float64"
    np.testing.assert_array_equal(ops.to_numpy(up), a16.astype(np.float64))
    assert ops.cast(x, "bfloat16") is x  # no-op cast returns the tensor itself
    back = ops.cast(ops.cast(x, "float32"), "bfloat16")
    np.testing.assert_array_equal(fw.f32(back), a16)


def test_contiguous_realigns_a_view_that_starts_mid_allocation(fw, rng):
    """``contiguous`` also puts the first element on a 16-byte boundary: ``x[1:]`` of a bf16
    tensor is contiguous, 2 bytes off, and the GPU kernels' 16-byte ``cp.async`` and TMA loads of
    it would fault or be refused.  An aligned contiguous tensor comes back as itself."""
    from paddlefleet.tilelang_ops.attn.adapter import ALIGN

    a = rng.standard_normal(4 * 2 * 64 + 1).astype(np.float32)
    x = fw.bf16(a)
    ops = ops_for(x)
    view = ops.reshape(x[1:], (4, 2, 64))
    assert ops.is_contiguous(view) and view.data_ptr() % ALIGN == 2
    c = ops.contiguous(view)
    assert c.data_ptr() % ALIGN == 0 and ops.shape(c) == (4, 2, 64) and ops.is_contiguous(c)
    np.testing.assert_array_equal(fw.f32(c), fw.f32(x)[1:].reshape(4, 2, 64))
    assert ops.contiguous(c) is c
    # a strided view: a dense copy, aligned too
    t = ops.contiguous(view[:, :, ::2])
    assert ops.is_contiguous(t) and t.data_ptr() % ALIGN == 0
    np.testing.assert_array_equal(fw.f32(t), fw.f32(x)[1:].reshape(4, 2, 64)[:, :, ::2])


def test_logaddexp(fw, rng):
    a, b = rng.standard_normal((3, 4)) * 5, rng.standard_normal(4) * 5
    ops = ops_for(fw.t(a))
    np.testing.assert_allclose(ops.to_numpy(ops.logaddexp(fw.t(a), fw.t(b))), np.logaddexp(a, b),
                               rtol=1e-14)
    inf = np.inf
    x = np.array([-inf, -inf, 1.0, -inf, inf, 1000.0])
    y = np.array([-inf, 2.0, -inf, inf, inf, 1000.0])
    got = ops.to_numpy(ops.logaddexp(fw.t(x), fw.t(y)))
    # Regression: paddle.logaddexp(-inf, -inf) is NaN in Paddle 3.3.1; the adapter gives -inf.
    np.testing.assert_array_equal(got[:5], [-inf, 2.0, 1.0, inf, inf])
    np.testing.assert_allclose(got[5], 1000.0 + np.log(2.0), rtol=1e-15)
    for dt in (np.float32, np.float64):
        m = fw.t(np.full(4, -inf, dt))
        assert (ops.to_numpy(ops.logaddexp(m, m)) == -inf).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_log_expm1(fw, rng, dtype):
    a = (rng.standard_normal(64) * 3).astype(dtype)
    ops = ops_for(fw.t(a))
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(ops.to_numpy(ops.exp(fw.t(a))), np.exp(a), rtol=tol)
    np.testing.assert_allclose(ops.to_numpy(ops.log(fw.t(np.abs(a)))), np.log(np.abs(a)), rtol=tol)
    np.testing.assert_allclose(ops.to_numpy(ops.expm1(fw.t(a))), np.expm1(a), rtol=tol)
    # Regression: Paddle 3.3.1's vectorised CPU exp returns ~tiny/4 instead of 0 below
    # log(tiny) (-inf included, from 16 elements up); log(sum(exp(-inf))) must be -inf.
    neg = np.full(32, -np.inf, dtype)
    neg[:8] = -1e4
    assert (ops.to_numpy(ops.exp(fw.t(neg))) == 0).all()
    assert ops.to_numpy(ops.log(ops.sum(ops.exp(fw.t(neg))))) == -np.inf


def test_reductions(fw, rng):
    a = rng.standard_normal((2, 3, 4))
    t = fw.t(a)
    ops = ops_for(t)
    np.testing.assert_allclose(ops.to_numpy(ops.sum(t)), a.sum(), rtol=1e-14)
    np.testing.assert_allclose(ops.to_numpy(ops.sum(t, axis=1)), a.sum(1), rtol=1e-14)
    assert ops.shape(ops.sum(t, axis=-1, keepdim=True)) == (2, 3, 1)
    np.testing.assert_array_equal(ops.to_numpy(ops.amax(t, axis=2)), a.max(2))
    np.testing.assert_array_equal(ops.to_numpy(ops.amin(t, axis=0, keepdim=True)), a.min(0, keepdims=True))
    assert float(ops.to_numpy(ops.amax(t))) == a.max() and float(ops.to_numpy(ops.amin(t))) == a.min()
    i = fw.t(np.array([[3, -1], [7, 2]], np.int32))
    assert int(ops.to_numpy(ops.amin(i))) == -1 and int(ops.to_numpy(ops.amax(i))) == 7


def test_where_and_einsum(fw, rng):
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    cond = a > b
    ops = ops_for(fw.t(a))
    np.testing.assert_array_equal(
        ops.to_numpy(ops.where(fw.t(cond), fw.t(a), fw.t(b))), np.where(cond, a, b)
    )
    # Broadcasting of the condition and of a one-element fill, as the reference uses them.
    got = ops.where(fw.t(cond[:1]), fw.t(a), fw.t(np.array([-np.inf])))
    np.testing.assert_array_equal(ops.to_numpy(got), np.where(cond[:1], a, -np.inf))
    q, k = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 6, 5))
    np.testing.assert_allclose(
        ops.to_numpy(ops.einsum("bshd,bsld->bshl", fw.t(q), fw.t(k))),
        np.einsum("bshd,bsld->bshl", q, k), rtol=1e-12,
    )


def test_gather_and_scatter_add_rows(fw, rng):
    """Rows are gathered/added per batch; duplicate indices add up (they are separate keys)."""
    B, N, D, S, L = 2, 5, 3, 4, 3
    src = rng.standard_normal((B, N, D))
    idx = rng.integers(0, N, (B, S, L))
    idx[0, 0] = [2, 2, 2]
    idx[1, 3, :2] = [4, 4]
    for idx_dtype in (np.int32, np.int64):
        ti = fw.t(idx.astype(idx_dtype))
        ops = ops_for(ti)
        g = ops.gather_rows(fw.t(src), ti)
        assert ops.shape(g) == (B, S, L, D)
        want = np.stack([src[b][idx[b]] for b in range(B)])
        np.testing.assert_array_equal(ops.to_numpy(g), want)

        contrib = rng.standard_normal((B, S, L, D))
        dst0 = rng.standard_normal((B, N, D))
        dst = fw.t(dst0)
        got = ops.scatter_add_rows(dst, ti, fw.t(contrib))
        want = dst0.copy()
        for b, s, l in np.ndindex(B, S, L):
            want[b, idx[b, s, l]] += contrib[b, s, l]
        np.testing.assert_allclose(ops.to_numpy(got), want, rtol=1e-13, atol=1e-13)
        np.testing.assert_array_equal(ops.to_numpy(dst), dst0)  # out of place


def test_read_later_gives_the_values_at_the_time_of_the_call(fw):
    """``read_later`` (the value checks' copy to the host): the numbers as they were when it was
    called, also if the tensor changes before they are read (on CPU and Paddle the copy is made
    at once; PyTorch CUDA copies asynchronously, GPU suite)."""
    t = fw.t(np.array([3, -1, 7], dtype=np.int32))
    ops = ops_for(t)
    get = ops.read_later(t)
    t[0] = 100
    np.testing.assert_array_equal(get(), [3, -1, 7])
