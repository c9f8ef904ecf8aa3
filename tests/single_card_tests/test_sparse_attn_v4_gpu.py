"""GPU tests of the kernels at DeepSeek-V4's (Dk, Dv) = (512, 512) (the value is the whole kv row),
beside the (576, 512) ones of test_sparse_attn_gpu.py, whose helpers they use: the same
poisoned, guard-framed kernel outputs (``GuardedKernels``), fp32 reference and tolerance
(``TOL``), bitwise repeatability of the deterministic backward in one process and across two.

Keys: DeepSeek-V4's layouts (``attn.indices.window_compressed_indices``: a causal sliding window
plus compressed keys, ``kv = [T tokens | T // ratio compressed]``), ratio 4 (a seeded choice of
compressed keys standing in for the indexer), ratio 128 (every complete group) and none (the
window alone), the query rows being the last ``S`` of the ``T`` tokens (all of them where
``S = T``: early rows with few keys); random causal top-k keys at the ends of the top-k range
(37 and 1152); whole ``-1`` rows and duplicate keys in a row.  H from 1 to 128 (pad heads at 24,
40 and 100), top-k 37 to 1152.

Skipped without CUDA, and skipped (not failed) while ``kernels.D_PAIRS`` does not list
(512, 512): the wrappers refuse the pair until its kernels are built.
"""

from __future__ import annotations

import zlib

import pytest

from helpers import cuda_available, rel_l2

from paddlefleet.tilelang_ops.attn import tiling

V4_DIMS = (512, 512)
BUILT = tiling.kernel_dims()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        V4_DIMS not in BUILT,
        reason=f"kernels for (Dk, Dv) = {V4_DIMS} not built: kernels.D_PAIRS lists "
               f"{list(BUILT)}; these tests run once it lists {V4_DIMS}"),
]

if cuda_available():
    import torch

    from paddlefleet.tilelang_ops.attn import interface
    from paddlefleet.tilelang_ops.attn.indices import (
        causal_topk_indices,
        window_compressed_indices,
    )
    from test_sparse_attn_gpu import (
        _digest,
        _inputs,
        check_against_reference,
        check_exact_rerun,
        digest_in_another_process,
    )

SM_SCALE = V4_DIMS[0] ** -0.5


def _case(id, H, S, *, T=None, window=None, ratio=None, ctopk=None, L=None, S_kv=None, B=1,
          **extra):
    """A case: V4's layout of ``T`` tokens (``window``; ``ratio`` and ``ctopk`` (None: every
    group) for the compressed keys; ``S_kv`` and top-k ``L`` follow), or, with ``L`` and
    ``S_kv``, random causal top-k keys."""
    if window is not None:
        G = T // ratio if ratio else 0
        S_kv = T + G
        L = window + (0 if not ratio else G if ctopk is None else ctopk)
    return dict(id=id, B=B, S=S, S_kv=S_kv, H=H, L=L, T=T, window=window, ratio=ratio,
                ctopk=ctopk, dims=V4_DIMS, **extra)


def _indices(case, seed):
    """numpy ``[B, S, L]`` indices of ``case`` (the last ``S`` rows of its V4 layout, or causal
    random ones); ``duplicates``: rows 1, S // 2 and S - 1 hold their first key in slots 0..3
    (four times)."""
    B, S, L = case["B"], case["S"], case["L"]
    dtype = case.get("index_dtype", "int32")
    if case["window"] is None:
        idx = causal_topk_indices(B, S, case["S_kv"], L, seed=seed, dtype=dtype)
    else:
        T = case["T"]
        idx = window_compressed_indices(T, window=case["window"], ratio=case["ratio"],
                                        compressed_topk=case["ctopk"], batch=B, seed=seed,
                                        dtype=dtype)[:, T - S:]
    if case.get("duplicates"):
        for b in range(B):
            for r in (1, S // 2, S - 1):
                first = idx[b, r][idx[b, r] >= 0]
                if first.size:
                    idx[b, r, :4] = first[0]
    assert idx.shape == (B, S, L) and int(idx.max()) < case["S_kv"]
    return idx


def _v4_inputs(case, seed):
    return _inputs(case, seed, indices=_indices(case, seed))


CASES = [
    # the window alone (37 keys), every row early: -1 slots at the end of most rows' window
    _case("H1_window37_sink", 1, 64, T=64, window=37, sink=True),
    # ratio 4, the 16-head kernels in block_h 32, a -1 row
    _case("H8_r4_L160_bh32_sink_empty", 8, 48, T=600, window=32, ratio=4, ctopk=128,
          block_h=32, sink=True, empty_rows=(3,)),
    # ratio 128: every complete group (16), no sink, a -1 row
    _case("H16_r128_L144_empty", 16, 40, T=2048, window=128, ratio=128, empty_rows=(0,)),
    # rows 0..199 of a ratio-4 layer: early rows without compressed keys, short windows
    _case("H16_r4_L48_early", 16, 200, T=200, window=32, ratio=4, ctopk=16, sink=True),
    # 24 heads in a 32-head tile (pad heads), V4-Flash's top-k, duplicates
    _case("H24_r4_L640_sink_dup", 24, 32, T=2400, window=128, ratio=4, ctopk=512, sink=True,
          duplicates=True),
    # 32 heads in 16-head tiles, non-contiguous q and dO
    _case("H32_bh16_r4_L64_noncontig_sink", 32, 64, T=256, window=16, ratio=4, ctopk=48,
          block_h=16, noncontig=True, sink=True),
    # random causal keys at the low end of the top-k range, 24 pad heads, int64 indices
    _case("H40_causal_L37_sink_i64", 40, 64, L=37, S_kv=128, sink=True, index_dtype="int64"),
    # V4-Flash (H 64, 128 + 512), two batches, a -1 row, duplicates
    _case("H64_B2_r4_L640_sink_empty_dup", 64, 40, T=2304, window=128, ratio=4, ctopk=512, B=2,
          sink=True, empty_rows=(5,), duplicates=True),
    # ratio 128 at 4K tokens: 32 groups
    _case("H64_r128_L160_sink", 64, 32, T=4096, window=128, ratio=128, sink=True),
    # the 128-token window alone, every row early
    _case("H64_window128_early", 64, 96, T=96, window=128),
    # random causal keys at the top of the range, duplicates
    _case("H64_causal_L1152_sink_dup", 64, 32, L=1152, S_kv=1300, sink=True, duplicates=True),
    # two 64-head groups with 28 pad heads
    _case("H100_r4_L192_sink", 100, 32, T=800, window=64, ratio=4, ctopk=128, sink=True),
    # V4-Pro (H 128, 128 + 1024)
    _case("H128_r4_L1152_sink", 128, 24, T=4400, window=128, ratio=4, ctopk=1024, sink=True),
    _case("H128_B2_window128_empty", 128, 160, T=160, window=128, B=2, empty_rows=(2,)),
]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_v4_against_reference(case):
    """Forward, deterministic (bitwise repeatable) and atomic backward at (512, 512) against
    the fp32 reference, every kernel output poisoned and guard-framed (test_sparse_attn_gpu's
    ``check_against_reference``)."""
    seed = zlib.crc32(case["id"].encode())
    check_against_reference(case, *_v4_inputs(case, seed), SM_SCALE)


RERUN_CASES = [
    # more rows than the re-run's CTAs (sparse_bwd.RERUN_CTAS = 132): each CTA walks 2-3 rows
    _case("H64_r4_L192_S300", 64, 300, T=1200, window=64, ratio=4, ctopk=128, sink=True),
    _case("H100_B2_r128_L136", 100, 48, T=1024, window=128, ratio=128, B=2, sink=True),
]


@pytest.mark.parametrize("case", RERUN_CASES, ids=[c["id"] for c in RERUN_CASES])
def test_v4_exact_rerun_is_repeatable_and_accurate(monkeypatch, case):
    """The exact dKV's re-run forced (first-pass grids too fine, too coarse) at (512, 512):
    bitwise repeatable and within the tolerance (test_sparse_attn_gpu's
    ``check_exact_rerun``)."""
    check_exact_rerun(monkeypatch, case, *_v4_inputs(case, 21), SM_SCALE)


def test_v4_rows_without_keys_give_zero_and_inf():
    case = _case("empty", 8, 16, T=64, window=16, ratio=4, ctopk=8, sink=True)
    q, kv, do, sink, idx = _v4_inputs(case, 7)
    idx[:, :4, :] = -1
    for s in (sink, None):
        out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, s, d_v=V4_DIMS[1])
        assert bool((out[:, :4] == 0).all())
        assert bool(torch.isneginf(lse[:, :4]).all())
        assert bool(torch.isfinite(lse[:, 4:]).all())
        for det in (True, False):
            dq, dkv, ds = interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, s, idx, SM_SCALE,
                                                          deterministic=det)
            assert bool((dq[:, :4] == 0).all()) and not torch.isnan(dkv).any()
            assert not torch.isnan(ds).any()


def _v4_cross_process_digest():
    case = _case("xproc", 64, 64, T=600, window=128, ratio=4, ctopk=64, sink=True)
    q, kv, do, sink, idx = _v4_inputs(case, 11)
    out, lse = interface.mqa_latent_sparse_fwd(q, kv, idx, SM_SCALE, sink, d_v=V4_DIMS[1])
    return _digest(*interface.mqa_latent_sparse_bwd(q, kv, out, do, lse, sink, idx, SM_SCALE))


def test_v4_deterministic_across_processes():
    here = _v4_cross_process_digest()
    assert _v4_cross_process_digest() == here, "dq/dkv/d_sink differ between two calls"
    other = digest_in_another_process("test_sparse_attn_v4_gpu", "_v4_cross_process_digest")
    assert other == [here], "dq/dkv/d_sink differ between two processes"
