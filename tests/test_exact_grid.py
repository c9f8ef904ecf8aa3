"""CPU tests of the exact dKV's bookkeeping kernels' formulas (``attn/kernels/exact_grid.py``).

The deterministic backward used to run its grid guess and its re-run bookkeeping as ~40
framework ops; kernels do it now.  ``helpers.CpuStandIn`` has each kernel's formula in numpy (the
GPU tests hold the kernels to it); here each stand-in launcher is held to the former framework
code, kept below verbatim as the reference (``_framework_*``), on random inputs that include
keys no slot names, rows with no valid slot, extreme bf16 magnitudes and first-pass grids forced
far too fine or too coarse, so that the formulas cannot drift.  Runs under Paddle (CI) and, where
installed, PyTorch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import (
    CpuStandIn,
    distinct_indices,
    exact_first_pass_state,
    launch_grid_rows,
    rerun_written,
    to_numpy,
    to_tensor,
)
from paddlefleet.tilelang_ops.attn import exact_dkv, interface
from paddlefleet.tilelang_ops.attn.adapter import ops_for

DK, DV = 576, 512
SM = DK ** -0.5
EXACT, COARSE = exact_dkv.EXACT_BITS, exact_dkv.RERUN_COARSE_BITS
POISON = 12345  # in idx2 / counts before a launch: still there = not written


def _assert_compaction(got_idx2, ref_idx2, counts):
    """``got_idx2`` (numpy, poisoned before the launch) holds the former framework
    compaction's ``ref_idx2`` where ``rerun_slots`` writes (``helpers.rerun_written``: up to
    the end of the ``INDEX_PAD``-slot block of a row's last re-run slot) and the poison
    elsewhere."""
    w = rerun_written(counts, got_idx2.shape[-1])
    assert np.array_equal(got_idx2[w], np.asarray(ref_idx2)[w])
    assert (got_idx2[~w] == POISON).all()


# --- the former framework code (interface.py before the exact_grid kernels) -------------------
def _copy(ops, t):
    # an independent tensor: Paddle's ldexp scales its first argument in place
    return ops.from_numpy(ops.to_numpy(t), t)


def _framework_c_row(ops, q, grad_out, kv, idx, sm_scale, fp64_norms=False, kv_norm=None):
    """The row weights ``c_row [B, S]`` of the former ``_grid_estimate``: fp32 row norms
    (``fp64_norms``: the same formula with the norms of q and dO taken in fp64 and ``kv_rms``
    from the given fp32 ``kv_norm`` in fp64)."""

    def norm(t):
        if fp64_norms:
            t = ops.cast(t, "float64")
            return ops.sqrt(ops.sum(t * t, axis=-1))
        return ops.row_norm(t)

    valid = idx >= 0
    d_k, d_v = ops.shape(q)[-1], ops.shape(grad_out)[-1]
    kv_f = ops.cast(kv, "float32")
    numel = max(1, ops.shape(kv)[0] * ops.shape(kv)[1] * d_k)
    if kv_norm is None:
        kv_rms = ops.cast(norm(ops.reshape(kv_f, (1, -1))) / math.sqrt(numel), "float64")
    else:
        kv_rms = ops.cast(kv_norm, "float64") / math.sqrt(numel)
    qn = ops.cast(norm(ops.cast(q, "float32")), "float64")  # [B, S, H]
    don = ops.cast(norm(ops.cast(grad_out, "float32")), "float64")
    w = don * don * ((qn * (kv_rms * sm_scale)) ** 2 / d_k + 1.0 / d_v)
    n_valid = ops.sum(ops.cast(valid, "float64"), axis=-1)  # [B, S]
    one = ops.full((1,), 1.0, "float64", n_valid)
    return 4.0 * ops.sqrt(ops.sum(w, axis=-1)) / ops.where(n_valid > 0, n_valid, one)


def _framework_grid(ops, c_row, idx, s_kv, margin):
    """The rest of the former ``_grid_estimate`` from ``c_row``: ``(est, e, inv_grid)``."""
    c_row = _copy(ops, c_row)
    b, s, l = ops.shape(idx)
    valid = idx >= 0
    flat_idx = ops.reshape(ops.where(valid, idx, ops.zeros((1,), "int32", idx)), (b, s * l))
    one = ops.full((1,), 1.0, "float64", c_row)
    top = ops.amax(c_row)
    frac_bits = 40.0 - ops.ceil(ops.log2(ops.where(top > 0, top, one)))
    c_fx = ops.cast(ops.ceil(ops.ldexp(c_row, ops.cast(frac_bits, "int32"))), "int64")
    vals = ops.where(valid, ops.reshape(c_fx, (b, s, 1)), ops.zeros((1,), "int64", c_fx))
    est = ops.put_along_axis(ops.zeros((b, s_kv), "int64", c_fx), flat_idx,
                             ops.reshape(vals, (b, s * l)), axis=1, reduce="add")
    est_f = ops.cast(est, "float64")
    e = ops.ceil(ops.log2(ops.where(est_f > 0, est_f, ops.full((1,), 1.0, "float64", est_f))))
    e = e - ops.cast(frac_bits, "float64") + float(margin - EXACT)
    e = e.clip(*exact_dkv.GRID_EXP_RANGE)
    inv_grid = ops.ldexp(ops.full((b, s_kv), 1.0, "float32", c_row), ops.cast(-e, "int32"))
    return est, e, inv_grid


def _framework_plan(ops, bound, bound_exp, inv_grid, acc, n_max):
    """The former post-pass of ``_exact_dkv``, first half: ``(over, inv_grid, acc)``."""
    inv_grid, acc = _copy(ops, inv_grid), _copy(ops, acc)
    b, s_kv = ops.shape(bound)
    bound_f = ops.cast(bound, "float64") * (1.0 + 2.0**-50)
    by_max = ops.ldexp(ops.full((1,), n_max, "float64", bound_f), bound_exp)
    u_sum = ops.where(bound_f >= 2.0**40, by_max,
                      ops.where(by_max < bound_f, by_max, bound_f))
    room = float(2**EXACT) - n_max
    has = bound_f > 0
    u_safe = ops.where(has, u_sum, ops.full((1,), 1.0, "float64", u_sum))
    t = ops.floor(ops.log2(room / u_safe))
    fits = ops.ldexp(_copy(ops, u_safe), ops.cast(t, "int32")) <= room
    t = ops.where(fits, t, t - 1.0)
    over = has & ((bound_f > float(2**EXACT)) | (t >= float(COARSE)))
    t = ops.where(over, t, ops.zeros((1,), "float64", t))
    inv_grid = ops.ldexp(inv_grid, ops.cast(t, "int32"))
    acc = ops.where(ops.reshape(over, (b, s_kv, 1)), ops.zeros((1,), "float32", acc), acc)
    return over, inv_grid, acc


def _framework_slots(ops, over, idx):
    """The former post-pass of ``_exact_dkv``, second half (``over`` bool): ``(idx2, counts)``."""
    b, s, l = ops.shape(idx)
    valid = idx >= 0
    flat_idx = ops.reshape(ops.where(valid, idx, ops.zeros((1,), "int32", idx)), (b, s * l))
    over_i = ops.cast(over, "int32")
    rerun = (ops.reshape(ops.take_along_axis(over_i, flat_idx, axis=1), (b, s, l)) > 0) & valid
    pos = ops.cast(ops.cumsum(ops.cast(rerun, "int32"), axis=-1), "int32") - 1
    minus1 = ops.full((1,), -1, "int32", idx)
    target = ops.where(rerun, pos, ops.full((1,), l - 1, "int32", idx))
    idx2 = ops.put_along_axis(ops.full((b, s, l), -1, "int32", idx), target,
                              ops.where(rerun, idx, minus1), axis=-1)
    counts = ops.cast(ops.sum(ops.cast(rerun, "int32"), axis=-1), "int32")
    return idx2, counts


# --- inputs -----------------------------------------------------------------------------------
def _bf16_rows(rng, shape, row_exp):
    """Random bf16-representable values, row ``(b, s)`` scaled by ``2**row_exp[b, s]``."""
    x = rng.standard_normal(shape).astype(np.float32)
    return x * np.exp2(row_exp)[..., None, None].astype(np.float32)


def _launch_grid(prov, ops, q, do, kv, idx, margin, h_pad=None):
    """The stand-in's grid launches as the deterministic backward makes them
    (``_grid_estimate``'s three, the first also the preprocess, for ``h_pad`` heads); returns
    ``(c_row, est, inv_grid)`` as numpy."""
    b, s, _ = ops.shape(idx)
    _, s_kv, d_k = ops.shape(kv)
    kv_norm = ops.row_norm(ops.reshape(ops.cast(kv, "float32"), (1, -1)))
    c_row = ops.empty((b, s), "float64", idx)
    launch_grid_rows(prov, q, do, idx, kv_norm, c_row, SM * SM / (b * s_kv * d_k * d_k), h_pad)
    top = ops.reshape(ops.amax(c_row), (1,))
    est = ops.zeros((b, s_kv), "int64", idx)
    prov.exact_grid_scatter(c_row, top, idx, est)
    inv = ops.empty((b, s_kv), "float32", idx)
    prov.exact_grid_keys(est, top, inv, margin - EXACT, *exact_dkv.GRID_EXP_RANGE)
    return c_row, to_numpy(est), to_numpy(inv)


# --- the grid guess -----------------------------------------------------------------------------
@pytest.mark.parametrize("scale", ["moderate", "extreme"])
def test_grid_rows_is_the_framework_formula(fw, rng, scale):
    """c_row, from q and dO (5 heads padded to 16): the row weights of the
    former framework code, which took the norms of q and dO.  With its fp32 row norms to fp32
    rounding at moderate scales; with the norms taken in fp64 (the kernels square bf16 in fp64)
    to fp64 rounding at extreme scales too (rows at 2^-60 .. 2^60: squares to 2^+-120, where the
    fp32 norms under- or overflow).  A row with no valid slot divides by 1; a zero row gives 0.
    A square off by a head or a row, or squared in fp32 (extreme scales), fails it."""
    B, S, S_kv, H, L = 2, 7, 50, 5, 70
    lo, hi = (-3, 3) if scale == "moderate" else (-60, 60)
    q = _bf16_rows(rng, (B, S, H, DK), rng.integers(lo, hi + 1, (B, S)))
    do = _bf16_rows(rng, (B, S, H, DV), rng.integers(lo, hi + 1, (B, S)))
    do[0, 2] = 0.0
    kv = rng.standard_normal((B, S_kv, DK)).astype(np.float32) * (2.0**-30 if scale != "moderate"
                                                                  else 1.0)
    idx = distinct_indices(rng, B, S, S_kv, L, used_keys=40, empty_rows=(3,))
    q, do, kv = (fw.bf16(a) for a in (q, do, kv))
    idx_t = fw.t(idx)
    ops = ops_for(q)
    c_row, _, _ = _launch_grid(CpuStandIn(), ops, q, do, kv, idx_t, 2, h_pad=16)
    got = to_numpy(c_row)
    assert got.dtype == np.float64 and got[0, 2] == 0 and (got > 0).sum() == B * S - 1
    kv_norm = ops.row_norm(ops.reshape(ops.cast(kv, "float32"), (1, -1)))  # as the wrapper's
    ref64 = to_numpy(_framework_c_row(ops, q, do, kv, idx_t, SM, fp64_norms=True,
                                      kv_norm=kv_norm))
    np.testing.assert_allclose(got, ref64, rtol=1e-13, atol=0)
    if scale == "moderate":
        ref = to_numpy(_framework_c_row(ops, q, do, kv, idx_t, SM))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("margin", [exact_dkv.GRID_MARGIN_BITS, -40, -20, 12])
@pytest.mark.parametrize("top_exp", [0, -120, 40, 170])
def test_grid_scatter_and_keys_are_the_framework_formula(fw, rng, margin, top_exp):
    """est (int64 fixed point) and the grids from a given c_row: exactly the former framework
    code's, for margins that force grids far too fine or coarse and row weights so small or
    large (largest 2^top_exp) that the exponent clip applies; keys no slot names get e from
    est = 1, zero rows add nothing."""
    B, S, S_kv, L = 2, 9, 60, 24
    c = np.exp2(top_exp + rng.uniform(-12, 0, (B, S)))
    c[0, 4] = 0.0
    c[1, 0] = np.exp2(float(top_exp))  # the largest row exactly a power of two
    idx = distinct_indices(rng, B, S, S_kv, L, used_keys=50, empty_rows=(6,))
    c_row, idx_t = fw.t(c), fw.t(idx)
    ops = ops_for(c_row)
    prov = CpuStandIn()
    top = ops.reshape(ops.amax(c_row), (1,))
    est = ops.zeros((B, S_kv), "int64", c_row)
    prov.exact_grid_scatter(c_row, top, idx_t, est)
    inv = ops.empty((B, S_kv), "float32", c_row)
    prov.exact_grid_keys(est, top, inv, margin - EXACT, *exact_dkv.GRID_EXP_RANGE)
    ref_est, ref_e, ref_inv = _framework_grid(ops, c_row, idx_t, S_kv, margin)
    assert np.array_equal(to_numpy(est), to_numpy(ref_est))
    assert not to_numpy(est)[:, 50:].any()
    assert np.array_equal(to_numpy(inv), to_numpy(ref_inv))
    e = to_numpy(ref_e)
    assert np.array_equal(to_numpy(inv), np.exp2(-e).astype(np.float32))
    if top_exp in (-120, 170):  # the clip applies (the exponent would leave [-100, 100])
        assert np.abs(e).max() == 100


# --- after the first pass -----------------------------------------------------------------------
def test_rerun_plan_is_the_framework_formula(fw, rng):
    """over, the re-run grids and the cleared accumulator rows: exactly the former framework
    code's, over keys of every kind (no contribution, too coarse, fitting, too fine, clamped)."""
    B, S_kv, n_max = 2, 400, 12.0
    bound, bexp, inv, acc = exact_first_pass_state(rng, B, S_kv, n_max)
    bound_t, bexp_t, inv_t, acc_t = fw.t(bound), fw.t(bexp), fw.t(inv), fw.t(acc)
    ops = ops_for(bound_t)
    ref = _framework_plan(ops, bound_t, bexp_t, inv_t, acc_t, n_max)
    over = ops.empty((B, S_kv), "int32", bound_t)
    any_over = ops.zeros((B,), "int32", bound_t)
    CpuStandIn().exact_rerun_plan(bound_t, bexp_t, inv_t, acc_t, over, any_over, n_max, EXACT,
                                  COARSE)
    got_over = to_numpy(over)
    assert got_over.dtype == np.int32 and set(np.unique(got_over)) == {0, 1}
    assert np.array_equal(got_over.astype(bool), to_numpy(ref[0]))
    assert to_numpy(any_over).tolist() == [1] * B  # every batch has over keys here
    assert np.array_equal(to_numpy(inv_t), to_numpy(ref[1]))
    assert np.array_equal(to_numpy(acc_t), to_numpy(ref[2]))
    # every branch was exercised: kept keys, too fine, too coarse
    o = got_over.astype(bool)
    assert (~o).any() and (o & (bound > 2**24)).any() and (o & (bound < 2**23)).any()


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_rerun_slots_are_the_framework_compaction(fw, rng, share):
    """idx2 (the re-run keys' slots first, in order, -1 after them to the end of their
    64-slot block, the rest unwritten) and counts: the former framework code's where written,
    for no key, some keys and every key re-run (more than one block's worth in a row of 70
    slots), with -1 slots anywhere in a row and whole -1 rows (no key re-run: the flag is 0,
    counts 0 and idx2 left as it was, which the framework code filled with -1)."""
    B, S, S_kv, L = 2, 11, 90, 70
    idx = distinct_indices(rng, B, S, S_kv, L, used_keys=80, empty_rows=(4,), fill=0.97)
    over = (rng.random((B, S_kv)) < share).astype(np.int32)
    idx_t, over_t = fw.t(idx), fw.t(over)
    ops = ops_for(idx_t)
    idx2 = ops.full((B, S, L), POISON, "int32", idx_t)
    counts = ops.empty((B, S), "int32", idx_t)
    CpuStandIn().exact_rerun_slots(idx_t, over_t, fw.t(over.any(-1).astype(np.int32)), idx2,
                                   counts)
    ref_idx2, ref_counts = _framework_slots(ops, over_t > 0, idx_t)
    assert np.array_equal(to_numpy(counts), to_numpy(ref_counts))
    if share == 0.0:
        assert (to_numpy(idx2) == POISON).all() and (to_numpy(ref_idx2) == -1).all()
        return
    _assert_compaction(to_numpy(idx2), to_numpy(ref_idx2), to_numpy(counts))
    # and what that means: each row's re-run slots first, in their order, -1 after them to
    # the end of their 64-slot block (L = 70 caps the second), nothing written past it
    rerun = (idx >= 0) & (np.take_along_axis(over, np.where(idx >= 0, idx, 0).reshape(B, -1),
                                             1).reshape(idx.shape) > 0)
    got, n = to_numpy(idx2), to_numpy(counts)
    assert np.array_equal(n, rerun.sum(-1))
    for b in range(B):
        for s in range(S):
            end = 0 if n[b, s] == 0 else (64 if n[b, s] <= 64 else L)
            assert list(got[b, s, :n[b, s]]) == list(idx[b, s][rerun[b, s]])
            assert (got[b, s, n[b, s]:end] == -1).all() and (got[b, s, end:] == POISON).all()
    assert (n > 64).any() == (share == 1.0) and (n == 0).any()


def test_rerun_slots_never_read_an_index_outside_the_keys(fw):
    """Only slots with a key in ``[0, S_kv)`` are looked up and moved (the kernel never reads
    ``Over`` elsewhere): ``-1`` slots stay out, whatever ``Over[b, 0]`` or ``Over[b, -1]`` say."""
    idx = np.array([[[-1, 2, -1, 0, 1]]], np.int32)
    over = np.array([[1, 0, 1]], np.int32)
    idx_t = fw.t(idx)
    ops = ops_for(idx_t)
    idx2 = ops.empty((1, 1, 5), "int32", idx_t)
    counts = ops.empty((1, 1), "int32", idx_t)
    CpuStandIn().exact_rerun_slots(idx_t, fw.t(over), fw.t(np.ones(1, np.int32)), idx2, counts)
    assert to_numpy(idx2).tolist() == [[[2, 0, -1, -1, -1]]] and to_numpy(counts).tolist() == [[2]]


def _framework_reference(fw, state, idx, n_max):
    """A first-pass ``state`` (bound, bound_exp, inv_grid, acc) and ``idx`` as framework tensors,
    their ops, and the former framework plan's over with its compaction (idx2, counts)."""
    t = [fw.t(a) for a in state]
    idx_t = fw.t(idx)
    ops = ops_for(idx_t)
    ref_over, _, _ = _framework_plan(ops, *t, n_max)
    ref_idx2, ref_counts = _framework_slots(ops, ref_over, idx_t)
    return t, idx_t, ops, ref_over, ref_idx2, ref_counts


def _stand_in_plan(ops, t, idx_t, n_max):
    """The stand-in's re-run plan of the state ``t``: ``(provider, over, any_over)``."""
    B, S_kv = ops.shape(t[0])
    over = ops.empty((B, S_kv), "int32", idx_t)
    any_over = ops.zeros((B,), "int32", idx_t)
    prov = CpuStandIn()
    prov.exact_rerun_plan(*t, over, any_over, n_max, EXACT, COARSE)
    return prov, over, any_over


def test_rerun_slots_match_the_framework_compaction_of_a_plan(fw, rng):
    """The former compaction code on the former plan's over of a first-pass state, and the
    stand-in's slots on the stand-in plan's over: the same idx2 and counts."""
    B, S, S_kv, L, n_max = 2, 10, 300, 64, 10.0
    bound, bexp, inv, acc = exact_first_pass_state(rng, B, S_kv, n_max)
    idx = distinct_indices(rng, B, S, S_kv, L, used_keys=S_kv - 20, empty_rows=(0,))
    t, idx_t, ops, ref_over, ref_idx2, ref_counts = _framework_reference(
        fw, (bound, bexp, inv, acc), idx, n_max)
    prov, over, any_over = _stand_in_plan(ops, t, idx_t, n_max)
    idx2 = ops.full((B, S, L), POISON, "int32", idx_t)
    counts = ops.empty((B, S), "int32", idx_t)
    prov.exact_rerun_slots(idx_t, over, any_over, idx2, counts)
    _assert_compaction(to_numpy(idx2), to_numpy(ref_idx2), to_numpy(counts))
    assert np.array_equal(to_numpy(counts), to_numpy(ref_counts))
    assert 0 < to_numpy(counts).sum() < (idx >= 0).sum()


def _keep_every_key(bound, bexp, over, b):
    """Batch ``b`` of a first-pass state with its over keys (``over``, bool) turned into keys
    without contributions (Bound 0, BoundExp at its start value): no key of it re-runs."""
    bound, bexp = bound.copy(), bexp.copy()
    bound[b][over[b]] = 0
    bexp[b][over[b]] = -(2**30)
    return bound, bexp


@pytest.mark.parametrize("over_in", [(), (1,)], ids=["none", "batch1"])
def test_rerun_slots_skip_a_batch_with_no_rerun_key(fw, rng, over_in):
    """The plan flags the batches with a re-run key (``any_over``, zeroed by the caller) and
    the compaction skips the others: their rows get counts 0, their idx2 rows keep the poison
    (not written), and the flag, not ``over``, decides (a stale over key in a batch whose flag
    is 0 is not looked up).  The flagged batch's rows are the former framework compaction.  A
    stand-in (or kernel) that ignored the flag would overwrite the poison."""
    B, S, S_kv, L, n_max = 2, 9, 200, 48, 10.0
    bound, bexp, inv, acc = exact_first_pass_state(rng, B, S_kv, n_max)
    ops0 = ops_for(fw.t(bound))
    over0 = to_numpy(_framework_plan(ops0, *(fw.t(a) for a in (bound, bexp, inv, acc)),
                                     n_max)[0])
    for b in range(B):
        if b not in over_in:
            bound, bexp = _keep_every_key(bound, bexp, over0, b)
    idx = distinct_indices(rng, B, S, S_kv, L, used_keys=S_kv - 10, empty_rows=(2,))
    t, idx_t, ops, ref_over, ref_idx2, ref_counts = _framework_reference(
        fw, (bound, bexp, inv, acc), idx, n_max)
    assert [bool(to_numpy(ref_over)[b].any()) for b in range(B)] == [b in over_in
                                                                      for b in range(B)]
    prov, over, any_over = _stand_in_plan(ops, t, idx_t, n_max)
    assert to_numpy(any_over).tolist() == [int(b in over_in) for b in range(B)]
    assert np.array_equal(to_numpy(over).astype(bool), to_numpy(ref_over))

    idx2 = ops.full((B, S, L), POISON, "int32", idx_t)
    counts = ops.full((B, S), POISON, "int32", idx_t)
    prov.exact_rerun_slots(idx_t, over, any_over, idx2, counts)
    got_idx2, got_counts = to_numpy(idx2), to_numpy(counts)
    assert np.array_equal(got_counts, to_numpy(ref_counts))
    for b in range(B):
        if b in over_in:
            _assert_compaction(got_idx2[b], to_numpy(ref_idx2)[b], got_counts[b])
            assert 0 < got_counts[b].sum() < (idx[b] >= 0).sum()
        else:
            assert (got_counts[b] == 0).all() and (got_idx2[b] == POISON).all()

    # the flag decides: every key of batch 0 marked over, its flag still 0
    stale = to_numpy(over).copy()
    stale[0] = 1
    idx2 = ops.full((B, S, L), POISON, "int32", idx_t)
    prov.exact_rerun_slots(idx_t, fw.t(stale), any_over, idx2, counts)
    assert (to_numpy(counts)[0] == 0).all() and (to_numpy(idx2)[0] == POISON).all()


# --- through the wrapper --------------------------------------------------------------------------
class _Capture(CpuStandIn):
    """The stand-in, keeping what the exact passes see: the first pass's grids and the state it
    leaves, the plan's per-batch flag, and the re-run's grids, accumulator and slots (numpy
    copies)."""

    def exact_rerun_plan(self, *args):
        super().exact_rerun_plan(*args)
        self.any_over = to_numpy(args[5]).copy()

    def bwd_main(self, m, deterministic, with_dq, q, kv, do, idx, lse2, delta, scale, inv_grid,
                 counts, dq, acc, bound, bound_exp):
        if deterministic and not with_dq:
            self.rerun_in = [to_numpy(x).copy() for x in (inv_grid, acc, idx, counts)]
        if deterministic and with_dq:
            self.first_in = to_numpy(inv_grid).copy()
        super().bwd_main(m, deterministic, with_dq, q, kv, do, idx, lse2, delta, scale, inv_grid,
                         counts, dq, acc, bound, bound_exp)
        if deterministic and with_dq:
            self.first_out = [to_numpy(x).copy() for x in (bound, bound_exp, inv_grid, acc, idx)]


@pytest.mark.parametrize("margin", [exact_dkv.GRID_MARGIN_BITS, -40, -20, -10, 12])
def test_exact_dkv_bookkeeping_is_the_framework_code(fw, margin, monkeypatch):
    """The deterministic backward through the stand-ins with first-pass grids as guessed, far
    too fine (-40: every u clamped; -20, -10) and far too coarse (+12): its first-pass grids are
    the former framework guess's (to one step where the fp32 norms' rounding crosses a power
    of two, none here), and what the re-run gets (grids, cleared accumulator, slots, counts) is
    exactly what the former framework code makes of the first pass's bound."""
    rng = np.random.default_rng(7)
    B, S, S_kv, H, L = 1, 6, 64, 16, 64
    q = fw.bf16(rng.standard_normal((B, S, H, DK)))
    kv = fw.bf16(rng.standard_normal((B, S_kv, DK)))
    do = fw.bf16(rng.standard_normal((B, S, H, DV)))
    sink = to_tensor(fw.name, rng.standard_normal(H).astype(np.float32), "float32")
    idx_np = distinct_indices(rng, B, S, S_kv, L, used_keys=56, empty_rows=(2,))
    idx = fw.t(idx_np)
    prov = _Capture()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM, sink, provider=prov)
    monkeypatch.setattr(exact_dkv, "GRID_MARGIN_BITS", margin)
    interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, SM, provider=prov)
    ops = ops_for(q)

    c_row = _framework_c_row(ops, q, do, kv, idx, SM)
    _, e, _ = _framework_grid(ops, c_row, idx, S_kv, margin)
    assert np.array_equal(prov.first_in, np.exp2(-to_numpy(e)).astype(np.float32))

    bound, bexp, inv, acc, idx_used = prov.first_out
    assert np.array_equal(idx_used, idx_np)  # L = 64: no padding
    over, ref_inv, ref_acc = _framework_plan(ops, fw.t(bound), fw.t(bexp), fw.t(inv), fw.t(acc),
                                             float(S))
    ref_idx2, ref_counts = _framework_slots(ops, over, idx)
    got_inv, got_acc, got_idx2, got_counts = prov.rerun_in
    assert np.array_equal(got_inv, to_numpy(ref_inv))
    assert np.array_equal(got_acc, to_numpy(ref_acc))
    assert np.array_equal(got_counts, to_numpy(ref_counts))
    n_over = int(to_numpy(over).sum())
    assert prov.any_over.tolist() == [int(n_over > 0)]  # B = 1
    if n_over:  # else idx2 is left unwritten (counts 0: the re-run reads none of it)
        w = rerun_written(got_counts, L)  # and past each row's last block of re-run slots
        assert np.array_equal(got_idx2[w], to_numpy(ref_idx2)[w]) and w.any()
    if margin in (-40, -20, -10, 12):
        assert n_over > 0  # the forced grids re-run keys
    else:
        assert n_over == 0
