"""The atomic backward's preprocess (where the main kernel does not fuse it) and the lse bridge.

``preprocess`` writes what the main backward kernels need per (query row, head) in one pass
over ``out`` and ``dO``: ``Delta``, the base-2 sink-inclusive ``Lse2`` and the rows' ``d_sink``
terms.  Launched by the atomic backward of 16- and 32-head tiles; the 64-head tiles' first
pass does the same work in its prologue (``bwd_two_warpgroups``, ``fused``) and the
deterministic backward in ``exact_grid.grid_rows``, all three with :func:`sink_lse2`.
Compiles with ``settings.PASS_CONFIGS``.
"""

from ... import settings

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["LOG2E", "sink_lse2", "preprocess"]

LOG2E = 1.4426950408889634


@T.macro
def sink_lse2(lse, sink2, natural):
    """The base-2, sink-inclusive, finite lse the main kernels take (``Lse2``), from one row's
    ``lse`` (fp32) and its sink in base 2, ``sink2 = sink log2 e`` (``-inf``: no sink): with
    ``natural`` (a natural-log, sink-exclusive ``lse``) ``log2(2^(lse log2 e) + 2^sink2)``, else
    ``lse`` as given; ``-inf`` (no key and no sink: every ``P`` is 0) becomes 0 and a NaN stays
    NaN (``docs/conventions.md``, the bridge).  Shared by :func:`preprocess`, the fused
    prologue of ``bwd_two_warpgroups`` and ``exact_grid.grid_rows``."""
    ninf = -T.infinity("float32")
    lse2 = lse
    if natural:
        a = lse * LOG2E
        hi = T.max(a, sink2)
        # an infinite larger term is the result (also -inf for both, not -inf - -inf); max()
        # drops a NaN, so a NaN lse is passed on as is (T.isnan: the simplifier folds x != x
        # to false)
        lse2 = T.if_then_else(
            T.isnan(lse), lse,
            T.if_then_else(hi == ninf or hi == -ninf, hi,
                           hi + T.log2(1.0 + T.exp2(T.min(a, sink2) - hi))))
    return T.if_then_else(lse2 == ninf, 0.0, lse2)


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def preprocess(d_v: int, natural: bool, block_rows: int = 32, block_d: int = 128,
               threads: int = 128):
    """Everything the atomic backward needs per (query row, head) before its main kernel, in one
    pass over ``out`` and ``dO`` (in place of ~12 framework ops of the lse bridge, the head
    padding and ``d_sink``; 64-head tiles do this in their main kernel's prologue instead, and
    the deterministic backward in ``exact_grid.grid_rows``, with the same formulas):

    * ``Delta [R, H_pad] = rowsum(O * dO)`` (fp32),
    * ``Lse2 [R, H_pad]``: the base-2, sink-inclusive lse the main kernels take; from a
      ``natural`` (sink-exclusive) ``Lse`` it is ``log2(2^(lse log2 e) + 2^(sink log2 e))``,
      else ``Lse`` as given; ``-inf`` (no key and no sink: every ``P`` is 0) becomes 0, a NaN
      stays NaN (``docs/conventions.md``, the bridge),
    * ``DSink [R, H_pad] = -2^(sink log2 e - Lse2) Delta``, the row's term of ``d_sink``
      (``-P_sink Delta``; 0 for a ``-inf`` sink),

    and 0 in all of them for the pad heads ``H <= h < H_pad`` (written by the thread of each
    row's last real head).  Inputs ``O``, ``dO [N, Dv]`` bf16 (``N = R H`` rows, head fastest),
    ``Lse [N]`` fp32 and ``Sink [H]`` fp32 (``-inf`` = no sink); ``N``, ``R``, ``H``, ``H_pad``
    dynamic; rows past ``N`` are neither read nor written.  The row sums walk the flattened
    rows, with no division in the inner loop (a division by ``H_pad`` there cost a fifth of the
    kernel's time)."""
    assert d_v % block_d == 0, "Dv must be a multiple of the column block"
    N = T.dynamic("N")
    R = T.dynamic("R")
    H = T.dynamic("H")
    H_pad = T.dynamic("H_pad")
    BR = block_rows

    @T.prim_func
    def sparse_bwd_preprocess(
        O: T.Tensor([N, d_v], "bfloat16"),
        dO: T.Tensor([N, d_v], "bfloat16"),
        Lse: T.Tensor([N], "float32"),
        Sink: T.Tensor([H], "float32"),
        Delta: T.Tensor([R, H_pad], "float32"),
        Lse2: T.Tensor([R, H_pad], "float32"),
        DSink: T.Tensor([R, H_pad], "float32"),
    ):
        with T.Kernel(T.ceildiv(N, BR), threads=threads) as r_blk:
            acc = T.alloc_fragment([BR, block_d], "float32")
            part = T.alloc_fragment([BR], "float32")
            total = T.alloc_fragment([BR], "float32")
            T.fill(total, 0)
            for c in T.serial(d_v // block_d):
                for r, d in T.Parallel(BR, block_d):
                    n = r_blk * BR + r
                    acc[r, d] = T.if_then_else(
                        n < N,
                        T.Cast("float32", O[n, c * block_d + d])
                        * T.Cast("float32", dO[n, c * block_d + d]),
                        0,
                    )
                T.reduce_sum(acc, part, dim=1)
                for r in T.Parallel(BR):
                    total[r] = total[r] + part[r]
            for r in T.Parallel(BR):
                n = r_blk * BR + r
                if n < N:
                    row = n // H
                    h = n % H
                    sink2 = Sink[h] * LOG2E
                    lse2 = sink_lse2(Lse[n], sink2, natural)
                    Delta[row, h] = total[r]
                    Lse2[row, h] = lse2
                    DSink[row, h] = -T.exp2(sink2 - lse2) * total[r]
                    if h == H - 1:
                        for p in T.serial(H_pad - H):
                            Delta[row, H + p] = 0.0
                            Lse2[row, H + p] = 0.0
                            DSink[row, H + p] = 0.0

    return sparse_bwd_preprocess
