"""CPU tests of the host wrappers in ``attn/interface.py`` and the exact dKV host algorithm in
``attn/exact_dkv.py`` (no GPU, no TileLang needed).

The wrappers' own logic (block_h / head plan, head padding and slicing, top-k padding with -1,
index dtype, the LSE bridge, d_sink, the exact dKV grids and their re-run, input errors) runs on
CPU tensors against :class:`CpuStandIn`, a provider whose launchers (fwd, bwd_preprocess,
bwd_main and the exact dKV's ``exact_*`` bookkeeping) implement each kernel's math in numpy (fp64
products; the forward reuses ``reference.py``; the attention ones raise when handed a head count
other than their tile).  Results are compared with the fp32 reference by relative L2 error.
Runs under Paddle (CI) and, where installed, PyTorch.
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

from helpers import (
    FRAMEWORKS,
    REPO_ROOT,
    CpuStandIn,
    record_calls,
    rel_l2,
    to_numpy,
    to_tensor,
)
from paddlefleet.tilelang_ops.attn import exact_dkv, interface, tiling
from paddlefleet.tilelang_ops.attn.adapter import ops_for
from paddlefleet.tilelang_ops.attn.indices import causal_topk_indices
from paddlefleet.tilelang_ops.attn.lse import lse_natural_to_log2_sink
from paddlefleet.tilelang_ops.attn.reference import (
    mqa_latent_sparse_bwd_ref,
    mqa_latent_sparse_fwd_ref,
)

DK, DV = 576, 512
SM = DK ** -0.5


def _case(fw, B, S, S_kv, H, L, sink, seed, index_dtype="int32", empty_rows=()):
    rng = np.random.default_rng(seed)
    q = to_tensor(fw, rng.standard_normal((B, S, H, DK), dtype=np.float32), "bfloat16")
    kv = to_tensor(fw, rng.standard_normal((B, S_kv, DK), dtype=np.float32), "bfloat16")
    do = to_tensor(fw, rng.standard_normal((B, S, H, DV), dtype=np.float32), "bfloat16")
    sk = to_tensor(fw, rng.standard_normal((H,), dtype=np.float32) + 1, "float32") if sink else None
    idx = causal_topk_indices(B, S, S_kv, L, seed=seed, dtype=index_dtype)
    for r in empty_rows:
        idx[:, r] = -1
    return q, kv, do, sk, to_tensor(fw, idx, index_dtype)


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
    ref_out, ref_lse = mqa_latent_sparse_fwd_ref(q, kv, idx, SM, sk)
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
        assert not to_numpy(ds).any()
    plan = tiling.head_plan(H)
    head = ("main", plan.heads_per_cta, plan.padded_heads, 128)
    finish = ("finish", plan.heads_per_cta, det)
    natural = lse_format == "natural"
    if not det and plan.heads_per_cta == 64:  # the preprocess fused into the atomic main
        assert prov.calls[1:] == [head + (False, True, ("pre", natural)), finish]
        return
    if det:  # the preprocess with the grids (grid_rows), the first pass, the re-run plan, the
        # re-run of the keys over their bound: no separate preprocess
        assert prov.calls[1:] == [("grid_rows", natural), ("grid_scatter",), ("grid_keys",),
                                  head + (True, True), ("rerun_plan",), ("rerun_slots",),
                                  head + (True, False), finish]
    else:
        assert prov.calls[1:] == [("pre", natural), head + (False, True), finish]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("H, sink, lse_format", [(64, True, "natural"), (40, True, "log2_sink"),
                                                 (100, False, "natural"), (64, False, "log2_sink")])
def test_atomic_bwd_fuses_the_preprocess_into_main(fw, H, sink, lse_format, monkeypatch):
    """The atomic backward on 64-head tiles launches no preprocess: its main kernel takes
    ``pre`` (kernel_provider.FusedPreprocess) and writes Delta, lse2 and the rows' d_sink terms
    itself (pad heads too: H=40 is one tile with 24 of them, H=100 two tiles with 28).  The gradients
    match the fp64 reference, and equal those of the separate preprocess
    (``FUSED_PREPROCESS = False``) bit for bit (the stand-in runs the same code both ways)."""
    q, kv, do, sk, idx = _case(fw, 2, 5, 70, H, 100, sink, seed=H + 7, empty_rows=(2,))
    prov = CpuStandIn()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    lse_in = lse_natural_to_log2_sink(lse, sk) if lse_format == "log2_sink" else lse
    natural = lse_format == "natural"

    def bwd():
        prov.calls.clear()
        return interface.mqa_latent_sparse_bwd(q, kv, out, do, lse_in, sk, idx, SM,
                                               deterministic=False, lse_format=lse_format,
                                               provider=prov)

    got = bwd()
    plan = tiling.head_plan(H)
    assert plan.heads_per_cta == 64 and (plan.padded_heads > H) == (H != 64)
    head = ("main", 64, plan.padded_heads, 128, False, True)
    assert prov.calls == [head + (("pre", natural),), ("finish", 64, False)]
    ref_dq, ref_dkv, ref_ds = mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sk, idx, SM)
    errs = (rel_l2(got[0], ref_dq), rel_l2(got[1], ref_dkv))
    assert max(errs) < 1e-2, errs
    if sink:
        assert rel_l2(got[2], ref_ds) < 1e-2
    else:
        assert not to_numpy(got[2]).any()
    monkeypatch.setattr(interface, "FUSED_PREPROCESS", False)
    want = bwd()
    assert [c[0] for c in prov.calls] == ["pre", "main", "finish"]
    assert prov.calls[1] == head
    for g, w in zip(got, want):
        np.testing.assert_array_equal(to_numpy(g), to_numpy(w))


class _NoPre(CpuStandIn):
    """A provider whose ``bwd_main`` override has no ``pre`` parameter (an older custom one)."""

    def bwd_main(self, m, deterministic, with_dq, q, kv, do, idx, lse2, delta, scale, inv_grid,
                 counts, dq, acc, bound, bound_exp):
        super().bwd_main(m, deterministic, with_dq, q, kv, do, idx, lse2, delta, scale, inv_grid,
                         counts, dq, acc, bound, bound_exp)


class _NoTiles(CpuStandIn):
    fused_preprocess_tiles = ()


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("provider", [_NoPre, _NoTiles])
def test_providers_without_the_fused_preprocess_keep_the_separate_launch(fw, provider):
    """A provider that does not list the tile in ``fused_preprocess_tiles``, or whose
    ``bwd_main`` has no ``pre`` parameter, gets the separate preprocess and the same results."""
    q, kv, do, sk, idx = _case(fw, 1, 4, 64, 64, 64, True, seed=12)
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=CpuStandIn())
    prov = provider()
    got = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, deterministic=False,
                                          provider=prov)
    assert [c[0] for c in prov.calls] == ["pre", "main", "finish"]
    assert prov.calls[1] == ("main", 64, 64, 64, False, True)
    want = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, deterministic=False,
                                           provider=CpuStandIn())
    for g, w in zip(got, want):
        np.testing.assert_array_equal(to_numpy(g), to_numpy(w))


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
    monkeypatch.setattr(exact_dkv, "GRID_MARGIN_BITS", margin)
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
        assert not (to_numpy(idx) == 0).any()
        k = to_numpy(kv)
        k[:, 0] *= factor
        kv = to_tensor(fw, k, "bfloat16")
    prov = CpuStandIn()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    _, ref_dkv, _ = mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sk, idx, SM)
    _, dkv, _ = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, provider=prov)
    _, dkv_a, _ = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM,
                                                  deterministic=False, provider=prov)
    assert np.abs(to_numpy(dkv)).max() > 0
    assert rel_l2(dkv, ref_dkv) < 1e-2 and rel_l2(dkv, dkv_a) < 1e-2


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_exact_dkv_refuses_more_rows_than_it_can_prove(fw, monkeypatch):
    q, kv, do, sk, idx = _case(fw, 1, 6, 64, 16, 64, True, seed=32)
    prov = CpuStandIn()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    monkeypatch.setattr(exact_dkv, "EXACT_BITS", 3)  # 2^2 = 4 < 6 rows per key
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
    lse_np = to_numpy(lse)
    assert np.isneginf(lse_np[:, 1]).all() and np.isfinite(np.delete(lse_np, 1, axis=1)).all()
    lse_np[:, 1] = np.inf
    lse_inf = to_tensor(fw, lse_np, "float32")
    got = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse_inf, sk, idx, SM,
                                          deterministic=det, provider=prov)
    ref = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM,
                                          deterministic=det, provider=prov)
    dq = to_numpy(got[0])
    assert not dq[:, 1].any() and np.abs(dq).max() > 0
    for g, r in zip(got, ref):
        assert np.isfinite(to_numpy(g)).all()
        assert np.array_equal(to_numpy(g), to_numpy(r))
    ref_dq, ref_dkv, ref_ds = mqa_latent_sparse_bwd_ref(q, kv, None, do, None, sk, idx, SM)
    assert max(rel_l2(got[0], ref_dq), rel_l2(got[1], ref_dkv)) < 1e-2
    if sink:
        assert rel_l2(got[2], ref_ds) < 1e-2


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_nan_lse_is_not_masked(fw):
    """A NaN lse is an error (check_indices=True names ``lse``) and, unchecked, must show up as
    NaN in that row's dq instead of being replaced by a plausible finite value."""
    q, kv, do, sk, idx, out, lse, prov = _empty_row_case(fw, 8, True, seed=22)
    lse_np = to_numpy(lse)
    lse_np[0, 2, 3] = np.nan
    bad = to_tensor(fw, lse_np, "float32")
    with pytest.raises(ValueError, match="lse"):
        interface.mqa_latent_sparse_bwd(q, kv, out, do, bad, sk, idx, SM, provider=prov)
    dq, _, _ = interface.mqa_latent_sparse_bwd(q, kv, out, do, bad, sk, idx, SM,
                                               check_indices=False, provider=prov)
    dq = to_numpy(dq)
    assert np.isnan(dq[0, 2, 3]).any()
    assert np.isfinite(np.delete(dq, 2, axis=1)).all()


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("natural", [True, False])
@pytest.mark.parametrize("kernel", ["pre", "grid_rows"])
def test_preprocess_stand_in_is_the_former_framework_code(fw, natural, kernel):
    """The preprocess kernel replaced framework ops (run 41): the lse bridge, ``-inf -> 0``, the
    head padding of lse2 and Delta, ``d_sink = -sum P_sink Delta``.  Its stand-ins (which the
    GPU test holds the kernels to), ``bwd_preprocess`` (the atomic backward's) and
    ``exact_grid_rows`` (the deterministic backward's, which also gives the rows' grid weights),
    give what those ops gave, written here as they were: with a NaN, +inf and -inf lse, a -inf
    sink, pad heads (H=5 in tiles of 16)."""
    rng = np.random.default_rng(31 + natural)
    B, S, H, h_pad = 2, 3, 5, 16
    out = rng.standard_normal((B, S, H, DV), dtype=np.float32)
    do = rng.standard_normal((B, S, H, DV), dtype=np.float32)
    lse = rng.standard_normal((B, S, H)).astype(np.float32) * 20
    lse[0, 0, 0], lse[0, 1, 1], lse[1, 2, 2] = np.nan, np.inf, -np.inf
    sink = rng.standard_normal(H).astype(np.float32) * 10
    sink[2] = -np.inf
    t = {k: to_tensor(fw, v, "bfloat16" if k in ("out", "do") else "float32")
         for k, v in dict(out=out, do=do, lse=lse, sink=sink).items()}
    ops = ops_for(t["lse"])
    got = [ops.full((B * S, h_pad), np.nan, "float32", t["lse"]) for _ in range(3)]
    prov = CpuStandIn()
    if kernel == "pre":
        prov.bwd_preprocess(natural, ops.reshape(t["out"], (B * S * H, DV)),
                            ops.reshape(t["do"], (B * S * H, DV)),
                            ops.reshape(t["lse"], (B * S * H,)), t["sink"], *got)
    else:
        q = to_tensor(fw, rng.standard_normal((B, S, H, DK), dtype=np.float32), "bfloat16")
        idx = to_tensor(fw, np.zeros((B, S, 4), np.int32), "int32")
        c_row = ops.empty((B, S), "float64", t["lse"])
        prov.exact_grid_rows(natural, q, t["out"], t["do"], t["lse"], t["sink"], idx,
                             ops.full((1,), 1.0, "float32", t["lse"]),
                             *(ops.reshape(g, (B, S, h_pad)) for g in got), c_row, 1e-3)
        assert np.isfinite(to_numpy(c_row)).all() and (to_numpy(c_row) > 0).all()
    assert prov.calls == [(kernel, natural)]
    delta, lse2, d_rows = (to_numpy(g).reshape(B, S, h_pad) for g in got)

    # the former framework code (interface._bwd and _d_sink before run 41), in numpy
    want_delta = (to_numpy(t["out"]).astype(np.float64) * to_numpy(t["do"])).sum(-1)
    want_lse2 = to_numpy(lse_natural_to_log2_sink(t["lse"], t["sink"])) if natural else lse
    want_lse2 = np.where(want_lse2 == -np.inf, 0.0, want_lse2)
    with np.errstate(invalid="ignore"):
        want_ds = -(np.exp(sink - want_lse2 * np.log(2.0)) * want_delta).sum((0, 1))
    np.testing.assert_allclose(delta[..., :H], want_delta, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(lse2[..., :H], want_lse2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(-d_rows[..., :H].sum((0, 1)), -want_ds, rtol=1e-5)
    assert np.isnan(lse2[0, 0, 0]) and lse2[0, 1, 1] == np.inf and lse2[1, 2, 2] == 0
    assert not (delta[..., H:].any() or lse2[..., H:].any() or d_rows[..., H:].any())


class _GridRowsSeen(CpuStandIn):
    """The stand-in, keeping what grid_rows was given (numpy copies of q, out, dO, lse, sink)."""

    def __init__(self):
        super().__init__()
        self.read = []

    def exact_grid_rows(self, natural, q, out, do, lse, sink, *rest):
        self.read.append(tuple(to_numpy(t).copy() for t in (q, out, do, lse, sink)))
        super().exact_grid_rows(natural, q, out, do, lse, sink, *rest)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("H, block_h", [(5, None), (40, 16), (72, None)])
def test_grid_estimate_takes_the_real_heads(fw, H, block_h):
    """The deterministic backward hands grid_rows the real heads of q, out, dO, lse and the
    sink (no pad-head copies: ``[B, S, H, D]``) and launches no separate preprocess; the
    first-pass grids are then the ones a direct numpy computation from q and dO gives.  The
    atomic backward launches no grid kernel."""
    B, S, S_kv, L = 2, 5, 70, 64
    q, kv, do, sk, idx = _case(fw, B, S, S_kv, H, L, True, seed=H + 50, empty_rows=(1,))
    prov = _GridRowsSeen()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, block_h=block_h,
                                    deterministic=False, provider=prov)
    assert prov.read == []
    grids = []

    class _Grids(_GridRowsSeen):
        def exact_grid_keys(self, est, top, inv_grid, *rest):
            super().exact_grid_keys(est, top, inv_grid, *rest)
            grids.append(to_numpy(inv_grid).copy())

    prov = _Grids()
    interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, block_h=block_h,
                                    provider=prov)
    assert "pre" not in [c[0] for c in prov.calls]
    h_pad = tiling.head_plan(H, block_h).padded_heads
    ((q_r, out_r, do_r, lse_r, sink_r),) = prov.read
    for got, want in ((q_r, q), (out_r, out), (do_r, do), (lse_r, lse), (sink_r, sk)):
        np.testing.assert_array_equal(got, to_numpy(want))
    do_f = to_numpy(do).astype(np.float64)
    want = np.zeros((B, S, h_pad))
    want[..., :H] = (do_f * do_f).sum(-1)

    # the grids from a direct computation: c_s = 4 sqrt(sum_h |dO_sh|^2 (kscale |q_sh|^2 +
    # 1 / Dv)) / L_s, E_j = sum over the rows naming key j of ceil(c_s 2^F), e_j from E_j
    q_f, kv_f = to_numpy(q).astype(np.float64), to_numpy(kv)
    kv_norm = np.float64(np.float32(np.sqrt((kv_f.astype(np.float64) ** 2).sum())))
    kscale = kv_norm * kv_norm * SM * SM / (kv_f.size * DK)
    w = want[..., :H] * (kscale * (q_f * q_f).sum(-1) + 1.0 / DV)
    idx_np = to_numpy(idx)
    n_valid = (idx_np >= 0).sum(-1)
    c = 4.0 * np.sqrt(w.sum(-1)) / np.maximum(n_valid, 1)
    frac = 40.0 - np.ceil(np.log2(c.max()))
    est = np.zeros((B, S_kv))
    for b in range(B):
        for s in range(S):
            keys = idx_np[b, s][idx_np[b, s] >= 0]
            est[b, keys] += np.ceil(np.ldexp(c[b, s], int(frac)))
    # one more bit of head-room per doubling of the row's head groups (each group's part is a
    # contribution of its own to the bound; run 46: H=128 re-ran 83 keys without it)
    groups = tiling.head_plan(H, block_h).num_groups
    e = np.ceil(np.log2(np.where(est > 0, est, 1.0))) - frac + (
        exact_dkv.GRID_MARGIN_BITS - exact_dkv.EXACT_BITS + (groups - 1).bit_length())
    e = np.clip(e, *exact_dkv.GRID_EXP_RANGE)
    # a different order of fp64 additions may move c_s by an ulp: a power-of-two step at most
    got_e = -np.log2(grids[0].astype(np.float64))
    assert np.abs(got_e - e).max() <= 1 and (got_e == e).mean() > 0.95


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
    assert np.array_equal(to_numpy(a), to_numpy(b))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_bad_inputs_raise_naming_theto_tensor(fw):
    q, kv, do, sk, idx = _case(fw, 1, 4, 64, 8, 64, True, seed=3)
    prov = CpuStandIn()
    ops = ops_for(q)
    with pytest.raises(TypeError, match="query"):
        interface.mqa_latent_sparse_fwd(ops.cast(q, "float32"), ops.cast(kv, "float32"), idx,
                                        SM, provider=prov)
    with pytest.raises(TypeError, match="token_indices"):
        interface.mqa_latent_sparse_fwd(q, kv, ops.cast(idx, "float32"), SM, provider=prov)
    bad = to_tensor(fw, np.full((1, 4, 64), 64, dtype=np.int32), "int32")
    with pytest.raises(ValueError, match="token_indices"):
        interface.mqa_latent_sparse_fwd(q, kv, bad, SM, provider=prov)
    bad = to_tensor(fw, np.full((1, 4, 64), -2, dtype=np.int32), "int32")
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
    # d_v=None named `out` (the forward took itself for a backward), now d_v
    with pytest.raises(TypeError, match="^d_v: expected a Python int"):
        interface.mqa_latent_sparse_fwd(q, kv, idx, SM, d_v=None, provider=prov)
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
    # Dv is out's last dim (was guessed from grad_out, and out was blamed)
    with pytest.raises(ValueError) as err:
        interface.mqa_latent_sparse_bwd(q, kv, out, do[..., :-1], lse, sk, idx, SM,
                                        provider=prov)
    assert str(err.value) == ("grad_out: expected shape [B, S, H, Dv] = [1, 4, 8, 512] (Dv from "
                              "out), got [1, 4, 8, 511]")


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_deferred_value_checks_raise_before_any_index_is_read(fw):
    """The wrappers launch their value checks early and wait for them late (run 41), but no
    kernel that dereferences an index runs before a bad value raises: the forward launches
    nothing, the atomic backward only its preprocess (which reads out, dO, lse and the sink),
    the deterministic one only grid_rows (its preprocess, which only counts each row's slots
    >= 0)."""
    q, kv, do, sk, idx = _case(fw, 1, 4, 64, 8, 64, True, seed=6)
    prov = CpuStandIn()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    bad = to_numpy(idx).astype(np.int32)
    bad[0, 2, 5] = 64  # = S_kv
    bad = to_tensor(fw, bad, "int32")
    prov.calls.clear()
    with pytest.raises(ValueError, match="token_indices"):
        interface.mqa_latent_sparse_fwd(q, kv, bad, SM, sk, provider=prov)
    assert prov.calls == []
    for det, launched in ((False, ["pre"]), (True, ["grid_rows"])):
        prov.calls.clear()
        with pytest.raises(ValueError, match="token_indices"):
            interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, bad, SM, provider=prov,
                                            deterministic=det)
        assert [c[0] for c in prov.calls] == launched
    # 64 heads: the atomic main kernel does the preprocess's work and reads indices, so
    # nothing runs before the checks raise
    q, kv, do, sk, _ = _case(fw, 1, 4, 64, 64, 64, True, seed=6)
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    for det, launched in ((False, []), (True, ["grid_rows"])):
        prov.calls.clear()
        with pytest.raises(ValueError, match="token_indices"):
            interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, bad, SM, provider=prov,
                                            deterministic=det)
        assert [c[0] for c in prov.calls] == launched


class _StandInWithStats(CpuStandIn):
    """:class:`CpuStandIn` with the value checks' kernel (``value_stats``) in numpy, as the
    CUDA provider has it: the numbers and the safe copy of the indices.  ``seen`` records the
    largest and smallest index each index-reading launcher was handed (of the re-run's, the
    slots it reads: the first ``counts[b, s]`` of each row; the rest may be unwritten)."""

    def __init__(self, fw):
        super().__init__()
        self.fw = fw
        self.seen = []

    def value_stats(self, token_indices, attn_sink, lse, s_kv):
        if ops_for(token_indices).dtype(token_indices) != "int32":
            return None  # as the kernel's provider: int64 takes the framework path
        self.calls.append(("value_stats",))
        idx = to_numpy(token_indices)
        sink = to_numpy(attn_sink) if attn_sink is not None else np.zeros(1)
        nan_lse = int(np.isnan(to_numpy(lse)).sum()) if lse is not None else 0
        rows = np.array([[idx.min(), idx.max(), int((~(sink < np.inf)).sum()), nan_lse]])
        safe = np.where((idx >= 0) & (idx < s_kv), idx, -1)
        return to_tensor(self.fw, rows, "int32"), to_tensor(self.fw, safe, "int32")

    def _saw(self, idx, counts=None):
        i = to_numpy(idx)
        if counts is not None:
            i = i[np.arange(i.shape[-1]) < to_numpy(counts)[..., None]]
        if i.size:
            self.seen.append((int(i.min()), int(i.max())))

    def fwd(self, m, q, kv, idx, *rest):
        self._saw(idx)
        return super().fwd(m, q, kv, idx, *rest)

    def bwd_main(self, m, deterministic, with_dq, q, kv, do, idx, *rest, pre=None):
        self._saw(idx, None if with_dq else rest[4])  # rest[4]: counts
        return super().bwd_main(m, deterministic, with_dq, q, kv, do, idx, *rest, pre=pre)

    def exact_grid_scatter(self, c_row, top, idx, est):
        self._saw(idx)
        return super().exact_grid_scatter(c_row, top, idx, est)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("H", [8, 64])
def test_value_checks_with_a_safe_copy_wait_after_the_kernels(fw, H):
    """With a provider whose ``value_stats`` makes the safe copy of the indices (the CUDA one),
    every kernel reads that copy and the wrappers wait for the numbers after queueing the
    kernels (run 43: no host wait with the GPU idle): bad indices still raise the same
    ``ValueError`` before the call returns, and no kernel is ever handed one outside
    ``[-1, S_kv)``.  Good inputs give the same results as without the copy; int64 indices
    (no copy) still wait before the first kernel that dereferences an index.  With 64 heads
    the atomic backward's first launch is its main kernel (the preprocess fused into it)."""
    q, kv, do, sk, idx = _case(fw, 1, 4, 64, H, 64, True, seed=7)
    plain = CpuStandIn()
    want_out, want_lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=plain)
    want = interface.mqa_latent_sparse_bwd(q, kv, want_out, do, want_lse, sk, idx, SM,
                                           provider=plain)
    prov = _StandInWithStats(fw)
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    got = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, provider=prov)
    for a, b in zip((out, lse) + tuple(got), (want_out, want_lse) + tuple(want)):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))

    bad = to_numpy(idx).astype(np.int32)
    bad[0, 2, 5], bad[0, 3, 1], bad[0, 1, 0] = 64, -9, 10**6  # S_kv = 64
    bad = to_tensor(fw, bad, "int32")
    runs = (("fwd", lambda: interface.mqa_latent_sparse_fwd(q, kv, bad, SM, sk, provider=prov)),
            ("bwd_det", lambda: interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, bad, SM,
                                                                 provider=prov)),
            ("bwd_atomic", lambda: interface.mqa_latent_sparse_bwd(
                q, kv, out, do, lse, sk, bad, SM, deterministic=False, provider=prov)))
    for name, run in runs:
        prov.calls.clear()
        prov.seen.clear()
        with pytest.raises(ValueError, match=r"token_indices.*\[-9, 1000000\]"):
            run()
        last = {"fwd": "fwd", "bwd_det": "finish", "bwd_atomic": "finish"}[name]
        fused = name == "bwd_atomic" and H == 64
        # the atomic backward's separate preprocess reads no index: it goes before the checks
        first = "pre" if name == "bwd_atomic" and not fused else "value_stats"
        assert prov.calls[0][0] == first, name
        assert prov.calls[-1][0] == last, (name, prov.calls)  # everything was queued first
        assert prov.seen and all(lo >= -1 and hi < 64 for lo, hi in prov.seen), (name, prov.seen)

    # int64 indices: no safe copy, the numbers first (nothing that reads an index ran)
    bad64 = to_tensor(fw, to_numpy(bad).astype(np.int64), "int64")
    prov.calls.clear()
    with pytest.raises(ValueError, match="token_indices"):
        interface.mqa_latent_sparse_fwd(q, kv, bad64, SM, sk, provider=prov)
    assert prov.calls == []


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("failing", ["fwd", "bwd_main", "bwd_finish"])
def test_bad_values_still_win_over_a_failed_launch(fw, failing):
    """With the safe copy the wrappers wait for the checks after their launches; a launch that
    fails in between (out of memory, a failed compile) must not hide the checks' ValueError for
    bad inputs (it came first when the checks were waited for first).  Good inputs: the
    launch's own error."""
    q, kv, do, sk, idx = _case(fw, 1, 4, 64, 8, 64, True, seed=8)
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=CpuStandIn())
    bad = to_numpy(idx).astype(np.int32)
    bad[0, 1, 3] = 64  # = S_kv
    bad = to_tensor(fw, bad, "int32")

    class Failing(_StandInWithStats):
        pass

    def boom(*args, **kwargs):
        raise RuntimeError("launch failed")

    setattr(Failing, failing, boom)
    prov = Failing(fw)
    if failing == "fwd":
        calls = [lambda i: interface.mqa_latent_sparse_fwd(q, kv, i, SM, sk, provider=prov)]
    else:
        calls = [lambda i, det=det: interface.mqa_latent_sparse_bwd(
            q, kv, out, do, lse, sk, i, SM, deterministic=det, provider=prov)
            for det in (True, False)]
    for call in calls:
        with pytest.raises(ValueError, match="token_indices"):
            call(bad)
        with pytest.raises(RuntimeError, match="launch failed"):
            call(idx)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_each_wrapper_checks_once(fw, monkeypatch):
    """One call, one tensor check and one value read (they used to run twice in places)."""
    q, kv, do, sk, idx = _case(fw, 1, 4, 64, 8, 64, True, seed=4)
    prov = CpuStandIn()
    calls = []
    record_calls(monkeypatch, calls, interface, "check_tensors", "start_value_checks")
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    assert calls == ["check_tensors", "start_value_checks"]
    calls.clear()
    interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, idx, SM, provider=prov)
    assert calls == ["check_tensors", "start_value_checks"]


def test_developing_doc_shows_the_wrappers_signatures():
    """docs/developing.md's "The kernels' host wrappers" quotes both signatures (moved there from
    the README); they must not drift."""
    text = " ".join((REPO_ROOT / "docs" / "developing.md").read_text().split())
    for fn in (interface.mqa_latent_sparse_fwd, interface.mqa_latent_sparse_bwd):
        params = []
        for p in inspect.signature(fn).parameters.values():
            if p.kind is p.KEYWORD_ONLY and "*" not in params:
                params.append("*")
            params.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
        want = f"{fn.__name__}({', '.join(params)})".replace("'", '"')
        assert want in re.sub(r"\( ", "(", text), want


def test_providers_offer_the_protocol():
    """``kernel_provider.KernelProvider`` describes what a provider must offer: the TileLang
    provider and the CPU stand-in both do; the backward launchers take ``deterministic`` (one
    name for that choice from the public API down)."""
    from paddlefleet.tilelang_ops.attn import kernel_provider as kp

    assert isinstance(kp.TileLangKernels(), kp.KernelProvider)
    assert isinstance(CpuStandIn(), kp.KernelProvider)
    assert not isinstance(object(), kp.KernelProvider)
    assert kp.DEFAULT_PROVIDER.device == "cuda"
    for cls in (kp.KernelProvider, kp.TileLangKernels):
        for name in ("bwd_main", "bwd_finish"):
            assert list(inspect.signature(getattr(cls, name)).parameters)[2] == "deterministic"


def test_provider_keys_are_registry_specialisations():
    """Every forward and main-backward key the TileLang provider can ask for, at both head-dim
    pairs, is a specialisation of ``kernels.specs()`` (what precompile builds); the kernel trial
    tool's variant changes only the key (``fwd_key`` / ``bwd_main_key``), on the 64-head
    forward and the 32/64-head main backward."""
    import dataclasses
    import sys

    from paddlefleet.tilelang_ops.attn import kernel_provider as kp
    from paddlefleet.tilelang_ops.attn import kernels, tiling
    from paddlefleet.tilelang_ops.attn.kernels.schedule import fwd_schedule

    specs = {(name,) + tuple(args) for name, args in kernels.specs()}
    prov = kp.TileLangKernels()
    pre = kp.FusedPreprocess(True, None, None, None, None)
    for d_qk, d_v in tiling.kernel_dims():
        for m in kernels.HEAD_TILES:
            assert prov.fwd_key(m, d_qk, d_v) in specs
            for det, with_dq in ((True, True), (True, False), (False, True)):
                fused = not det and with_dq and m in prov.fused_preprocess_tiles
                key = prov.bwd_main_key(m, det, with_dq, d_qk, d_v, pre if fused else None)
                assert key in specs, key
    sys.path.insert(0, str(REPO_ROOT / "tools" / "experiments"))
    import kernel_trial

    trial = kernel_trial.Variant(fwd_fields={"consumer_regs": 216},
                                 bwd_fields={"row_lanes": 4})
    assert trial.fwd_key(64, 576, 512) == ("fwd", 64, 576, 512,
                                           dataclasses.replace(fwd_schedule(), consumer_regs=216))
    assert trial.fwd_key(16, 576, 512) == prov.fwd_key(16, 576, 512)
    shipped = prov.bwd_main_key(64, False, True, 576, 512, pre)
    tried = trial.bwd_main_key(64, False, True, 576, 512, pre)
    assert tried != shipped and tried[-3].row_lanes == 4
    assert tried[:-3] + tried[-2:] == shipped[:-3] + shipped[-2:]
    assert trial.bwd_main_key(16, True, True, 576, 512) == prov.bwd_main_key(16, True, True,
                                                                            576, 512)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_prepared_indices_are_checked_once_and_skip_every_check(fw, index_dtype, monkeypatch):
    """``check_inputs`` checks a forward's inputs once and returns the indices as the kernels
    read them (int32, ``L`` padded to a multiple of 64 with -1); the wrappers given that
    ``PreparedIndices`` check no value and cast nothing (only the tensors' metadata, against
    the sizes it was made for: one ``check_tensors`` a call), with the same results as on the
    tensor."""
    q, kv, do, sk, idx = _case(fw, 1, 4, 64, 8, 70, True, seed=5, index_dtype=index_dtype)
    prov = CpuStandIn()
    prepared = interface.check_inputs(q, kv, idx, sk, provider=prov)
    got = to_numpy(prepared.indices)
    assert got.dtype == np.int32 and got.shape == (1, 4, 128)
    np.testing.assert_array_equal(got[..., :70], to_numpy(idx))
    assert (got[..., 70:] == -1).all() and prepared.cu_seqlens is None
    assert prepared.dims == (interface.check_tensors(q, kv, idx, attn_sink=sk, d_v=512))
    want_out, want_lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sk, provider=prov)
    want = interface.mqa_latent_sparse_bwd(q, kv, want_out, do, want_lse, sk, idx, SM,
                                           provider=prov)
    calls = []  # (the stand-in's forward, the reference, checks its own arguments)
    record_calls(monkeypatch, calls, interface, "check_tensors", "start_value_checks",
                 "int32_indices")
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, prepared, SM, sk, provider=prov)
    for det in (True, False):
        got = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sk, prepared, SM,
                                              deterministic=det, provider=prov)
        if det:
            for a, b in zip((out, lse) + tuple(got), (want_out, want_lse) + tuple(want)):
                np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    assert calls == ["check_tensors"] * 3


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_prepared_indices_used_with_other_tensors_are_refused(fw):
    """Break-it 2: a ``PreparedIndices`` was trusted whatever tensors came with it (its sizes
    returned unchecked; on a GPU indices checked for one ``S_kv`` read against a smaller kv).
    Each wrapper now checks the tensors' shapes against the ones it was made for."""
    q, kv, do, sk, idx = _case(fw, 2, 4, 64, 8, 16, True, seed=7)
    prov = CpuStandIn()
    prepared = interface.check_inputs(q, kv, idx, sk, provider=prov)
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, prepared, SM, sk, provider=prov)
    small_kv = kv[:, :32]
    with pytest.raises(ValueError, match=r"^kv: shape \[2, 32, 576\] differs from the shape "
                                         r"\[2, 64, 576\] the PreparedIndices"):
        interface.mqa_latent_sparse_fwd(q, small_kv, prepared, SM, sk, provider=prov)
    with pytest.raises(ValueError, match=r"^query: shape \[1, 4, 8, 576\] differs from the "
                                         r"shape \[2, 4, 8, 576\]"):
        interface.mqa_latent_sparse_fwd(q[:1], kv[:1], prepared, SM, sk, provider=prov)
    with pytest.raises(ValueError, match=r"^attn_sink: shape \[4\] differs from the shape \[8\]"):
        interface.mqa_latent_sparse_fwd(q, kv, prepared, SM, sk[:4], provider=prov)
    with pytest.raises(ValueError, match=r"^kv: shape \[2, 32, 576\] differs"):
        interface.mqa_latent_sparse_bwd(q, small_kv, out, do, lse, sk, prepared, SM,
                                        provider=prov)
    with pytest.raises(ValueError, match=r"^grad_out: shape \[2, 4, 8, 256\] differs from "
                                         r"the shape \[2, 4, 8, 512\]"):
        interface.mqa_latent_sparse_bwd(q, kv, out, do[..., :256], lse, sk, prepared, SM,
                                        provider=prov)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_check_inputs_errors(fw):
    """``check_inputs``: the forward's errors, and with ``cu_seqlens`` the packed checks."""
    q, kv, do, sk, idx = _case(fw, 2, 4, 64, 8, 16, True, seed=6)
    prov = CpuStandIn()
    bad = to_numpy(idx).astype(np.int32)
    bad[1, 3, 2] = 64
    with pytest.raises(ValueError, match=r"^token_indices: expected values -1 .* \[-?\d+, 64\]"):
        interface.check_inputs(q, kv, to_tensor(fw, bad, "int32"), sk, provider=prov)
    with pytest.raises(TypeError, match="^d_v: expected a Python int"):
        interface.check_inputs(q, kv, idx, sk, d_v=None, provider=prov)
    with pytest.raises(ValueError, match="^query: expected a tensor on cuda"):
        interface.check_inputs(q, kv, idx, sk)  # CPU tensors, the TileLang provider
    cu = np.array([0, 4], np.int32)
    with pytest.raises(ValueError, match=r"^query: packed documents \(cu_seqlens\) need B=1"):
        interface.check_inputs(q, kv, idx, sk, cu_seqlens=cu, provider=prov)
    with pytest.raises(ValueError, match=r"^kv: with cu_seqlens expected S_kv = S = 4"):
        interface.check_inputs(q[:1], kv[:1], idx[:1], sk, cu_seqlens=cu, provider=prov)
