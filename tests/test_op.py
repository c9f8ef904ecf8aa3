"""attn/op.py: mqa_latent_sparse_attention (Paddle PyLayer) on CPU: values and gradients against
an independent float64 dense formulation, exact plumbing against the reference, backend dispatch
and errors.

The dense formulation scores every key and weights it by how often the row's top-k indices
name it (duplicates count separately, -1 slots not at all), with the sink as one extra
softmax column; float64 Paddle autograd gives its gradients.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")  # the GPU host's torch-only env skips this module
from helpers import CpuStandIn, record_calls, rel_l2

from paddlefleet.tilelang_ops.attn.checks import check_tensors, check_values
from paddlefleet.tilelang_ops.attn.indices import (
    cu_seqlens_from_lengths,
    varlen_causal_topk_indices,
)
from paddlefleet.tilelang_ops.attn.op import (
    MQALatentSparseAttentionFunction,
    mqa_latent_sparse_attention,
    resolve_backward_backend,
)
from paddlefleet.tilelang_ops.attn.reference import (
    mqa_latent_sparse_bwd_ref,
    mqa_latent_sparse_fwd_ref,
)

TOL = 1e-5  # fp32 op vs float64 dense


def _dense(q, kv, idx, scale, sink, d_v):
    """float64 Paddle tensors in, ``out`` out (differentiable)."""
    B, S, H, _ = q.shape
    T = kv.shape[1]
    counts = np.zeros((B, S, T))
    b, s, l = np.nonzero(idx >= 0)
    np.add.at(counts, (b, s, idx[b, s, l]), 1.0)
    with np.errstate(divide="ignore"):
        log_counts = paddle.to_tensor(np.log(counts)[:, :, None, :])  # -inf where never picked
    logits = paddle.einsum("bshd,btd->bsht", q, kv) * scale + log_counts
    if sink is not None:
        logits = paddle.concat([logits, sink.reshape([1, 1, H, 1]).expand([B, S, H, 1])], -1)
    p = paddle.nn.functional.softmax(logits, axis=-1)[..., :T]
    return paddle.einsum("bsht,btd->bshd", p, kv[..., :d_v])


def _inputs(rng, B=2, S=24, H=8, Dk=80, d_v=64, S_kv=40, L=16, sink=True, idx_dtype="int32"):
    q = rng.standard_normal((B, S, H, Dk)).astype(np.float32)
    kv = rng.standard_normal((B, S_kv, Dk)).astype(np.float32)
    # Random with replacement: -1 slots and duplicate keys both occur.
    idx = rng.integers(-1, S_kv, (B, S, L)).astype(idx_dtype)
    if sink:
        idx[:, 0, :] = -1  # a row with no valid key: all weight on the sink
    else:
        idx[..., 0] = np.abs(idx[..., 0])  # every row keeps a key (no sink to absorb it)
    sk = rng.standard_normal(H).astype(np.float32) if sink else None
    grad = rng.standard_normal((B, S, H, d_v)).astype(np.float32)
    return q, kv, idx, sk, grad, d_v


def _run_op(q, kv, idx, sk, grad, d_v, scale, backend=None, grads=(True, True, True)):
    tq = paddle.to_tensor(q, stop_gradient=not grads[0])
    tkv = paddle.to_tensor(kv, stop_gradient=not grads[1])
    tsk = None if sk is None else paddle.to_tensor(sk, stop_gradient=not grads[2])
    out = mqa_latent_sparse_attention(tq, tkv, paddle.to_tensor(idx), scale, tsk, backend, d_v=d_v)
    (out * paddle.to_tensor(grad)).sum().backward()
    return out, tq, tkv, tsk


@pytest.mark.parametrize("sink", [True, False], ids=["sink", "nosink"])
@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
@pytest.mark.parametrize("H", [1, 8, 24])
def test_matches_dense_float64(rng, sink, idx_dtype, H):
    q, kv, idx, sk, grad, d_v = _inputs(rng, H=H, sink=sink, idx_dtype=idx_dtype)
    scale = 80**-0.5 * 2.0  # sharper than 1/sqrt(Dk) so the softmax is far from uniform
    out, tq, tkv, tsk = _run_op(q, kv, idx, sk, grad, d_v, scale)
    assert out.dtype == paddle.float32 and list(out.shape) == [2, 24, H, d_v]

    rq = paddle.to_tensor(q.astype(np.float64), stop_gradient=False)
    rkv = paddle.to_tensor(kv.astype(np.float64), stop_gradient=False)
    rsk = None if sk is None else paddle.to_tensor(sk.astype(np.float64), stop_gradient=False)
    ref = _dense(rq, rkv, idx, scale, rsk, d_v)
    (ref * paddle.to_tensor(grad.astype(np.float64))).sum().backward()

    assert rel_l2(out, ref) < TOL
    assert rel_l2(tq.grad, rq.grad) < TOL
    assert rel_l2(tkv.grad, rkv.grad) < TOL
    if sink:
        assert tsk.grad.dtype == paddle.float32
        assert rel_l2(tsk.grad, rsk.grad) < TOL
        np.testing.assert_array_equal(out.numpy()[:, 0], 0.0)  # sink-only row


def test_equals_reference_exactly(rng):
    # The CPU op is the reference plus ctx bookkeeping: gradients must land on the right
    # inputs unchanged.
    q, kv, idx, sk, grad, d_v = _inputs(rng)
    out, tq, tkv, tsk = _run_op(q, kv, idx, sk, grad, d_v, 0.1, backend="reference")
    t = paddle.to_tensor
    ref_out, ref_lse = mqa_latent_sparse_fwd_ref(t(q), t(kv), t(idx), 0.1, t(sk), d_v=d_v)
    dq, dkv, dsink = mqa_latent_sparse_bwd_ref(t(q), t(kv), ref_out, t(grad), ref_lse, t(sk), t(idx),
                                               0.1)
    np.testing.assert_array_equal(out.numpy(), ref_out.numpy())
    np.testing.assert_array_equal(tq.grad.numpy(), dq.numpy())
    np.testing.assert_array_equal(tkv.grad.numpy(), dkv.numpy())
    np.testing.assert_array_equal(tsk.grad.numpy(), dsink.numpy())


@pytest.mark.parametrize("grads", [(True, False, False), (False, True, True), (True, True, False)])
def test_partial_requires_grad(rng, grads):
    # Paddle demands None for every input with stop_gradient=True.
    q, kv, idx, sk, grad, d_v = _inputs(rng)
    _, tq, tkv, tsk = _run_op(q, kv, idx, sk, grad, d_v, 0.1, grads=grads)
    for t, wanted in zip((tq, tkv, tsk), grads):
        assert (t.grad is not None) == wanted
        if wanted:
            assert np.isfinite(t.grad.numpy()).all() and np.abs(t.grad.numpy()).max() > 0


def test_backend_choice():
    assert resolve_backward_backend(None, "cpu") == "reference"
    assert resolve_backward_backend(None, "cuda") == "tilelang"
    assert resolve_backward_backend("reference", "cuda") == "reference"
    with pytest.raises(ValueError, match="'tilelang', 'reference'.*'flash'"):
        resolve_backward_backend("flash", "cpu")
    with pytest.raises(ValueError, match="needs CUDA tensors.*cpu"):
        resolve_backward_backend("tilelang", "cpu")


def test_errors_raised_at_call(rng):
    q, kv, idx, sk, grad, d_v = _inputs(rng)
    t = paddle.to_tensor
    with pytest.raises(ValueError, match="backward_backend"):
        mqa_latent_sparse_attention(t(q), t(kv), t(idx), 0.1, t(sk), "flash", d_v=d_v)
    with pytest.raises(ValueError, match="tilelang"):
        mqa_latent_sparse_attention(t(q), t(kv), t(idx), 0.1, t(sk), "tilelang", d_v=d_v)
    with pytest.raises(TypeError, match="token_indices"):
        mqa_latent_sparse_attention(t(q), t(kv), t(idx.astype(np.float32)), 0.1, t(sk), d_v=d_v)
    bad = idx.copy()
    bad[0, 0, 0] = kv.shape[1]
    with pytest.raises(ValueError, match="token_indices"):
        mqa_latent_sparse_attention(t(q), t(kv), t(bad), 0.1, t(sk), d_v=d_v)
    with pytest.raises(ValueError, match="sm_scale"):
        mqa_latent_sparse_attention(t(q), t(kv), t(idx), float("nan"), t(sk), d_v=d_v)
    # The CPU path used to accept these while the CUDA path rejected them: one rule for both.
    for scale in (-1.0, 0.0, 1e39, 1e-46):
        with pytest.raises(ValueError, match="^sm_scale: expected a finite float > 0"):
            mqa_latent_sparse_attention(t(q), t(kv), t(idx), scale, t(sk), d_v=d_v)
    for value in (np.nan, np.inf):
        bad_sink = sk.copy()
        bad_sink[5] = value
        with pytest.raises(ValueError, match=r"^attn_sink: expected finite values or -inf.*\[5\]"):
            mqa_latent_sparse_attention(t(q), t(kv), t(idx), 0.1, t(bad_sink), d_v=d_v)


def test_non_paddle_inputs_name_the_argument_and_the_type(rng):
    """numpy arrays used to give "expected a paddle.Tensor or torch.Tensor, got ndarray" (no
    argument named) and torch tensors "got Tensor"."""
    q, kv, idx, sk, grad, d_v = _inputs(rng)
    t = paddle.to_tensor
    with pytest.raises(TypeError, match=r"^query: expected a paddle.Tensor, got numpy.ndarray$"):
        mqa_latent_sparse_attention(q, t(kv), t(idx), 0.1, t(sk), d_v=d_v)
    with pytest.raises(TypeError, match=r"^kv: expected a paddle.Tensor or torch.Tensor, got "
                                        r"numpy.ndarray$"):
        mqa_latent_sparse_attention(t(q), kv, t(idx), 0.1, t(sk), d_v=d_v)
    with pytest.raises(TypeError, match=r"^attn_sink: .*got list$"):
        mqa_latent_sparse_attention(t(q), t(kv), t(idx), 0.1, sk.tolist(), d_v=d_v)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^query: expected a paddle.Tensor, got torch.Tensor "
                                        r"\(this is Paddle's autograd op"):
        mqa_latent_sparse_attention(torch.from_numpy(q), torch.from_numpy(kv), torch.from_numpy(idx),
                             0.1, torch.from_numpy(sk), d_v=d_v)


def test_float64_inputs_computed_in_float64(rng):
    """fp64 inputs get the fp64 reference (fp32 compute would leave ~1e-7 errors)."""
    q, kv, idx, sk, grad, d_v = _inputs(rng, H=4)
    q, kv, grad = q.astype(np.float64), kv.astype(np.float64), grad.astype(np.float64)
    scale = 80**-0.5 * 2.0
    out, tq, tkv, tsk = _run_op(q, kv, idx, sk, grad, d_v, scale)
    assert out.dtype == paddle.float64 and tq.grad.dtype == paddle.float64

    rq = paddle.to_tensor(q, stop_gradient=False)
    rkv = paddle.to_tensor(kv, stop_gradient=False)
    rsk = paddle.to_tensor(sk.astype(np.float64), stop_gradient=False)
    ref = _dense(rq, rkv, idx, scale, rsk, d_v)
    (ref * paddle.to_tensor(grad)).sum().backward()
    assert rel_l2(out, ref) < 1e-12
    assert rel_l2(tq.grad, rq.grad) < 1e-12
    assert rel_l2(tkv.grad, rkv.grad) < 1e-12
    # d_sink is computed in fp64 too, then rounded to the sink's fp32.
    assert tsk.grad.dtype == paddle.float32 and rel_l2(tsk.grad, rsk.grad) < 1e-6


def _fake_interface(monkeypatch, **functions):
    """A stand-in for ``attn/interface.py`` in ``sys.modules``, where the op imports it from."""
    fake = types.ModuleType("paddlefleet.tilelang_ops.attn.interface")
    fake._DEFAULT_PROVIDER = "provider"
    for name, fn in functions.items():
        setattr(fake, name, fn)
    monkeypatch.setitem(sys.modules, "paddlefleet.tilelang_ops.attn.interface", fake)


def test_cuda_path_dispatch_with_fake_kernels(rng, monkeypatch):
    """The CUDA path (run here with a stand-in for ``interface``, since no Paddle GPU build is
    available): the backward gets the forward's own out, natural-log LSE, indices and sizes,
    asks for the deterministic kernel, and its gradients reach the right inputs."""
    q, kv, idx, sk, grad, d_v = _inputs(rng)
    calls = {}

    def fake_fwd(provider, dims, query, kv_, token_indices, sm_scale, attn_sink, block_h):
        out, lse = mqa_latent_sparse_fwd_ref(query, kv_, token_indices, sm_scale, attn_sink, d_v=dims.Dv)
        calls["fwd"] = dict(out=out.numpy(), lse=lse.numpy(), idx=token_indices.numpy(),
                            provider=provider, dims=dims, block_h=block_h)
        return out, lse

    def fake_bwd(provider, dims, query, kv_, out, grad_out, lse, attn_sink, token_indices,
                 sm_scale, block_h, deterministic, lse_format):
        calls["bwd"] = dict(out=out.numpy(), lse=lse.numpy(), idx=token_indices.numpy(),
                            provider=provider, dims=dims, deterministic=deterministic,
                            lse_format=lse_format)
        return mqa_latent_sparse_bwd_ref(query, kv_, out, grad_out, lse, attn_sink, token_indices,
                                         sm_scale)

    _fake_interface(monkeypatch, _fwd=fake_fwd, _bwd=fake_bwd)
    tq = paddle.to_tensor(q, stop_gradient=False)
    tkv = paddle.to_tensor(kv, stop_gradient=False)
    tsk = paddle.to_tensor(sk, stop_gradient=False)
    tidx = paddle.to_tensor(idx)
    dims = check_tensors(tq, tkv, tidx, attn_sink=tsk, d_v=d_v)
    out = MQALatentSparseAttentionFunction.apply(tq, tkv, tidx, tsk, 0.1, dims, "tilelang", "cuda")
    (out * paddle.to_tensor(grad)).sum().backward()

    fwd, bwd = calls["fwd"], calls["bwd"]
    np.testing.assert_array_equal(bwd["out"], fwd["out"])
    np.testing.assert_array_equal(bwd["lse"], fwd["lse"])
    np.testing.assert_array_equal(bwd["idx"], idx)
    np.testing.assert_array_equal(fwd["idx"], idx)
    assert fwd["dims"] == bwd["dims"] == dims and fwd["block_h"] is None
    assert fwd["provider"] == bwd["provider"] == "provider"  # the wrappers' default kernels
    assert bwd["deterministic"] is True and bwd["lse_format"] == "natural"
    t = paddle.to_tensor
    dq, dkv, dsink = mqa_latent_sparse_bwd_ref(t(q), t(kv), None, t(grad), None, t(sk), t(idx), 0.1)
    assert rel_l2(tq.grad, dq) < 1e-6
    assert rel_l2(tkv.grad, dkv) < 1e-6
    assert rel_l2(tsk.grad, dsink) < 1e-6


def test_one_call_checks_once(rng, monkeypatch):
    """The op checks its tensors and reads their values once per call (the reference or the
    kernel wrapper behind it used to check again); the backward checks nothing."""
    from paddlefleet.tilelang_ops.attn import op as op_mod
    from paddlefleet.tilelang_ops.attn import reference as ref_mod

    q, kv, idx, sk, grad, d_v = _inputs(rng, H=4)
    calls = []
    for module in (op_mod, ref_mod):
        record_calls(monkeypatch, calls, module, "check_tensors", "check_values")
    _run_op(q, kv, idx, sk, grad, d_v, 0.1)
    assert calls == ["check_tensors", "check_values"]


def test_bf16_on_cpu_keeps_dtypes(rng):
    # Paddle's CPU build has no bf16 math, but the reference computes in fp32 internally, so a
    # bf16 call works on CPU and returns bf16 out/dq/dkv (fp32 d_sink), close to the fp32 op.
    q, kv, idx, sk, grad, d_v = _inputs(rng, H=4)
    q16 = paddle.to_tensor(q).astype("bfloat16")
    kv16 = paddle.to_tensor(kv).astype("bfloat16")
    q16.stop_gradient = kv16.stop_gradient = False
    tsk = paddle.to_tensor(sk, stop_gradient=False)
    out = mqa_latent_sparse_attention(q16, kv16, paddle.to_tensor(idx), 0.1, tsk, d_v=d_v)
    (out.astype("float32") * paddle.to_tensor(grad)).sum().backward()
    assert out.dtype == q16.grad.dtype == kv16.grad.dtype == paddle.bfloat16
    assert tsk.grad.dtype == paddle.float32
    # fp32 op on the bf16-rounded inputs: only the output/gradient roundings differ.
    ref_out, rq, rkv, rsk = _run_op(
        q16.astype("float32").numpy(), kv16.astype("float32").numpy(), idx, sk, grad, d_v, 0.1
    )
    assert rel_l2(out, ref_out) < 1e-2
    assert rel_l2(q16.grad, rq.grad) < 1e-2
    assert rel_l2(kv16.grad, rkv.grad) < 1e-2
    assert rel_l2(tsk.grad, rsk.grad) < 1e-2


@pytest.mark.parametrize("sink", [True, False], ids=["sink", "nosink"])
def test_cuda_path_through_real_wrappers_with_cpu_stand_in(rng, monkeypatch, sink):
    """The op's CUDA path through the real host wrappers' bodies (``interface.py``: head
    padding, LSE bridge, exact deterministic dKV), with the three kernels replaced by the CPU
    stand-ins of ``helpers.CpuStandIn``.  bf16 in and out, (Dk, Dv) = (576, 512) as the kernels
    take."""
    from paddlefleet.tilelang_ops.attn import interface

    stand_in = CpuStandIn()
    monkeypatch.setattr(interface, "_DEFAULT_PROVIDER", stand_in)
    monkeypatch.setitem(sys.modules, "paddlefleet.tilelang_ops.attn.interface", interface)
    B, S, H, S_kv, L = 1, 6, 20, 12, 8  # 20 heads: one 32-head tile (12 pad heads)
    q = rng.standard_normal((B, S, H, 576)).astype(np.float32)
    kv = rng.standard_normal((B, S_kv, 576)).astype(np.float32)
    idx = rng.integers(-1, S_kv, (B, S, L)).astype(np.int32)
    idx[..., 0] = np.abs(idx[..., 0])
    sk = rng.standard_normal(H).astype(np.float32) if sink else None
    grad = rng.standard_normal((B, S, H, 512)).astype(np.float32)
    scale = 576**-0.5

    q16 = paddle.to_tensor(q).astype("bfloat16")
    kv16 = paddle.to_tensor(kv).astype("bfloat16")
    q16.stop_gradient = kv16.stop_gradient = False
    tsk = None if sk is None else paddle.to_tensor(sk, stop_gradient=False)
    tidx = paddle.to_tensor(idx)
    dims = check_tensors(q16, kv16, tidx, attn_sink=tsk, d_v=512)
    out = MQALatentSparseAttentionFunction.apply(q16, kv16, tidx, tsk, scale, dims, "tilelang", "cuda")
    assert out.dtype == paddle.bfloat16
    (out.astype("float32") * paddle.to_tensor(grad)).sum().backward()
    assert q16.grad.dtype == kv16.grad.dtype == paddle.bfloat16
    kinds = [c[0] for c in stand_in.calls]
    # The deterministic backward: the preprocess with the grids, the exact first pass (with
    # dq), the re-run plan and slots, then the re-run and the finish (fp32 accumulator to bf16).
    assert kinds == ["fwd", "grid_rows", "grid_scatter", "grid_keys", "main",
                     "rerun_plan", "rerun_slots", "main", "finish"], stand_in.calls
    mains = [c for c in stand_in.calls if c[0] == "main"]
    assert [c[-2:] for c in mains] == [("exact", True), ("exact", False)]

    # fp32 reference on the same bf16-rounded inputs; bf16 outputs, so ~1e-2 relative.
    ref_out, rq, rkv, rsk = _run_op(
        q16.astype("float32").numpy(), kv16.astype("float32").numpy(), idx, sk, grad, 512, scale
    )
    assert rel_l2(out, ref_out) < 1e-2
    assert rel_l2(q16.grad, rq.grad) < 1e-2
    assert rel_l2(kv16.grad, rkv.grad) < 1e-2
    if sink:
        assert rel_l2(tsk.grad, rsk.grad) < 1e-2


# --- packed documents (B = 1, cu_seqlens) -----------------------------------------------------
def _packed(rng, lengths, H=8, Dk=80, d_v=64, L=12):
    cu = cu_seqlens_from_lengths(lengths)
    S = int(cu[-1])
    q = rng.standard_normal((1, S, H, Dk))
    kv = rng.standard_normal((1, S, Dk))
    idx = varlen_causal_topk_indices(cu, L, seed=int(rng.integers(1 << 30)))
    sk = rng.standard_normal(H).astype(np.float32)
    grad = rng.standard_normal((1, S, H, d_v))
    return cu, q, kv, idx, sk, grad, d_v


@pytest.mark.parametrize("sink", [True, False], ids=["sink", "nosink"])
def test_packed_equals_documents_alone_float64(rng, sink):
    """One packed call (B = 1, indices inside each document) equals every document run alone,
    stacked along S: out, dq, dkv, and d_sink summed over the documents."""
    cu, q, kv, idx, sk, grad, d_v = _packed(rng, [1, 30, 0, 7, 2, 19])
    sk = sk if sink else None
    scale = 80**-0.5 * 2.0
    tcu = paddle.to_tensor(cu)
    tq = paddle.to_tensor(q, stop_gradient=False)
    tkv = paddle.to_tensor(kv, stop_gradient=False)
    tsk = None if sk is None else paddle.to_tensor(sk, stop_gradient=False)
    out = mqa_latent_sparse_attention(tq, tkv, paddle.to_tensor(idx), scale, tsk, d_v=d_v,
                               cu_seqlens=tcu)
    (out * paddle.to_tensor(grad)).sum().backward()
    assert out.dtype == paddle.float64

    outs, dqs, dkvs, dsink = [], [], [], 0.0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == b:
            continue
        doc_idx = np.where(idx[:, a:b] >= 0, idx[:, a:b] - a, -1)
        o, dq_, dkv_, ds_ = _run_op(q[:, a:b], kv[:, a:b], doc_idx, sk, grad[:, a:b], d_v, scale)
        outs.append(o.numpy())
        dqs.append(dq_.grad.numpy())
        dkvs.append(dkv_.grad.numpy())
        if sk is not None:
            dsink = dsink + ds_.grad.numpy().astype(np.float64)
    assert rel_l2(out, np.concatenate(outs, 1)) <= 1e-12
    assert rel_l2(tq.grad, np.concatenate(dqs, 1)) <= 1e-12
    assert rel_l2(tkv.grad, np.concatenate(dkvs, 1)) <= 1e-12
    if sk is not None:  # d_sink is rounded to the sink's fp32, per call
        assert rel_l2(tsk.grad, dsink) <= 1e-6
    # and cu_seqlens changes nothing but the checks: the same call without it is identical
    plain = mqa_latent_sparse_attention(paddle.to_tensor(q), paddle.to_tensor(kv), paddle.to_tensor(idx),
                                 scale, None if sk is None else paddle.to_tensor(sk), d_v=d_v)
    np.testing.assert_array_equal(plain.numpy(), out.numpy())


def test_packed_errors(rng):
    cu, q, kv, idx, sk, grad, d_v = _packed(rng, [6, 10, 4])
    t = paddle.to_tensor

    def call(idx_=idx, cu_=cu, q_=q, kv_=kv):
        return mqa_latent_sparse_attention(t(q_), t(kv_), t(idx_), 0.1, t(sk), d_v=d_v, cu_seqlens=cu_)

    call(cu_=t(cu))  # numpy and Paddle cu_seqlens both work
    with pytest.raises(TypeError, match="^cu_seqlens: expected dtype int32, got int64"):
        call(cu_=t(cu.astype(np.int64)))
    with pytest.raises(TypeError, match="^cu_seqlens: expected an int32 paddle.Tensor.*got list"):
        call(cu_=cu.tolist())
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected cu_seqlens\[0\] == 0, got 1"):
        call(cu_=np.array([1, 6, 16, 20], np.int32))
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected non-decreasing values, got "
                                         r"cu_seqlens\[2\]=5 < cu_seqlens\[1\]=6"):
        call(cu_=np.array([0, 6, 5, 20], np.int32))
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected cu_seqlens\[-1\] == S=20 "
                                         r"\(the packed rows\), got 16"):
        call(cu_=np.array([0, 6, 16], np.int32))
    with pytest.raises(ValueError, match="^query: packed documents .cu_seqlens. need B=1"):
        call(q_=np.concatenate([q, q]), kv_=np.concatenate([kv, kv]),
             idx_=np.concatenate([idx, idx]))
    with pytest.raises(ValueError, match=r"^kv: with cu_seqlens expected S_kv = S = 20.*got S_kv=21"):
        call(kv_=np.concatenate([kv, kv[:, :1]], 1))
    # a key of the previous document, the row's own start stays fine
    bad = idx.copy()
    bad[0, 9, 3] = 5  # row 9 is in document 1, rows [6, 16)
    bad[0, 17, 0] = 15  # row 17 is in document 2, rows [16, 20): a second bad row
    with pytest.raises(ValueError, match=r"^token_indices: row 9 \(document 1, rows \[6, 16\) of "
                                         r"cu_seqlens\) holds key 5, outside its document \(2 such"):
        call(idx_=bad)
    # the range check comes first (the op's value checks, before the in-document one)
    bad[0, 2, 0] = 20
    with pytest.raises(ValueError, match=r"^token_indices: expected values -1 .empty slot. or in "
                                         r"\[0, S_kv=20\)"):
        call(idx_=bad)


def test_packed_check_runs_on_the_cuda_path(rng, monkeypatch):
    """On CUDA the op checks its inputs with the kernel wrapper's rules
    (``interface._check_inputs``); the in-document check must run there too, before the
    kernel.  Simulated: the op sees its tensors as CUDA ones and a stand-in ``interface`` checks
    with the CPU rules and runs the reference."""
    from paddlefleet.tilelang_ops.attn import op as op_mod

    cu, q, kv, idx, sk, grad, d_v = _packed(rng, [5, 11])
    launched = []

    def fake_check(query, kv_, token_indices, sm_scale, attn_sink, check_indices, provider, *,
                   d_v):
        assert check_indices is True and provider == "provider"  # the default provider
        dims = check_tensors(query, kv_, token_indices, attn_sink=attn_sink, d_v=d_v)
        check_values(dims, token_indices, attn_sink=attn_sink)
        launched.append("check")
        return dims, sm_scale

    def fake_fwd(provider, dims, query, kv_, token_indices, sm_scale, attn_sink, block_h):
        launched.append("fwd")
        return mqa_latent_sparse_fwd_ref(query, kv_, token_indices, sm_scale, attn_sink, d_v=dims.Dv)

    _fake_interface(monkeypatch, _check_inputs=fake_check, _fwd=fake_fwd)
    real_ops_for = op_mod.ops_for

    def cuda_ops_for(*ts):
        ops = real_ops_for(*ts)
        ops = types.SimpleNamespace(**{k: getattr(ops, k) for k in ("name", "dtype", "cast")})
        ops.device_kind = lambda t: "cuda"
        return ops

    monkeypatch.setattr(op_mod, "ops_for", cuda_ops_for)
    t = paddle.to_tensor
    bad = idx.copy()
    bad[0, 7, 0] = 2  # row 7 is in document 1, rows [5, 16)
    with pytest.raises(ValueError, match=r"^token_indices: row 7 \(document 1"):
        mqa_latent_sparse_attention(t(q), t(kv), t(bad), 0.1, t(sk), "reference", d_v=d_v,
                             cu_seqlens=cu)
    assert launched == ["check"]
    out = mqa_latent_sparse_attention(t(q), t(kv), t(idx), 0.1, t(sk), "reference", d_v=d_v,
                               cu_seqlens=cu)
    assert launched == ["check", "check", "fwd"]
    ref, _ = mqa_latent_sparse_fwd_ref(t(q), t(kv), t(idx), 0.1, t(sk), d_v=d_v)  # as the stand-in
    np.testing.assert_array_equal(out.numpy(), ref.numpy())
