"""Shared test helpers and fixtures: the one place test files import them from.

``tests/conftest.py`` registers this module as a pytest plugin, so its fixtures and hooks apply
to every test; test files import the plain helpers (``pytest.ini`` puts ``tests/`` on
``sys.path``)::

    from helpers import REPO_ROOT, rel_l2, requires_cuda

Helpers:

* ``REPO_ROOT``: the checkout's root (a ``pathlib.Path``).
* ``FRAMEWORKS``: ``"paddle"`` and/or ``"torch"``, those installed here.
* ``rel_l2(x, ref)``: relative L2 error ``||x - ref|| / ||ref||`` of two tensors or arrays
  (Paddle, PyTorch or numpy; compared in float64 on the host).  The guide's error measure.
* ``cuda_available()``, ``requires_cuda``: a ``skipif`` marker for tests that need a CUDA
  device through PyTorch (the GPU host); it never fails when torch is not installed (the Paddle
  CPU CI).  Tests marked ``@pytest.mark.gpu`` are skipped the same way, with the same reason.
* ``record_calls(monkeypatch, calls, module, *names)``: log the calls of a module's functions.
* ``to_tensor(fw, array, dtype)`` / ``to_numpy(tensor)``: numpy to a ``fw`` tensor of a
  canonical dtype (``"bfloat16"`` included) and back (bf16 widened to fp32 first).
* ``CpuStandIn``: a kernel provider (``attn/kernel_provider.py``) whose launchers implement each
  kernel's math in numpy (they take CPU or CUDA tensors: read to the host, written back).
* ``extreme_logits_case()``: issue 9's input, every logit of a row about +-5.6e7.
* ``distinct_indices(...)``, ``exact_first_pass_state(...)``: inputs of the exact dKV's
  bookkeeping kernels (top-k rows with unnamed keys and ``-1`` slots; a first pass's bounds
  covering every branch of the re-run plan), numpy; ``launch_grid_rows(provider, ...)``: the
  deterministic backward's first kernel (preprocess and row weights) on given ``q`` and ``dO``.
* ``run_until_signalled(script, args, marker, sig)``: run a script in a process group of its own
  and send it ``sig`` (as a terminal's Ctrl-C does) once ``marker`` shows on its stdout.

Fixtures:

* ``rng``: a ``numpy.random.Generator`` seeded from the test's node id and ``$PFTO_TEST_SEED``
  (default 0), so each test gets its own fresh random inputs, reproducible run to run; set
  ``PFTO_TEST_SEED`` to draw different ones.  The seed is printed on failure.
* ``fw``: each installed framework in turn (a :class:`Framework`: ``fw.name``, ``fw.t(array)``,
  ``fw.np(tensor)``, ``fw.bf16(array)``, ``fw.f32(tensor)``); ``paddle_fw``: Paddle only.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from paddlefleet.tilelang_ops.attn.adapter import ops_for
from paddlefleet.tilelang_ops.attn.kernels import FUSED_TILES
from paddlefleet.tilelang_ops.attn.reference import mqa_latent_sparse_fwd_ref

REPO_ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = [fw for fw in ("paddle", "torch") if importlib.util.find_spec(fw) is not None]


# --- comparing results ------------------------------------------------------------------------
def _to_float64(x) -> np.ndarray:
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return np.asarray(x, dtype=np.float64)
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        return x.detach().to("cpu").double().numpy()
    if mod.startswith("paddle"):
        # bf16 has no numpy dtype (.numpy() gives uint16), so widen inside Paddle first.
        return x.detach().astype("float64").numpy()
    return np.asarray(x, dtype=np.float64)


def rel_l2(x, ref) -> float:
    """``||x - ref||_2 / ||ref||_2`` in float64; ``inf`` if any non-finite entries differ.

    ``-inf``/``inf`` entries must sit at the same places with the same sign (they are then
    excluded); NaN anywhere gives ``inf`` so that a NaN result can never pass a tolerance.
    """
    a, b = _to_float64(x), _to_float64(ref)
    if a.shape != b.shape:
        raise ValueError(f"rel_l2: shapes differ, got {a.shape} and reference {b.shape}")
    if np.isnan(a).any() or np.isnan(b).any():
        return float("inf")
    fa, fb = np.isfinite(a), np.isfinite(b)
    if (fa != fb).any() or (a[~fa] != b[~fb]).any():
        return float("inf")
    num = np.linalg.norm(a[fa] - b[fa])
    den = np.linalg.norm(b[fb])
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(num / den)


def record_calls(monkeypatch, calls: list, module, *names) -> None:
    """Wrap the functions ``names`` of ``module`` so that each call appends its name to
    ``calls`` (the function still runs)."""
    for name in names:
        real = getattr(module, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)


# --- CUDA -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """True when PyTorch is installed and sees a CUDA device (never raises)."""
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken torch install means no usable CUDA, not a test error
        return False


_NO_CUDA = "needs a CUDA device through PyTorch (torch missing or no GPU visible)"

requires_cuda = pytest.mark.skipif(not cuda_available(), reason=_NO_CUDA)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=_NO_CUDA)
    for item in items:
        if item.get_closest_marker("gpu") is not None and not cuda_available():
            item.add_marker(skip)


# --- random inputs ----------------------------------------------------------------------------
def _base_seed() -> int:
    return int(os.environ.get("PFTO_TEST_SEED", "0"))


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random generator per test, seeded from the node id and ``$PFTO_TEST_SEED``."""
    seed = zlib.crc32(request.node.nodeid.encode()) ^ _base_seed()
    request.node.user_properties.append(("rng_seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "rng_seed":
                report.sections.append(("rng", f"rng seed {value} (PFTO_TEST_SEED={_base_seed()})"))


# --- tensors of either framework ---------------------------------------------------------------
class Framework:
    """numpy <-> tensors of one framework (``name``: ``"paddle"`` or ``"torch"``), on
    ``device`` (torch only; Paddle tensors stay on its default place)."""

    def __init__(self, name: str, device: str = "cpu"):
        self.name = name
        self.device = device
        self.m = importlib.import_module(name)

    def t(self, a):
        """The array as a tensor of the same dtype."""
        a = np.ascontiguousarray(a)
        if self.name == "paddle":
            return self.m.to_tensor(a)
        return self.m.from_numpy(a).to(self.device)

    def np(self, t):
        if self.name == "paddle":
            return t.numpy()
        return t.detach().cpu().numpy()

    def bf16(self, a):
        return to_tensor(self.name, np.asarray(a, np.float32), "bfloat16")

    def f32(self, t):
        return self.np(t.astype("float32") if self.name == "paddle" else t.float())


@pytest.fixture(params=["paddle", "torch"])
def fw(request) -> Framework:
    pytest.importorskip(request.param)
    return Framework(request.param)


@pytest.fixture
def paddle_fw() -> Framework:
    pytest.importorskip("paddle")
    return Framework("paddle")


def to_tensor(fw: str, arr, dtype: str):
    """``arr`` (numpy) as a CPU tensor of framework ``fw`` with canonical dtype ``dtype``."""
    arr = np.ascontiguousarray(arr)
    if fw == "paddle":
        import paddle

        t = paddle.to_tensor(arr)
        return t.astype(dtype) if dtype != str(arr.dtype) else t
    import torch

    return torch.from_numpy(arr).to(getattr(torch, dtype))


def to_numpy(t) -> np.ndarray:
    """A tensor of either framework as numpy; bf16/fp16 widened to fp32 (numpy has no bf16)."""
    ops = ops_for(t)
    if ops.dtype(t) in ("bfloat16", "float16"):
        t = ops.cast(t, "float32")
    return np.asarray(ops.to_numpy(t))


def _write(dst, arr):
    ops = ops_for(dst)
    dst[...] = ops.cast(ops.from_numpy(np.ascontiguousarray(arr), dst), ops.dtype(dst))


# --- the kernels' math on CPU -------------------------------------------------------------------
LOG2E = 1.0 / math.log(2.0)


class CpuStandIn:
    """CPU stand-ins of the kernels (fwd, preprocess, main, finish and the exact dKV's
    bookkeeping): their math, in numpy.

    A ``KernelProvider`` (``attn/kernel_provider.py``; ``device = "cpu"``).  Each attention
    launcher checks that it is handed a whole number of head tiles of ``heads_per_cta`` heads
    (16, 32 or 64) and processes one tile at a time, as the kernels' CTAs do; the forward reuses
    the reference.  ``main`` with ``deterministic`` rounds each contribution onto its key's grid
    and adds ``max |k|`` into ``bound`` as the kernel does; ``rerun_bounds`` keeps, per re-run (``with_dq=False``) call, the
    largest bound a re-run key reached in that call alone.  The ``exact_*`` launchers are the
    formulas of ``kernels/exact_grid.py`` in fp64 numpy (sums in numpy's order: ``grid_rows``
    agrees with the kernel to rounding, the others exactly).  ``calls`` lists every launch.
    Like the CUDA provider it lists the 64-head tile in ``fused_preprocess_tiles``: its
    ``bwd_main`` then takes ``pre`` (``kernel_provider.FusedPreprocess``) and computes the
    preprocess's outputs itself (the same code as ``bwd_preprocess``), checking the shapes the
    fused kernel takes; the call is logged with ``("pre", natural)`` appended.
    """

    device = "cpu"
    fused_preprocess_tiles = FUSED_TILES

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
        sm = float(to_numpy(scale)[0])
        o_all, l_all = np.zeros(to_numpy(out).shape), np.zeros(to_numpy(lse).shape)
        for sl in self._groups(m, h_pad):
            ops = ops_for(q)
            qg = ops.contiguous(q[:, :, sl])
            sg = ops.contiguous(sink[sl])
            o, l = mqa_latent_sparse_fwd_ref(qg, kv, idx, sm, sg, d_v=ops.shape(out)[-1])
            o_all[:, :, sl], l_all[:, :, sl] = to_numpy(o), to_numpy(l)
        _write(out, o_all)
        _write(lse, l_all)

    @staticmethod
    def _preprocess(natural, out, do, lse, sink, h_pad):
        # numpy out, do [..., H, Dv] (bf16 values); lse [..., H]; sink [H] (-inf: none) ->
        # (Delta, Lse2, DSink, |dO|^2) [R, h_pad] fp64 (R rows, every leading axis), 0 at pad
        # heads.  The bridge in fp64 (the kernels' in fp32, the same formula); |dO|^2: the
        # squares of the bf16 values, exact
        SINK = sink.astype(np.float64)
        H = SINK.shape[0]
        O = out.astype(np.float64).reshape(-1, H, out.shape[-1])
        R = O.shape[0]
        DO = do.astype(np.float64).reshape(R, H, -1)
        LSE = lse.astype(np.float64).reshape(R, H)
        DEL, L2, DS, SQ = (np.zeros((R, h_pad)) for _ in range(4))
        DEL[:, :H] = (O * DO).sum(-1)
        with np.errstate(invalid="ignore", over="ignore"):
            l2 = np.logaddexp(LSE, SINK) * LOG2E if natural else LSE
            L2[:, :H] = np.where(l2 == -np.inf, 0.0, l2)
            DS[:, :H] = -np.exp2(SINK * LOG2E - L2[:, :H]) * DEL[:, :H]
        SQ[:, :H] = (DO * DO).sum(-1)
        return DEL, L2, DS, SQ

    def bwd_preprocess(self, natural, out, do, lse, sink, delta, lse2, d_sink_rows):
        # outputs [R, H_pad]
        self.calls.append(("pre", bool(natural)))
        DEL, L2, DS, _ = self._preprocess(natural, *map(to_numpy, (out, do, lse, sink)),
                                          to_numpy(delta).shape[1])
        _write(delta, DEL)
        _write(lse2, L2)
        _write(d_sink_rows, DS)

    def _fused_preprocess(self, m, deterministic, with_dq, do, lse2, delta, pre):
        # the fused kernel's prologue (bwd_two_warpgroups, fused): its argument shapes
        # checked, lse2 / delta / pre.d_sink_rows written from pre.out, dO's real heads, pre.lse
        # and pre.sink
        B, S, h_pad, d_v = to_numpy(do).shape
        H = ops_for(pre.sink).shape(pre.sink)[0]
        shapes = {"out": (B, S, H, d_v), "lse": (B, S, H), "sink": (H,),
                  "d_sink_rows": (B, S, h_pad)}
        for name, want in shapes.items():
            t = getattr(pre, name)
            assert tuple(ops_for(t).shape(t)) == want, (name, ops_for(t).shape(t), want)
        assert m in self.fused_preprocess_tiles and with_dq and H <= h_pad, (m, with_dq, H)
        assert tuple(to_numpy(lse2).shape) == tuple(to_numpy(delta).shape) == (B, S, h_pad)
        DEL, L2, DS, _ = self._preprocess(pre.natural, to_numpy(pre.out), to_numpy(do)[:, :, :H],
                                          to_numpy(pre.lse), to_numpy(pre.sink), h_pad)
        _write(delta, DEL.reshape(B, S, h_pad))
        _write(lse2, L2.reshape(B, S, h_pad))
        _write(pre.d_sink_rows, DS.reshape(B, S, h_pad))

    def bwd_main(self, m, deterministic, with_dq, q, kv, do, idx, lse2, delta, scale, inv_grid,
                 counts, dq, acc, bound, bound_exp, pre=None):
        if pre is not None:
            self._fused_preprocess(m, deterministic, with_dq, do, lse2, delta, pre)
        Q, KV = to_numpy(q).astype(np.float64), to_numpy(kv).astype(np.float64)
        DO, I = to_numpy(do), to_numpy(idx)
        LSE2, DEL, ACC = to_numpy(lse2), to_numpy(delta), to_numpy(acc)
        sm = float(to_numpy(scale)[0])
        B, S, h_pad, _ = Q.shape
        dv = DO.shape[-1]
        self.calls.append(("main", m, h_pad, I.shape[-1], deterministic, with_dq)
                          + (() if pre is None else (("pre", bool(pre.natural)),)))
        assert isinstance(deterministic, bool) and (with_dq or deterministic)
        valid = I >= 0
        if not with_dq:  # only the first counts[b, s] slots of each row
            valid &= np.arange(I.shape[-1]) < to_numpy(counts)[:, :, None]
        if deterministic:
            INV = to_numpy(inv_grid).astype(np.float64)
            BOUND, BEXP = to_numpy(bound), to_numpy(bound_exp)
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
                if deterministic:
                    x = (c * INV[b][rows][:, None]).astype(np.float32)  # grid units
                    np.add.at(ACC[b], rows, np.rint(x))
                    u = np.abs(x).max(-1).astype(np.float64)  # before the rounding
                    # a NaN lse (test_nan_lse_is_not_masked) makes u NaN: its integer casts
                    # are meaningless, and no test reads them
                    with np.errstate(invalid="ignore"):
                        np.add.at(BOUND[b], rows,
                                  np.ceil(np.minimum(u, 2.0**40)).astype(np.int64))
                        e = np.ceil(np.log2(np.maximum(np.minimum(u, 2.0**100), 2.0**-120))) + 1
                        np.maximum.at(BEXP[b], rows, e.astype(np.int32))
                else:
                    np.add.at(ACC[b], rows, c.astype(np.float32))
        if with_dq:
            _write(dq, dQ)
        _write(acc, ACC)
        if deterministic:
            _write(bound, BOUND)
            _write(bound_exp, BEXP)
            if not with_dq:
                rerun = np.zeros(BOUND.shape, bool)
                for b in range(B):
                    rerun[b, I[b][valid[b]]] = True
                self.rerun_bounds.append(int((BOUND - before)[rerun].max(initial=0)))

    def bwd_finish(self, m, deterministic, acc, inv_grid, dkv):
        # the stand-in keeps the accumulator's columns in their real order
        self.calls.append(("finish", m, deterministic))
        ACC = to_numpy(acc).astype(np.float64)
        if deterministic:  # acc is in grid units
            ACC = ACC / to_numpy(inv_grid).astype(np.float64)[..., None]
        _write(dkv, ACC.astype(np.float32))  # exact: acc times a power of two

    # --- the exact dKV's bookkeeping (kernels/exact_grid.py) --------------------------------
    @staticmethod
    def _frac_bits(top):
        top = float(to_numpy(top).reshape(-1)[0])
        return 40.0 - np.ceil(np.log2(top if top > 0 else 1.0))

    def exact_grid_rows(self, natural, q, out, do, lse, sink, indices, kv_norm, delta, lse2,
                        d_sink_rows, c_row, kv_coef):
        # q [B, S, H, Dk], out, do [B, S, H, Dv] bf16, lse [B, S, H], sink [H] (the real heads);
        # delta, lse2, d_sink_rows [B, S, H_pad] written as bwd_preprocess writes them; c_row
        # from the fp64 squares of q and dO (exact: bf16 values)
        self.calls.append(("grid_rows", bool(natural)))
        Q = to_numpy(q).astype(np.float64)
        B, S, H, d_v = to_numpy(do).shape
        h_pad = to_numpy(delta).shape[-1]
        assert Q.shape[:3] == (B, S, H) and to_numpy(out).shape == (B, S, H, d_v), (Q.shape, H)
        assert to_numpy(lse2).shape == to_numpy(d_sink_rows).shape == (B, S, h_pad) and H <= h_pad
        DEL, L2, DS, SQ = self._preprocess(natural, *map(to_numpy, (out, do, lse, sink)), h_pad)
        _write(delta, DEL.reshape(B, S, h_pad))
        _write(lse2, L2.reshape(B, S, h_pad))
        _write(d_sink_rows, DS.reshape(B, S, h_pad))
        DO2 = SQ.reshape(B, S, h_pad)[:, :, :H]
        norm = np.float64(to_numpy(kv_norm).reshape(-1)[0])
        kscale = norm * norm * np.float64(kv_coef)
        w = DO2 * (kscale * (Q * Q).sum(-1) + 1.0 / d_v)  # [B, S, H]
        n_valid = (to_numpy(indices) >= 0).sum(-1)
        _write(c_row, 4.0 * np.sqrt(w.sum(-1)) / np.maximum(n_valid, 1).astype(np.float64))

    def exact_grid_scatter(self, c_row, top, indices, est):
        self.calls.append(("grid_scatter",))
        C, I, EST = to_numpy(c_row), to_numpy(indices), to_numpy(est).copy()
        c_fx = np.ceil(np.ldexp(C, int(self._frac_bits(top)))).astype(np.int64)
        ok = (I >= 0) & (I < EST.shape[1])
        for b in range(I.shape[0]):
            np.add.at(EST[b], I[b][ok[b]], np.broadcast_to(c_fx[b][:, None], I[b].shape)[ok[b]])
        _write(est, EST)

    def exact_grid_keys(self, est, top, inv_grid, shift, e_lo, e_hi):
        self.calls.append(("grid_keys",))
        est_f = to_numpy(est).astype(np.float64)
        e = np.ceil(np.log2(np.where(est_f > 0, est_f, 1.0))) - self._frac_bits(top) + shift
        e = np.clip(e, e_lo, e_hi)
        _write(inv_grid, np.ldexp(np.float32(1.0), (-e).astype(np.int32)).astype(np.float32))

    def exact_rerun_plan(self, bound, bound_exp, inv_grid, dkv_acc, over, any_over, n_max,
                         exact_bits, coarse_bits):
        self.calls.append(("rerun_plan",))
        bound_f = to_numpy(bound).astype(np.float64) * (1.0 + 2.0**-50)
        by_max = np.ldexp(np.float64(n_max), to_numpy(bound_exp).astype(np.int32))
        u = np.where(bound_f >= 2.0**40, by_max, np.minimum(by_max, bound_f))
        room = np.ldexp(1.0, exact_bits) - n_max
        has = bound_f > 0
        u = np.where(has, u, 1.0)
        with np.errstate(over="ignore"):
            t = np.floor(np.log2(room / u))
            t = np.where(np.ldexp(u, t.astype(np.int32)) <= room, t, t - 1)
        out = has & ((bound_f > np.ldexp(1.0, exact_bits)) | (t >= coarse_bits))
        inv = to_numpy(inv_grid)
        with np.errstate(over="ignore"):
            scaled = np.ldexp(inv.astype(np.float64), np.where(out, t, 0).astype(np.int32))
            inv = np.where(out, scaled.astype(np.float32), inv)
        acc = to_numpy(dkv_acc)
        acc[out] = 0
        _write(inv_grid, inv)
        _write(dkv_acc, acc)
        _write(over, out.astype(np.int32))
        # the kernel only raises the caller's zeroed flag (atomic max of 1 per over key)
        _write(any_over, np.maximum(to_numpy(any_over), out.any(-1)).astype(np.int32))

    def exact_rerun_slots(self, indices, over, any_over, indices2, counts):
        # a batch whose flag is 0: counts 0, its indices2 rows left as they are, and neither
        # its indices nor its over flags read (as the kernel); a flagged batch's rows written
        # only up to the end of the INDEX_PAD-slot block that holds their last re-run slot
        # (rerun_written)
        self.calls.append(("rerun_slots",))
        FLAG = to_numpy(any_over)
        IDX2 = to_numpy(indices2).copy()
        n = np.zeros(to_numpy(counts).shape, np.int32)
        for b in np.flatnonzero(FLAG):
            I, O = to_numpy(indices)[b], to_numpy(over)[b]
            ok = (I >= 0) & (I < O.shape[0])
            rerun = ok & (O[np.where(ok, I, 0)] != 0)
            first = np.argsort(~rerun, axis=-1, kind="stable")  # re-run slots first, in order
            n[b] = rerun.sum(-1)
            IDX2[b] = np.where(np.arange(I.shape[-1]) < n[b][:, None],
                               np.take_along_axis(I, first, -1), -1)
        IDX2 = np.where(rerun_written(n, IDX2.shape[-1]), IDX2, to_numpy(indices2))
        _write(indices2, IDX2.astype(np.int32))
        _write(counts, n)


def rerun_written(counts, L: int) -> np.ndarray:
    """``[B, S, L]`` bool: the slots of ``Idx2`` that ``rerun_slots`` writes for ``counts [B,
    S]`` (numpy): those before the end of the ``tiling.INDEX_PAD``-slot block that holds a
    row's last re-run slot (the re-run reads whole key blocks, each dividing it), capped at
    ``L``; none in a row with ``counts = 0``."""
    from paddlefleet.tilelang_ops.attn.tiling import INDEX_PAD

    n = np.asarray(counts)
    end = np.minimum(-(-n // INDEX_PAD) * INDEX_PAD, L)
    return np.arange(L) < end[..., None]


# --- shared inputs ------------------------------------------------------------------------------
def distinct_indices(rng, B, S, S_kv, L, used_keys, empty_rows=(), fill=0.8):
    """``[B, S, L]`` int32 top-k indices for the exact dKV's bookkeeping tests: distinct keys per
    row from ``[0, used_keys)`` (``used_keys < S_kv``: the keys past it are named by no slot),
    in random order, a share ``1 - fill`` of the slots ``-1``, rows ``empty_rows`` all ``-1``."""
    assert used_keys < S_kv
    idx = np.full((B, S, L), -1, np.int32)
    for b in range(B):
        for s in range(S):
            k = rng.permutation(used_keys)[:L]
            idx[b, s, :len(k)] = k
            idx[b, s] = rng.permutation(idx[b, s])
    idx[rng.random(idx.shape) > fill] = -1
    for r in empty_rows:
        idx[:, r] = -1
    return idx


def launch_grid_rows(provider, q, grad_out, indices, kv_norm, c_row, kv_coef, h_pad=None,
                     natural=True):
    """``provider.exact_grid_rows`` as the deterministic backward launches it, on ``q [B, S,
    H, Dk]`` and ``grad_out [B, S, H, Dv]`` (bf16), with ``out = grad_out``, ``lse = 0`` and no
    sink for the preprocess's part; returns its ``(delta, lse2, d_sink_rows)`` (``[B, S,
    h_pad]`` fp32, ``h_pad`` default ``H``).  Works with any provider and framework (CPU
    stand-in, GPU kernels)."""
    ops = ops_for(grad_out)
    b, s, h, _ = ops.shape(grad_out)
    h_pad = h if h_pad is None else h_pad
    outs = [ops.empty((b, s, h_pad), "float32", grad_out) for _ in range(3)]
    lse = ops.zeros((b, s, h), "float32", grad_out)
    sink = ops.full((h,), -math.inf, "float32", grad_out)
    provider.exact_grid_rows(natural, q, grad_out, grad_out, lse, sink, indices, kv_norm, *outs,
                             c_row, kv_coef)
    return outs


def exact_first_pass_state(rng, B, S_kv, n_max, d_k=576):
    """``(Bound int64, BoundExp int32, InvGrid fp32, Acc fp32 [B, S_kv, d_k])`` as numpy, as an
    exact first pass could leave them for ``n_max = S G``, drawn to cover every branch of the
    re-run plan: keys without contributions (Bound 0, BoundExp at its start value), bounds far
    inside 2^24 (grids far too coarse), near it (kept), above it (too fine) and clamped
    (>= 2^40, half of them with BoundExp at its cap)."""
    kind = rng.integers(0, 6, (B, S_kv))
    bound = np.select(
        [kind == 0, kind == 1, kind == 2, kind == 3, kind == 4],
        [np.zeros((B, S_kv)), rng.integers(1, 2**10, (B, S_kv)),
         rng.integers(2**23, 2**24 - int(n_max), (B, S_kv)), rng.integers(2**24, 2**30, (B, S_kv)),
         rng.integers(2**40, 2**50, (B, S_kv))],
        rng.integers(2**12, 2**20, (B, S_kv))).astype(np.int64)
    log_u = np.log2(np.maximum(bound, 1) / n_max)
    bexp = np.where(bound > 0, np.ceil(log_u) + rng.integers(1, 4, (B, S_kv)), -(2**30))
    bexp[(kind == 4) & (rng.random((B, S_kv)) < 0.5)] = 101  # clamped u: the exponent's cap
    inv = np.exp2(rng.integers(-60, 61, (B, S_kv))).astype(np.float32)
    acc = rng.standard_normal((B, S_kv, d_k)).astype(np.float32)
    return bound, bexp.astype(np.int32), inv, acc


def extreme_logits_case():
    """Issue 9's input as numpy ``(q, kv, idx, sm_scale, out_exact, lse_exact)``.

    Dk=576, Dv=512, H=2, S=4, S_kv=8, every row selects all 8 keys; ``q[..., 0]`` is -32768 for
    head 0 and +32768 for head 1 (other channels 0), ``kv[..., 0] = -40960`` and
    ``kv[..., 1:Dv] = 1``, ``sm_scale = 576**-0.5``.  Every logit of a row is the same, about
    ``+5.6e7`` (head 0) or ``-5.6e7`` (head 1) after scaling (raw ``q.k`` = +-1.34e9), so the
    exact ``out`` is ``kv[..., :Dv]`` of any key: -40960 in channel 0, 1 elsewhere, and ``lse``
    is ``log(8) + logit``.  A running max that starts at a finite floor gets head 1 wrong;
    computing probabilities as ``exp(s - lse)`` loses ``|lse| * eps`` in the exponent (out = 8
    instead of 1 here in fp32).
    """
    dk, dv = 576, 512
    B, S, S_kv, H = 1, 4, 8, 2
    q = np.zeros((B, S, H, dk), np.float32)
    q[:, :, 0, 0], q[:, :, 1, 0] = -32768.0, 32768.0
    kv = np.zeros((B, S_kv, dk), np.float32)
    kv[:, :, 0] = -40960.0
    kv[:, :, 1:dv] = 1.0
    idx = np.broadcast_to(np.arange(S_kv, dtype=np.int32), (B, S, S_kv)).copy()
    sm = dk ** -0.5
    out = np.broadcast_to(kv[:, :1, :dv][:, :, None], (B, S, H, dv)).astype(np.float64)
    logit = np.array([-32768.0, 32768.0]) * -40960.0 * sm
    lse = np.broadcast_to(math.log(S_kv) + logit, (B, S, H)).astype(np.float64)
    return q, kv, idx, sm, out, lse


# --- processes ----------------------------------------------------------------------------------
def run_until_signalled(script, args, marker: str, sig, timeout: float = 120):
    """Start ``python script args`` in a process group of its own and send ``sig`` to the whole
    group (as a terminal's Ctrl-C does) once ``marker`` is on its stdout.

    Returns ``(returncode, stdout, stderr, seconds from the signal to the exit, the processes it
    had started)`` (``psutil.Process`` objects, to check that none outlives it).
    """
    import psutil

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src"))
    proc = subprocess.Popen([sys.executable, str(script), *args], text=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out, err = [], []
    readers = [threading.Thread(target=lambda f=f, acc=acc: acc.extend(f), daemon=True)
               for f, acc in ((proc.stdout, out), (proc.stderr, err))]
    for r in readers:
        r.start()
    try:
        deadline = time.monotonic() + timeout
        while not any(marker in ln for ln in out) and time.monotonic() < deadline:
            assert proc.poll() is None, "".join(out + err)
            time.sleep(0.2)
        assert any(marker in ln for ln in out), "".join(out + err)
        started = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.monotonic()
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    for r in readers:
        r.join(10)
    proc.stdout.close()
    proc.stderr.close()
    return proc.returncode, "".join(out), "".join(err), seconds, started
