"""The reference (attn/reference.py) against independent statements of the same math.

* forward: a dense numpy softmax over all S_kv keys (duplicate slots as multiplicities) with the
  sink as one extra column;
* backward: Paddle autograd through a plain fp64 formulation of the forward written here, and
  central finite differences of the reference forward itself (fp64);
* the kernel's base-2 LSE form (attn/lse.py) rebuilding the probabilities.

Tolerances (relative L2 unless said otherwise): fp64 vs numpy / autograd 1e-12 (pure rounding,
a few hundred flops per entry); fp32 vs fp64 numpy 2e-6; finite differences (fp64, step 1e-6,
error O(step^2 * f''') + O(eps / step) ~ 1e-9) 1e-6.
"""

from __future__ import annotations

import math
import re

import numpy as np
import paddle
import pytest

from helpers import Framework, extreme_logits_case, record_calls, rel_l2, requires_cuda

from paddlefleet.tilelang_ops.attn import reference as ref_mod
from paddlefleet.tilelang_ops.attn.checks import Dims, check_tensors
from paddlefleet.tilelang_ops.attn.lse import lse_natural_to_log2_sink
from paddlefleet.tilelang_ops.attn.reference import (
    mqa_latent_sparse_bwd_ref,
    mqa_latent_sparse_fwd_ref,
)

DK, DV, S, S_KV, L = 24, 16, 5, 9, 6


# --- inputs ----------------------------------------------------------------------------------


def make_case(rng, B, H, with_sink, dtype=np.float64):
    """Random inputs with -1 holes, one duplicate key and one row whose every slot is -1."""
    q = rng.standard_normal((B, S, H, DK)).astype(dtype)
    kv = rng.standard_normal((B, S_KV, DK)).astype(dtype)
    idx = rng.integers(0, S_KV, (B, S, L))
    idx[rng.random((B, S, L)) < 0.25] = -1
    idx[0, 0, :2] = rng.integers(0, S_KV)  # a duplicate: counts as two keys
    idx[0, 2, :] = -1  # no valid key at all
    if B > 1:
        idx[B - 1, S - 1, :] = -1
    sink = rng.standard_normal(H).astype(dtype) if with_sink else None
    grad_out = rng.standard_normal((B, S, H, DV)).astype(dtype)
    return dict(q=q, kv=kv, idx=idx, sink=sink, grad_out=grad_out, scale=1.0 / math.sqrt(DK))


def dense_numpy_fwd(q, kv, idx, sink, scale, d_v=DV):
    """Softmax over all S_kv keys, each weighted by how often the row selected it, + sink."""
    B, S_, H, _ = q.shape
    n_kv = kv.shape[1]
    counts = np.zeros((B, S_, n_kv))
    for b, s, l in np.ndindex(idx.shape):
        if idx[b, s, l] >= 0:
            counts[b, s, idx[b, s, l]] += 1
    scores = scale * np.einsum("bshd,bnd->bshn", q, kv)
    with np.errstate(divide="ignore"):
        logw = np.where(counts[:, :, None, :] > 0, scores + np.log(counts)[:, :, None, :], -np.inf)
    sink_col = np.broadcast_to(
        -np.inf if sink is None else sink[None, None, :, None], (B, S_, H, 1)
    )
    logits = np.concatenate([logw, sink_col], axis=-1)
    m = logits.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(logits - m)
    z = e.sum(axis=-1, keepdims=True)
    p = e / np.where(z > 0, z, 1.0)
    out = np.einsum("bshn,bnd->bshd", p[..., :-1], kv[..., :d_v])
    with np.errstate(divide="ignore"):
        lse = np.log(np.exp(logw - m).sum(axis=-1)) + m[..., 0]
    return out, lse


def run_ref(fw, c, dtype="float64"):
    args = (fw.t(c["q"]), fw.t(c["kv"]), fw.t(c["idx"]))
    sink = None if c["sink"] is None else fw.t(c["sink"])
    out, lse = mqa_latent_sparse_fwd_ref(*args, c["scale"], attn_sink=sink, d_v=DV, dtype=dtype)
    dq, dkv, dsink = mqa_latent_sparse_bwd_ref(
        args[0], args[1], out, fw.t(c["grad_out"]), lse, sink, args[2], c["scale"], dtype=dtype
    )
    return out, lse, dq, dkv, dsink


CASES = [(B, H, sink) for B in (1, 2) for H in (1, 3, 8) for sink in (False, True)]
CASE_IDS = [f"B{B}-H{H}-{'sink' if s else 'nosink'}" for B, H, s in CASES]


# --- forward ---------------------------------------------------------------------------------


@pytest.mark.parametrize("B,H,with_sink", CASES, ids=CASE_IDS)
def test_forward_matches_dense_numpy_fp64(fw, rng, B, H, with_sink):
    c = make_case(rng, B, H, with_sink)
    out, lse = mqa_latent_sparse_fwd_ref(
        fw.t(c["q"]), fw.t(c["kv"]), fw.t(c["idx"]), c["scale"],
        attn_sink=None if c["sink"] is None else fw.t(c["sink"]), d_v=DV, dtype="float64",
    )
    want_out, want_lse = dense_numpy_fwd(c["q"], c["kv"], c["idx"], c["sink"], c["scale"])
    assert fw.np(out).dtype == np.float64 and fw.np(lse).dtype == np.float64
    assert fw.np(out).shape == (B, S, H, DV) and fw.np(lse).shape == (B, S, H)
    assert rel_l2(fw.np(out), want_out) < 1e-12
    assert rel_l2(fw.np(lse), want_lse) < 1e-12  # -inf rows must match exactly
    # Rows without a key: out 0 and lse -inf, with or without a sink.
    np.testing.assert_array_equal(fw.np(out)[0, 2], 0.0)
    np.testing.assert_array_equal(fw.np(lse)[0, 2], -np.inf)


def test_forward_fp32_default(fw, rng):
    c = make_case(rng, 2, 3, True, dtype=np.float32)
    out, lse = mqa_latent_sparse_fwd_ref(
        fw.t(c["q"]), fw.t(c["kv"]), fw.t(c["idx"]), c["scale"], fw.t(c["sink"]), d_v=DV
    )
    assert fw.np(out).dtype == np.float32 and fw.np(lse).dtype == np.float32
    want_out, want_lse = dense_numpy_fwd(
        *(c[k].astype(np.float64) for k in ("q", "kv")), c["idx"], c["sink"].astype(np.float64),
        c["scale"],
    )
    assert rel_l2(fw.np(out), want_out) < 2e-6
    assert rel_l2(fw.np(lse), want_lse) < 2e-6


def test_forward_large_scores_stay_finite(fw, rng):
    """Scores of +-100 overflow a naive exp in fp32; the max shift must keep them finite."""
    c = make_case(rng, 1, 3, True, dtype=np.float32)
    c["q"] *= 120.0
    c["sink"] = (c["sink"] * 50.0).astype(np.float32)
    out, lse = mqa_latent_sparse_fwd_ref(
        fw.t(c["q"]), fw.t(c["kv"]), fw.t(c["idx"]), c["scale"], fw.t(c["sink"]), d_v=DV
    )
    assert np.abs(fw.np(lse)[np.isfinite(fw.np(lse))]).max() > 88  # exp would overflow fp32
    assert np.isfinite(fw.np(out)).all()
    want_out, want_lse = dense_numpy_fwd(
        c["q"].astype(np.float64), c["kv"].astype(np.float64), c["idx"],
        c["sink"].astype(np.float64), c["scale"],
    )
    assert rel_l2(fw.np(out), want_out) < 1e-5
    assert rel_l2(fw.np(lse), want_lse) < 1e-6


def test_logits_finite_where_the_raw_dot_product_overflows(fw, rng):
    """Issue 41, item 3a: fp32 inputs at 3e19 with ``sm_scale = 1e-30`` have logits ~1e9, but
    the raw ``q . k`` (~1e40) overflows fp32; scaling after the dot product gave NaN ``out`` and
    ``lse``.  The reference scales the query first: its fp32 results match the fp64 ones (where
    nothing overflows).  (The backward is finite too; its fp32 values at this scale are
    rounding noise: ``dS = P (dP - Delta)`` cancels terms of ~1e39.)"""
    c = make_case(rng, 2, 3, True, dtype=np.float32)
    for key in ("q", "kv"):
        c[key] = (c[key] * np.float32(3e19)).astype(np.float32)
    c["scale"] = 1e-30
    raw = np.einsum("bshd,bnd->bshn", c["q"].astype(np.float64), c["kv"].astype(np.float64))
    assert np.abs(raw).max() > np.finfo(np.float32).max  # the raw q.k overflows fp32
    got = [fw.np(t) for t in run_ref(fw, c, dtype="float32")]
    want = [fw.np(t) for t in run_ref(fw, c, dtype="float64")]
    for name, g in zip(("out", "dq", "dkv", "d_sink"), got[:1] + got[2:]):
        assert np.isfinite(g).all(), name
    valid = np.isfinite(want[1])
    assert np.abs(want[1][valid]).max() > 1e8  # logits ~1e9: finite in fp32
    assert rel_l2(got[0], want[0]) < 1e-6
    np.testing.assert_array_equal(np.isfinite(got[1]), valid)
    assert rel_l2(got[1][valid], want[1][valid]) < 1e-6


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_forward_at_extreme_logits(fw, dtype):
    """Issue 9's input (``helpers.extreme_logits_case``): every logit of a row equal, about
    +-5.6e7 after scaling.  No finite floor and no ``exp(s - lse)``: both heads get ``out`` =
    the keys' value row exactly (1 in channels 1.., -40960 in channel 0; was 8 = L for head 1
    in fp32) and a finite ``lse``.  The GPU forward's version is in
    ``tests/single_card_tests/test_sparse_attn_gpu.py``."""
    q, kv, idx, sm, out_x, lse_x = extreme_logits_case()
    out, lse = mqa_latent_sparse_fwd_ref(fw.bf16(q), fw.bf16(kv), fw.t(idx), sm, dtype=dtype)
    out, lse = fw.np(out), fw.np(lse)
    np.testing.assert_allclose(out, out_x, rtol=1e-6, atol=0)
    assert np.isfinite(lse).all()
    np.testing.assert_allclose(lse, lse_x, rtol=1e-6)


def test_d_v_equal_dk_and_small(fw, rng):
    """d_v is a free parameter: the value is kv[..., :d_v], including d_v = Dk."""
    c = make_case(rng, 1, 3, True)
    for d_v in (1, DK):
        out, _ = mqa_latent_sparse_fwd_ref(
            fw.t(c["q"]), fw.t(c["kv"]), fw.t(c["idx"]), c["scale"], fw.t(c["sink"]),
            d_v=d_v, dtype="float64",
        )
        want, _ = dense_numpy_fwd(c["q"], c["kv"], c["idx"], c["sink"], c["scale"], d_v=d_v)
        assert rel_l2(fw.np(out), want) < 1e-12


def test_bf16_inputs_on_paddle_cpu(paddle_fw, rng):
    """bf16 is cast to the compute dtype before any math (Paddle CPU has no bf16 kernels), so the
    result equals the fp32 reference on the bf16-rounded inputs exactly."""
    fw = paddle_fw
    c = make_case(rng, 2, 3, True, dtype=np.float32)
    q16, kv16, do16 = (fw.t(c[k]).astype("bfloat16") for k in ("q", "kv", "grad_out"))
    sink, idx = fw.t(c["sink"]), fw.t(c["idx"])
    got = mqa_latent_sparse_fwd_ref(q16, kv16, idx, c["scale"], sink, d_v=DV) + mqa_latent_sparse_bwd_ref(
        q16, kv16, None, do16, None, sink, idx, c["scale"]
    )
    q32, kv32, do32 = (t.astype("float32") for t in (q16, kv16, do16))
    want = mqa_latent_sparse_fwd_ref(q32, kv32, idx, c["scale"], sink, d_v=DV) + mqa_latent_sparse_bwd_ref(
        q32, kv32, None, do32, None, sink, idx, c["scale"]
    )
    for g, w in zip(got, want):
        assert str(g.dtype).endswith("float32")
        np.testing.assert_array_equal(g.numpy(), w.numpy())


# --- backward --------------------------------------------------------------------------------


def autograd_grads(c):
    """dq, dkv, d_sink by Paddle autograd through a plain fp64 statement of the forward."""
    import paddle

    q = paddle.to_tensor(c["q"], stop_gradient=False)
    kv = paddle.to_tensor(c["kv"], stop_gradient=False)
    idx = paddle.to_tensor(c["idx"])
    B, S_, H, _ = c["q"].shape
    valid = (idx >= 0).astype("float64").unsqueeze(2)  # [B, S, 1, L]
    safe = paddle.clip(idx, min=0)
    keys = paddle.stack([paddle.gather(kv[b], safe[b].flatten()) for b in range(B)])
    keys = keys.reshape([B, S_, L, DK])
    scores = c["scale"] * paddle.einsum("bshd,bsld->bshl", q, keys)
    # Scores here are O(1): no max shift needed, and masked slots get weight 0, not exp(-inf).
    weights = paddle.exp(scores) * valid
    z = weights.sum(-1, keepdim=True)
    if c["sink"] is not None:
        sink = paddle.to_tensor(c["sink"], stop_gradient=False)
        z = z + paddle.exp(sink).reshape([1, 1, H, 1])
    p = weights / paddle.where(z > 0, z, paddle.ones_like(z))
    out = paddle.einsum("bshl,bsld->bshd", p, keys[..., :DV])
    loss = (out * paddle.to_tensor(c["grad_out"])).sum()
    loss.backward()
    dsink = sink.grad.numpy() if c["sink"] is not None else np.zeros(H)
    return q.grad.numpy(), kv.grad.numpy(), dsink


@pytest.mark.parametrize("B,H,with_sink", CASES, ids=CASE_IDS)
def test_backward_matches_paddle_autograd(paddle_fw, rng, B, H, with_sink):
    c = make_case(rng, B, H, with_sink)
    _, _, dq, dkv, dsink = run_ref(paddle_fw, c)
    want = autograd_grads(c)
    assert dq.numpy().shape == (B, S, H, DK) and dkv.numpy().shape == (B, S_KV, DK)
    assert dsink.numpy().shape == (H,)
    assert rel_l2(dq, want[0]) < 1e-12
    assert rel_l2(dkv, want[1]) < 1e-12
    if with_sink:
        assert rel_l2(dsink, want[2]) < 1e-12
    else:
        np.testing.assert_array_equal(dsink.numpy(), 0.0)
    # The row with no key gets no gradient.
    np.testing.assert_array_equal(dq.numpy()[0, 2], 0.0)


def _loss(fw, c, q, kv, sink):
    out, _ = mqa_latent_sparse_fwd_ref(
        fw.t(q), fw.t(kv), fw.t(c["idx"]), c["scale"],
        attn_sink=None if sink is None else fw.t(sink), d_v=DV, dtype="float64",
    )
    return float((fw.np(out) * c["grad_out"]).sum())


@pytest.mark.parametrize("B,H,with_sink", CASES, ids=CASE_IDS)
def test_backward_matches_finite_differences(paddle_fw, rng, B, H, with_sink):
    fw = paddle_fw
    c = make_case(rng, B, H, with_sink)
    _, _, dq, dkv, dsink = run_ref(fw, c)
    analytic = {"q": fw.np(dq), "kv": fw.np(dkv), "sink": fw.np(dsink)}
    step = 1e-6
    names = ["q", "kv"] + (["sink"] if with_sink else [])
    for name in names:
        base = c[name]
        n_probe = base.size if name == "sink" else 16
        flat = rng.choice(base.size, size=min(n_probe, base.size), replace=False)
        fd, an = [], []
        for f in flat:
            pos = np.unravel_index(f, base.shape)
            plus, minus = base.copy(), base.copy()
            plus[pos] += step
            minus[pos] -= step
            args = {k: c[k] for k in ("q", "kv", "sink")}
            lp = _loss(fw, c, **{**args, name: plus})
            lm = _loss(fw, c, **{**args, name: minus})
            fd.append((lp - lm) / (2 * step))
            an.append(analytic[name][pos])
        assert rel_l2(np.array(an), np.array(fd)) < 1e-6, name


def test_backward_fp32_close_to_fp64(fw, rng):
    c = make_case(rng, 2, 8, True)
    got = run_ref(fw, {k: (v.astype(np.float32) if k in ("q", "kv", "sink", "grad_out") else v)
                       for k, v in c.items()}, dtype="float32")
    want = run_ref(fw, c, dtype="float64")
    for g, w in zip(got, want):
        assert fw.np(g).dtype == np.float32
        assert rel_l2(fw.np(g), fw.np(w)) < 2e-6


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("with_sink", [True, False], ids=["sink", "nosink"])
def test_rows_without_keys_are_zero_never_nan(fw, rng, with_sink, dtype):
    """Every slot -1: out, dq, dkv and d_sink are 0 and lse is -inf, with or without a sink.
    With a sink all weight is on it (out = 0, so Delta = 0 and d_sink gets 0); without one the
    softmax denominator is 0, which must give 0, never NaN."""
    c = make_case(rng, 2, 3, with_sink)
    c["idx"][:] = -1
    out, lse, dq, dkv, dsink = run_ref(fw, c, dtype=dtype)
    for t in (out, dq, dkv, dsink):
        np.testing.assert_array_equal(fw.np(t), 0.0)
    np.testing.assert_array_equal(fw.np(lse), -np.inf)


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_rows_without_keys_add_nothing_to_d_sink_whatever_their_grad_out(fw, rng, poison):
    """Issue 41, item 3b: a row with no valid key has ``out = 0``, so ``Delta = 0`` and its
    ``d_sink`` term is 0 (docs/conventions.md, "Rows with no valid key"); a NaN or inf in that
    row's ``grad_out`` made ``Delta = 0 * NaN`` and ``d_sink`` NaN.  The poisoned run equals
    the run with that row's ``grad_out`` zeroed, bit for bit."""
    c = make_case(rng, 2, 3, True)  # row (0, 2) has no valid key
    c["grad_out"][0, 2] = 0.0
    clean = [fw.np(t) for t in run_ref(fw, c)]
    c["grad_out"][0, 2] = poison
    poisoned = [fw.np(t) for t in run_ref(fw, c)]
    assert np.isfinite(clean[4]).all() and np.abs(clean[4]).max() > 0
    for name, a, b in zip(("out", "lse", "dq", "dkv", "d_sink"), clean, poisoned):
        np.testing.assert_array_equal(b, a, err_msg=name)


def test_minus_one_slots_never_touch_row_zero(fw, rng):
    """A -1 slot is gathered as row 0 but masked: dkv[0] must stay 0 when no row selects key 0."""
    c = make_case(rng, 1, 3, True)
    c["idx"][c["idx"] == 0] = 1
    _, _, _, dkv, _ = run_ref(fw, c)
    np.testing.assert_array_equal(fw.np(dkv)[0, 0], 0.0)
    assert np.abs(fw.np(dkv)[0, 1]).sum() > 0


@pytest.mark.parametrize("poison", ["kv_row0_inf", "padding_row_grad_out_nan"])
def test_minus_one_slots_add_nothing_beside_non_finite_values(fw, rng, poison):
    """A -1 slot is gathered as row 0 but adds exactly nothing, not ``0 * x`` (NaN when ``x`` is
    not finite).  An inf in key row 0, which no row selects: every result bitwise as with row 0
    finite (before the fix: NaN out and dq in every row with a -1 slot).  A NaN in the grad_out
    of a row whose every slot is -1: dkv bitwise as before (no row selects key 0; before the fix
    dkv[0] was NaN) and every other row's dq too."""
    c = make_case(rng, 1, 3, True)
    c["idx"][c["idx"] == 0] = 1
    base = [fw.np(t) for t in run_ref(fw, c)]
    if poison == "kv_row0_inf":
        c["kv"][0, 0, :] = np.inf
    else:
        assert (c["idx"][0, 2] == -1).all()
        c["grad_out"][0, 2] = np.nan
    out, lse, dq, dkv, dsink = (fw.np(t) for t in run_ref(fw, c))
    np.testing.assert_array_equal(dkv, base[3])
    np.testing.assert_array_equal(np.delete(dq, 2, axis=1), np.delete(base[2], 2, axis=1))
    if poison == "kv_row0_inf":
        for got, want in zip((out, lse, dq, dsink), (base[0], base[1], base[2], base[4])):
            np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_array_equal(dq[:, 2], 0.0)  # no key: dS is 0, not 0 * NaN


def test_chunking_does_not_change_results(fw, rng, monkeypatch):
    c = make_case(rng, 2, 3, True)
    whole = run_ref(fw, c)
    monkeypatch.setattr(ref_mod, "_CHUNK_BYTES", 1)  # one query row per chunk
    assert ref_mod._chunk_rows(check_tensors(
        fw.t(c["q"]), fw.t(c["kv"]), fw.t(c["idx"]), d_v=DV), "float64", True) == 1
    rows = run_ref(fw, c)
    for a, b in zip(whole, rows):
        assert rel_l2(fw.np(b), fw.np(a)) < 1e-14


def test_chunk_bound_at_the_gpu_suite_size():
    """S=1024, L=2048, Dk=576, H=128 in fp64: one chunk's per-row terms stay within budget."""
    dims = Dims(B=1, S=1024, H=128, Dk=576, Dv=512, S_kv=2048, L=2048)
    # Generous counts of what one chunk holds alive at its peak: [L, Dk]-sized tensors (gathered
    # keys; in backward also the two dKV terms, their padding and their sum; one more for the
    # [H, Dk]-sized query copies) and [H, L]-sized ones (scores, masks, exp, P, dP, dS).
    live = {False: (3, 6), True: (6, 8)}
    for backward, (n_keys, n_scores) in live.items():
        rows = ref_mod._chunk_rows(dims, "float64", backward)
        assert 1 <= rows < dims.S
        per_row = 8 * (n_keys * dims.L * dims.Dk + n_scores * dims.H * dims.L)
        assert rows * per_row < (1 << 30)


@pytest.mark.gpu
@requires_cuda
def test_reference_on_cuda_matches_cpu(rng):
    c = make_case(rng, 2, 8, True)
    cpu = run_ref(Framework("torch", "cpu"), c)
    gpu_fw = Framework("torch", "cuda")
    gpu = run_ref(gpu_fw, c)
    for a, b in zip(cpu, gpu):
        assert b.device.type == "cuda"
        assert rel_l2(gpu_fw.np(b), a.numpy()) < 1e-12


# --- bad input --------------------------------------------------------------------------------


def test_bad_arguments(paddle_fw, rng):
    fw = paddle_fw
    c = make_case(rng, 1, 3, True)
    q, kv, idx, do = (fw.t(c[k]) for k in ("q", "kv", "idx", "grad_out"))
    with pytest.raises(ValueError, match="dtype: expected 'float32' or 'float64'"):
        mqa_latent_sparse_fwd_ref(q, kv, idx, 0.1, d_v=DV, dtype="bfloat16")
    with pytest.raises(TypeError, match="dtype"):
        mqa_latent_sparse_fwd_ref(q, kv, idx, 0.1, d_v=DV, dtype=np.float64)
    with pytest.raises(TypeError, match="sm_scale"):
        mqa_latent_sparse_fwd_ref(q, kv, idx, fw.t(np.array(0.1)), d_v=DV)
    with pytest.raises(ValueError, match="sm_scale"):
        mqa_latent_sparse_fwd_ref(q, kv, idx, float("nan"), d_v=DV)
    with pytest.raises(TypeError, match="query"):
        mqa_latent_sparse_fwd_ref(c["q"], kv, idx, 0.1, d_v=DV)
    out, lse = mqa_latent_sparse_fwd_ref(q, kv, idx, 0.1, d_v=DV)
    with pytest.raises(ValueError) as err:  # Dv is out's last dim: grad_out is the odd one
        mqa_latent_sparse_bwd_ref(q, kv, out, do[..., :-1], lse, None, idx, 0.1)
    assert str(err.value) == ("grad_out: expected shape [B, S, H, Dv] = [1, 5, 3, 16] (Dv from "
                              "out), got [1, 5, 3, 15]")
    with pytest.raises(ValueError, match="^lse: expected shape"):
        mqa_latent_sparse_bwd_ref(q, kv, out, do, lse[:, :-1], None, idx, 0.1)
    with pytest.raises(TypeError, match="^out: expected a paddle.Tensor or torch.Tensor, got numpy.ndarray"):
        mqa_latent_sparse_bwd_ref(q, kv, out.numpy(), do, lse, None, idx, 0.1)
    with pytest.raises(ValueError, match="token_indices"):
        bad = c["idx"].copy()
        bad[0, 0, 0] = S_KV
        mqa_latent_sparse_fwd_ref(q, kv, fw.t(bad), 0.1, d_v=DV)
    with pytest.raises(ValueError, match="d_v"):
        mqa_latent_sparse_fwd_ref(q, kv, idx, 0.1, d_v=DK + 1)


# --- the LSE bridge with the forward ----------------------------------------------------------


def test_log2_lse_rebuilds_the_probabilities(fw, rng):
    """The kernels' form: P_l = exp2(s_l log2(e) - lse2) and P_sink sum to 1 and rebuild out."""
    c = make_case(rng, 1, 3, True)
    out, lse = mqa_latent_sparse_fwd_ref(
        fw.t(c["q"]), fw.t(c["kv"]), fw.t(c["idx"]), c["scale"], fw.t(c["sink"]), d_v=DV,
        dtype="float64",
    )
    lse2 = fw.np(lse_natural_to_log2_sink(lse, fw.t(c["sink"])))
    valid = c["idx"] >= 0
    keys = c["kv"][0][np.clip(c["idx"][0], 0, None)]  # [S, L, Dk]
    s = c["scale"] * np.einsum("shd,sld->shl", c["q"][0], keys)
    p = np.where(valid[0][:, None, :], np.exp2(s / math.log(2.0) - lse2[0][..., None]), 0.0)
    p_sink = np.exp2(c["sink"] / math.log(2.0) - lse2[0])
    np.testing.assert_allclose(p.sum(-1) + p_sink, 1.0, rtol=1e-13)
    assert rel_l2(fw.np(out)[0], np.einsum("shl,sld->shd", p, keys[..., :DV])) < 1e-12


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_sink_rejected(fw, rng, value):
    c = make_case(rng, 1, 3, True)
    c["sink"][1] = value
    args = (fw.t(c["q"]), fw.t(c["kv"]))
    with pytest.raises(ValueError, match=r"^attn_sink: expected finite values or -inf.*heads \[1\]"):
        mqa_latent_sparse_fwd_ref(*args, fw.t(c["idx"]), c["scale"], fw.t(c["sink"]), d_v=DV)
    with pytest.raises(ValueError, match=r"^attn_sink: expected finite values or -inf"):
        mqa_latent_sparse_bwd_ref(*args, None, fw.t(c["grad_out"]), None, fw.t(c["sink"]),
                                  fw.t(c["idx"]), c["scale"])


def test_probabilities_do_not_mask_nan(paddle_fw, rng):
    """The -inf guards of the probabilities test "== -inf", so a NaN (which validation keeps
    out of the public functions) stays NaN instead of becoming a finite 0 shift."""
    from paddlefleet.tilelang_ops.attn.adapter import ops_for

    fw = paddle_fw
    c = make_case(rng, 1, 3, True)
    sink = c["sink"].copy()
    sink[1] = np.nan
    q, kv, idx = fw.t(c["q"]), fw.t(c["kv"]), fw.t(c["idx"])
    dims = Dims(B=1, S=S, H=3, Dk=DK, Dv=DV, S_kv=S_KV, L=L)
    _, _, P, lse, lse_safe = ref_mod._chunk_probs(ops_for(q), q, kv, idx, fw.t(sink), 0.2, dims)
    P, lse_safe = fw.np(P), fw.np(lse_safe)
    assert np.isnan(lse_safe[:, :, 1]).all()
    assert np.isnan(P[:, :, 1].sum(-1)).all()
    assert not np.isnan(np.delete(P, 1, axis=2)).any()
    # The all-masked row (idx row 2) of a finite head still gets an exact 0 shift.
    np.testing.assert_array_equal(P[0, 2, 0], 0.0)


def test_backward_requires_grad_out(fw, rng):
    c = make_case(rng, 1, 3, True)
    with pytest.raises(TypeError, match="^grad_out: expected a paddle.Tensor or torch.Tensor, got None"):
        mqa_latent_sparse_bwd_ref(fw.t(c["q"]), fw.t(c["kv"]), None, None, None,
                                  fw.t(c["sink"]), fw.t(c["idx"]), c["scale"])


@pytest.mark.parametrize("scale", [0.0, -0.5, 1e39, 1e-46, float("nan")])
def test_sm_scale_rejected(fw, rng, scale):
    """Not finite and > 0 in float32: rejected by the reference as by the kernels."""
    c = make_case(rng, 1, 2, False)
    with pytest.raises(ValueError, match="^sm_scale: expected a finite float > 0"):
        mqa_latent_sparse_fwd_ref(fw.t(c["q"]), fw.t(c["kv"]), fw.t(c["idx"]), scale, d_v=DV)


# --- the reference takes the kernels' arguments -------------------------------------------------


def test_reference_arguments_are_the_kernels():
    """``mqa_latent_sparse_bwd_ref`` takes ``mqa_latent_sparse_bwd``'s arguments in its order
    (issue: the reference had ``grad_out, token_indices, sm_scale, attn_sink``)."""
    import inspect

    from paddlefleet.tilelang_ops.attn import interface

    kernel_bwd = list(inspect.signature(interface.mqa_latent_sparse_bwd).parameters)[:8]
    assert kernel_bwd == ["query", "kv", "out", "grad_out", "lse", "attn_sink",
                          "token_indices", "sm_scale"]
    assert list(inspect.signature(mqa_latent_sparse_bwd_ref).parameters)[:8] == kernel_bwd
    kernel_fwd = list(inspect.signature(interface.mqa_latent_sparse_fwd).parameters)[:6]
    assert list(inspect.signature(mqa_latent_sparse_fwd_ref).parameters)[:6] == kernel_fwd


def test_reference_backward_in_kernel_order_matches_autograd(paddle_fw, rng):
    """Positional call in the kernel's order; out and lse given or None give the same result."""
    fw = paddle_fw
    c = make_case(rng, 2, 3, True)
    q, kv, idx, do, sink = (fw.t(c[k]) for k in ("q", "kv", "idx", "grad_out", "sink"))
    out, lse = mqa_latent_sparse_fwd_ref(q, kv, idx, c["scale"], sink, d_v=DV, dtype="float64")
    got = mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sink, idx, c["scale"], dtype="float64")
    bare = mqa_latent_sparse_bwd_ref(q, kv, None, do, None, sink, idx, c["scale"],
                                     dtype="float64")
    for g, b in zip(got, bare):
        np.testing.assert_array_equal(fw.np(g), fw.np(b))
    for g, w in zip(got, autograd_grads(c)):
        assert rel_l2(fw.np(g), w) < 1e-12


def test_each_reference_call_checks_once(paddle_fw, rng, monkeypatch):
    """One tensor check and one value read per call (the backward used to check twice)."""
    fw = paddle_fw
    c = make_case(rng, 1, 3, True)
    q, kv, idx, do, sink = (fw.t(c[k]) for k in ("q", "kv", "idx", "grad_out", "sink"))
    calls = []
    record_calls(monkeypatch, calls, ref_mod, "check_tensors", "check_values")
    out, lse = mqa_latent_sparse_fwd_ref(q, kv, idx, c["scale"], sink, d_v=DV)
    mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sink, idx, c["scale"])
    assert calls == ["check_tensors", "check_values"] * 2



# --- a checks.PreparedIndices is checked against the tensors it comes with --------------------
def _prepared_case(B=2, S=6, S_kv=16, H=4, Dk=16, d_v=8, L=3, seed=0):
    from paddlefleet.tilelang_ops.attn.checks import prepare_indices
    rng = np.random.default_rng(seed)
    q = paddle.to_tensor(rng.standard_normal((B, S, H, Dk)).astype("float32"))
    kv = paddle.to_tensor(rng.standard_normal((B, S_kv, Dk)).astype("float32"))
    idx = paddle.to_tensor(rng.integers(0, S_kv, (B, S, L)).astype("int32"))
    sk = paddle.to_tensor(rng.standard_normal(H).astype("float32"))
    prepared = prepare_indices(check_tensors(q, kv, idx, attn_sink=sk, d_v=d_v), idx,
                               attn_sink=sk)
    return q, kv, idx, sk, prepared, rng


def _randn(rng, *shape):
    return paddle.to_tensor(rng.standard_normal(shape).astype("float32"))


@pytest.mark.parametrize("which, shape, want", [
    ("query", (1, 6, 4, 16), "[2, 6, 4, 16]"),   # other B: returned a [2, ...] output
    ("query", (2, 6, 4, 32), "[2, 6, 4, 16]"),   # other Dk: accepted
    ("query", (2, 3, 4, 16), "[2, 6, 4, 16]"),   # other S: an opaque einsum error
    ("query", (2, 6, 2, 16), "[2, 6, 4, 16]"),   # other H: an opaque reshape error
    ("kv", (2, 4, 16), "[2, 16, 16]"),           # smaller S_kv: a raw IndexError
    ("attn_sink", (7,), "[4]")])
def test_prepared_indices_with_other_tensors_are_refused(which, shape, want):
    """Break-it 2: the reference trusted a ``PreparedIndices`` whatever tensors came with it."""
    q, kv, _, sk, prepared, rng = _prepared_case()
    args = dict(query=q, kv=kv, attn_sink=sk)
    args[which] = _randn(rng, *shape)
    if which == "query" and shape[0] == 1:
        args["kv"] = _randn(rng, 1, 16, 16)
    if which == "query" and shape[3] == 32:
        args["kv"] = _randn(rng, 2, 16, 32)
    msg = (rf"^{which}: shape \[{', '.join(map(str, shape))}\] differs from the shape "
           rf"{re.escape(want)} the PreparedIndices")
    with pytest.raises(ValueError, match=msg):
        mqa_latent_sparse_fwd_ref(args["query"], args["kv"], prepared, 0.3, args["attn_sink"])
    grad = _randn(rng, 2, 6, 4, 8)
    with pytest.raises(ValueError, match=msg):
        mqa_latent_sparse_bwd_ref(args["query"], args["kv"], None, grad, None,
                                  args["attn_sink"], prepared, 0.3)


def test_prepared_indices_still_get_the_value_checks():
    """Break-it 2: a NaN sink passed with a ``PreparedIndices`` was accepted (and out-of-range
    indices in a hand-made one read out of range): the reference checks the values as it does
    for a plain tensor, and a ``grad_out`` of another ``Dv`` is named."""
    from paddlefleet.tilelang_ops.attn.checks import PreparedIndices
    q, kv, _, sk, prepared, rng = _prepared_case()
    nan_sink = paddle.to_tensor(np.array([0.0, np.nan, 1.0, 2.0], np.float32))
    with pytest.raises(ValueError,
                       match=r"^attn_sink: expected finite values or -inf.* heads \[1\]"):
        mqa_latent_sparse_fwd_ref(q, kv, prepared, 0.3, nan_sink)
    with pytest.raises(ValueError, match=r"^attn_sink: expected finite values"):
        mqa_latent_sparse_bwd_ref(q, kv, None, _randn(rng, 2, 6, 4, 8), None, nan_sink,
                                  prepared, 0.3)
    fake = PreparedIndices(prepared.dims, paddle.full([2, 6, 3], 99, "int32"))
    with pytest.raises(ValueError, match=r"^token_indices: expected values -1 .* \[99, 99\]"):
        mqa_latent_sparse_fwd_ref(q, kv, fake, 0.3, sk)
    with pytest.raises(ValueError, match=r"^grad_out: shape \[2, 6, 4, 5\] differs from the "
                                         r"shape \[2, 6, 4, 8\]"):
        mqa_latent_sparse_bwd_ref(q, kv, None, _randn(rng, 2, 6, 4, 5), None, sk, prepared, 0.3)
    # the prepared call still gives the plain call's values
    out, lse = mqa_latent_sparse_fwd_ref(q, kv, prepared, 0.3, sk)
    want, want_lse = mqa_latent_sparse_fwd_ref(q, kv, prepared.indices, 0.3, sk, d_v=8)
    np.testing.assert_array_equal(out.numpy(), want.numpy())
    np.testing.assert_array_equal(lse.numpy(), want_lse.numpy())


@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
def test_prepared_indices_are_a_copy_of_the_callers(idx_dtype):
    """Break-it 3: ``prepare_indices`` kept an int32 input as the very same tensor, so a later
    ``idx.set_value(...)`` (which Paddle does not version) changed what it had checked."""
    from paddlefleet.tilelang_ops.attn.checks import prepare_indices
    q, kv, _, sk, _, rng = _prepared_case()
    idx = paddle.to_tensor(rng.integers(0, 16, (2, 6, 3)).astype(idx_dtype))
    prepared = prepare_indices(check_tensors(q, kv, idx, attn_sink=sk, d_v=8), idx)
    assert prepared.indices is not idx
    before = prepared.indices.numpy().copy()
    want = mqa_latent_sparse_fwd_ref(q, kv, prepared, 0.3, sk)[0].numpy()
    idx.set_value(np.full((2, 6, 3), 15, idx_dtype))
    np.testing.assert_array_equal(prepared.indices.numpy(), before)
    np.testing.assert_array_equal(mqa_latent_sparse_fwd_ref(q, kv, prepared, 0.3, sk)[0].numpy(),
                                  want)
