"""GPU tests of the TileLang sparse MQA-latent attention kernels through their host wrappers.

Driven with PyTorch CUDA tensors (the GPU host has no Paddle GPU build); skipped without CUDA.
Every case compares against the fp32 reference (``attn/reference.py``) by relative L2 error,
runs every kernel on outputs poisoned with NaN and framed by sentinel guard regions
(:class:`GuardedKernels`), checks bitwise repeatability of the deterministic backward and that
the deterministic and atomic backward agree within rounding.  Packed documents (B = 1,
``cu_seqlens``, per-document causal indices) of very different lengths are checked against the
reference and against each document run alone.

Tolerance: bf16 inputs and outputs put the error floor at ~2e-3 (out), ~2.4e-3 (dQ, dKV),
~1.8e-3 (d_sink) relative L2 (measured on H200, docs/validation.md); 1e-2 leaves room
for longer top-k sums and still fails on any real bug (those give O(1) errors or NaN).
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from helpers import (
    CpuStandIn,
    cuda_available,
    distinct_indices,
    exact_first_pass_state,
    extreme_logits_case,
    rel_l2,
    rerun_written,
)

pytestmark = pytest.mark.gpu

if cuda_available():
    import torch

    from paddlefleet.tilelang_ops.attn import exact_dkv, interface, kernel_provider, tiling
    from paddlefleet.tilelang_ops.attn.checks import check_cu_seqlens, check_indices_in_documents
    from paddlefleet.tilelang_ops.attn.indices import (
        causal_topk_indices,
        cu_seqlens_from_lengths,
        varlen_causal_topk_indices,
    )
    from paddlefleet.tilelang_ops.attn.lse import lse_natural_to_log2_sink
    from paddlefleet.tilelang_ops.attn.reference import (
        mqa_latent_sparse_bwd_ref,
        mqa_latent_sparse_fwd_ref,
    )

TOL = 1e-2
DK, DV = 576, 512
SM_SCALE = DK ** -0.5
GUARD = 4096  # elements of sentinel before and after every kernel output


def _sentinel(dtype):
    return 0x5A5A5A5A if dtype in (torch.int64, torch.int32) else -7.5


def _poison(dtype):
    if dtype == torch.int64:
        return 0x7FFF_FFFF_FFFF
    return 0x7FFF_FFF0 if dtype == torch.int32 else float("nan")


def _unwritten(t):
    """Elements still holding the poison (NaN for floats)."""
    return int(torch.isnan(t).sum()) if t.is_floating_point() else int((t == _poison(t.dtype)).sum())


if cuda_available():

    class GuardedKernels(kernel_provider.TileLangKernels):
        """The real kernels, each output replaced by a view into a larger buffer whose head and
        tail hold a sentinel; outputs are poisoned (NaN) first, except those a kernel adds into
        or updates (the dKV accumulator, Bound, BoundExp, est, the grids the re-run plan
        scales).  After each launch the guards must be untouched, and the outputs the exact
        dKV's bookkeeping kernels write whole must hold no poison."""

        def __init__(self):
            super().__init__()
            self.launches = 0

        def _framed(self, t, poison):
            big = torch.empty(t.numel() + 2 * GUARD, dtype=t.dtype, device=t.device)
            big.fill_(_sentinel(t.dtype))
            view = big[GUARD:GUARD + t.numel()].view(t.shape)
            if poison:
                view.fill_(_poison(t.dtype))
            else:
                view.copy_(t)
            return big, view

        def _check(self, name, big, view, t):
            head, tail = big[:GUARD], big[GUARD + t.numel():]
            s = _sentinel(t.dtype)
            assert bool((head == s).all()) and bool((tail == s).all()), (
                f"{name}: a kernel wrote outside its output tensor"
            )
            t.copy_(view)

        def _run(self, launch, outputs, whole=False):
            framed = [(n, t, poison, *self._framed(t, poison)) for n, t, poison in outputs]
            launch([v for _, _, _, _, v in framed])
            torch.cuda.synchronize()
            self.launches += 1
            for n, t, poison, big, view in framed:
                self._check(n, big, view, t)
                if whole and poison:
                    assert _unwritten(t) == 0, f"{n}: {_unwritten(t)} elements not written"

        def fwd(self, m, q, kv, idx, sink, scale, out, lse):
            self._run(lambda v: super(GuardedKernels, self).fwd(m, q, kv, idx, sink, scale, *v),
                      [("out", out, True), ("lse", lse, True)])

        @staticmethod
        def _preprocess_outputs(delta, lse2, d_sink_rows):
            # the preprocess's three outputs (bwd_preprocess, the fused prologue, grid_rows),
            # poisoned first, in the kernels' argument order
            return [("delta", delta, True), ("lse2", lse2, True),
                    ("d_sink_rows", d_sink_rows, True)]

        def bwd_preprocess(self, natural, out, do, lse, sink, delta, lse2, d_sink_rows):
            self._run(lambda v: super(GuardedKernels, self).bwd_preprocess(natural, out, do, lse,
                                                                           sink, *v),
                      self._preprocess_outputs(delta, lse2, d_sink_rows),
                      whole=not bool(torch.isnan(lse).any()))  # NaN lse: NaN (= poison)

        def bwd_main(self, m, deterministic, with_dq, q, kv, do, idx, lse2, delta, scale,
                     inv_grid, counts, dq, acc, bound, bound_exp, pre=None):
            # dq is written whole (poisoned first) by the pass that computes it; the
            # accumulators are added into, so they keep their contents.  With pre (the fused
            # preprocess) lse2, delta and the rows' d_sink terms are outputs, written whole
            # unless the lse has a NaN (NaN = the poison)
            outs = [("dq", dq, True)] if with_dq else []
            outs += [("dkv_acc", acc, False), ("bound", bound, False),
                     ("bound_exp", bound_exp, False)]
            if not with_dq:
                outs.append(("dq_untouched", dq, False))
            pre_outs = ([] if pre is None
                        else self._preprocess_outputs(delta, lse2, pre.d_sink_rows))

            def launch(v):
                d = dict(zip([n for n, _, _ in outs + pre_outs], v))
                p = None if pre is None else pre._replace(d_sink_rows=d["d_sink_rows"])
                super(GuardedKernels, self).bwd_main(
                    m, deterministic, with_dq, q, kv, do, idx, d.get("lse2", lse2),
                    d.get("delta", delta),
                    scale, inv_grid, counts, d.get("dq", d.get("dq_untouched")), d["dkv_acc"],
                    d["bound"], d["bound_exp"], p)

            self._run(launch, outs + pre_outs)
            if pre is not None and not bool(torch.isnan(pre.lse).any()):
                for n, t, _ in pre_outs:
                    assert _unwritten(t) == 0, f"{n}: {_unwritten(t)} elements not written"

        def bwd_finish(self, m, deterministic, acc, inv_grid, dkv):
            self._run(lambda v: super(GuardedKernels, self).bwd_finish(m, deterministic, acc,
                                                                       inv_grid, *v),
                      [("dkv", dkv, True)], whole=True)

        def exact_grid_rows(self, natural, q, out, do, lse, sink, idx, kv_norm, delta, lse2,
                            d_sink_rows, c_row, kv_coef):
            # the deterministic backward's preprocess: its three outputs as bwd_preprocess's
            # (written whole unless the lse has a NaN: NaN = the poison); c_row always whole
            self._run(lambda v: super(GuardedKernels, self).exact_grid_rows(
                natural, q, out, do, lse, sink, idx, kv_norm, *v, kv_coef),
                self._preprocess_outputs(delta, lse2, d_sink_rows) + [("c_row", c_row, True)],
                whole=not bool(torch.isnan(lse).any()))
            assert _unwritten(c_row) == 0, "c_row: not written whole"

        def exact_grid_scatter(self, c_row, top, idx, est):
            self._run(lambda v: super(GuardedKernels, self).exact_grid_scatter(
                c_row, top, idx, *v), [("est", est, False)])

        def exact_grid_keys(self, est, top, inv_grid, shift, e_lo, e_hi):
            self._run(lambda v: super(GuardedKernels, self).exact_grid_keys(
                est, top, *v, shift, e_lo, e_hi), [("inv_grid", inv_grid, True)], whole=True)

        def exact_rerun_plan(self, bound, bound_exp, inv_grid, acc, over, any_over, n_max,
                             exact_bits, coarse_bits):
            # any_over is raised from the caller's zeros: not poisoned
            self._run(lambda v: super(GuardedKernels, self).exact_rerun_plan(
                bound, bound_exp, *v, n_max, exact_bits, coarse_bits),
                [("inv_grid", inv_grid, False), ("dkv_acc", acc, False), ("over", over, True),
                 ("any_over", any_over, False)],
                whole=True)

        def exact_rerun_slots(self, idx, over, any_over, idx2, counts):
            # counts is written whole, idx2 only in the batches with a re-run key and there
            # only up to the end of the 64-slot block of each row's last re-run slot
            # (helpers.rerun_written): the rest keeps the poison (an index far past S_kv),
            # which the re-run then must not read
            self._run(lambda v: super(GuardedKernels, self).exact_rerun_slots(
                idx, over, any_over, *v), [("idx2", idx2, True), ("counts", counts, True)])
            assert _unwritten(counts) == 0, f"counts: {_unwritten(counts)} elements not written"
            # (counts = 0 in a batch without the flag: nothing written there)
            written = torch.from_numpy(rerun_written(counts.cpu().numpy(), idx2.shape[-1]))
            for b, flag in enumerate(any_over.tolist()):
                w = written[b].to(idx2.device)
                poisoned = idx2[b] == _poison(idx2.dtype)
                assert not bool((poisoned & w).any()) and bool(poisoned[~w].all()), (
                    f"idx2[{b}] (any_over {flag}): {int((poisoned & w).sum())} slots it must "
                    f"write not written, {int((~poisoned & ~w).sum())} written past them")
                # then a key that re-runs where nothing was written: the poison (past S_kv)
                # would be skipped by the re-run's key checks, this key would add to its dKV
                # (and fail the tests' accuracy checks) if the re-run read past its blocks
                keys = torch.nonzero(over[b]).flatten()
                if keys.numel():
                    idx2[b][~w] = int(keys[0])


def _inputs(case, seed, indices=None):
    """Random bf16 ``q [B, S, H, Dk]``, ``kv [B, S_kv, Dk]``, ``dO [B, S, H, Dv]``, an fp32
    sink (``case["sink"]``) and the indices on the GPU: ``indices`` (numpy ``[B, S, L]``) where
    given, else ragged (``case["ragged"]``) or causal random ones; ``case["empty_rows"]`` made
    ``-1``.  ``(Dk, Dv)``: ``case["dims"]``, default ``(DK, DV)``."""
    B, S, S_kv, H, L = case["B"], case["S"], case["S_kv"], case["H"], case["L"]
    dk, dv = case.get("dims", (DK, DV))
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.randn((B, S, H, dk), generator=g, device=dev).to(torch.bfloat16)
    kv = torch.randn((B, S_kv, dk), generator=g, device=dev).to(torch.bfloat16)
    do = torch.randn((B, S, H, dv), generator=g, device=dev).to(torch.bfloat16)
    sink = None
    if case.get("sink"):
        sink = (torch.randn((H,), generator=g, device=dev) + 1.0).float()
    if indices is not None:
        assert indices.shape == (B, S, L), (indices.shape, (B, S, L))
        idx = indices
    elif case.get("ragged"):  # keys end early in most rows, with holes (_ragged_indices)
        idx = _ragged_indices(np.random.default_rng(seed), B, S, S_kv, L)
    else:
        idx = causal_topk_indices(B, S, S_kv, L, seed=seed,
                                  dtype=case.get("index_dtype", "int32"))
    idx = torch.from_numpy(idx).to(dev)
    for r in case.get("empty_rows", ()):
        idx[:, r, :] = -1
    return q, kv, do, sink, idx


# ~20 cases covering every H in {1..128}, sink on/off, B in {1, 2}, topk in {64, 100, 150, 512, 640,
# 2048}, early rows with few keys (S_kv close to S), whole -1 rows, block_h 16/32, int64
# indices and non-contiguous inputs.
CASES = [
    dict(id="H1_L64_sink", B=1, S=64, S_kv=64, H=1, L=64, sink=True),
    dict(id="H2_B2_L100", B=2, S=48, S_kv=160, H=2, L=100),
    dict(id="H4_L512_sink", B=1, S=64, S_kv=600, H=4, L=512, sink=True, empty_rows=(5,)),
    dict(id="H8_B2_L64_sink_empty", B=2, S=40, S_kv=96, H=8, L=64, sink=True,
         empty_rows=(0, 17)),
    dict(id="H8_bh32_L640", B=1, S=32, S_kv=700, H=8, L=640, block_h=32),
    dict(id="H16_L640", B=1, S=64, S_kv=800, H=16, L=640),
    dict(id="H24_L100_sink", B=1, S=80, S_kv=200, H=24, L=100, sink=True),
    dict(id="H32_B2_L512_sink", B=2, S=48, S_kv=560, H=32, L=512, sink=True),
    dict(id="H32_bh16_L64", B=1, S=64, S_kv=64, H=32, L=64, block_h=16, empty_rows=(63,)),
    dict(id="H40_L64", B=1, S=96, S_kv=128, H=40, L=64),
    dict(id="H48_L2048_sink", B=1, S=32, S_kv=2100, H=48, L=2048, sink=True),
    dict(id="H64_L2048_sink", B=1, S=64, S_kv=2112, H=64, L=2048, sink=True),
    dict(id="H64_B2_L640_empty", B=2, S=40, S_kv=700, H=64, L=640, empty_rows=(3,)),
    # keys end early in most rows, with holes: the 64-head kernels stop after a row's last key
    dict(id="H64_L640_ragged_sink", B=1, S=48, S_kv=900, H=64, L=640, sink=True, ragged=True),
    # 192 slots: an odd number (3) of the 64-head forward's and backward's 64-key blocks
    dict(id="H64_L150_sink_oddblocks", B=1, S=40, S_kv=200, H=64, L=150, sink=True,
         empty_rows=(7,)),
    dict(id="H64_bh16_L100_sink_i64", B=1, S=48, S_kv=120, H=64, L=100, sink=True,
         block_h=16, index_dtype="int64"),
    dict(id="H128_L512_sink", B=1, S=32, S_kv=560, H=128, L=512, sink=True),
    dict(id="H128_B2_L100", B=2, S=24, S_kv=100, H=128, L=100, empty_rows=(2,)),
    dict(id="H100_L64_sink", B=1, S=32, S_kv=64, H=100, L=64, sink=True),
    dict(id="H1_B2_L2048", B=2, S=16, S_kv=2048, H=1, L=2048),
    dict(id="H20_L100_noncontig_sink", B=1, S=32, S_kv=96, H=20, L=100, sink=True,
         noncontig=True),
]


def _noncontig(t):
    # same values, a strided view into a wider buffer (not contiguous)
    return torch.cat([t, t], dim=-1)[..., : t.shape[-1]]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_against_reference(case):
    seed = zlib.crc32(case["id"].encode())
    check_against_reference(case, *_inputs(case, seed), SM_SCALE)


def check_against_reference(case, q, kv, do, sink, idx, sm_scale):
    """Forward, the deterministic backward (three calls, bitwise equal) and the atomic one
    through :class:`GuardedKernels` against the fp32 reference by relative L2 (< ``TOL``), the
    deterministic and atomic dKV against each other, and the base-2 sink-inclusive lse form
    against the natural one.  ``case``: ``B, S, H``, ``block_h``, ``noncontig``, ``id``
    (printed); ``Dv`` is ``do``'s last dim (the forward's ``d_v``).  Shared with
    test_sparse_attn_v4_gpu.py."""
    if case.get("noncontig"):
        q, do = _noncontig(q), _noncontig(do)
        assert not q.is_contiguous()
    H, bh, dv = case["H"], case.get("block_h"), do.shape[-1]
    prov = GuardedKernels()

    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, sm_scale, sink, d_v=dv, block_h=bh,
                                               provider=prov)
    ref_out, ref_lse = mqa_latent_sparse_fwd_ref(q, kv, idx, sm_scale, sink, d_v=dv)
    e_out, e_lse = rel_l2(out.float(), ref_out), rel_l2(lse, ref_lse)
    assert out.shape == (case["B"], case["S"], H, dv) and out.dtype == torch.bfloat16
    assert lse.shape == (case["B"], case["S"], H) and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()

    ref_dq, ref_dkv, ref_ds = mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sink, idx, sm_scale)
    runs = []
    for _ in range(3):
        runs.append(interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, sm_scale,
                                                    block_h=bh, deterministic=True,
                                                    provider=prov))
    dq, dkv, ds = runs[0]
    for other in runs[1:]:
        for a, b, name in zip(runs[0], other, ("dq", "dkv", "d_sink")):
            assert torch.equal(a, b), f"{name} not bitwise repeatable (deterministic=True)"
    dq_a, dkv_a, ds_a = interface.mqa_latent_sparse_bwd(
        q, kv, out, do, lse, sink, idx, sm_scale, block_h=bh, deterministic=False,
        provider=prov)
    errs = dict(out=e_out, lse=e_lse, dq=rel_l2(dq.float(), ref_dq),
                dkv=rel_l2(dkv.float(), ref_dkv), dq_atomic=rel_l2(dq_a.float(), ref_dq),
                dkv_atomic=rel_l2(dkv_a.float(), ref_dkv),
                det_vs_atomic=rel_l2(dkv.float(), dkv_a.float()))
    if sink is not None:
        # d_sink[h] sums P_sink * Delta over rows with both signs: with few heads the sum cancels
        # and its relative error grows, so measure it against the size of the summed terms.
        ref_lse_all = torch.logaddexp(ref_lse, sink.view(1, 1, -1))
        terms = torch.exp(sink.view(1, 1, -1) - ref_lse_all) * (ref_out * do.float()).sum(-1)
        scale_ds = terms.abs().sum((0, 1)).norm()
        errs["d_sink"] = float((ds - ref_ds).norm() / scale_ds)
        errs["d_sink_atomic"] = float((ds_a - ref_ds).norm() / scale_ds)
        errs["d_sink_rel"] = rel_l2(ds, ref_ds)
    else:
        assert bool((ds == 0).all()) and bool((ds_a == 0).all())
    print(f"\n[{case['id']}] " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    for t in (dq, dkv, ds, dq_a, dkv_a):
        assert not torch.isnan(t).any()
    for k, v in errs.items():
        if k != "d_sink_rel":  # printed for the record; cancellation makes it noisy
            assert v < TOL, f"{k}: relative L2 error {v:.3e} >= {TOL}"
    assert dq.shape == q.shape and dkv.shape == kv.shape and ds.shape == (H,)

    # the base-2 sink-inclusive LSE form gives the same gradients
    lse2 = lse_natural_to_log2_sink(lse, sink)
    dq2, dkv2, ds2 = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse2, sink, idx, sm_scale,
                                                     block_h=bh, lse_format="log2_sink",
                                                     provider=prov)
    assert rel_l2(dq2.float(), dq.float()) < 1e-3 and rel_l2(dkv2.float(), dkv.float()) < 1e-3
    if sink is not None:
        assert rel_l2(ds2, ds) < 1e-4
    return errs


# Packed documents (B = 1, cu_seqlens, the THD layout): the kernels take them as they are, with
# per-document causal indices.  Specialisations as in CASES (H=64 and H=16, default block_h,
# default deterministic backward), so no new kernel is compiled.
PACKED_CASES = [
    # a document longer than top-k beside documents of 1..600 rows and an empty one
    dict(id="H64_L2048_sink_docs", H=64, L=2048, sink=True, lengths=[2500, 1, 37, 0, 600, 3]),
    # one long document, the others tiny
    dict(id="H16_L640_docs", H=16, L=640, sink=False, lengths=[1, 900, 5, 130, 2, 64]),
]


def _packed_inputs(case, seed):
    cu = cu_seqlens_from_lengths(case["lengths"])
    S, H = int(cu[-1]), case["H"]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((1, S, H, DK), generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn((1, S, DK), generator=g, device="cuda").to(torch.bfloat16)
    do = torch.randn((1, S, H, DV), generator=g, device="cuda").to(torch.bfloat16)
    sink = None
    if case["sink"]:
        sink = (torch.randn((H,), generator=g, device="cuda") + 1.0).float()
    idx = torch.from_numpy(varlen_causal_topk_indices(cu, case["L"], seed=seed)).to("cuda")
    return cu, q, kv, do, sink, idx


@pytest.mark.parametrize("case", PACKED_CASES, ids=[c["id"] for c in PACKED_CASES])
def test_packed_documents_against_reference(case):
    """A packed batch of documents of very different lengths: out, lse, dq, dkv and d_sink
    against the fp32 reference; every document's rows equal that document run alone; the
    in-document check of the op runs on CUDA tensors."""
    seed = zlib.crc32(case["id"].encode())
    cu, q, kv, do, sink, idx = _packed_inputs(case, seed)
    S = int(cu[-1])
    np.testing.assert_array_equal(check_cu_seqlens(torch.from_numpy(cu).cuda(), S), cu)
    check_indices_in_documents(idx, cu)
    bad = idx.clone()
    bad[0, S - 1, 0] = 0  # the last row (last document) points at the first document
    with pytest.raises(ValueError, match=rf"^token_indices: row {S - 1} \(document "
                                         rf"{len(cu) - 2}, .* holds key 0, outside its document"):
        check_indices_in_documents(bad, cu)

    prov = GuardedKernels()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, sink, provider=prov)
    dq, dkv, ds = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, SM_SCALE,
                                                  provider=prov)
    ref_out, ref_lse = mqa_latent_sparse_fwd_ref(q, kv, idx, SM_SCALE, sink)
    ref_dq, ref_dkv, ref_ds = mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sink, idx, SM_SCALE)
    for t in (out, lse, dq, dkv, ds):
        assert not torch.isnan(t).any()
    assert bool(torch.isfinite(lse).all())  # every row sees at least itself
    errs = dict(out=rel_l2(out.float(), ref_out), lse=rel_l2(lse, ref_lse),
                dq=rel_l2(dq.float(), ref_dq), dkv=rel_l2(dkv.float(), ref_dkv))
    if sink is not None:  # measured against the summed magnitudes, as in test_against_reference
        ref_lse_all = torch.logaddexp(ref_lse, sink.view(1, 1, -1))
        terms = torch.exp(sink.view(1, 1, -1) - ref_lse_all) * (ref_out * do.float()).sum(-1)
        errs["d_sink"] = float((ds - ref_ds).norm() / terms.abs().sum((0, 1)).norm())
    else:
        assert bool((ds == 0).all())

    # Each document alone (its rows, its keys, indices shifted to start at 0).  Rows and keys
    # of one document never meet another's, so the packed slices equal the lone runs up to the
    # dKV grids (the packed run's per-key grid guess sees the whole kv) and bf16 rounding.
    for d, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == b:
            continue
        idx_d = torch.where(idx[:, a:b] >= 0, idx[:, a:b] - a, idx[:, a:b])
        q_d, kv_d, do_d = q[:, a:b].contiguous(), kv[:, a:b].contiguous(), do[:, a:b].contiguous()
        out_d, lse_d = interface.mqa_latent_sparse_fwd(q_d, kv_d, idx_d, SM_SCALE, sink)
        dq_d, dkv_d, _ = interface.mqa_latent_sparse_bwd(q_d, kv_d, out_d, do_d, lse_d, sink,
                                                         idx_d, SM_SCALE)
        for name, packed, alone in (("out", out[:, a:b], out_d), ("lse", lse[:, a:b], lse_d),
                                    ("dq", dq[:, a:b], dq_d), ("dkv", dkv[:, a:b], dkv_d)):
            errs[f"{name}_doc{d}_vs_alone"] = rel_l2(packed.float(), alone.float())
    print(f"\n[{case['id']}] " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    for k, v in errs.items():
        limit = TOL / 10 if k.endswith("_vs_alone") else TOL
        assert v < limit, f"{k}: relative L2 error {v:.3e} >= {limit}"
    assert dq.shape == q.shape and dkv.shape == kv.shape


RERUN_CASES = [
    dict(id="H100_B2_S48", B=2, S=48, S_kv=300, H=100, L=200, sink=True),  # two head groups
    # more rows than the re-run's CTAs (bwd_main.RERUN_CTAS): each CTA walks 2-3 rows
    dict(id="H64_S300", B=1, S=300, S_kv=400, H=64, L=96, sink=True),
]


@pytest.mark.parametrize("case", RERUN_CASES, ids=[c["id"] for c in RERUN_CASES])
def test_exact_rerun_is_repeatable_and_accurate(monkeypatch, case):
    """Force the exact mode's re-run (first-pass grids 2^20 too fine, so every u is clamped and
    the re-run grid comes from BoundExp; 2^6 too fine, the usual case; 2^10 too coarse, re-run on
    a finer grid): the result must stay bitwise repeatable and as accurate as without, also
    where a re-run CTA walks several rows."""
    check_exact_rerun(monkeypatch, case, *_inputs(case, 21), SM_SCALE)


def check_exact_rerun(monkeypatch, case, q, kv, do, sink, idx, sm_scale):
    """The deterministic backward with its first-pass grids 2^20 and 2^6 too fine and 2^12
    too coarse (``exact_dkv.GRID_MARGIN_BITS``): bitwise repeatable, dq as without the
    re-run, dKV within ``TOL`` of the fp32 reference.  Shared with test_sparse_attn_v4_gpu.py."""
    prov = GuardedKernels()
    dv = do.shape[-1]
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, sm_scale, sink, d_v=dv,
                                               provider=prov)
    ref_dq, ref_dkv, _ = mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sink, idx, sm_scale)
    base = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, sm_scale,
                                           provider=prov)
    for margin in (-20, -6, 12):  # too fine (clamped), too fine, too coarse
        monkeypatch.setattr(exact_dkv, "GRID_MARGIN_BITS", margin)
        runs = [interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, sm_scale,
                                                provider=prov) for _ in range(2)]
        for a, b, name in zip(runs[0], runs[1], ("dq", "dkv", "d_sink")):
            assert torch.equal(a, b), f"{name}: re-run path not bitwise repeatable"
        assert torch.equal(runs[0][0], base[0]), "dq must not depend on the dKV grid"
        e = rel_l2(runs[0][1].float(), ref_dkv)
        print(f"\n[rerun {case['id']} margin {margin}] dkv={e:.2e}")
        assert e < TOL


class _RerunCapture(kernel_provider.TileLangKernels if cuda_available() else object):
    """The shipped kernels; keeps copies of the exact re-run launch's arguments (``rerun``)."""

    def bwd_main(self, m, deterministic, with_dq, *args, **kw):
        if not with_dq:
            torch.cuda.synchronize()
            self.rerun = (m, [t.clone() for t in args])
        super().bwd_main(m, deterministic, with_dq, *args, **kw)


def test_exact_rerun_walks_exactly_the_busy_rows(monkeypatch):
    """The re-run kernel's walk (``bwd_main.main``, ``with_dq=False``: CTA ``x`` of
    ``RERUN_CTAS`` owns rows ``x, x + RERUN_CTAS, ...`` and walks those with ``Counts > 0``) on
    the arguments of a forced re-run (every key re-runs, every row has slots in ``idx2``),
    with ``Counts`` kept only in a few rows: a CTA whose busy row is its second or third (its
    first empty), one with its first and third busy around an empty second, one with its
    first busy and its second empty, and CTAs with none.  Its accumulator and ``Bound`` equal
    the sums of one launch per busy row, exactly (the re-run grids keep every sum exact), so
    it walked each busy row once, with its own count (every other row's ``idx2`` holds slots
    that a count read for the wrong row would add).  One chunk of 256 rows per CTA only: the
    walk's later chunks (more than 33,792 rows per batch) are checked by the lowering test."""
    from paddlefleet.tilelang_ops.attn.kernels.bwd_main import RERUN_CTAS as C

    case = dict(B=1, S=300, S_kv=400, H=64, L=96, sink=True)
    q, kv, do, sink, idx = _inputs(case, 5)
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, sink)
    monkeypatch.setattr(exact_dkv, "GRID_MARGIN_BITS", -20)  # every key re-runs
    cap = _RerunCapture()
    interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, SM_SCALE, provider=cap)
    m, (q_p, kv_p, do_p, idx2, lse2, delta, scale, inv_grid, counts, dq, acc, bound,
        bexp) = cap.rerun
    assert C == 132 and case["S"] > 2 * C  # CTAs 0..35 own three rows, the others two
    busy = [C + 3, 2 * C + 7, 10, 2 * C + 10, 50]
    assert bool((counts[0, busy] > 0).all())

    def rerun(rows):
        c = torch.zeros_like(counts)
        c[0, rows] = counts[0, rows]
        a, b = torch.zeros_like(acc), torch.zeros_like(bound)
        e = torch.full_like(bexp, -(2**30))
        d = torch.full_like(dq, float("nan"))  # not written by the re-run
        kernel_provider.TileLangKernels().bwd_main(m, True, False, q_p, kv_p, do_p, idx2, lse2,
                                                   delta, scale, inv_grid, c, d, a, b, e)
        torch.cuda.synchronize()
        assert bool(torch.isnan(d).all())
        return a.double(), b

    acc_all, bound_all = rerun(busy)
    acc_sum = torch.zeros_like(acc_all)
    bound_sum = torch.zeros_like(bound_all)
    for r in busy:
        a, b = rerun([r])
        assert bool(a.any())
        acc_sum += a
        bound_sum += b
    assert torch.equal(acc_all, acc_sum) and torch.equal(bound_all, bound_sum)
    assert bool(acc_all.any()) and not bool(rerun([])[0].any())


class _FirstPassCapture(kernel_provider.TileLangKernels if cuda_available() else object):
    """The shipped kernels, except that 64-head first passes may run the one-role kernel
    (``one_role=True``); keeps a copy of each exact first pass's dq, dKV accumulator, Bound and
    BoundExp."""

    def __init__(self, one_role=False):
        super().__init__()
        self.one_role, self.passes = one_role, []

    def bwd_main_key(self, m, deterministic, with_dq, d_qk, d_v, pre=None):
        if self.one_role and m == 64 and with_dq:
            from paddlefleet.tilelang_ops.attn.kernels.schedule import bwd_schedule

            # a BwdSchedule picks the one-role kernel (bwd_main): 64-head transposed chunks
            return ("bwd_main", m, d_qk, d_v, bool(deterministic), True, bwd_schedule(m))
        return super().bwd_main_key(m, deterministic, with_dq, d_qk, d_v, pre)

    def bwd_main(self, m, deterministic, with_dq, q, kv, do, idx, lse2, delta, scale, inv_grid,
                 counts, dq, acc, bound, bound_exp):
        super().bwd_main(m, deterministic, with_dq, q, kv, do, idx, lse2, delta, scale, inv_grid,
                         counts, dq, acc, bound, bound_exp)
        if with_dq and deterministic:
            torch.cuda.synchronize()
            self.passes.append([t.clone() for t in (dq, acc, bound, bound_exp)])

@pytest.mark.parametrize("case", [
    dict(B=1, S=40, S_kv=200, H=64, L=150, sink=True, empty_rows=(7,)),  # 3 key blocks: odd
    dict(B=2, S=24, S_kv=300, H=100, L=200, sink=True),  # two head groups, 28 pad heads
    dict(B=2, S=40, S_kv=900, H=64, L=640, sink=True, ragged=True),  # rows end early, holes
], ids=["H64_odd_blocks", "H100_two_groups", "H64_ragged_rows"])
def test_warp_specialized_bound_equals_one_role(case):
    """The 64-head kernel splits each key block's dKV between two warpgroups; warpgroup 0 hands
    its slots' maxima to warpgroup 1, which adds each key's exactness bound.  Nothing else
    checks those bounds (a lost handover leaves them too small and the results still right),
    so compare the first pass with the one-role kernel's: the contributions are the same fp32
    GEMM sums, so dq, the exact dKV accumulator, Bound and BoundExp are bitwise equal.  With
    ragged rows the 64-head kernel stops after a row's last key (``row_blocks``) and the
    one-role kernel walks every block: the same again."""
    q, kv, do, sink, idx = _inputs(case, 31)
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, sink)
    got = {}
    for one_role in (False, True):
        prov = _FirstPassCapture(one_role)
        interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, SM_SCALE, provider=prov)
        assert len(prov.passes) == 1
        got[one_role] = prov.passes[0]
    for name, a, b in zip(("dq", "dkv_acc", "bound", "bound_exp"), got[False], got[True]):
        assert torch.equal(a, b), f"{name}: warp-specialised and one-role first passes differ"
    assert int(got[False][2].max()) > 0, "no bound was added: the comparison proves nothing"


def test_exact_dkv_peaked_attention():
    """Attention piled on a few keys (every row selects keys 0..3, with large logits there):
    those keys' sums are far above the uniform-attention grid guess and go through the re-run.
    dkv must match the reference and be bitwise repeatable."""
    case = dict(B=1, S=128, S_kv=640, H=64, L=512, sink=True)
    q, kv, do, sink, idx = _inputs(case, 5)
    # every query shares a direction u with keys 0..3: logits there ~ 0.25 * 576 / 24 = 6
    u = torch.randn(DK, generator=torch.Generator(device="cuda").manual_seed(6), device="cuda")
    q = (q.float() + 0.5 * u).to(torch.bfloat16)
    kv[:, :4] = (0.5 * u).to(torch.bfloat16)
    idx[:, :, :4] = torch.arange(4, device=idx.device, dtype=idx.dtype)
    dup = (idx[:, :, 4:, None] == idx[:, :, None, :4]).any(-1)  # keep each row's keys distinct
    idx[:, :, 4:] = torch.where(dup, -1, idx[:, :, 4:])
    prov = GuardedKernels()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, sink, provider=prov)
    ref_dq, ref_dkv, _ = mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sink, idx, SM_SCALE)
    runs = [interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, SM_SCALE,
                                            provider=prov) for _ in range(2)]
    for a, b, name in zip(runs[0], runs[1], ("dq", "dkv", "d_sink")):
        assert torch.equal(a, b), f"{name} not bitwise repeatable"
    e_dq, e_dkv = rel_l2(runs[0][0].float(), ref_dq), rel_l2(runs[0][1].float(), ref_dkv)
    e_top = rel_l2(runs[0][1][:, :4].float(), ref_dkv[:, :4])
    print(f"\n[peaked] dq={e_dq:.2e} dkv={e_dkv:.2e} dkv(keys 0..3)={e_top:.2e}")
    assert e_dq < TOL and e_dkv < TOL and e_top < TOL


# The exact dKV's bookkeeping kernels (kernels/exact_grid.py) alone: H from 1 to 128, top-k not a
# multiple of anything, rows at scales 2^-20 .. 2^20, a zero grad_out row, an empty row, keys that
# no slot names.
GRID_CASES = [
    dict(id="H1_L64", B=1, S=20, S_kv=80, H=1, L=64, used=70),
    dict(id="H5_B2_L100", B=2, S=37, S_kv=300, H=5, L=100, used=280),
    dict(id="H64_L2048", B=1, S=40, S_kv=2200, H=64, L=2048, used=2150),
    dict(id="H128_L650", B=1, S=24, S_kv=700, H=128, L=650, used=690),
    # more keys than grid_scatter's shared histogram holds (8192): straight into Est
    dict(id="H2_Skv9000_L300", B=1, S=30, S_kv=9000, H=2, L=300, used=8990),
]


@pytest.mark.parametrize("case", GRID_CASES, ids=[c["id"] for c in GRID_CASES])
def test_exact_grid_kernels_match_the_stand_in(case):
    """Each bookkeeping kernel against its numpy stand-in (``helpers.CpuStandIn``, itself held to
    the former framework code by ``tests/test_exact_grid.py``) on random GPU inputs:
    ``grid_rows``' preprocess outputs (Delta, Lse2, DSink; 3 pad heads, 0 there) to fp32
    rounding and its row weights to fp64 rounding (the sums' order differs), all bitwise
    repeatable; from the same
    row weights the int64 estimates and the grids (margins 2, -40, +12) exactly; the re-run
    plan (every branch: ``helpers.exact_first_pass_state``) exactly (over, the scaled grids,
    the cleared accumulator rows, the per-batch flag; with B > 1 batch 0 has no re-run key);
    the slot compaction exactly (the same slots per row, in the same order) for the plan's over
    and flag, for none, all and a third of the keys with every batch flagged, and with no batch
    flagged (nothing looked up: counts 0, idx2 unwritten)."""
    rng = np.random.default_rng(zlib.crc32(case["id"].encode()))
    B, S, S_kv, H, L = case["B"], case["S"], case["S_kv"], case["H"], case["L"]

    def bf16(shape, row_scale):
        x = rng.standard_normal(shape) * row_scale[..., None, None]
        return torch.from_numpy(x.astype(np.float32)).cuda().to(torch.bfloat16)

    q = bf16((B, S, H, DK), np.exp2(rng.integers(-20, 21, (B, S))))
    do = bf16((B, S, H, DV), np.exp2(rng.integers(-20, 21, (B, S))))
    do[0, 1] = 0
    kv = torch.from_numpy(rng.standard_normal((B, S_kv, DK), dtype=np.float32)).cuda()
    kv = kv.to(torch.bfloat16)
    idx_np = distinct_indices(rng, B, S, S_kv, L, case["used"], empty_rows=(2,), fill=0.85)
    idx = torch.from_numpy(idx_np).cuda()
    prov, ref = GuardedKernels(), CpuStandIn()

    # grid_rows (the deterministic backward's preprocess and row weights; 3 pad heads) against
    # numpy: Delta to fp32 rounding, Lse2 and DSink to fp32 rounding, 0 at pad heads; the row
    # weights (fp64 sums of the exact fp64 squares, in another order) to fp64 rounding; all
    # bitwise repeatable
    out = bf16((B, S, H, DV), np.ones((B, S)))
    lse = torch.from_numpy(rng.standard_normal((B, S, H)).astype(np.float32) * 4 + 8).cuda()
    sink = torch.from_numpy(rng.standard_normal(H).astype(np.float32)).cuda()
    sink[0] = -math.inf
    kv_norm = torch.linalg.vector_norm(kv.reshape(1, -1), dim=-1, dtype=torch.float32)
    coef = SM_SCALE**2 / (kv.numel() * DK)
    runs = []
    for p in (prov, prov, ref):
        rows = [torch.empty((B, S, H + 3), device="cuda") for _ in range(3)]
        c = torch.empty((B, S), dtype=torch.float64, device="cuda")
        p.exact_grid_rows(True, q, out, do, lse, sink, idx, kv_norm, *rows, c, coef)
        runs.append(rows + [c])
    (*rows, c_row), again, (*rows_ref, c_ref) = runs
    assert all(torch.equal(a, b) for a, b in zip(runs[0], again)), "grid_rows not repeatable"
    for name, got, want in zip(("delta", "lse2", "d_sink_rows"), rows, rows_ref):
        assert not bool(got[..., H:].any()), f"{name}: pad heads not 0"
        # fp32 sums of 512 products in another order; all 0 (H=1, sink[0] = -inf): exactly
        diff, den = (got.double() - want.double()).norm(), want.double().norm()
        err = float(diff / den) if den > 0 else float(diff)
        assert err < 1e-5, (name, err)
    assert not bool(rows[0][0, 1].any())  # dO = 0: Delta = 0
    torch.testing.assert_close(c_row, c_ref, rtol=1e-12, atol=0)
    assert c_row[0, 1] == 0 and bool((c_row[0, 2:] > 0).all())

    top = c_row.amax().reshape(1)
    est, est_ref = (torch.zeros((B, S_kv), dtype=torch.int64, device="cuda") for _ in range(2))
    prov.exact_grid_scatter(c_row, top, idx, est)
    ref.exact_grid_scatter(c_row, top, idx, est_ref)
    assert torch.equal(est, est_ref)
    assert not bool(est[:, case["used"]:].any()) and bool((est[:, :case["used"]] > 0).any())
    for margin in (exact_dkv.GRID_MARGIN_BITS, -40, 12):
        inv, inv_ref = (torch.empty((B, S_kv), device="cuda") for _ in range(2))
        args = (margin - exact_dkv.EXACT_BITS, *exact_dkv.GRID_EXP_RANGE)
        prov.exact_grid_keys(est, top, inv, *args)
        ref.exact_grid_keys(est, top, inv_ref, *args)
        assert torch.equal(inv, inv_ref), f"grids differ at margin {margin}"

    n_max = float(S * 2)
    state = exact_first_pass_state(rng, B, S_kv, n_max)
    if B > 1:  # batch 0 without a re-run key: its over keys made keys without contributions
        probe = [torch.from_numpy(a).cuda() for a in state]
        over0 = torch.zeros((B, S_kv), dtype=torch.int32, device="cuda")
        ref.exact_rerun_plan(*probe, over0, torch.zeros_like(over0[:, 0]), n_max,
                             exact_dkv.EXACT_BITS, exact_dkv.RERUN_COARSE_BITS)
        gone = over0[0].cpu().numpy() != 0
        state[0][0][gone], state[1][0][gone] = 0, -(2**30)
    got = [torch.from_numpy(a).cuda() for a in state]
    want = [torch.from_numpy(a).cuda() for a in state]
    over, over_ref = (torch.empty((B, S_kv), dtype=torch.int32, device="cuda") for _ in range(2))
    any_over, any_ref = (torch.zeros((B,), dtype=torch.int32, device="cuda") for _ in range(2))
    bits = (exact_dkv.EXACT_BITS, exact_dkv.RERUN_COARSE_BITS)
    prov.exact_rerun_plan(*got, over, any_over, n_max, *bits)
    ref.exact_rerun_plan(*want, over_ref, any_ref, n_max, *bits)
    assert torch.equal(over, over_ref)
    assert torch.equal(any_over, any_ref)
    assert any_over.tolist() == [int(B == 1)] + [1] * (B - 1)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    assert 0 < int(over.sum()) < over.numel()

    # the flag as the plan gives it, and all batches on with none, all and a third of the keys
    # (GuardedKernels checks that idx2 is written exactly where helpers.rerun_written says)
    ones = torch.ones_like(any_over)
    for name, o, flag in (("plan", over, any_over), ("none", torch.zeros_like(over), ones),
                          ("all", torch.ones_like(over), ones),
                          ("third", (torch.rand(over.shape, device="cuda") < 0.3).int(), ones),
                          ("flag off", torch.ones_like(over), torch.zeros_like(any_over))):
        idx2, idx2_ref = (torch.full_like(idx, 12345) for _ in range(2))
        counts, counts_ref = (torch.empty((B, S), dtype=torch.int32, device="cuda")
                              for _ in range(2))
        prov.exact_rerun_slots(idx, o, flag, idx2, counts)
        ref.exact_rerun_slots(idx, o, flag, idx2_ref, counts_ref)
        assert torch.equal(counts, counts_ref), name
        # written: each row up to the end of the 64-slot block of its last re-run slot, in the
        # flagged batches only (GuardedKernels checked that the kernel wrote exactly that; its
        # own poison, not 12345, is left in idx2 elsewhere)
        w = torch.from_numpy(rerun_written(counts_ref.cpu().numpy(), idx.shape[-1])).cuda()
        assert bool((idx2_ref[~w] == 12345).all()), name
        got, want = torch.where(w, idx2, -2), torch.where(w, idx2_ref, -2)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values), name  # as sets
        assert torch.equal(got, want), f"{name}: the re-run slots' order differs"


FUSED_CASES = [
    dict(id="H64_L2048_sink", B=1, S=64, S_kv=2112, H=64, L=2048, sink=True),
    dict(id="H64_L150_sink_oddblocks_log2", B=1, S=40, S_kv=200, H=64, L=150, sink=True,
         empty_rows=(7,), lse_format="log2_sink"),
    dict(id="H40_L64_pad24_sink_log2", B=1, S=96, S_kv=128, H=40, L=64, sink=True,
         lse_format="log2_sink"),
    dict(id="H100_B2_L640_nosink", B=2, S=24, S_kv=700, H=100, L=640, empty_rows=(3,)),
]


@pytest.mark.parametrize("case", FUSED_CASES, ids=[c["id"] for c in FUSED_CASES])
def test_fused_preprocess_atomic_backward(case, monkeypatch):
    """The atomic backward on 64-head tiles with the preprocess fused into its main kernel
    (``interface.FUSED_PREPROCESS``; no preprocess launch): the gradients at the bf16 floor
    against the fp64 reference, dq and d_sink bitwise repeatable (dq written once per (row,
    head), d_sink a fixed-order sum: the fused Delta is summed in a fixed order too; dKV's fp32
    atomics are not), and within fp32 rounding of the separate preprocess's (its Delta sums in
    another order), every output of the prologue written whole and nothing outside it."""
    seed = zlib.crc32(case["id"].encode())
    q, kv, do, sink, idx = _inputs(case, seed)
    fmt = case.get("lse_format", "natural")
    prov = GuardedKernels()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, sink, provider=prov)
    lse_in = lse_natural_to_log2_sink(lse, sink) if fmt == "log2_sink" else lse
    assert tiling.head_plan(case["H"]).heads_per_cta == 64

    def bwd():
        return interface.mqa_latent_sparse_bwd(q, kv, out, do, lse_in, sink, idx, SM_SCALE,
                                               deterministic=False, lse_format=fmt,
                                               provider=prov)

    def no_preprocess(*args, **kwargs):
        raise AssertionError("the fused atomic backward launched the preprocess")

    monkeypatch.setattr(prov, "bwd_preprocess", no_preprocess)
    runs = [bwd() for _ in range(3)]
    monkeypatch.undo()
    dq, dkv, ds = runs[0]
    for other in runs[1:]:
        assert torch.equal(dq, other[0]), "dq not bitwise repeatable (fused, atomic)"
        assert torch.equal(ds, other[2]), "d_sink not bitwise repeatable (fused, atomic)"
    ref_dq, ref_dkv, ref_ds = mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sink, idx, SM_SCALE)
    errs = dict(dq=rel_l2(dq.float(), ref_dq), dkv=rel_l2(dkv.float(), ref_dkv))
    monkeypatch.setattr(interface, "FUSED_PREPROCESS", False)
    dq_u, dkv_u, ds_u = bwd()
    errs.update(dq_vs_unfused=rel_l2(dq.float(), dq_u.float()),
                dkv_vs_unfused=rel_l2(dkv.float(), dkv_u.float()))
    if sink is not None:
        # as test_against_reference: against the size of the summed terms (cancellation)
        ref_lse_all = torch.logaddexp(lse, sink.view(1, 1, -1))
        terms = torch.exp(sink.view(1, 1, -1) - ref_lse_all) * (out.float() * do.float()).sum(-1)
        errs["d_sink"] = float((ds - ref_ds).norm() / terms.abs().sum((0, 1)).norm())
        errs["d_sink_vs_unfused"] = rel_l2(ds, ds_u)
    else:
        assert bool((ds == 0).all())
    print(f"\n[{case['id']} fused] " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    for t in (dq, dkv, ds):
        assert not torch.isnan(t).any()
    for k, v in errs.items():
        limit = 1e-4 if k == "d_sink_vs_unfused" else 1e-3 if k.endswith("_vs_unfused") else TOL
        assert v < limit, f"{k}: relative L2 error {v:.3e} >= {limit}"


@pytest.mark.parametrize("natural", [True, False], ids=["natural", "log2_sink"])
def test_fused_prologue_matches_the_preprocess(natural):
    """The fused main kernel's Delta, lse2 and d_sink terms against the preprocess's stand-in,
    with the special lse values of test_preprocess_kernel_matches_the_stand_in (a NaN, +-inf,
    a -inf sink with a -inf lse) and 24 pad heads (H=40 in one 64-head tile): same tolerances,
    0 at pad heads, NaN where the stand-in has NaN, nothing written outside."""
    rng = np.random.default_rng(11 + natural)
    S, H, h_pad, S_kv, L = 70, 40, 64, 96, 64
    out = torch.from_numpy(rng.standard_normal((1, S, H, DV), dtype=np.float32)).cuda()
    do = torch.from_numpy(rng.standard_normal((1, S, H, DV), dtype=np.float32)).cuda()
    out, do = out.to(torch.bfloat16), do.to(torch.bfloat16)
    lse = torch.from_numpy(rng.standard_normal((1, S, H), dtype=np.float32) * 30).cuda()
    lse[0, 3, 0], lse[0, 4, 1], lse[0, 5, 2], lse[0, 6, 3] = (float("nan"), float("inf"),
                                                              -float("inf"), 1e30)
    sink = torch.from_numpy(rng.standard_normal(H, dtype=np.float32) * 20).cuda()
    sink[2] = -float("inf")
    q = torch.zeros((1, S, h_pad, DK), dtype=torch.bfloat16, device="cuda")
    q[:, :, :H] = torch.randn((1, S, H, DK), device="cuda").to(torch.bfloat16)
    kv = torch.randn((1, S_kv, DK), device="cuda").to(torch.bfloat16)
    do_p = torch.zeros((1, S, h_pad, DV), dtype=torch.bfloat16, device="cuda")
    do_p[:, :, :H] = do
    idx = torch.from_numpy(causal_topk_indices(1, S, S_kv, L, seed=3)).cuda()
    got = [torch.empty((1, S, h_pad), device="cuda") for _ in range(3)]  # lse2, delta, d_sink
    pre = kernel_provider.FusedPreprocess(natural, out, lse, sink, got[2])
    GuardedKernels().bwd_main(
        64, "atomic", True, q, kv, do_p, idx, got[0], got[1],
        torch.full((1,), SM_SCALE, device="cuda"), torch.empty((1, S_kv), device="cuda"),
        torch.empty((1, S), dtype=torch.int32, device="cuda"), torch.empty_like(q),
        torch.zeros((1, S_kv, DK), device="cuda"),
        torch.empty((1, S_kv), dtype=torch.int64, device="cuda"),
        torch.empty((1, S_kv), dtype=torch.int32, device="cuda"), pre)
    want = [torch.empty((S, h_pad), device="cuda") for _ in range(3)]  # delta, lse2, d_sink
    CpuStandIn().bwd_preprocess(natural, out.reshape(S * H, DV), do.reshape(S * H, DV),
                                lse.reshape(S * H), sink, *want)
    tols = {"delta": (1e-5, 1e-3), "lse2": (1e-6, 1e-5), "d_sink_rows": (1e-4, 1e-3)}
    for name, g, w in zip(("delta", "lse2", "d_sink_rows"), (got[1], got[0], got[2]), want):
        g = g.reshape(S, h_pad)
        assert bool((g[:, H:] == 0).all()), f"{name}: pad heads not 0"
        assert torch.equal(torch.isnan(g), torch.isnan(w)), f"{name}: NaN pattern differs"
        rtol, atol = tols[name]
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True, msg=name)
    lse2 = got[0].reshape(S, h_pad)
    assert lse2[5, 2] == 0 and bool(torch.isnan(lse2[3, 0])) and lse2[4, 1] == float("inf")


@pytest.mark.parametrize("kernel", ["pre", "grid_rows"])
@pytest.mark.parametrize("natural", [True, False], ids=["natural", "log2_sink"])
def test_preprocess_kernel_matches_the_stand_in(natural, kernel):
    """The backward's preprocess (Delta, the finite base-2 lse, each row's d_sink term; 0 at
    pad heads) against its fp64 stand-in (itself held to the former framework ops by
    ``tests/test_interface.py``), with a NaN, +inf and -inf lse, a -inf sink and 3 pad heads
    (H=13 padded to 16): Delta to fp32 rounding, lse2 to a few ulps, every element written
    (poisoned first, guard regions intact), NaN where the stand-in has NaN.  Both kernels that
    do it: the atomic backward's ``bwd_preprocess`` and the deterministic backward's
    ``grid_rows`` (also bitwise repeatable, its row weights finite whatever the lse)."""
    rng = np.random.default_rng(5 + natural)
    R, H, h_pad = 70, 13, 16
    out = torch.from_numpy(rng.standard_normal((R, H, DV), dtype=np.float32)).cuda()
    do = torch.from_numpy(rng.standard_normal((R, H, DV), dtype=np.float32)).cuda()
    out, do = out.to(torch.bfloat16), do.to(torch.bfloat16)
    lse = torch.from_numpy(rng.standard_normal((R, H), dtype=np.float32) * 30).cuda()
    lse[3, 0], lse[4, 1], lse[5, 2], lse[6, 3] = float("nan"), float("inf"), -float("inf"), 1e30
    sink = torch.from_numpy(rng.standard_normal(H, dtype=np.float32) * 20).cuda()
    sink[2] = -float("inf")  # lse[5, 2] = -inf there too: no key, no sink
    got = [torch.empty((R, h_pad), device="cuda") for _ in range(3)]
    want = [torch.empty((R, h_pad), device="cuda") for _ in range(3)]
    args = (out.reshape(R * H, DV), do.reshape(R * H, DV), lse.reshape(R * H), sink)
    if kernel == "pre":
        GuardedKernels().bwd_preprocess(natural, *args, *got)
    else:
        q = torch.randn((1, R, H, DK), device="cuda").to(torch.bfloat16)
        idx = torch.from_numpy(causal_topk_indices(1, R, 100, 64, seed=4)).cuda()
        kv_norm = torch.full((1,), 3.0, device="cuda")
        c_rows = []
        for outs in (got, [torch.empty_like(g) for g in got]):
            c_rows.append(torch.empty((1, R), dtype=torch.float64, device="cuda"))
            GuardedKernels().exact_grid_rows(natural, q, out[None], do[None], lse[None], sink, idx,
                                             kv_norm, *(g.view(1, R, h_pad) for g in outs),
                                             c_rows[-1], 1e-3)
            if len(c_rows) == 2:
                assert all(torch.equal(g.isnan(), a.isnan())
                           and torch.equal(g.nan_to_num(), a.nan_to_num())
                           for g, a in zip(got, outs)), "grid_rows not bitwise repeatable"
        assert torch.equal(c_rows[0], c_rows[1]), "row weights not bitwise repeatable"
        assert bool(torch.isfinite(c_rows[0]).all()) and bool((c_rows[0] > 0).all())
    CpuStandIn().bwd_preprocess(natural, *args, *want)
    # (rtol, atol): fp32 sums of 512 products (|terms| sum to ~400); lse2 ~ 1 ulp of |lse2|
    # <= 60; exp2 of a rounded exponent near 40 times Delta
    tols = {"delta": (1e-5, 1e-3), "lse2": (1e-6, 1e-5), "d_sink_rows": (1e-4, 1e-3)}
    for name, g, w in zip(("delta", "lse2", "d_sink_rows"), got, want):
        assert bool((g[:, H:] == 0).all()), f"{name}: pad heads not 0"
        assert torch.equal(torch.isnan(g), torch.isnan(w)), f"{name}: NaN pattern differs"
        rtol, atol = tols[name]
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True, msg=name)
    assert got[1][5, 2] == 0 and bool(torch.isnan(got[1][3, 0])) and got[1][4, 1] == float("inf")


def test_deterministic_backward_captures_in_a_cuda_graph(monkeypatch):
    """With the value checks off the deterministic backward has no host sync and no shape that
    depends on the data: it captures in a CUDA graph, and a replay gives the eager result bit
    for bit, with no key re-run and with keys re-run (first-pass grids 2^20 too fine)."""
    case = dict(B=1, S=48, S_kv=300, H=64, L=200, sink=True)
    q, kv, do, sink, idx = _inputs(case, 41)
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, sink)
    for margin in (exact_dkv.GRID_MARGIN_BITS, -20):
        monkeypatch.setattr(exact_dkv, "GRID_MARGIN_BITS", margin)

        def bwd():
            return interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, SM_SCALE,
                                                   check_indices=False)

        eager = bwd()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch asks
            bwd()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = bwd()
        graph.replay()
        torch.cuda.synchronize()
        for a, b, name in zip(eager, captured, ("dq", "dkv", "d_sink")):
            assert torch.equal(a, b), f"{name}: graph replay differs (margin {margin})"


def _ragged_indices(rng, B, S, S_kv, L):
    """``[B, S, L]`` int32: row ``s`` has keys only in its first ``e_s`` slots (``e_s`` random in
    ``0..L``, some rows 0, 1 or ``L``), a third of those ``-1`` (holes), its slot ``e_s - 1``
    always a key: the 64-head kernels walk a row only up to that slot (``row_blocks``)."""
    idx = np.full((B, S, L), -1, np.int32)
    ext = rng.integers(0, L + 1, (B, S))
    ext[:, :3] = (0, 1, L)
    for b in range(B):
        for r in range(S):
            e = int(ext[b, r])
            keys = rng.permutation(S_kv)[:e]
            holes = rng.random(e) < 1 / 3
            holes[-1:] = False
            keys[holes] = -1
            idx[b, r, :e] = keys
    return idx


def test_ragged_rows_forward():
    """Rows whose keys end early, with holes: the 64-head forward, which stops after a row's
    last key (and walks the rows last-first), gives the reference's out and lse.  (Its bitwise
    comparison with a build that walked every block went with that build's knob,
    ``row_extent=False``.)"""
    B, S, S_kv, H, L = 2, 48, 900, 64, 640
    rng = np.random.default_rng(11)
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn((B, S, H, DK), generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn((B, S_kv, DK), generator=g, device="cuda").to(torch.bfloat16)
    sink = torch.randn((H,), generator=g, device="cuda").float()
    idx = torch.from_numpy(_ragged_indices(rng, B, S, S_kv, L)).cuda()
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, sink,
                                               provider=GuardedKernels())
    ref_out, ref_lse = mqa_latent_sparse_fwd_ref(q, kv, idx, SM_SCALE, sink)
    assert rel_l2(out.float(), ref_out) < TOL and rel_l2(lse, ref_lse) < TOL


def test_rows_without_keys_give_zero_and_inf():
    case = dict(B=1, S=16, S_kv=64, H=8, L=64, sink=True)
    q, kv, do, sink, idx = _inputs(case, 7)
    idx[:, :4, :] = -1
    for s in (sink, None):
        out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, s)
        assert bool((out[:, :4] == 0).all())
        assert bool(torch.isneginf(lse[:, :4]).all())
        dq, dkv, ds = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, s, idx, SM_SCALE)
        assert bool((dq[:, :4] == 0).all()) and not torch.isnan(dkv).any()
        assert not torch.isnan(ds).any()


def _misaligned(t):
    # same values, contiguous, starting 2 bytes past a 16-byte boundary (a view into a buffer)
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 == 2
    return view


def test_misaligned_contiguous_inputs():
    """A contiguous view that starts 2 bytes past a 16-byte boundary (``x[1:]`` of a buffer) is
    realigned by the host code: the 64-head kernels' TMA tile loads and 16-byte ``cp.async``
    need 16-byte-aligned tensors.  Forward and both backwards give bitwise the results of the
    same values in fresh tensors."""
    case = dict(B=1, S=24, S_kv=200, H=64, L=128, sink=True)
    q, kv, do, sink, idx = _inputs(case, 5)
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, sink)
    out_m, lse_m = interface.mqa_latent_sparse_fwd(_misaligned(q), _misaligned(kv), idx,
                                                   SM_SCALE, sink)
    assert torch.equal(out, out_m) and torch.equal(lse, lse_m)
    for det in (True, False):
        ref = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, SM_SCALE,
                                              deterministic=det)
        got = interface.mqa_latent_sparse_bwd(_misaligned(q), _misaligned(kv), _misaligned(out),
                                              _misaligned(do), lse, sink, idx, SM_SCALE,
                                              deterministic=det)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[2], got[2])
        if det:
            assert torch.equal(ref[1], got[1])
        else:  # the atomic dKV's run-to-run spread: ~3e-5 (run 111), 2.3e-5 here (run 113)
            assert rel_l2(got[1].float(), ref[1].float()) < 1e-4


def _digest(*ts):
    h = hashlib.sha256()
    for t in ts:
        h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


_XPROC = """
import sys, torch
sys.path.insert(0, {tests!r})
sys.path.insert(0, {tests_root!r})
from {module} import {function}
print("DIGEST", {function}())
"""


def digest_in_another_process(module, function):
    """``function()`` of this folder's ``module`` (a digest string) run in a fresh Python
    process: ``[digest]``.  Shared with test_sparse_attn_v4_gpu.py."""
    here_dir = Path(__file__).resolve().parent
    code = _XPROC.format(tests=str(here_dir), tests_root=str(here_dir.parent), module=module,
                         function=function)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("DIGEST")]


def _cross_process_digest():
    case = dict(B=1, S=64, S_kv=600, H=64, L=512, sink=True)
    q, kv, do, sink, idx = _inputs(case, 11)
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, sink)
    return _digest(*interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, SM_SCALE))


def test_deterministic_across_processes():
    here = _cross_process_digest()
    other = digest_in_another_process("test_sparse_attn_gpu", "_cross_process_digest")
    assert other == [here], "dq/dkv/d_sink differ between two processes"


def test_new_shapes_do_not_recompile():
    # One compiled kernel object per static key serves every B / S / S_kv / L: a kernel with
    # static shapes would reject the second call's tensors instead of computing them.
    prov = kernel_provider.TileLangKernels()
    for case in (dict(B=1, S=24, S_kv=70, H=64, L=64, sink=True),
                 dict(B=2, S=40, S_kv=300, H=64, L=200, sink=True)):
        q, kv, do, sink, idx = _inputs(case, 5)
        out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, sink, provider=prov)
        ref_out, _ = mqa_latent_sparse_fwd_ref(q, kv, idx, SM_SCALE, sink)
        assert rel_l2(out.float(), ref_out) < TOL
        dq, dkv, _ = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, SM_SCALE,
                                                     provider=prov)
        ref_dq, ref_dkv, _ = mqa_latent_sparse_bwd_ref(q, kv, out, do, lse, sink, idx, SM_SCALE)
        assert rel_l2(dq.float(), ref_dq) < TOL and rel_l2(dkv.float(), ref_dkv) < TOL
    assert sorted({k[0] for k in prov._kernels}) == [
        "bwd_finish", "bwd_main", "fwd", "grid_keys", "grid_rows", "grid_scatter",
        "rerun_plan", "rerun_slots", "value_stats"]
    # the value checks (forward: sink; backward: sink and lse), fwd, main exact with dq and its
    # re-run, finish, the exact dKV's five bookkeeping kernels (grid_rows: the preprocess)
    assert len(prov._kernels) == 11


def test_bad_inputs_raise():
    case = dict(B=1, S=8, S_kv=64, H=8, L=64)
    q, kv, do, sink, idx = _inputs(case, 1)
    with pytest.raises(TypeError, match="query"):
        interface.mqa_latent_sparse_fwd(q.float(), kv.float(), idx, SM_SCALE)
    with pytest.raises(ValueError, match="token_indices"):
        bad = idx.clone()
        bad[0, 0, 0] = 64
        interface.mqa_latent_sparse_fwd(q, kv, bad, SM_SCALE)
    with pytest.raises(ValueError, match="query"):
        interface.mqa_latent_sparse_fwd(q.cpu(), kv.cpu(), idx.cpu(), SM_SCALE)
    with pytest.raises(ValueError, match="block_h"):
        interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, block_h=64)


@pytest.mark.parametrize("has_sink, has_lse", [(True, True), (False, True), (True, False),
                                               (False, False)])
def test_value_stats_kernel(has_sink, has_lse):
    """The value checks' kernel (``kernels/value_stats.py``) against numpy: the index range
    (-1 slots, one index far out of range, more elements than its grid's threads so every
    thread strides), the NaN/+inf sinks (-inf allowed), the NaN lse, and the safe copy of the
    indices (outside [0, S_kv): -1); the wrappers raise on each through it (checks launched
    early, read through an asynchronous copy, waited for after the kernels are queued), naming
    the tensor; int64 or non-contiguous indices take the framework path (None)."""
    rng = np.random.default_rng(3)
    idx = rng.integers(-1, 5000, (3, 300, 200)).astype(np.int32)
    idx[2, 299, 199] = 123456
    sink = rng.standard_normal(37).astype(np.float32)
    sink[[3, 9, 20]] = [np.nan, np.inf, -np.inf]
    lse = rng.standard_normal((3, 300, 37)).astype(np.float32)
    lse[1, 7, [4, 5]] = np.nan
    lse[0, 0, 0] = -np.inf
    t = lambda a: torch.from_numpy(a).cuda()
    prov = kernel_provider.TileLangKernels()
    idx[0, 0, :3] = [-7, -(2**31), 2**31 - 1]
    rows, safe = prov.value_stats(t(idx), t(sink) if has_sink else None,
                                  t(lse) if has_lse else None, 4000)
    rows = rows.cpu().numpy().astype(np.int64)  # one row per CTA
    got = [rows[:, 0].min(), rows[:, 1].max(), rows[:, 2].sum(), rows[:, 3].sum()]
    want = [idx.min(), idx.max(), 2 if has_sink else 0, 2 if has_lse else 0]
    assert [int(v) for v in got] == want
    # the safe copy the kernels read: every value outside [0, S_kv) is -1, the rest as given
    want_safe = np.where((idx >= 0) & (idx < 4000), idx, -1)
    assert safe.shape == idx.shape and safe.dtype == torch.int32
    np.testing.assert_array_equal(safe.cpu().numpy(), want_safe)
    assert prov.value_stats(t(idx.astype(np.int64)), None, None, 4000) is None
    assert prov.value_stats(t(idx)[:, ::2], None, None, 4000) is None  # not contiguous

    case = dict(B=1, S=8, S_kv=64, H=8, L=64, sink=True)
    q, kv, do, sk, ix = _inputs(case, 2)
    out, lse_t = interface.mqa_latent_sparse_fwd(q, kv, ix, SM_SCALE, sk)
    bad_sink = sk.clone()
    bad_sink[1] = float("nan")
    with pytest.raises(ValueError, match="attn_sink"):
        interface.mqa_latent_sparse_fwd(q, kv, ix, SM_SCALE, bad_sink)
    bad_lse = lse_t.clone()
    bad_lse[0, 3, 2] = float("nan")
    with pytest.raises(ValueError, match="lse"):
        interface.mqa_latent_sparse_bwd(q, kv, out, do, bad_lse, sk, ix, SM_SCALE)
    bad_idx = ix.clone()
    bad_idx[0, 1, 5] = -2
    with pytest.raises(ValueError, match=r"token_indices.*\[-2, "):
        interface.mqa_latent_sparse_bwd(q, kv, out, do, lse_t, sk, bad_idx, SM_SCALE)


def test_forward_at_extreme_logits():
    """Issue 9's input (``helpers.extreme_logits_case``): every logit of a row equal, about +-5.6e7
    after scaling.  The forward's running max starts at -inf, not at a finite floor, so head 1
    (all logits far below zero) gets out = kv's value row and a finite lse, like head 0."""
    q, kv, idx, sm, out_x, lse_x = extreme_logits_case()
    q_t = torch.from_numpy(q).cuda().to(torch.bfloat16)
    kv_t = torch.from_numpy(kv).cuda().to(torch.bfloat16)
    idx_t = torch.from_numpy(idx).cuda()
    out, lse = interface.mqa_latent_sparse_fwd(q_t, kv_t, idx_t, sm, None,
                                               provider=GuardedKernels())
    assert torch.equal(out.float().cpu(), torch.from_numpy(out_x).float())
    assert bool(torch.isfinite(lse).all())
    torch.testing.assert_close(lse.double().cpu(), torch.from_numpy(lse_x), rtol=1e-6, atol=0)
