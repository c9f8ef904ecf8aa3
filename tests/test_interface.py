"""CPU tests of the host wrappers in ``attn/interface.py`` (no GPU, no TileLang needed).

The wrappers' own logic (block_h / head plan, head padding and slicing, top-k padding with -1,
index dtype, the LSE bridge, d_sink, the exact dKV grids and their re-run, input errors) runs on
CPU tensors against :class:`CpuStandIn`, a provider whose three launchers (fwd, bwd_preprocess,
bwd_main) implement each kernel's math in numpy (fp64 products; the forward reuses
``reference.py``) and raise when handed a head count other than their tile.  Results are compared with the fp32 reference by relative L2 error.  Runs under
Paddle (CI) and, where installed, PyTorch.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import re

import numpy as np
import pytest

from conftest import REPO_ROOT, rel_l2
from paddlefleet.tilelang_ops.attn import interface, tiling
from paddlefleet.tilelang_ops.attn.adapter import ops_for
from paddlefleet.tilelang_ops.attn.indices import causal_topk_indices
from paddlefleet.tilelang_ops.attn.reference import (
    lse_natural_to_log2_sink,
    mqa_latent_sparse_bwd_ref,
    sparse_mqa_fwd_ref,
)

FRAMEWORKS = [fw for fw in ("paddle", "torch") if importlib.util.find_spec(fw) is not None]
DK, DV = 576, 512
SM = DK ** -0.5
LOG2E = 1.0 / math.log(2.0)


def _tensor(fw, arr, dtype):
    if fw == "paddle":
        import paddle

        t = paddle.to_tensor(np.ascontiguousarray(arr))
        return t.astype(dtype) if dtype != str(arr.dtype) else t
    import torch

    return torch.from_numpy(np.ascontiguousarray(arr)).to(getattr(torch, dtype))


def _np(t):
    ops = ops_for(t)
    if ops.dtype(t) in ("bfloat16", "float16"):
        t = ops.cast(t, "float32")
    return np.asarray(ops.to_numpy(t))


def _write(dst, arr):
    ops = ops_for(dst)
    dst[...] = ops.cast(ops.from_numpy(np.ascontiguousarray(arr), dst), ops.dtype(dst))


class CpuStandIn:
    """CPU stand-ins of the three kernels (fwd, preprocess, main): their math, in numpy.

    Each launcher checks that it is handed a whole number of head tiles of ``heads_per_cta``
    heads (16, 32 or 64) and processes one tile at a time, as the kernels' CTAs do.  ``main``
    in exact mode rounds each contribution onto its key's grid and adds ``max |k|`` into
    ``bound`` as the kernel does; ``rerun_bounds`` keeps, per re-run (``with_dq=False``) call,
    the largest bound a re-run key reached in that call alone.
    """

    device = "cpu"

    def __init__(self):
        self.calls = []
        self.rerun_bounds = []

    @staticmethod
    def _groups(m, h_pad):
        if m not in (16, 32, 64) or h_pad % m:
            raise AssertionError(f"kernel tile {m} handed {h_pad} heads")
        return [slice(g * m, (g + 1) * m) for g in range(h_pad // m)]

    def fwd(self, m, q, kv, idx, sink, scale, out, lse):
        h_pad = ops_for(q).shape(q)[2]
        self.calls.append(("fwd", m, h_pad, ops_for(idx).shape(idx)[-1]))
        sm = float(_np(scale)[0])
        o_all, l_all = np.zeros(_np(out).shape), np.zeros(_np(lse).shape)
        for sl in self._groups(m, h_pad):
            ops = ops_for(q)
            qg = ops.contiguous(q[:, :, sl])
            sg = ops.contiguous(sink[sl])
            o, l = sparse_mqa_fwd_ref(qg, kv, idx, sm, sg, d_v=ops.shape(out)[-1])
            o_all[:, :, sl], l_all[:, :, sl] = _np(o), _np(l)
        _write(out, o_all)
        _write(lse, l_all)

    def bwd_preprocess(self, out2d, do2d, delta):
        self.calls.append(("pre",))
        _write(delta, (_np(out2d).astype(np.float64) * _np(do2d)).sum(-1))

    def bwd_main(self, m, mode, with_dq, q, kv, do, idx, lse2, delta, scale, inv_grid, counts,
                 dq, acc, bound, bound_exp):
        Q, KV, DO, I = _np(q).astype(np.float64), _np(kv).astype(np.float64), _np(do), _np(idx)
        LSE2, DEL, ACC = _np(lse2), _np(delta), _np(acc)
        sm = float(_np(scale)[0])
        B, S, h_pad, _ = Q.shape
        dv = DO.shape[-1]
        self.calls.append(("main", m, h_pad, I.shape[-1], mode, with_dq))
        assert mode in ("atomic", "exact") and (with_dq or mode == "exact")
        valid = I >= 0
        if not with_dq:  # only the first counts[b, s] slots of each row
            valid &= np.arange(I.shape[-1]) < _np(counts)[:, :, None]
        if mode == "exact":
            INV, BOUND, BEXP = _np(inv_grid).astype(np.float64), _np(bound), _np(bound_exp)
            before = BOUND.copy()
        safe = np.where(valid, I, 0)
        K = np.stack([KV[b][safe[b]] for b in range(B)])  # [B, S, L, Dk]
        dQ = np.zeros_like(Q)
        for sl in self._groups(m, h_pad):
            s = np.einsum("bshd,bsld->bshl", Q[:, :, sl], K)
            s = np.where(valid[:, :, None, :], s, -np.inf)
            P = np.exp2(s * sm * LOG2E - LSE2[:, :, sl, None])
            dP = np.einsum("bshd,bsld->bshl", DO[:, :, sl], K[..., :dv])
            dS = P * (dP - DEL[:, :, sl, None]) * sm
            dQ[:, :, sl] = np.einsum("bshl,bsld->bshd", dS, K)
            contrib = np.einsum("bshl,bshd->bsld", dS, Q[:, :, sl])
            contrib[..., :dv] += np.einsum("bshl,bshd->bsld", P, DO[:, :, sl])
            for b in range(B):
                rows, c = I[b][valid[b]], contrib[b][valid[b]]
                if mode == "exact":
                    x = (c * INV[b][rows][:, None]).astype(np.float32)  # grid units
                    np.add.at(ACC[b], rows, np.rint(x))
                    u = np.abs(x).max(-1).astype(np.float64)  # before the rounding
                    np.add.at(BOUND[b], rows, np.ceil(np.minimum(u, 2.0**40)).astype(np.int64))
                    e = np.ceil(np.log2(np.maximum(np.minimum(u, 2.0**100), 2.0**-120))) + 1
                    np.maximum.at(BEXP[b], rows, e.astype(np.int32))
                else:
                    np.add.at(ACC[b], rows, c.astype(np.float32))
        if with_dq:
            _write(dq, dQ)
        _write(acc, ACC)
        if mode == "exact":
            _write(bound, BOUND)
            _write(bound_exp, BEXP)
            if not with_dq:
                rerun = np.zeros(BOUND.shape, bool)
                for b in range(B):
                    rerun[b, I[b][valid[b]]] = True
                self.rerun_bounds.append(int((BOUND - before)[rerun].max(initial=0)))


def _case(fw, B, S, S_kv, H, L, sink, seed, index_dtype="int32", empty_rows=()):
    rng = np.random.default_rng(seed)
    q = _tensor(fw, rng.standard_normal((B, S, H, DK), dtype=np.float32), "bfloat16")
    kv = _tensor(fw, rng.standard_normal((B, S_kv, DK), dtype=np.float32), "bfloat16")
    do = _tensor(fw, rng.standard_normal((B, S, H, DV), dtype=np.float32), "bfloat16")
    sk = _tensor(fw, rng.standard_normal((H,), dtype=np.float32) + 1, "float32") if sink else None
    idx = causal_topk_indices(B, S, S_kv, L, seed=seed, dtype=index_dtype)
    for r in empty_rows:
        idx[:, r] = -1
    return q, kv, do, sk, _tensor(fw, idx, index_dtype)


@pytest.mark.parametrize(
    "H, block_h, tile, h_pad",
    [(1, None, 16, 16), (8, 32, 32, 32), (16, None, 16, 16), (24, None, 32, 32),
     (32, None, 32, 32), (40, None, 64, 64), (48, 16, 64, 64), (64, None, 64, 64),
     (100, None, 64, 128), (128, 16, 64, 128)],
)
def test_head_plan(H, block_h, tile, h_pad):
    plan = tiling.head_plan(H, block_h)
    assert (plan.heads_per_cta, plan.padded_heads) == (tile, h_pad)
    assert plan.num_groups * plan.heads_per_cta == plan.padded_heads >= H
    assert plan.block_h == (block_h or (32 if H % 32 == 0 else 16))


@pytest.mark.parametrize("bad", [8, 64, 0, -16])
def test_block_h_must_be_16_or_32(bad):
    with pytest.raises(ValueError, match="block_h.*head tile"):
        tiling.head_plan(64, bad)


@pytest.mark.parametrize("bad", [16.0, 32.0, True, "32", np.float64(16.0)])
def test_block_h_must_be_an_int(bad):
    """16.0 compares equal to 16; it must still be refused, not silently taken as 16."""
    with pytest.raises(TypeError, match=r"^block_h: expected 16, 32 or None, got "):
        tiling.head_plan(64, bad)


def test_block_h_accepts_numpy_ints():
    assert tiling.head_plan(64, np.int64(16)).block_h == 16


def test_key_blocks_divide_index_pad():
    for m in (16, 32, 64):
        assert tiling.INDEX_PAD % tiling.bwd_key_block(m) == 0
    assert tiling.INDEX_PAD % tiling.FWD_KEY_BLOCK == 0
    assert [tiling.padded_topk(L) for L in (1, 64, 65, 100, 2048)] == [64, 64, 128, 128, 2048]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize(
    "H, L, sink, block_h, index_dtype",
    [(1, 64, True, None, "int32"), (24, 100, False, None, "int64"), (40, 70, True, 16, "int32"),
     (100, 64, True, None, "int32")],
)
def test_fwd_through_stand_in_matches_reference(fw, H, L, sink, block_h, index_dtype):
    q, kv, _, sk, idx = _case(fw, 1, 6, 80, H, L, sink, seed=H, index_dtype=index_dtype,
                              empty_rows=(1,))
    prov = CpuStandIn()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, block_h=block_h,
                                               provider=prov)
    ref_out, ref_lse = sparse_mqa_fwd_ref(q, kv, idx, SM, sk)
    assert ops_for(out).shape(out) == (1, 6, H, DV) and ops_for(out).dtype(out) == "bfloat16"
    assert ops_for(lse).shape(lse) == (1, 6, H) and ops_for(lse).dtype(lse) == "float32"
    assert rel_l2(out, ref_out) < 1e-2
    assert rel_l2(lse, ref_lse) < 1e-5
    plan = tiling.head_plan(H, block_h)
    assert prov.calls == [("fwd", plan.heads_per_cta, plan.padded_heads, tiling.padded_topk(L))]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("det", [True, False])
@pytest.mark.parametrize("H, sink, lse_format", [(3, True, "natural"), (40, False, "natural"),
                                                 (100, True, "log2_sink")])
def test_bwd_through_stand_in_matches_reference(fw, det, H, sink, lse_format):
    q, kv, do, sk, idx = _case(fw, 2, 5, 70, H, 100, sink, seed=H + 1, empty_rows=(0,))
    prov = CpuStandIn()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    if lse_format == "log2_sink":
        lse = lse_natural_to_log2_sink(lse, sk)
    dq, dkv, ds = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM,
                                                  deterministic=det, lse_format=lse_format,
                                                  provider=prov)
    ref_dq, ref_dkv, ref_ds = mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sk, idx, SM)
    errs = (rel_l2(dq, ref_dq), rel_l2(dkv, ref_dkv))
    assert max(errs) < 1e-2, errs
    ops = ops_for(dq)
    assert ops.shape(dq) == (2, 5, H, DK) and ops.dtype(dq) == "bfloat16"
    assert ops.shape(dkv) == (2, 70, DK) and ops.dtype(dkv) == "bfloat16"
    assert ops.shape(ds) == (H,) and ops.dtype(ds) == "float32"
    if sink:
        assert rel_l2(ds, ref_ds) < 1e-2
    else:
        assert not _np(ds).any()
    plan = tiling.head_plan(H)
    head = ("main", plan.heads_per_cta, plan.padded_heads, 128)
    if det:  # the first pass, then the re-run of the keys that exceeded their bound
        assert prov.calls[2:] == [head + ("exact", True), head + ("exact", False)]
    else:
        assert prov.calls[2:] == [head + ("atomic", True)]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("margin", [-40, -10, 12])
def test_exact_dkv_reruns_keys_over_their_bound(fw, margin, monkeypatch):
    """A first-pass grid far too fine makes keys exceed 2^24 grid units: they must be cleared
    and re-run on a grid whose bound holds (<= 2^24).  At -40 bits every u is clamped (2^40)
    and the re-run grid comes from BoundExp.  A grid far too coarse (+12 bits) must be re-run
    too, on a finer grid, instead of rounding the contributions away.  Either way dkv matches
    the reference."""
    q, kv, do, sk, idx = _case(fw, 1, 6, 64, 16, 64, True, seed=31, empty_rows=(2,))
    prov = CpuStandIn()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    ref_dq, ref_dkv, _ = mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sk, idx, SM)
    monkeypatch.setattr(interface, "GRID_MARGIN_BITS", margin)
    dq, dkv, _ = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, provider=prov)
    (rerun_max,) = prov.rerun_bounds
    assert 2**16 < rerun_max <= 2**24  # re-run keys land close under the bound, never over
    assert rel_l2(dq, ref_dq) < 1e-2 and rel_l2(dkv, ref_dkv) < 1e-2


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("what, factor", [("grad_out", 1e-24), ("grad_out", 1e18),
                                          ("kv_outlier", 1e10)])
def test_exact_dkv_survives_a_bad_grid_guess(fw, what, factor):
    """Inputs that throw the first pass's grid guess far off (found by a break-it session: the
    guess's squares under/overflowed fp32, and one unselected kv row scaled the guess for every
    key) must still give the right dkv, never silently zero: the guess is taken in fp64 and
    keys whose grid proves too coarse are re-run."""
    q, kv, do, sk, idx = _case(fw, 1, 4, 40, 16, 8, False, seed=41)
    ops = ops_for(q)
    if what == "grad_out":
        do = ops.cast(ops.cast(do, "float32") * factor, "bfloat16")
    else:  # key 0 is never selected here; make it huge
        assert not (_np(idx) == 0).any()
        k = _np(kv)
        k[:, 0] *= factor
        kv = _tensor(fw, k, "bfloat16")
    prov = CpuStandIn()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    _, ref_dkv, _ = mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sk, idx, SM)
    _, dkv, _ = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, provider=prov)
    _, dkv_a, _ = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM,
                                                  deterministic=False, provider=prov)
    assert np.abs(_np(dkv)).max() > 0
    assert rel_l2(dkv, ref_dkv) < 1e-2 and rel_l2(dkv, dkv_a) < 1e-2


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_exact_dkv_refuses_more_rows_than_it_can_prove(fw, monkeypatch):
    q, kv, do, sk, idx = _case(fw, 1, 6, 64, 16, 64, True, seed=32)
    prov = CpuStandIn()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    monkeypatch.setattr(interface, "EXACT_BITS", 3)  # 2^2 = 4 < 6 rows per key
    with pytest.raises(ValueError, match="rows may add to one key"):
        interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, provider=prov)


def _empty_row_case(fw, H, sink, seed):
    """A backward case whose query row 1 has no valid key (forward lse -inf there)."""
    q, kv, do, sk, idx = _case(fw, 1, 4, 64, H, 64, sink, seed=seed, empty_rows=(1,))
    prov = CpuStandIn()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    return q, kv, do, sk, idx, out, lse, prov


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("sink", [True, False], ids=["sink", "nosink"])
@pytest.mark.parametrize("det", [True, False])
def test_flashmla_inf_lse_rows_contribute_nothing(fw, sink, det):
    """FlashMLA marks a row with no valid key by ``lse = +inf``: the backward must give that
    row zero dq and add nothing to dkv or d_sink (same result as our forward's ``-inf``)."""
    q, kv, do, sk, idx, out, lse, prov = _empty_row_case(fw, 8, sink, seed=21)
    lse_np = _np(lse)
    assert np.isneginf(lse_np[:, 1]).all() and np.isfinite(np.delete(lse_np, 1, axis=1)).all()
    lse_np[:, 1] = np.inf
    lse_inf = _tensor(fw, lse_np, "float32")
    got = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse_inf, sk, idx, SM,
                                          deterministic=det, provider=prov)
    ref = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM,
                                          deterministic=det, provider=prov)
    dq = _np(got[0])
    assert not dq[:, 1].any() and np.abs(dq).max() > 0
    for g, r in zip(got, ref):
        assert np.isfinite(_np(g)).all()
        assert np.array_equal(_np(g), _np(r))
    ref_dq, ref_dkv, ref_ds = mqa_latent_sparse_bwd_ref(q, kv, None, do, None, sk, idx, SM)
    assert max(rel_l2(got[0], ref_dq), rel_l2(got[1], ref_dkv)) < 1e-2
    if sink:
        assert rel_l2(got[2], ref_ds) < 1e-2


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_nan_lse_is_not_masked(fw):
    """A NaN lse is an error (check_indices=True names ``lse``) and, unchecked, must show up as
    NaN in that row's dq instead of being replaced by a plausible finite value."""
    q, kv, do, sk, idx, out, lse, prov = _empty_row_case(fw, 8, True, seed=22)
    lse_np = _np(lse)
    lse_np[0, 2, 3] = np.nan
    bad = _tensor(fw, lse_np, "float32")
    with pytest.raises(ValueError, match="lse"):
        interface.mqa_latent_sparse_bwd(q, kv, out, do, bad, sk, idx, SM, provider=prov)
    dq, _, _ = interface.mqa_latent_sparse_bwd(q, kv, out, do, bad, sk, idx, SM,
                                               check_indices=False, provider=prov)
    dq = _np(dq)
    assert np.isnan(dq[0, 2, 3]).any()
    assert np.isfinite(np.delete(dq, 2, axis=1)).all()


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("flag", [1, 0, "yes", None, np.True_])
def test_check_indices_must_be_a_bool(fw, flag):
    q, kv, do, sk, idx, out, lse, prov = _empty_row_case(fw, 8, True, seed=23)
    with pytest.raises(TypeError, match="check_indices"):
        interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, check_indices=flag, provider=prov)
    with pytest.raises(TypeError, match="check_indices") as err:
        interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, check_indices=flag,
                                        provider=prov)
    # numpy's bool is named as such, never a self-contradictory "expected a bool, got bool"
    assert not str(err.value).endswith("got bool")


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_non_contiguous_inputs(fw):
    q, kv, do, sk, idx = _case(fw, 2, 4, 64, 8, 64, True, seed=9)
    ops = ops_for(q)
    if fw == "paddle":
        qt = q.transpose([1, 0, 2, 3]).contiguous().transpose([1, 0, 2, 3])
    else:
        qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not ops.is_contiguous(qt)
    a, _ = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=CpuStandIn())
    b, _ = interface.mqa_latent_sparse_fwd(qt, kv, idx, SM, sk, provider=CpuStandIn())
    assert np.array_equal(_np(a), _np(b))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_bad_inputs_raise_naming_the_tensor(fw):
    q, kv, do, sk, idx = _case(fw, 1, 4, 64, 8, 64, True, seed=3)
    prov = CpuStandIn()
    ops = ops_for(q)
    with pytest.raises(TypeError, match="query"):
        interface.mqa_latent_sparse_fwd(ops.cast(q, "float32"), ops.cast(kv, "float32"), idx,
                                        SM, provider=prov)
    with pytest.raises(TypeError, match="token_indices"):
        interface.mqa_latent_sparse_fwd(q, kv, ops.cast(idx, "float32"), SM, provider=prov)
    bad = _tensor(fw, np.full((1, 4, 64), 64, dtype=np.int32), "int32")
    with pytest.raises(ValueError, match="token_indices"):
        interface.mqa_latent_sparse_fwd(q, kv, bad, SM, provider=prov)
    bad = _tensor(fw, np.full((1, 4, 64), -2, dtype=np.int32), "int32")
    with pytest.raises(ValueError, match="token_indices"):
        interface.mqa_latent_sparse_fwd(q, kv, bad, SM, provider=prov)
    with pytest.raises(ValueError, match="query"):  # CPU tensors with the CUDA kernels
        interface.mqa_latent_sparse_fwd(q, kv, idx, SM)
    with pytest.raises(ValueError, match="Dk"):
        interface.mqa_latent_sparse_fwd(q[..., :64], kv[..., :64], idx, SM, d_v=64,
                                        provider=prov)
    with pytest.raises(ValueError, match="sm_scale"):
        interface.mqa_latent_sparse_fwd(q, kv, idx, 0.0, provider=prov)
    with pytest.raises(ValueError, match="block_h"):
        interface.mqa_latent_sparse_fwd(q, kv, idx, SM, block_h=48, provider=prov)
    with pytest.raises(TypeError, match="block_h"):
        interface.mqa_latent_sparse_fwd(q, kv, idx, SM, block_h=16.0, provider=prov)
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    with pytest.raises(ValueError, match="lse_format"):
        interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, lse_format="log2",
                                        provider=prov)
    with pytest.raises(TypeError, match="deterministic"):
        interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, deterministic=1,
                                        provider=prov)
    with pytest.raises(TypeError, match="grad_out"):
        interface.mqa_latent_sparse_bwd(q, kv, out, ops.cast(do, "float32"), lse, sk, idx, SM,
                                        provider=prov)
    with pytest.raises(ValueError, match="lse"):
        interface.mqa_latent_sparse_bwd(q, kv, out, do, lse[:, :2], sk, idx, SM, provider=prov)


def test_readme_shows_the_wrappers_signatures():
    """README's "The kernels in one paragraph" quotes both signatures; they must not drift."""
    text = " ".join((REPO_ROOT / "README.md").read_text().split())
    for fn in (interface.mqa_latent_sparse_fwd, interface.mqa_latent_sparse_bwd):
        params = []
        for p in inspect.signature(fn).parameters.values():
            if p.kind is p.KEYWORD_ONLY and "*" not in params:
                params.append("*")
            params.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
        want = f"{fn.__name__}({', '.join(params)})".replace("'", '"')
        assert want in re.sub(r"\( ", "(", text), want
