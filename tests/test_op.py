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

from paddlefleet.tilelang_ops.attn.checks import check_tensors, prepare_indices
from paddlefleet.tilelang_ops.attn.indices import (
    cu_seqlens_from_lengths,
    varlen_causal_topk_indices,
)
from paddlefleet.tilelang_ops.attn.op import (
    DETERMINISM_FLAG,
    mqa_latent_sparse_attention,
    resolve_backward_backend,
    resolve_deterministic,
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


@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
def test_numpy_token_indices_equal_tensor_indices(rng, idx_dtype):
    """Issue 42: indices.causal_topk_indices returns numpy, and the op refused it.  A numpy
    int32/int64 array is copied to the query's place and gives the same output and gradients,
    bit for bit, as the same indices as a tensor; the value checks still apply to it, and a
    numpy array of another dtype is a TypeError naming it."""
    q, kv, idx, sk, grad, d_v = _inputs(rng, idx_dtype=idx_dtype)
    results = []
    for indices in (paddle.to_tensor(idx), idx):
        tq, tkv, tsk = (paddle.to_tensor(a, stop_gradient=False) for a in (q, kv, sk))
        out = mqa_latent_sparse_attention(tq, tkv, indices, 0.1, tsk, d_v=d_v)
        (out * paddle.to_tensor(grad)).sum().backward()
        results.append([out.numpy(), tq.grad.numpy(), tkv.grad.numpy(), tsk.grad.numpy()])
    assert np.abs(results[0][0]).max() > 0
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)
    t = paddle.to_tensor
    bad = idx.copy()
    bad[0, 0, 0] = kv.shape[1]
    with pytest.raises(ValueError, match="^token_indices: expected values -1"):
        mqa_latent_sparse_attention(t(q), t(kv), bad, 0.1, t(sk), d_v=d_v)
    with pytest.raises(TypeError, match=r"^token_indices: expected dtype int32 or int64 \(a numpy "
                                        r"array is accepted\), got numpy float32$"):
        mqa_latent_sparse_attention(t(q), t(kv), idx.astype(np.float32), 0.1, t(sk), d_v=d_v)


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
    for name, fn in functions.items():
        setattr(fake, name, fn)
    monkeypatch.setitem(sys.modules, "paddlefleet.tilelang_ops.attn.interface", fake)


def _as_cuda(monkeypatch):
    """The op sees its (CPU) tensors as CUDA ones: its CUDA path runs here (no Paddle GPU
    build); the wrappers behind it are the real ones or stand-ins, their tensors CPU ones."""
    from paddlefleet.tilelang_ops.attn import op as op_mod

    real_ops_for = op_mod.ops_for

    def cuda_ops_for(*ts):
        ops = real_ops_for(*ts)
        ops = types.SimpleNamespace(**{k: getattr(ops, k)
                                       for k in ("name", "dtype", "cast", "contiguous")})
        ops.device_kind = lambda t: "cuda"
        return ops

    monkeypatch.setattr(op_mod, "ops_for", cuda_ops_for)


def _stand_in_kernels(monkeypatch):
    """The real wrappers (``interface.py``) with ``helpers.CpuStandIn`` as their default kernel
    provider."""
    from paddlefleet.tilelang_ops.attn import interface, kernel_provider

    stand_in = CpuStandIn()
    monkeypatch.setattr(kernel_provider, "DEFAULT_PROVIDER", stand_in)
    monkeypatch.setitem(sys.modules, "paddlefleet.tilelang_ops.attn.interface", interface)
    return stand_in


def test_cuda_path_dispatch_with_fake_kernels(rng, monkeypatch):
    """The CUDA path through the wrappers' public entry points (a stand-in ``interface``): one
    ``check_inputs``, whose ``PreparedIndices`` the forward and the backward get in place of
    the indices; the backward gets the forward's own out and natural-log LSE, asks for the
    deterministic kernel, and its gradients reach the right inputs."""
    q, kv, idx, sk, grad, d_v = _inputs(rng)
    calls = {}

    def fake_check(query, kv_, token_indices, attn_sink, *, d_v, cu_seqlens):
        assert cu_seqlens is None
        dims = check_tensors(query, kv_, token_indices, attn_sink=attn_sink, d_v=d_v)
        calls["check"] = prepare_indices(dims, token_indices, attn_sink=attn_sink)
        return calls["check"]

    def fake_fwd(query, kv_, token_indices, sm_scale, attn_sink, **kw):
        out, lse = mqa_latent_sparse_fwd_ref(query, kv_, token_indices, sm_scale, attn_sink)
        calls["fwd"] = dict(out=out.numpy(), lse=lse.numpy(), idx=token_indices, kw=kw)
        return out, lse

    def fake_bwd(query, kv_, out, grad_out, lse, attn_sink, token_indices, sm_scale, **kw):
        calls["bwd"] = dict(out=out.numpy(), lse=lse.numpy(), idx=token_indices, kw=kw)
        return mqa_latent_sparse_bwd_ref(query, kv_, out, grad_out, lse, attn_sink, token_indices,
                                         sm_scale)

    _fake_interface(monkeypatch, check_inputs=fake_check, mqa_latent_sparse_fwd=fake_fwd,
                    mqa_latent_sparse_bwd=fake_bwd)
    _as_cuda(monkeypatch)
    monkeypatch.delenv(DETERMINISM_FLAG, raising=False)  # the default: deterministic
    out, tq, tkv, tsk = _run_op(q, kv, idx, sk, grad, d_v, 0.1)

    fwd, bwd = calls["fwd"], calls["bwd"]
    np.testing.assert_array_equal(bwd["out"], fwd["out"])
    np.testing.assert_array_equal(bwd["lse"], fwd["lse"])
    assert fwd["idx"] is bwd["idx"] is calls["check"]  # checked and cast once, then reused
    np.testing.assert_array_equal(calls["check"].indices.numpy(), idx)
    assert fwd["kw"] == {} and bwd["kw"] == {"deterministic": True}  # the default kernels
    t = paddle.to_tensor
    dq, dkv, dsink = mqa_latent_sparse_bwd_ref(t(q), t(kv), None, t(grad), None, t(sk), t(idx), 0.1)
    assert rel_l2(tq.grad, dq) < 1e-6
    assert rel_l2(tkv.grad, dkv) < 1e-6
    assert rel_l2(tsk.grad, dsink) < 1e-6


def test_one_call_checks_once(rng, monkeypatch):
    """The op checks its tensors and reads their values once per call, and casts the indices
    once.  The reference behind it, handed the ``PreparedIndices``, checks the tensors' metadata
    against it and the (cheap on CPU: two reductions and the [H] sink) values again, so that a
    ``PreparedIndices`` is never trusted with tensors it was not made for (break-it 2); it
    casts nothing."""
    from paddlefleet.tilelang_ops.attn import checks as checks_mod
    from paddlefleet.tilelang_ops.attn import op as op_mod
    from paddlefleet.tilelang_ops.attn import reference as ref_mod

    q, kv, idx, sk, grad, d_v = _inputs(rng, H=4, idx_dtype="int64")
    calls = []
    record_calls(monkeypatch, calls, op_mod, "check_tensors", "prepare_indices")
    record_calls(monkeypatch, calls, ref_mod, "check_tensors", "check_values")
    record_calls(monkeypatch, calls, checks_mod, "int32_indices", "check_cu_seqlens")
    _run_op(q, kv, idx, sk, grad, d_v, 0.1)
    assert calls == ["check_tensors", "prepare_indices", "int32_indices",
                     "check_tensors", "check_values",    # the reference forward
                     "check_tensors", "check_values"]    # the reference backward


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
    """The op's CUDA path through the real host wrappers (``interface.py``: head padding, LSE
    bridge, exact deterministic dKV), with the kernels replaced by the CPU stand-ins of
    ``helpers.CpuStandIn``.  bf16 in and out, (Dk, Dv) = (576, 512) as the kernels take."""
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
    with monkeypatch.context() as m:
        stand_in = _stand_in_kernels(m)
        _as_cuda(m)
        m.delenv(DETERMINISM_FLAG, raising=False)  # the default: deterministic
        out = mqa_latent_sparse_attention(q16, kv16, paddle.to_tensor(idx), scale, tsk)
        assert out.dtype == paddle.bfloat16
        (out.astype("float32") * paddle.to_tensor(grad)).sum().backward()
    assert q16.grad.dtype == kv16.grad.dtype == paddle.bfloat16
    kinds = [c[0] for c in stand_in.calls]
    # The deterministic backward: the preprocess with the grids, the exact first pass (with
    # dq), the re-run plan and slots, then the re-run and the finish (fp32 accumulator to bf16).
    assert kinds == ["fwd", "grid_rows", "grid_scatter", "grid_keys", "main",
                     "rerun_plan", "rerun_slots", "main", "finish"], stand_in.calls
    mains = [c for c in stand_in.calls if c[0] == "main"]
    assert [c[-2:] for c in mains] == [(True, True), (True, False)]  # (deterministic, with dq)

    # fp32 reference on the same bf16-rounded inputs; bf16 outputs, so ~1e-2 relative.
    ref_out, rq, rkv, rsk = _run_op(
        q16.astype("float32").numpy(), kv16.astype("float32").numpy(), idx, sk, grad, 512, scale
    )
    assert rel_l2(out, ref_out) < 1e-2
    assert rel_l2(q16.grad, rq.grad) < 1e-2
    assert rel_l2(kv16.grad, rkv.grad) < 1e-2
    if sink:
        assert rel_l2(tsk.grad, rsk.grad) < 1e-2


def _kernel_case(rng, H=16, S=4, S_kv=12, L=8):
    """bf16 inputs the kernels (and their stand-ins) take: (q, kv, idx, sink, grad) numpy."""
    q = rng.standard_normal((1, S, H, 576)).astype(np.float32)
    kv = rng.standard_normal((1, S_kv, 576)).astype(np.float32)
    idx = rng.integers(-1, S_kv, (1, S, L)).astype(np.int32)
    idx[..., 0] = np.abs(idx[..., 0])
    sk = rng.standard_normal(H).astype(np.float32)
    grad = rng.standard_normal((1, S, H, 512)).astype(np.float32)
    return q, kv, idx, sk, grad


@pytest.mark.parametrize("deterministic, flag, want", [
    (None, None, True), (None, "0", False), (None, "false", False), (None, "1", True),
    (True, "0", True), (False, None, False), (False, "1", False)])
def test_deterministic_reaches_the_kernel_provider(rng, monkeypatch, deterministic, flag, want):
    """Issue 42: the op hard-coded the deterministic kernel.  ``deterministic`` (``None``:
    Paddle's ``FLAGS_cudnn_deterministic`` where set, else True) is what the provider's
    backward launchers get; the gradients agree either way."""
    if flag is None:
        monkeypatch.delenv(DETERMINISM_FLAG, raising=False)
    else:
        monkeypatch.setenv(DETERMINISM_FLAG, flag)
    q, kv, idx, sk, grad = _kernel_case(rng)
    tq = paddle.to_tensor(q).astype("bfloat16")
    tq.stop_gradient = False
    with monkeypatch.context() as m:
        stand_in = _stand_in_kernels(m)
        _as_cuda(m)
        out = mqa_latent_sparse_attention(tq, paddle.to_tensor(kv).astype("bfloat16"),
                                          paddle.to_tensor(idx), 576**-0.5,
                                          paddle.to_tensor(sk), deterministic=deterministic)
        (out.astype("float32") * paddle.to_tensor(grad)).sum().backward()
    launched = [c for c in stand_in.calls if c[0] in ("main", "finish")]
    if want:
        assert [c[-2:] for c in launched[:2]] == [(True, True), (True, False)]
    else:
        assert [c[-2] for c in launched[:1]] == [False] and len(launched) == 2
    assert launched[-1] == ("finish", 16, want)
    _, rq, _, _ = _run_op(tq.astype("float32").numpy(), paddle.to_tensor(kv).astype(
        "bfloat16").astype("float32").numpy(), idx, sk, grad, 512, 576**-0.5)
    assert rel_l2(tq.grad, rq.grad) < 1e-2


def test_deterministic_follows_paddles_flag_where_the_user_set_it(monkeypatch):
    """``None``: ``FLAGS_cudnn_deterministic`` as ``paddle.get_flags`` reads it when true, or
    false and set in the environment; the flag's default (false, not set) keeps ours, True.
    Paddle's CPU build registers no such flag (``get_flags`` raises): the environment then."""
    flags = {}

    def get_flags(names):
        if "value" not in flags:
            raise ValueError(f"Flag {names[0]} cannot get its value through this function.")
        return {names[0]: flags["value"]}

    monkeypatch.setattr(paddle, "get_flags", get_flags)
    monkeypatch.delenv(DETERMINISM_FLAG, raising=False)
    assert resolve_deterministic(None) is True  # no flag, not set
    monkeypatch.setenv(DETERMINISM_FLAG, "0")
    assert resolve_deterministic(None) is False
    monkeypatch.setenv(DETERMINISM_FLAG, "True")
    assert resolve_deterministic(None) is True
    flags["value"] = False  # a build with the flag: its default, nobody set it
    monkeypatch.delenv(DETERMINISM_FLAG)
    assert resolve_deterministic(None) is True
    monkeypatch.setenv(DETERMINISM_FLAG, "1")  # set in the environment, then set_flags(False)
    assert resolve_deterministic(None) is False
    flags["value"] = True  # paddle.set_flags({"FLAGS_cudnn_deterministic": True})
    monkeypatch.delenv(DETERMINISM_FLAG)
    assert resolve_deterministic(None) is True
    assert resolve_deterministic(False) is False and resolve_deterministic(True) is True
    for bad in (1, "yes", np.array([True])):
        with pytest.raises(TypeError, match="^deterministic: expected True, False or None"):
            resolve_deterministic(bad)


def test_deterministic_takes_numpy_bools_by_value():
    """The configs take ``numpy.bool_`` by value; the op refused ``np.True_`` (break-it 5)."""
    assert resolve_deterministic(np.True_) is True
    assert resolve_deterministic(np.False_) is False


@pytest.mark.parametrize("text, want", [
    ("t", True), ("F", False), ("true", True), ("FALSE", False), ("Yes", True), ("no", False),
    ("y", True), ("N", False), ("1", True), ("0", False), (" yes ", True)])
def test_the_environment_flag_is_read_as_gflags_reads_it(monkeypatch, text, want):
    """Paddle's CPU build has no cuDNN flag: the environment value is read as gflags would."""
    monkeypatch.setattr(paddle, "get_flags", _no_flag)
    monkeypatch.setenv(DETERMINISM_FLAG, text)
    assert resolve_deterministic(None) is want


@pytest.mark.parametrize("text", ["garbage", "on", "off", "2", "-1", "truee"])
def test_an_unreadable_environment_flag_is_refused(monkeypatch, text):
    """gflags refuses these; we read them as False (break-it 5: 'on' and 'garbage' gave
    False).  Now a ValueError naming the variable and its value."""
    monkeypatch.setattr(paddle, "get_flags", _no_flag)
    monkeypatch.setenv(DETERMINISM_FLAG, text)
    with pytest.raises(ValueError, match=f"^{DETERMINISM_FLAG}={text!r} in the environment"):
        resolve_deterministic(None)
    with pytest.raises(ValueError, match=DETERMINISM_FLAG):
        mqa_latent_sparse_attention(paddle.ones([1, 1, 1, 4]), paddle.ones([1, 1, 4]),
                                    paddle.zeros([1, 1, 1], "int32"), 0.5, d_v=4)


@pytest.mark.parametrize("text", ["", "  "])
def test_an_empty_environment_flag_counts_as_unset(monkeypatch, text):
    monkeypatch.setattr(paddle, "get_flags", _no_flag)
    monkeypatch.setenv(DETERMINISM_FLAG, text)
    assert resolve_deterministic(None) is True


def _no_flag(names):
    raise ValueError(f"Flag {names[0]} cannot get its value through this function.")


def _edit_case(rng, monkeypatch, path):
    """``(q, kv, idx, sink, grad, d_v, dtype)`` for the op on the reference path (fp32) or the
    TileLang path (bf16, the CPU stand-in kernels as if on CUDA)."""
    if path == "tilelang":
        _stand_in_kernels(monkeypatch)
        _as_cuda(monkeypatch)
        q, kv, idx, sk, grad = _kernel_case(rng)
        return q, kv, idx, sk, grad, 512, "bfloat16"
    return (*_inputs(rng), "float32")


@pytest.mark.parametrize("path", ["reference", "tilelang"])
@pytest.mark.parametrize("edited", ["query", "kv", "attn_sink"])
@pytest.mark.parametrize("how", ["add_", "setitem"])
def test_an_input_edited_in_place_after_the_forward_is_refused(rng, monkeypatch, path, edited,
                                                               how):
    """Issue 41: ``Qn = Q * 1.0``, the op on ``Qn``, ``Qn.add_(1)``, then ``.backward()`` gave
    dq off by up to 0.37.  As Paddle's own ops, the backward now refuses an edit by an op that
    bumps the inplace version (``add_``/``scale_``, setitem), naming the tensor (Paddle reports
    a PyLayer's error as an OSError).  (``set_value``/``copy_`` are not versioned by Paddle and
    cannot be seen: documented, not tested.)"""
    q, kv, idx, sk, grad, d_v, dtype = _edit_case(rng, monkeypatch, path)
    Q = paddle.to_tensor(q).astype(dtype)
    KV = paddle.to_tensor(kv).astype(dtype)
    SK = paddle.to_tensor(sk)
    Q.stop_gradient = KV.stop_gradient = SK.stop_gradient = False
    t = dict(query=Q * 1.0, kv=KV * 1.0, token_indices=paddle.to_tensor(idx),
             attn_sink=SK * 1.0)
    out = mqa_latent_sparse_attention(t["query"], t["kv"], t["token_indices"], 0.1,
                                      t["attn_sink"], d_v=d_v)
    if how == "setitem":
        t[edited][0] = 3.0
    elif t[edited].dtype == paddle.bfloat16:
        t[edited].scale_(2.0)  # Paddle's CPU build has no bf16 add
    else:
        t[edited].add_(paddle.ones_like(t[edited]))
    loss = (out.astype("float32") * paddle.to_tensor(grad)).sum()
    with pytest.raises((OSError, RuntimeError),
                       match=f"{edited} was modified by an inplace operation after the forward"):
        loss.backward()


@pytest.mark.parametrize("path", ["reference", "tilelang"])
@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
@pytest.mark.parametrize("how", ["set_value", "add_", "setitem"])
def test_indices_edited_after_the_forward_leave_the_gradients_unchanged(rng, monkeypatch, path,
                                                                        idx_dtype, how):
    """Break-it 1(a): an int32 ``token_indices`` was saved as the caller's own tensor, and
    ``idx.set_value(...)`` (which Paddle does not version) between forward and backward gave
    gradients for other keys, silently.  The forward now keeps its own copy, so any edit of
    the caller's indices, versioned or not, leaves the gradients those of an unedited run."""
    q, kv, idx, sk, grad, d_v, dtype = _edit_case(rng, monkeypatch, path)
    idx = idx.astype(idx_dtype)

    def grads(edit):
        Q = paddle.to_tensor(q).astype(dtype)
        KV = paddle.to_tensor(kv).astype(dtype)
        SK = paddle.to_tensor(sk)
        Q.stop_gradient = KV.stop_gradient = SK.stop_gradient = False
        I = paddle.to_tensor(idx)
        out = mqa_latent_sparse_attention(Q, KV, I, 0.1, SK, d_v=d_v)
        if edit:
            other = np.where(idx >= 0, 0, -1).astype(idx_dtype)  # every valid slot -> key 0
            if how == "set_value":
                I.set_value(other)
            elif how == "add_":
                I.add_(paddle.ones_like(I))
            else:
                I[:] = paddle.to_tensor(other)
            assert not np.array_equal(I.numpy(), idx)
        (out.astype("float32") * paddle.to_tensor(grad)).sum().backward()
        return [t.grad.astype("float32").numpy() for t in (Q, KV, SK)]

    for want, got in zip(grads(False), grads(True)):
        np.testing.assert_array_equal(got, want)


def test_out_edited_in_place_is_refused_where_the_backward_reads_it(rng, monkeypatch):
    """The kernels' backward reads ``out`` (Delta); the reference recomputes it, so an edited
    ``out`` changes nothing there and is allowed."""
    q, kv, idx, sk, grad, d_v = _inputs(rng)
    out, tq, _, _ = _run_op(q, kv, idx, sk, grad, d_v, 0.1)
    want = tq.grad.numpy()
    tq = paddle.to_tensor(q, stop_gradient=False)
    out = mqa_latent_sparse_attention(tq, paddle.to_tensor(kv), paddle.to_tensor(idx), 0.1,
                                      paddle.to_tensor(sk), d_v=d_v)
    out.add_(paddle.ones_like(out))
    (out * paddle.to_tensor(grad)).sum().backward()
    np.testing.assert_array_equal(tq.grad.numpy(), want)

    _stand_in_kernels(monkeypatch)
    _as_cuda(monkeypatch)
    q, kv, idx, sk, grad = _kernel_case(rng)
    tq = paddle.to_tensor(q).astype("bfloat16")
    tq.stop_gradient = False
    out = mqa_latent_sparse_attention(tq, paddle.to_tensor(kv).astype("bfloat16"),
                                      paddle.to_tensor(idx), 0.1, paddle.to_tensor(sk))
    out.scale_(2.0)
    with pytest.raises((OSError, RuntimeError), match="out was modified by an inplace operation"):
        (out.astype("float32") * paddle.to_tensor(grad)).sum().backward()


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
    (``interface.check_inputs``); the in-document check must run there too, before any kernel.
    The real wrappers with ``helpers.CpuStandIn`` as their kernels."""
    stand_in = _stand_in_kernels(monkeypatch)
    _as_cuda(monkeypatch)
    cu = cu_seqlens_from_lengths([5, 11])
    idx = varlen_causal_topk_indices(cu, 8, seed=int(rng.integers(1 << 30)))
    q = paddle.to_tensor(rng.standard_normal((1, 16, 16, 576)).astype(np.float32)).astype(
        "bfloat16")
    kv = paddle.to_tensor(rng.standard_normal((1, 16, 576)).astype(np.float32)).astype(
        "bfloat16")
    sk = paddle.to_tensor(rng.standard_normal(16).astype(np.float32))
    bad = idx.copy()
    bad[0, 7, 0] = 2  # row 7 is in document 1, rows [5, 16)
    with pytest.raises(ValueError, match=r"^token_indices: row 7 \(document 1"):
        mqa_latent_sparse_attention(q, kv, paddle.to_tensor(bad), 0.1, sk, "reference",
                                    cu_seqlens=cu)
    assert stand_in.calls == []
    out = mqa_latent_sparse_attention(q, kv, paddle.to_tensor(idx), 0.1, sk, "reference",
                                      cu_seqlens=cu)
    assert [c[0] for c in stand_in.calls] == ["fwd"]
    ref, _ = mqa_latent_sparse_fwd_ref(q, kv, paddle.to_tensor(idx), 0.1, sk)
    assert rel_l2(out.astype("float32"), ref) < 1e-2
