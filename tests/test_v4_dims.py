"""(Dk, Dv) = (512, 512), DeepSeek-V4's sparse attention (the value is the whole kv row): the
reference against an fp64 numpy formulation and finite differences, the op on CPU against a
dense Paddle formulation with autograd, and the kernel wrapper's refusal of the pair when the
kernel registry does not list it (it does now: ``kernels.D_PAIRS``)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import CpuStandIn, rel_l2

from paddlefleet.tilelang_ops.attn import kernels, tiling
from paddlefleet.tilelang_ops.attn.indices import window_compressed_indices
from paddlefleet.tilelang_ops.attn.reference import (
    mqa_latent_sparse_bwd_ref,
    mqa_latent_sparse_fwd_ref,
)

paddle = pytest.importorskip("paddle")

D = 512
SM = D ** -0.5


def numpy_attention(q, kv, idx, sink, sm):
    """fp64, one (row, head) at a time: softmax over the row's valid slots (a duplicate counts
    twice) and the sink column, value = the whole kv row.  -> (out, natural sink-exclusive lse)."""
    B, S, H, _ = q.shape
    out = np.zeros((B, S, H, kv.shape[-1]))
    lse = np.full((B, S, H), -np.inf)
    for b in range(B):
        for s in range(S):
            keys = [int(t) for t in idx[b, s] if t >= 0]
            for h in range(H):
                logits = np.array([sm * q[b, s, h] @ kv[b, t] for t in keys])
                extra = [] if sink is None else [sink[h]]
                if not keys and not extra:
                    continue
                m = max(list(logits) + extra)
                w = np.exp(logits - m)
                z = w.sum() + sum(np.exp(e - m) for e in extra)
                if keys:
                    out[b, s, h] = (w[:, None] * kv[b, keys]).sum(0) / z
                    lse[b, s, h] = m + np.log(w.sum())
    return out, lse


def _case(rng, B=2, S=9, S_kv=13, H=3, L=70, sink=True, empty_row=True, duplicates=True):
    q = rng.standard_normal((B, S, H, D))
    kv = rng.standard_normal((B, S_kv, D))
    idx = np.full((B, S, L), -1, np.int32)
    for b in range(B):
        for s in range(S):
            n = int(rng.integers(1, min(L, S_kv) + 1))
            idx[b, s, :n] = rng.choice(S_kv, n, replace=False)
            rng.shuffle(idx[b, s])
    if duplicates:
        idx[0, 1, :3] = idx[0, 1, 3] = 5  # key 5 four times in one row
    if empty_row:
        idx[-1, 2] = -1  # no key: only the sink
    sk = rng.standard_normal(H) + 0.5 if sink else None
    return q, kv, idx, sk


def test_supported_and_built_pairs():
    assert (512, 512) in tiling.SUPPORTED_DIMS and (576, 512) in tiling.SUPPORTED_DIMS
    assert tiling.kernel_dims() == tuple(getattr(kernels, "D_PAIRS", ((576, 512),)))


@pytest.mark.parametrize("sink", [True, False])
def test_reference_forward_matches_numpy(rng, sink):
    q, kv, idx, sk = _case(rng, sink=sink, empty_row=sink)
    out, lse = mqa_latent_sparse_fwd_ref(
        paddle.to_tensor(q), paddle.to_tensor(kv), paddle.to_tensor(idx), SM,
        None if sk is None else paddle.to_tensor(sk), d_v=D, dtype="float64")
    ref_out, ref_lse = numpy_attention(q, kv, idx, sk, SM)
    assert tuple(out.shape) == (2, 9, 3, D)
    assert rel_l2(out, ref_out) < 1e-12
    assert rel_l2(lse, ref_lse) < 1e-12


def test_reference_backward_matches_finite_differences(rng):
    """Directional derivatives of sum(out * dO) along random directions of q, kv and the sink:
    the value's gradient and the key's land on the same 512 columns of dkv."""
    q, kv, idx, sk = _case(rng, B=1, S=6, S_kv=8, H=2, L=9)
    do = rng.standard_normal((1, 6, 2, D))
    t = paddle.to_tensor
    dq, dkv, dsink = mqa_latent_sparse_bwd_ref(t(q), t(kv), None, t(do), None, t(sk), t(idx), SM,
                                               dtype="float64")
    grads = {"q": dq.numpy(), "kv": dkv.numpy(), "sink": dsink.numpy()}

    def loss(**x):
        args = dict(q=q, kv=kv, sink=sk)
        args.update(x)
        return float((numpy_attention(args["q"], args["kv"], idx, args["sink"], SM)[0] * do).sum())

    eps = 1e-5
    for name, x in (("q", q), ("kv", kv), ("sink", sk)):
        for _ in range(2):
            d = rng.standard_normal(x.shape)
            fd = (loss(**{name: x + eps * d}) - loss(**{name: x - eps * d})) / (2 * eps)
            an = float((grads[name] * d).sum())
            assert abs(fd - an) <= 1e-7 * max(1.0, abs(an)), (name, fd, an)
    # a key only some rows see as a value: both its key and value terms, column by column
    assert np.abs(grads["kv"][0, 5]).max() > 0


def _dense_paddle(q, kv, idx, sink, sm):
    """The same attention written with Paddle ops (gather, softmax with a sink column) and
    differentiated by Paddle's autograd: independent of the reference's hand-written backward."""
    B, S, L = idx.shape
    valid = paddle.to_tensor(idx >= 0)
    safe = paddle.to_tensor(np.where(idx >= 0, idx, 0).astype(np.int64))
    kv_g = paddle.stack([paddle.gather(kv[b], safe[b].reshape([-1])).reshape([S, L, D])
                         for b in range(B)])
    scores = paddle.einsum("bshd,bsld->bshl", q, kv_g) * sm
    scores = paddle.where(valid.unsqueeze(2), scores, paddle.full_like(scores, -np.inf))
    H = q.shape[2]
    col = paddle.broadcast_to(sink.astype(q.dtype).reshape([1, 1, H, 1]), [B, S, H, 1])
    p = paddle.nn.functional.softmax(paddle.concat([scores, col], axis=-1), axis=-1)
    return paddle.einsum("bshl,bsld->bshd", p[..., :L], kv_g)


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", 2e-6)])
def test_op_on_cpu_every_gradient(rng, dtype, tol):
    """The op at (512, 512) on CPU: output, dq, dkv and d_sink against the dense Paddle
    formulation; -1 slots, a row with no key, a key chosen four times in a row, L = 70 (not a
    multiple of the 64-key block)."""
    from paddlefleet.tilelang_ops.attn.op import mqa_latent_sparse_attention

    q, kv, idx, sk = _case(rng)
    do = rng.standard_normal((2, 9, 3, D))
    res = {}
    for name in ("op", "dense"):
        qt = paddle.to_tensor(q.astype(dtype), stop_gradient=False)
        kvt = paddle.to_tensor(kv.astype(dtype), stop_gradient=False)
        st = paddle.to_tensor(sk.astype("float32"), stop_gradient=False)
        if name == "op":
            out = mqa_latent_sparse_attention(qt, kvt, paddle.to_tensor(idx), SM, st, d_v=D)
        else:
            out = _dense_paddle(qt.astype("float64"), kvt.astype("float64"), idx, st, SM)
        (out.astype("float64") * paddle.to_tensor(do)).sum().backward()
        res[name] = (out, qt.grad, kvt.grad, st.grad)
    assert tuple(res["op"][0].shape) == (2, 9, 3, D) and res["op"][0].dtype == res["op"][1].dtype
    for got, want, what in zip(res["op"], res["dense"], ("out", "dq", "dkv", "d_sink")):
        assert rel_l2(got, want) < (tol if what != "d_sink" else max(tol, 1e-6)), what
    assert float(paddle.abs(res["op"][0][-1, 2]).max()) == 0.0  # the row with no key


def test_op_on_window_compressed_indices(rng):
    """Keys of a ratio-2 layer, kv = [vanilla S | compressed S // 2], through the op."""
    from paddlefleet.tilelang_ops.attn.op import mqa_latent_sparse_attention

    S, H = 10, 2
    idx = window_compressed_indices(S, window=3, ratio=2, compressed_topk=2, seed=4)
    q = rng.standard_normal((1, S, H, D))
    kv = rng.standard_normal((1, S + S // 2, D))
    sk = rng.standard_normal(H)
    out = mqa_latent_sparse_attention(paddle.to_tensor(q), paddle.to_tensor(kv),
                                      paddle.to_tensor(idx), SM,
                                      paddle.to_tensor(sk.astype("float32")), d_v=D)
    want, _ = numpy_attention(q, kv, idx, sk.astype("float32").astype(np.float64), SM)
    assert rel_l2(out, want) < 1e-12


def test_kernel_wrapper_refuses_the_pair_until_built(monkeypatch):
    """The kernel wrapper names (512, 512) as not built yet; once the registry lists it the
    wrapper's head-dims check passes (checked on the stand-in provider)."""
    from paddlefleet.tilelang_ops.attn import interface

    q = paddle.to_tensor(np.zeros((1, 4, 2, D), np.float32)).astype("bfloat16")
    kv = paddle.to_tensor(np.zeros((1, 4, D), np.float32)).astype("bfloat16")
    idx = paddle.to_tensor(np.zeros((1, 4, 64), np.int32))
    monkeypatch.delattr(kernels, "D_PAIRS", raising=False)
    not_built = r"kernels for \(Dk, Dv\) = \(512, 512\) are not built yet"
    with pytest.raises(ValueError, match=not_built):
        interface.mqa_latent_sparse_fwd(q, kv, idx, SM, d_v=D, provider=CpuStandIn())
    with pytest.raises(ValueError, match=r"take \(Dk, Dv\) in \[\(576, 512\)\], got Dk=512, Dv=64"):
        tiling.check_head_dims(512, 64)
    monkeypatch.setattr(kernels, "D_PAIRS", ((576, 512), (512, 512)), raising=False)
    tiling.check_head_dims(512, 512)
    with pytest.raises(ValueError, match="not built yet"):
        monkeypatch.setattr(kernels, "D_PAIRS", ((576, 512),))
        tiling.check_head_dims(512, 512)
