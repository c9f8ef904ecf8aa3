"""TileLang backward kernels: sparse MQA-latent attention with an attention sink.

Run in this order by ``attn/interface.py``:

``preprocess``   ``Delta[n] = sum_d O[n, d] * dO[n, d]`` (fp32) over the flattened rows
                 ``n = (b, s, h)`` of the real heads (the atomic backward of 64-head tiles
                 does this in ``main``'s prologue instead: :func:`_two_warpgroups`, ``fused``;
                 the deterministic backward in ``exact_grid.grid_rows``).
``main``         one CTA per (query row ``s``, batch ``b``, head group ``g``) walks the row's top-k
                 (the exact re-run: :data:`RERUN_CTAS` CTAs per (``b``, ``g``), each walking
                 rows ``x, x + RERUN_CTAS, ...``)
                 slots in key blocks of ``BK``; per block it gathers the latent rows through
                 clamped indices, recomputes ``P = exp2(s * sm_scale * log2(e) - lse2)`` (``lse2``
                 base-2, sink-inclusive, finite), then ``dP = dO V^T``, ``dS = P (dP - Delta)
                 sm_scale``, ``dQ += dS K`` (registers, written once at the end: deterministic)
                 and ``dKV_blk = dS^T Q + P^T dO`` (the second term on the first ``Dv`` columns),
                 in column chunks, each scattered into the fp32 accumulator with vector atomics:

                 * exact (``mode="exact"``, the deterministic backward): each contribution is
                   rounded onto its key's power-of-two grid first, so the atomics add integers
                   that fp32 holds exactly and the sum does not depend on the order; the kernel
                   also sums a bound that proves it (``interface._exact_dkv``).
                 * atomic (``mode="atomic"``): plain fp32 (order-dependent rounding).

With 64-head tiles the first pass (with dQ) is :func:`_two_warpgroups`, on 64-key blocks: one
warpgroup computes P and dS and hands them to the other; both add their part of dQ, and the
block's dKV is added straight from the accumulator registers (by both in the exact mode, by the
second in the atomic mode), at the permuted columns of ``tiling.dkv_column`` that the 64-head
re-run follows too.

``finish``       the fp32 dKV accumulator to bf16: the permuted columns back in order, the exact
                 mode's grids applied (``dKV = acc / InvGrid``, exact: powers of two).

Static (one compile each): head tile ``M``, ``Dk``, ``Dv``, key block, mode, dQ on/off, fused
preprocess (and its lse format).  Dynamic:
``B``, ``S``, ``S_kv``, ``L`` (a multiple of the key block), ``H_pad``.  ``sm_scale`` is a runtime
value in the one-element tensor ``Scale``.  All kernels compile with ``settings.PASS_CONFIGS``.
"""

from ... import settings
from ..tiling import INDEX_PAD, dkv_column, dkv_columns_permuted, dkv_source_column
from .async_copy import load_head_tile, tma_head_tile
from .row_blocks import alloc_scratch, last_row_first, row_key_blocks
from .timeline import stampers

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["preprocess", "main", "finish"]

LOG2E = 1.4426950408889634
#: The exact mode's re-run (``main`` with ``with_dq=False``) runs on this many CTAs per (batch,
#: head group), each owning every ``RERUN_CTAS``-th row: one wave on the 132 SMs of an H100 SXM /
#: H200 (one CTA each: its shared memory).  Any value is correct; another GPU's SM count only
#: changes how the rare re-run's rows spread.
RERUN_CTAS = 132

#: The 64-head first pass's default schedule (docs/performance.md, runs 38-40): whether its dKV
#: warpgroup also adds dQ's rope tail and gathers the next block's right half (``w1_right``).
W1_RIGHT = False


def two_warpgroup_schedule(mode, wg0_chunks=None, overlap=None, w1_right=None, row_lanes=None,
                           pred_red=None):
    """``(wg0_chunks, overlap, w1_right, row_lanes, pred_red)`` of :func:`_two_warpgroups` for
    ``mode``, the defaults (``None``) filled in (docs/performance.md, runs 38, 82-83, 86-87, 91):

    * ``w1_right``: :data:`W1_RIGHT`;
    * ``overlap``: in the atomic mode, unless ``w1_right`` or ``wg0_chunks=0`` leaves warpgroup 0
      no chunk (run 86: -5 to -11% at ``ref``); the exact mode lost with it (run 87: +0.5-4%
      with two chunks on warpgroup 0, +2.5-13% with one);
    * ``wg0_chunks``: 0 with ``w1_right``; in the atomic mode 1 with ``overlap`` (the rope
      tail), else 0; in the exact mode 2;
    * ``row_lanes``: 8 in the atomic mode (128-byte pieces: run 82 adds them 17% faster than
      64-byte ones; alone, run 83 moved the atomic call by -2% to +1%, with ``overlap`` it is
      the schedule of run 86), 4 in the exact mode (8 lost there, +2.6-6.2%: with its rounding
      ptxas spills);
    * ``pred_red``: in the atomic mode (run 91: -1.2 to -2.6% cool, -0.2 to -1.8% hot); the exact
      mode lost with it (+2.1 to +3.1% cool, +1.1 to +1.6% hot)."""
    atomic = mode == "atomic"
    if w1_right is None:
        w1_right = W1_RIGHT
    if overlap is None:
        overlap = atomic and not w1_right and wg0_chunks != 0
    if wg0_chunks is None:
        wg0_chunks = 0 if w1_right else (int(bool(overlap)) if atomic else 2)
    if row_lanes is None:
        row_lanes = 8 if atomic else 4
    if pred_red is None:
        pred_red = atomic
    return wg0_chunks, bool(overlap), bool(w1_right), row_lanes, bool(pred_red)


#: ``pred_red``: a 16-byte fp32 reduction under a predicate (PTX ISA 8.1+, sm_90), no branch
RED_V4_SRC = r"""
__device__ __forceinline__ void pf_red_add_v4_if(bool p, float* base, long long off, float x,
                                                 float y, float z, float w) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %0, 0;\n"
               "@q red.relaxed.gpu.global.add.v4.f32 [%1], {%2, %3, %4, %5};\n}\n"
               :: "r"((int)p), "l"(base + off), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}
"""


# exact mode: u above 2^24 already fails the bound; clamped at 2^40, n <= 2^23 of them sum
# exactly in int64.  BoundExp (a max, order-free too) covers the clamped ones: u <= 2^BoundExp.
U_CLAMP = float(2**40)
EXP_CLAMP = float(2**100)
U_FLOOR = float(2**-120)


@T.macro
def slot_bound(Bound, BoundExp, b_i, idx, u):
    """One (row, head group, slot) contribution's share of the exactness proof for key ``idx``
    (``>= 0``): ``ceil(u)`` into the int64 sum, the exponent of ``u`` into the max."""
    T.atomic_add(Bound[b_i, idx], T.Cast("int64", T.ceil(T.min(u, U_CLAMP))))
    T.atomic_max(BoundExp[b_i, idx], T.Cast("int32", T.ceil(
        T.log2(T.max(T.min(u, EXP_CLAMP), U_FLOOR)))) + 1)


@T.macro
def add_bounds(u_stage, Bound, BoundExp, Indices, b_i, s_i, k):
    """The atomics of :func:`add_key_bounds`, from each slot's ``u`` in ``u_stage [BK]``."""
    BK = u_stage.shape[0]
    for j in T.Parallel(BK):
        idx = Indices[b_i, s_i, k * BK + j]
        if idx >= 0:
            slot_bound(Bound, BoundExp, b_i, idx, u_stage[j])


@T.macro
def add_key_bounds(u_cols, u_frag, u_stage, Bound, BoundExp, Indices, b_i, s_i, k):
    """The exact mode's proof for key block ``k``: ``u_cols [BK, CW/4]`` holds each slot's
    running max ``|c / g|`` per 4-column group; per slot with a key, one int64 add of
    ``ceil(u) >= max |k|`` (an exact sum) and the exponent of the largest ``u`` (``>= 2^-120``,
    which bounds ``u`` when a clamp makes the sum short and sizes a grid that was too coarse)."""
    T.reduce_max(u_cols, u_frag, dim=1)
    T.copy(u_frag, u_stage)
    add_bounds(u_stage, Bound, BoundExp, Indices, b_i, s_i, k)


@T.macro
def sink_lse2(lse, sink2, natural):
    """The base-2, sink-inclusive, finite lse the main kernels take (``Lse2``), from one row's
    ``lse`` (fp32) and its sink in base 2, ``sink2 = sink log2 e`` (``-inf``: no sink): with
    ``natural`` (a natural-log, sink-exclusive ``lse``) ``log2(2^(lse log2 e) + 2^sink2)``, else
    ``lse`` as given; ``-inf`` (no key and no sink: every ``P`` is 0) becomes 0 and a NaN stays
    NaN (``docs/conventions.md``, the bridge).  Shared by :func:`preprocess` and the fused
    prologue of :func:`_two_warpgroups`."""
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
    pass over ``out`` and ``dO`` (it replaced ~12 framework ops of the lse bridge, the head
    padding and ``d_sink``, run 41; 64-head tiles do this in ``main``'s prologue instead, and the
    deterministic backward in ``exact_grid.grid_rows``, with the same formulas):

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
    rows (no division in the inner loop: run 41's first version divided by ``H_pad`` there and
    took 0.23 ms instead of 0.19)."""
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


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def finish(d_qk: int, permuted: bool, scaled: bool, block_rows: int = 8, threads: int = 128):
    """``dKV [B, S_kv, Dk] bf16`` from the main kernel's fp32 accumulator ``Acc [B, S_kv,
    Dk]``: column ``c`` read at :func:`dkv_column` ``(c)`` when ``permuted``, times the key's grid
    ``g_j = 1 / InvGrid[b, j]`` when ``scaled`` (the exact mode: an exact division by a power of
    two), rounded to bf16.  ``InvGrid [B, S_kv] fp32`` is not read unless ``scaled``."""
    B = T.dynamic("B")
    S_kv = T.dynamic("S_kv")
    R = block_rows
    col_of = dkv_column if permuted else (lambda c: c)

    @T.prim_func
    def sparse_bwd_finish(
        Acc: T.Tensor([B, S_kv, d_qk], "float32"),
        InvGrid: T.Tensor([B, S_kv], "float32"),
        dKV: T.Tensor([B, S_kv, d_qk], "bfloat16"),
    ):
        with T.Kernel(T.ceildiv(S_kv, R), B, threads=threads) as (r_blk, b_i):
            for r, c in T.Parallel(R, d_qk):
                row = r_blk * R + r
                if row < S_kv:
                    if scaled:
                        dKV[b_i, row, c] = T.Cast("bfloat16",
                                                  Acc[b_i, row, col_of(c)] / InvGrid[b_i, row])
                    else:
                        dKV[b_i, row, c] = T.Cast("bfloat16", Acc[b_i, row, col_of(c)])

    return sparse_bwd_finish


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def main(heads_per_cta: int, d_qk: int, d_v: int, mode: str, with_dq: bool = True,
         block_k: int = 32, threads: int | None = None, num_stages: int | None = None,
         dkv_chunk: int | None = None, dkv_transposed: bool | None = None,
         warp_specialized: bool | None = None, wg0_chunks: int | None = None,
         overlap: bool | None = None, w1_right: bool | None = None, row_extent: bool = True,
         row_lanes: int | None = None, pred_red: bool | None = None,
         tma_tiles: bool | None = None, timeline: bool | None = None, fused: bool = False,
         natural: bool = True):
    """Build the main backward kernel for one head tile and one dKV accumulation mode.

    Kernel arguments: ``Q [B, S, H_pad, Dk] bf16``, ``KV [B, S_kv, Dk] bf16``,
    ``dO [B, S, H_pad, Dv] bf16``, ``Indices [B, S, L] int32``, ``Lse2 [B, S, H_pad] fp32``
    (base-2, sink-inclusive, finite), ``Delta [B, S, H_pad] fp32``, ``Scale [1] fp32``
    (``sm_scale``), ``InvGrid [B, S_kv] fp32`` (exact mode: ``1 / g_j``, a power of two per
    key row), ``Counts [B, S] int32`` (``with_dq=False``: slots to process per row, a prefix of
    ``Indices``), outputs ``dQ [B, S, H_pad, Dk] bf16``, the accumulator
    ``dKV_acc [B, S_kv, Dk] fp32`` (zeroed by the caller), ``Bound [B, S_kv] int64`` and
    ``BoundExp [B, S_kv] int32`` (exact mode; zeroed by the caller).  Arguments a mode does not
    use are not read.

    ``mode``:

    * ``"atomic"``: fp32 ``atomic_addx4`` of each block's dKV rows (fast; the order in which
      CTAs arrive changes the last bits).
    * ``"exact"``: each contribution ``c`` to key ``j`` is rounded to the key's power-of-two grid,
      ``k = round(c / g_j)`` (exact scaling, one rounding), and the integer-valued floats ``k``
      are added with the same ``atomic_addx4``.  While every partial sum of a column stays within
      ``2^24`` in magnitude, every fp32 addition is exact, so the sum does not depend on the
      order: bitwise repeatable at the atomic path's speed.  To prove that bound the kernel also
      adds ``ceil(u)``, ``u = max_d |c_d / g_j|`` (clamped to ``2^40``; ``ceil(u) >= max_d
      |k_d|``) of every (row, head group, slot) contribution into ``Bound[b, j]`` with int64
      atomics (exact), and keeps the largest ``ceil(log2 max(u, 2^-120)) + 1`` in
      ``BoundExp[b, j]`` (atomic max; the caller starts it far below): ``Bound[b, j] <= 2^24``
      guarantees it.  The host re-runs the keys that exceed it on a coarser grid, and those
      whose grid proves far too coarse on a finer one (``interface._exact_dkv``).

    ``with_dq=False`` (the exact mode's re-run) skips dQ's GEMMs and store and walks only the
    first ``Counts[b, s]`` slots of each row (the host moves the re-run keys' slots to the front;
    a row with ``Counts = 0`` does nothing), on a fixed grid of :data:`RERUN_CTAS` CTAs per
    (batch, head group): CTA ``x`` loads the ``Counts`` of its rows ``x, x + RERUN_CTAS, ...``
    together into shared memory (256 rows at a time) and, only if one is positive, walks those
    with a count one after another (a call that re-runs no key costs one wave of CTAs that
    each read a few counts).  It reads ``Indices`` in whole key blocks, the first ``ceil(Counts
    / BK)`` of a row and none at ``Counts = 0``: ``exact_grid.rerun_slots`` writes ``-1`` past
    ``Counts`` to the end of that 64-slot block (``BK`` divides 64) and nothing else.

    Schedule knobs (static; defaults measured on H200 at B=1 S=4096 S_kv=8192 H=64 topk=2048,
    docs/performance.md): ``num_stages=1`` issues the next block's KV gather (cp.async) right
    after the last GEMM that reads the current one; dQ's two GEMMs run right after dS, so that
    the gather overlaps the dKV GEMMs and the scatter.  ``dkv_transposed=True`` computes each
    dKV chunk transposed, ``[CW, BK] = Q_c^T dS + dO_c^T P`` (the tail ``[Dk - Dv, BK]``): the
    GEMM's M is then ``CW`` instead of
    ``BK = 32`` (too few rows for wgmma), so it runs on wgmma from shared memory instead of
    ``mma_sync``, whose 8 warps each re-read dS^T / P^T through ldmatrix (the kernel is bound by
    shared memory); the staging writes it back untransposed.  (With 16 heads, ``BK = 64``, both
    forms are wgmma.)  ``warp_specialized`` (default: 64-head tiles) builds the 64-head first pass
    as :func:`_two_warpgroups` instead (two warpgroups with different roles, 64-key blocks); the
    other knobs then do not apply, ``wg0_chunks`` (0, 1 or 2) is how many of each block's nine
    dKV chunks its scores warpgroup adds, ``overlap`` gives the dKV warpgroup two accumulators
    and ``row_lanes`` (4 or 8) is how many lanes add each key row's piece of an atomic,
    ``pred_red`` adds each piece with a predicated ``red`` instead of one behind a branch
    (:data:`RED_V4_SRC`; defaults by mode: :func:`two_warpgroup_schedule`), ``tma_tiles``
    (default ``True``) loads the Q and dO tiles by TMA instead of ``cp.async`` (run 111:
    atomic -1 to -4% at ``ref``, -4% at ``fleet``, +2.4% in one ``h128`` pair; deterministic -2
    to -3% at ``fleet``, even at ``ref`` and ``h128``), ``timeline`` (a diagnostic, the fused
    kernel only) writes SM-cycle stamps of the CTA's stages into ``DSink`` instead of its terms
    (``tools/experiments/bwd_timeline.py``); ``row_extent``
    (default) makes it walk a row only up to the block that holds its last slot with a key,
    rows last-first (``row_blocks``; ``False``: every block, a trial knob).
    ``threads``, ``num_stages``, ``dkv_chunk``: ``None`` is 256, 1, 128.

    ``fused=True`` (the two-warpgroup kernel only) also does the preprocess's work for its
    rows: ``Lse2`` and ``Delta`` become outputs, and the kernel takes four more arguments
    after ``BoundExp``: ``O [B, S, H, Dv] bf16`` (the forward output, the real heads,
    ``H <= H_pad``), ``Lse [B, S, H] fp32`` (natural and sink-exclusive when ``natural``, else
    base-2 and sink-inclusive), ``Sink [H] fp32`` (``-inf``: no sink) and the output
    ``DSink [B, S, H_pad] fp32`` (each row's ``d_sink`` term); see :func:`_two_warpgroups`.
    """
    assert mode in ("atomic", "exact"), "mode is 'atomic' or 'exact'"
    assert heads_per_cta in (16, 32, 64), "the head tile is 16, 32 or 64 (tiling.head_plan)"
    assert d_qk > d_v and d_v % 64 == 0 and (d_qk - d_v) % 16 == 0, "unsupported Dk/Dv"
    if warp_specialized is None:  # measured faster for 64-head tiles (run 29)
        warp_specialized = heads_per_cta == 64
    if warp_specialized and with_dq:
        return _two_warpgroups(heads_per_cta, d_qk, d_v, mode, wg0_chunks, overlap, w1_right,
                               row_extent, row_lanes, pred_red, fused, natural,
                               tma_tiles is None or bool(tma_tiles), bool(timeline))
    assert not fused, "the fused preprocess is built into the two-warpgroup kernel only"
    threads = 256 if threads is None else threads
    num_stages = 1 if num_stages is None else num_stages
    dkv_chunk = 128 if dkv_chunk is None else dkv_chunk
    exact = mode == "exact"
    if dkv_transposed is None:  # measured faster for 64-head tiles only (run 24)
        dkv_transposed = heads_per_cta == 64
    M = heads_per_cta
    D = d_v
    D_tail = d_qk - d_v
    BK = block_k
    CW = dkv_chunk
    # rows padded so the accumulator's stores hit distinct banks (ncu: unpadded was 8-way):
    # row-major fragments store 8 rows x 8 bytes per lane quad (pad 8); transposed ones store
    # column j = 2 (lane % 4) + e, row d = lane / 4, i.e. word 2 (lane % 4) stride + lane / 4,
    # distinct mod 32 for stride = 4 mod 32 (pad 4 keeps the rows 16-byte aligned for float4)
    STAGE_PAD = 4 if dkv_transposed else 8
    # the re-run reads whole key blocks of Idx2, which rerun_slots writes in INDEX_PAD blocks
    assert with_dq or INDEX_PAD % BK == 0, "the re-run's key block must divide INDEX_PAD"
    dtype = "bfloat16"
    acc_t = "float32"
    assert D % CW == 0 and CW >= D_tail

    def dkv_shape(width):
        return [width, BK] if dkv_transposed else [BK, width]

    B = T.dynamic("B")
    S = T.dynamic("S")
    S_kv = T.dynamic("S_kv")
    L = T.dynamic("L")
    H_pad = T.dynamic("H_pad")

    @T.macro
    def stage_rows(stage, acc, width):
        # the dKV fragment into the fp32 staging rows, as it is (scatter4 scales the exact
        # mode's rows: one broadcast read of the key's grid per float4 there instead of one
        # shared-memory read per element here; run 28: -10% on the deterministic backward)
        if dkv_transposed:
            for d, j in T.Parallel(width, BK):
                stage[j, d] = acc[d, j]
        else:
            for j, d in T.Parallel(BK, width):
                stage[j, d] = acc[j, d]

    permuted = dkv_columns_permuted(M)
    src_of = dkv_source_column if permuted else (lambda p: p)

    @T.macro
    def scatter4(u_cols, r4, stage, inv_grid, dkv_acc, b_i, idx, col, j, d4):
        # one float4 of staged row j.  Exact mode: in grid units (c / g_j: exact, g_j a power
        # of two), the running max |c / g| taken before the rounding (so a grid too coarse
        # still shows the size), then the rounding, into registers: rounded in place, the
        # atomic's read of the staging row needed two CTA barriers per row (TileLang cannot
        # see that each thread reads only what it wrote).  A permuted accumulator
        # (dkv_columns_permuted: 64-head tiles) takes at d4 * 4 + t the staged column
        # dkv_source_column(d4 * 4 + t)
        if exact:
            for t in T.serial(4):
                r4[t] = stage[j, src_of(d4 * 4 + t)] * inv_grid[j]
            u_cols[j, d4] = T.max(u_cols[j, d4], T.max(T.max(T.abs(r4[0]), T.abs(r4[1])),
                                                       T.max(T.abs(r4[2]), T.abs(r4[3]))))
            for t in T.serial(4):
                r4[t] = T.round(r4[t])
            if idx >= 0:
                T.atomic_addx4(dkv_acc[b_i, idx, col + d4 * 4], r4[0])
        elif permuted:
            for t in T.serial(4):
                r4[t] = stage[j, src_of(d4 * 4 + t)]
            if idx >= 0:
                T.atomic_addx4(dkv_acc[b_i, idx, col + d4 * 4], r4[0])
        elif idx >= 0:
            T.atomic_addx4(dkv_acc[b_i, idx, col + d4 * 4], stage[j, d4 * 4])

    @T.prim_func
    def sparse_bwd_main(
        Q: T.Tensor([B, S, H_pad, d_qk], dtype),
        KV: T.Tensor([B, S_kv, d_qk], dtype),
        dO: T.Tensor([B, S, H_pad, D], dtype),
        Indices: T.Tensor([B, S, L], "int32"),
        Lse2: T.Tensor([B, S, H_pad], acc_t),
        Delta: T.Tensor([B, S, H_pad], acc_t),
        Scale: T.Tensor([1], acc_t),
        InvGrid: T.Tensor([B, S_kv], acc_t),
        Counts: T.Tensor([B, S], "int32"),
        dQ: T.Tensor([B, S, H_pad, d_qk], dtype),
        dKV_acc: T.Tensor([B, S_kv, d_qk], acc_t),
        Bound: T.Tensor([B, S_kv], "int64"),
        BoundExp: T.Tensor([B, S_kv], "int32"),
    ):
        with T.Kernel(S if with_dq else RERUN_CTAS, B, H_pad // M, threads=threads) as (
                bx, b_i, g_i):
            Q_shared = T.alloc_shared([M, D], dtype)
            Q_tail_shared = T.alloc_shared([M, D_tail], dtype)
            dO_shared = T.alloc_shared([M, D], dtype)
            KV_shared = T.alloc_shared([BK, D], dtype)
            KV_tail_shared = T.alloc_shared([BK, D_tail], dtype)
            P_shared = T.alloc_shared([M, BK], dtype)
            dS_shared = T.alloc_shared([M, BK], dtype)
            dkv_stage = T.alloc_shared([BK, CW + STAGE_PAD], acc_t)
            dkv_tail_stage = T.alloc_shared([BK, D_tail + STAGE_PAD], acc_t)
            inv_grid = T.alloc_shared([BK], acc_t)
            u_stage = T.alloc_shared([BK], acc_t)
            valid = T.alloc_fragment([BK], "bool")

            acc_p = T.alloc_fragment([M, BK], acc_t)
            acc_dp = T.alloc_fragment([M, BK], acc_t)
            acc_dq = T.alloc_fragment([M, D], acc_t)
            acc_dq_tail = T.alloc_fragment([M, D_tail], acc_t)
            acc_dkv = T.alloc_fragment(dkv_shape(CW), acc_t)
            acc_dkv_tail = T.alloc_fragment(dkv_shape(D_tail), acc_t)
            # running max |c / g| per (slot, 4-column group), taken while scattering and reduced
            # once per block (a reduce straight from the GEMM's accumulator layout does not lower)
            u_cols = T.alloc_fragment([BK, CW // 4], acc_t)
            u_frag = T.alloc_fragment([BK], acc_t)
            sc = T.alloc_local([2], acc_t)
            r4 = T.alloc_local([4], acc_t)

            # the re-run: its rows' Counts, a chunk of `threads` rows at a time
            cnt_s = T.alloc_shared([threads], "int32", scope="shared") if not with_dq else None

            h0 = g_i * M
            sc[0] = Scale[0] * LOG2E  # raw q.k -> base-2 logit
            sc[1] = Scale[0]
            # the re-run (with_dq=False) runs on a fixed grid of RERUN_CTAS CTAs per (batch,
            # head group), CTA bx owning rows bx, bx + RERUN_CTAS, ...: almost every row has no
            # slot to re-run, and one CTA per row (one per SM: its shared memory) made the re-run
            # ~60 waves of CTAs that only read Counts (0.05 ms at fleet, run 64).  The CTA loads
            # the Counts of `threads` of its rows together (a thread per row) into shared memory
            # and walks them one after another only if one of them has a slot (walking them all
            # cost ~0.1 ms, run 63; reading each row's Counts from global memory during the walk
            # cost ~0.5 us a row, inferred from run 68).  (The chunk loop's `c` is not the dKV
            # chunk loop's below: TileLang renames the inner one.)
            if not with_dq:
                tx = T.get_thread_binding()
                busy = T.alloc_local([1], "int32")
                n_rows = T.ceildiv(T.max(S - bx, 0), RERUN_CTAS)  # this CTA's rows
            for c in T.serial(1 if with_dq else T.ceildiv(n_rows, threads)):
                if not with_dq:
                    cnt_s[tx] = 0
                    if c * threads + tx < n_rows:
                        cnt_s[tx] = Counts[b_i, bx + (c * threads + tx) * RERUN_CTAS]
                    # a barrier that ORs every thread's flag and publishes cnt_s (TileLang's sync
                    # planner adds a __syncthreads before and after it: harmless)
                    busy[0] = T.call_extern("int32", "__syncthreads_or",
                                            T.if_then_else(cnt_s[tx] > 0, 1, 0))
                for r in T.serial(1 if with_dq else T.if_then_else(
                        busy[0] != 0, T.min(threads, n_rows - c * threads), 0)):
                    s_i = bx if with_dq else bx + (c * threads + r) * RERUN_CTAS
                    # the re-run (with_dq=False): a row with no key to re-run (almost every row)
                    # loads nothing (run 39: the empty re-run's tile loads cost 0.16 ms)
                    if with_dq or cnt_s[r] > 0:
                        T.copy(Q[b_i, s_i, h0:h0 + M, :D], Q_shared)
                        T.copy(Q[b_i, s_i, h0:h0 + M, D:], Q_tail_shared)
                        T.copy(dO[b_i, s_i, h0:h0 + M, :], dO_shared)
                    if with_dq:
                        T.clear(acc_dq)
                        T.clear(acc_dq_tail)
                    num_blocks = L // BK if with_dq else T.ceildiv(cnt_s[r], BK)

                    for k_i in T.Pipelined(num_blocks, num_stages=num_stages):
                        for j in T.Parallel(BK):
                            valid[j] = Indices[b_i, s_i, k_i * BK + j] >= 0
                        # clamped gather: a -1 slot reads row 0; its score is masked to -inf (P = 0)
                        for j, d in T.Parallel(BK, D):
                            KV_shared[j, d] = KV[b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0), d]
                        for j, d in T.Parallel(BK, D_tail):
                            KV_tail_shared[j, d] = KV[
                                b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0), D + d]
                        if exact:
                            for j in T.Parallel(BK):
                                inv_grid[j] = InvGrid[
                                    b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0)]
                        for h, j in T.Parallel(M, BK):
                            acc_p[h, j] = T.if_then_else(valid[j], 0, -T.infinity(acc_t))
                        T.gemm(Q_shared, KV_shared, acc_p, transpose_B=True,
                               policy=T.GemmWarpPolicy.FullCol)
                        T.gemm(Q_tail_shared, KV_tail_shared, acc_p, transpose_B=True,
                               policy=T.GemmWarpPolicy.FullCol)
                        for h, j in T.Parallel(M, BK):
                            acc_p[h, j] = T.exp2(acc_p[h, j] * sc[0] - Lse2[b_i, s_i, h0 + h])
                        T.copy(acc_p, P_shared)

                        T.gemm(dO_shared, KV_shared, acc_dp, transpose_B=True,
                               policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                        for h, j in T.Parallel(M, BK):
                            acc_dp[h, j] = (acc_p[h, j] * (acc_dp[h, j] - Delta[b_i, s_i, h0 + h])
                                            * sc[1])
                        T.copy(acc_dp, dS_shared)
                        if with_dq:
                            # dQ before dKV: its GEMMs are KV_shared's last readers, so the pipeline
                            # issues the next block's gather here and it lands under the dKV chunks
                            # (with dQ last it was waited for at the top of the next block; run 28)
                            T.gemm(dS_shared, KV_shared, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                            T.gemm(dS_shared, KV_tail_shared, acc_dq_tail,
                                   policy=T.GemmWarpPolicy.FullCol)

                        # dKV in column chunks: a [BK, CW] accumulator instead of [BK, Dk] keeps the
                        # registers under the cap (the whole-row version spilled in the exact mode)
                        if exact:
                            T.fill(u_cols, 0)
                        for c in T.serial(D // CW):
                            if dkv_transposed:
                                # issued without a wait: the next GEMM's wait covers both
                                T.wgmma_gemm(Q_shared[:, c * CW:(c + 1) * CW], dS_shared, acc_dkv,
                                             transpose_A=True, policy=T.GemmWarpPolicy.FullRow,
                                             clear_accum=True)
                                T.gemm(dO_shared[:, c * CW:(c + 1) * CW], P_shared, acc_dkv,
                                       transpose_A=True, policy=T.GemmWarpPolicy.FullRow)
                            else:
                                T.gemm(dS_shared, Q_shared[:, c * CW:(c + 1) * CW], acc_dkv,
                                       transpose_A=True, policy=T.GemmWarpPolicy.FullCol,
                                       clear_accum=True)
                                T.gemm(P_shared, dO_shared[:, c * CW:(c + 1) * CW], acc_dkv,
                                       transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                            stage_rows(dkv_stage, acc_dkv, CW)
                            for j, d4 in T.Parallel(BK, CW // 4):
                                scatter4(u_cols, r4, dkv_stage, inv_grid, dKV_acc, b_i,
                                         Indices[b_i, s_i, k_i * BK + j], c * CW, j, d4)

                        if dkv_transposed:
                            # M = 64 splits N over the warpgroups: BK / 2 columns each, so
                            # TileLang narrows dS_shared's swizzle (64 -> 32 bytes for BK = 32)
                            # for every GEMM
                            T.gemm(Q_tail_shared, dS_shared, acc_dkv_tail, transpose_A=True,
                                   policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                        else:
                            T.gemm(dS_shared, Q_tail_shared, acc_dkv_tail, transpose_A=True,
                                   policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                        stage_rows(dkv_tail_stage, acc_dkv_tail, D_tail)
                        # same (slot, 4-column) to thread map as the chunks' loop, so that
                        # u_cols keeps one layout; the tail's 16 column groups use the first 16
                        for j, d4 in T.Parallel(BK, CW // 4):
                            if d4 < D_tail // 4:
                                scatter4(u_cols, r4, dkv_tail_stage, inv_grid, dKV_acc, b_i,
                                         Indices[b_i, s_i, k_i * BK + j], D, j, d4)
                        if exact:
                            add_key_bounds(u_cols, u_frag, u_stage, Bound, BoundExp, Indices,
                                           b_i, s_i, k_i)

                    if with_dq:
                        T.copy(acc_dq, dQ[b_i, s_i, h0:h0 + M, :D])
                        T.copy(acc_dq_tail, dQ[b_i, s_i, h0:h0 + M, D:])
                if not with_dq:
                    T.sync_threads()  # cnt_s is rewritten by the next chunk

    return sparse_bwd_main




def _two_warpgroups(heads_per_cta: int, d_qk: int, d_v: int, mode: str,
                    wg0_chunks: int | None = None, overlap: bool | None = None,
                    w1_right: bool | None = None, row_extent: bool = True,
                    row_lanes: int | None = None, pred_red: bool | None = None,
                    fused: bool = False, natural: bool = True, tma_tiles: bool = True,
                    timeline: bool = False):
    """The 64-head main backward on 64-key blocks, two warpgroups (256 threads), dKV added
    straight from the accumulator registers; same arguments and results as :func:`main` with
    ``with_dq=True`` (the exact re-run, which has no dQ, keeps the one-role kernel).

    * warpgroup 0 (scores): waits for key block ``i``; ``S = Q K^T`` and ``dP = dO V^T`` as one
      batch of GEMMs, then ``P`` and ``dS``, handed over through shared memory once warpgroup 1
      is done with block ``i - 1``'s; ``dQ[:, :Dv/2] += dS K_l`` and the rope tail's
      ``dS K_t``; then it gathers block ``i + 1`` (the left half of the latent columns at once:
      only it reads them; the right half and the rope tail once warpgroup 1 has added its part
      of dQ, ``kv_free``) and, under the gather's latency, adds block ``i``'s last
      ``wg0_chunks`` dKV chunks (the right half's last if 2, then the rope tail).
    * warpgroup 1 (dKV): ``dQ[:, Dv/2:] += dS K_r``; then the block's other dKV chunks, each
      ``[BK, 64] = dS^T Q_c + P^T dO_c`` (the rope tail: ``dS^T Q_t``).  With ``overlap`` it
      holds two accumulators and issues chunk ``c + 1``'s GEMMs before it adds chunk ``c``, so
      that the tensor cores run while the atomics drain (the atomic mode's default since run
      86, there with ``row_lanes = 8``; with 64-byte pieces run 38 found it no faster
      than the one-accumulator schedule overall, a form that spills 324 bytes under ptxas 13.0;
      slower in the exact mode, run 87).

    Defaults: :func:`two_warpgroup_schedule` (the exact mode: two chunks on warpgroup 0, which
    is the shorter path there, warpgroup 1 also rounds; the atomic mode: the rope tail there,
    ``overlap``, ``row_lanes = 8``).  Each chunk is added into ``dKV_acc`` from the wgmma
    accumulator, with 16-byte atomics at the permuted columns of ``tiling.dkv_column``
    (:func:`scatter_chunk` inside), no staging in shared memory: each lane's own float4s
    (``row_lanes = 4``) or, with 8, after one exchange of half of them with lane ``t ^ 4``;
    the exact mode scales, takes each slot's maximum and rounds in
    registers, and warpgroup 0 hands its chunks' maxima to warpgroup 1 (``u_w0``, ``u_ready``),
    which adds each key's bound once.

    Why: with 32-key blocks the dKV GEMM has ``M = 32`` (too few rows for a row-major wgmma), so
    it ran transposed through fp32 staging rows in shared memory, and every 32-key GEMM re-read
    its 64-row operand for half the work (docs/performance.md, round 2, sixth session).  Shared
    memory holds one 64-key block (Q, dO, K: 208 KB; P and dS: 16 KB), so block ``i + 1``'s
    gather waits until block ``i``'s K is read.

    mbarriers, each completing once per block: ``kl_full`` / ``kr_full`` (the gather's two parts
    landed), ``kv_free`` (warpgroup 1 done with K_r), ``pds_full`` (P, dS written), ``pds_free``
    (warpgroup 1 done reading them; waited on with parity ``(i & 1) ^ 1``, i.e. not at all
    before block 0), ``u_ready`` (exact mode with ``wg0_chunks > 0``: warpgroup 0's slot maxima
    written); the others are waited on with parity ``i & 1``.  No waiter may fall two phases
    behind: warpgroup 0 waits for ``kv_free`` in every block, the last included, which holds it
    back until warpgroup 1 has read the previous block's ``u_w0`` (a review found that a
    conditional wait let ``u_ready`` run ahead in the last block).

    ``fused`` (the preprocess in the prologue; arguments in :func:`main`): the CTA's ``dO``
    tile is in shared memory anyway, so ``Delta``, ``Lse2`` and ``DSink`` of its 64 rows come
    from it and the ``O`` tile, read once, instead of a launch that streams both from HBM.
    Thread ``t`` of 256 takes row ``t // 4`` and columns ``[p 64, p 64 + 64)`` of each half
    (``p = t % 4``): its 16-byte loads of ``O`` (0 at pad heads) are issued before the wait for
    the query tile, so that they fly with its ``cp.async``; after it, the products with ``dO``
    in fp32, added in a fixed order, then a butterfly over the row's four lanes.  Lane 0 of
    each row applies :func:`sink_lse2`, writes the row's three values to global memory (0 at
    pad heads, as the preprocess) and ``Lse2`` / ``Delta`` to static shared memory (``rows_s``,
    512 bytes), where warpgroup 0 reads them after a CTA barrier.  Deterministic (no atomics);
    ``Delta`` is summed in another order than the preprocess's, so the results differ from the
    unfused kernel's at fp32 rounding only.  ptxas (CUDA 13.0): 12-20 bytes of spill, as
    unfused; with ``rows_s`` in the dynamic pool it spilled ~180 bytes in warpgroup 0's key loop.
    Run 49: atomic ``ref`` 7.956 -> 7.865 ms against the separate preprocess; the deterministic
    backward does not fuse it (fused, its ``grid_rows`` had to read dO: no gain): its
    ``grid_rows`` is the preprocess instead, which reads q, O and dO once for both jobs.
    """
    assert heads_per_cta == 64 and d_v % 128 == 0 and d_qk - d_v == 64
    exact = mode == "exact"
    wg0_chunks, overlap, w1_right, row_lanes, pred_red = two_warpgroup_schedule(
        mode, wg0_chunks, overlap, w1_right, row_lanes, pred_red)
    assert wg0_chunks in (0, 1, 2)
    # with no chunk on warpgroup 0 the overlapped list would end in the rope tail, a case that
    # gave a wrong dKV (run 38) and was slower anyway
    assert not (overlap and wg0_chunks == 0), "overlap needs the rope tail on warpgroup 0"
    # w1_right (a trial, run 40): warpgroup 1 also adds dQ's rope tail and gathers the next
    # block's right half and tail right after its dQ GEMMs, so that warpgroup 0 (the longer path
    # in the atomic mode, run 39's profile) neither waits for kv_free nor gathers them
    assert not (w1_right and wg0_chunks), "w1_right: warpgroup 0 adds no dKV chunk"
    assert row_lanes in (4, 8), "row_lanes: 4 or 8 lanes per key row of an atomic"
    M = heads_per_cta
    D = d_v
    DH = d_v // 2
    D_tail = d_qk - d_v
    BK = 64
    CW = 64
    WG = 128
    dtype = "bfloat16"
    acc_t = "float32"
    assert (M * d_qk // 8) % (2 * WG) == 0 and (M * D // 8) % (2 * WG) == 0

    B = T.dynamic("B")
    S = T.dynamic("S")
    S_kv = T.dynamic("S_kv")
    L = T.dynamic("L")
    H_pad = T.dynamic("H_pad")
    H = T.dynamic("H")  # fused: the real heads of O, Lse and Sink
    PC = DH // 4  # fused: the columns of each half one thread multiplies
    VEC = 8  # bf16 per 16-byte load

    def slot_row(t):
        # the first of the two accumulator rows (slots of the key block) thread t of a warpgroup
        # adds, see scatter_chunk; the other is slot_row(t) + 8
        return (t // 32) * 16 + (t % 32) // 4

    @T.macro
    def gather_cols(KV, Indices, dst, col0, b_i, s_i, k, t):
        # columns [col0, col0 + width) of key block k's latent rows into dst [BK, width], by
        # 128 threads, 16 bytes each per step (a -1 slot copies row 0; its score is masked)
        width = dst.shape[1]
        per_row = width // 8
        for r in T.serial(BK * per_row // WG):
            c = r * WG + t
            j = c // per_row
            col = (c % per_row) * 8
            row = T.max(Indices[b_i, s_i, k * BK + j], 0)
            T.ptx_cp_async(T.access_ptr(dst[j, col], "w", 8),
                           T.access_ptr(KV[b_i, row, col0 + col], "r", 8), 8)

    @T.macro
    def gather_left(KV, Indices, K_l, kl_full, b_i, s_i, k, t):
        gather_cols(KV, Indices, K_l, 0, b_i, s_i, k, t)
        T.cp_async_barrier_noinc(kl_full[0])

    @T.macro
    def gather_right(KV, Indices, InvGrid, K_r, K_t, inv, kr_full, b_i, s_i, k, t):
        # the right half, the rope tail and, in the exact mode, the keys' grids (inv[k % 2])
        gather_cols(KV, Indices, K_r, DH, b_i, s_i, k, t)
        gather_cols(KV, Indices, K_t, D, b_i, s_i, k, t)
        if exact:
            if t < BK:
                T.ptx_cp_async(T.access_ptr(inv[k % 2, t], "w", 1),
                               T.access_ptr(InvGrid[b_i, T.max(Indices[b_i, s_i, k * BK + t], 0)],
                                            "r", 1), 1)
        T.cp_async_barrier_noinc(kr_full[0])

    @T.macro
    def own_slot(Indices, inv, slot, inv_l, u_l, b_i, s_i, k, t):
        # thread t's two key rows in block k (slot_row and slot_row + 8), their inverse grids,
        # fresh running maxima; row_lanes = 8: slot[2:] are the partner lane t ^ 4's two rows
        for i in T.unroll(2):
            slot[i] = Indices[b_i, s_i, k * BK + slot_row(t) + 8 * i]
            if exact:
                inv_l[i] = inv[k % 2, slot_row(t) + 8 * i]
                u_l[i] = 0
        if row_lanes == 8:
            for i in T.unroll(2):
                slot[2 + i] = T.shfl_xor(slot[i], 4)

    @T.macro
    def to_grid(v, o, inv_l, u_l, i):
        # exact mode: v[o:o + 4] (of row i) in grid units (c / g_j, exact: g_j a power of two),
        # the slot's running max |c / g| taken before the rounding (a grid too coarse still
        # shows the size), then rounded
        if exact:
            for e in T.unroll(4):
                v[o + e] = v[o + e] * inv_l[i]
                u_l[i] = T.max(u_l[i], T.abs(v[o + e]))
                v[o + e] = T.round(v[o + e])

    def dkv_pieces():
        # scatter_chunk's copies of one dKV accumulator (a thread's four columns per float4, one
        # fragment each: TileLang takes one index per fragment in a parallel loop; register
        # renames after ptxas): 4 fragments [BK, CW / 4], or with row_lanes = 8 those of the
        # even and of the odd 16-column groups apart, 8 fragments [BK, CW / 8]
        n, width = (4, CW // 4) if row_lanes == 4 else (8, CW // 8)
        return tuple(T.alloc_fragment([BK, width], acc_t) for _ in range(n))

    @T.macro
    def copy_cols(acc, dst, first, step):
        for j, g in T.Parallel(BK, dst.shape[1]):
            dst[j, g] = acc[j, step * (g // 4) + 2 * (g % 4) + first]

    @T.macro
    def red4(dKV_acc, b_i, row, c, v):
        # pred_red: v[0:4] into dKV_acc[b_i, row, c:c + 4] unless row is -1 (or past S_kv), one
        # predicated 16-byte red (RED_V4_SRC) instead of an atomic behind an `if`: the `if` ended
        # a basic block at every atomic, so ptxas could not move the next shuffles above it
        # and waited for each of their results (run 90's profile: 11% of the samples, short
        # scoreboard).  The row's offset from the batch's first row, not an index into dKV_acc:
        # TileLang puts its own bounds test (a branch) around a data-dependent index
        T.call_extern("handle", "pf_red_add_v4_if", T.And(row >= 0, row < S_kv),
                      T.address_of(dKV_acc[b_i, 0, 0]), T.Cast("int64", T.max(row, 0)) * d_qk + c,
                      v[0], v[1], v[2], v[3])

    @T.macro
    def scatter_chunk(acc, ev, r4, slot, inv_l, u_l, dKV_acc, b_i, col):
        # chunk [BK, CW] of the block's dKV from the wgmma accumulator, with 16-byte atomics.
        # Thread t holds, of rows r = slot_row(t) and r + 8, the columns 16 c + 2 (t % 4) + {0, 1,
        # 8, 9} (c = 0 .. CW / 16 - 1); each such four is added as one float4 at columns
        # 16 c + 4 (t % 4) .. + 3 of dKV_acc (tiling.dkv_column: a fixed permutation within
        # every 16 columns, undone by `finish`), by its own lane (row_lanes = 4) or, for half
        # of them, by lane t ^ 4 (row_lanes = 8).  ev: dkv_pieces()
        if row_lanes == 4:
            # the four lanes of a row write 64 contiguous bytes per instruction, no lane
            # exchange (cuDNN's SM90 DSA backward stores its dKV partials the same way)
            copy_cols(acc, ev[0], 0, 16)
            copy_cols(acc, ev[1], 1, 16)
            copy_cols(acc, ev[2], 8, 16)
            copy_cols(acc, ev[3], 9, 16)
            for j, g in T.Parallel(BK, CW // 4):
                i = (j % 16) // 8  # which of the thread's two rows
                r4[0] = ev[0][j, g]
                r4[1] = ev[1][j, g]
                r4[2] = ev[2][j, g]
                r4[3] = ev[3][j, g]
                to_grid(r4, 0, inv_l, u_l, i)
                if pred_red:
                    red4(dKV_acc, b_i, slot[i], col + 4 * g, r4)
                elif slot[i] >= 0:
                    T.atomic_addx4(dKV_acc[b_i, slot[i], col + 4 * g], r4[0])
        else:
            # eight lanes per row: quads q and q ^ 1 (lanes t and t ^ 4, rows j and j ^ 1) each
            # hold groups c = 2 k (r4[4:8]) and 2 k + 1 (r4[8:12]) of their own row; the even
            # quad sends group 2 k + 1, the odd one group 2 k (one shuffle per float, into
            # r4[12:16]), so that one atomic adds both groups of the even row (128 contiguous
            # bytes from 8 lanes) and the next both of the odd row (red_pieces.py: 128-byte
            # pieces reach the L2 faster than 64-byte ones).  Same columns as above
            copy_cols(acc, ev[0], 0, 32)
            copy_cols(acc, ev[1], 1, 32)
            copy_cols(acc, ev[2], 8, 32)
            copy_cols(acc, ev[3], 9, 32)
            copy_cols(acc, ev[4], 16, 32)
            copy_cols(acc, ev[5], 17, 32)
            copy_cols(acc, ev[6], 24, 32)
            copy_cols(acc, ev[7], 25, 32)
            for j, h in T.Parallel(BK, CW // 8):
                i = (j % 16) // 8
                odd = j % 2 == 1
                r4[4] = ev[0][j, h]
                r4[5] = ev[1][j, h]
                r4[6] = ev[2][j, h]
                r4[7] = ev[3][j, h]
                r4[8] = ev[4][j, h]
                r4[9] = ev[5][j, h]
                r4[10] = ev[6][j, h]
                r4[11] = ev[7][j, h]
                to_grid(r4, 4, inv_l, u_l, i)
                to_grid(r4, 8, inv_l, u_l, i)
                for e in T.unroll(4):
                    r4[12 + e] = T.shfl_xor(T.if_then_else(odd, r4[4 + e], r4[8 + e]), 4)
                col_e = col + 32 * (h // 4) + 16 * (j % 2) + 4 * (h % 4)
                for e in T.unroll(4):
                    r4[e] = T.if_then_else(odd, r4[12 + e], r4[4 + e])
                row_e = T.if_then_else(odd, slot[2 + i], slot[i])  # the even quad's row
                if pred_red:
                    red4(dKV_acc, b_i, row_e, col_e, r4)
                elif row_e >= 0:
                    T.atomic_addx4(dKV_acc[b_i, row_e, col_e], r4[0])
                for e in T.unroll(4):
                    r4[e] = T.if_then_else(odd, r4[8 + e], r4[12 + e])
                row_o = T.if_then_else(odd, slot[i], slot[2 + i])  # the odd quad's row
                if pred_red:
                    red4(dKV_acc, b_i, row_o, col_e, r4)
                elif row_o >= 0:
                    T.atomic_addx4(dKV_acc[b_i, row_o, col_e], r4[0])

    @T.macro
    def slot_max(u_l):
        # each slot row is spread over the four lanes t ^ {0, 1, 2, 3} (16 columns each)
        for i in T.unroll(2):
            u_l[i] = T.max(u_l[i], T.shfl_xor(u_l[i], 1))
            u_l[i] = T.max(u_l[i], T.shfl_xor(u_l[i], 2))

    @T.macro
    def add_slot_bound(u_l, slot, Bound, BoundExp, b_i, t):
        # the exactness proof for the thread's two slots, once per row (by lane t % 4 == 0)
        if t % 4 == 0:
            for i in T.unroll(2):
                if slot[i] >= 0:
                    slot_bound(Bound, BoundExp, b_i, slot[i], u_l[i])

    @T.macro
    def dkv_chunks(Q_h, dO_h, P_s, dS_s, acc, ev, r4, slot, inv_l, u_l, dKV_acc, b_i,
                   c0, n, col0):
        # chunks c0 .. c0 + n - 1 of one half of the latent columns (Q_h / dO_h: that half)
        for c in T.serial(n):
            T.wgmma_gemm(dS_s, Q_h[:, (c0 + c) * CW:(c0 + c + 1) * CW], acc, transpose_A=True,
                         clear_accum=True)
            T.gemm(P_s, dO_h[:, (c0 + c) * CW:(c0 + c + 1) * CW], acc, transpose_A=True)
            scatter_chunk(acc, ev, r4, slot, inv_l, u_l, dKV_acc, b_i, col0 + (c0 + c) * CW)

    def w1_chunk_list(Q_l, dO_l, Q_r, dO_r):
        # warpgroup 1's chunks in order with overlap: (half tile Q, half tile dO, chunk in the
        # half, column)
        return ([(Q_l, dO_l, c, c * CW) for c in range(DH // CW)]
                + [(Q_r, dO_r, c, DH + c * CW) for c in range(DH // CW - wg0_chunks + 1)])

    @T.macro
    def issue_chunk(Q_h, dO_h, c, P_s, dS_s, acc):
        T.wgmma_gemm(dS_s, Q_h[:, c * CW:(c + 1) * CW], acc, transpose_A=True, clear_accum=True)
        T.wgmma_gemm(P_s, dO_h[:, c * CW:(c + 1) * CW], acc, transpose_A=True)

    @T.macro
    def dkv_chunks_overlapped(chunks, i, P_s, dS_s, acc_a, acc_b, ev, r4, slot, inv_l, u_l,
                              dKV_acc, b_i, pds_free):
        # chunks[i:] with chunk i's GEMMs issued into acc_a: chunk i + 1's GEMMs go into acc_b
        # (two accumulators) and run while chunk i is added, so that the atomics overlap the
        # tensor cores.  chunks: (half tile Q, half tile dO, chunk in the half, column).
        # Unrolled by recursion while tracing (a Python loop over the list does not trace in
        # tilelang-paddle 0.1.13)
        if i + 1 < len(chunks):
            issue_chunk(chunks[i + 1][0], chunks[i + 1][1], chunks[i + 1][2], P_s, dS_s, acc_b)
            T.wait_wgmma(2)  # chunk i's two GEMMs done, chunk i + 1's in flight
        else:
            T.wait_wgmma(0)
            T.barrier_arrive(pds_free[0])  # the last read of P / dS
        T.warpgroup_fence_operand(acc_a, num_regs=BK * CW // WG)
        scatter_chunk(acc_a, ev, r4, slot, inv_l, u_l, dKV_acc, b_i, chunks[i][3])
        if i + 1 < len(chunks):
            dkv_chunks_overlapped(chunks, i + 1, P_s, dS_s, acc_b, acc_a, ev, r4, slot, inv_l,
                                  u_l, dKV_acc, b_i, pds_free)

    @T.macro
    def fused_loads(O, Lse, Sink, o_r, lse_r, b_i, s_i, h0, tx):
        # the fused preprocess before the query tile's wait: thread tx's row tx // 4 of O,
        # columns [p PC, p PC + PC) of each half (p = tx % 4), into registers (0 at pad heads),
        # and the row's lse and base-2 sink (a pad head: 0 and -inf)
        h = tx // 4
        p = tx % 4
        if h0 + h < H:
            for half in T.unroll(2):
                for i in T.unroll(PC // VEC):
                    for e in T.vectorized(VEC):
                        o_r[half * PC + i * VEC + e] = O[b_i, s_i, h0 + h,
                                                         half * DH + p * PC + i * VEC + e]
            lse_r[0] = Lse[b_i, s_i, h0 + h]
            lse_r[1] = Sink[h0 + h] * LOG2E
        else:
            for i in T.unroll(2 * PC):
                o_r[i] = T.Cast(dtype, 0)
            lse_r[0] = 0
            lse_r[1] = -T.infinity(acc_t)

    @T.macro
    def row_products(dO_h, o_r, do_r, lse_r, o0, h, p):
        # lse_r[2] += the products of row h's columns [p PC, p PC + PC) of one half of dO
        # (dO_h, 16 bytes at a time from shared memory) and of O (o_r[o0:])
        for i in T.unroll(PC // VEC):
            for e in T.vectorized(VEC):
                do_r[e] = dO_h[h, p * PC + i * VEC + e]
            for e in T.unroll(VEC):
                lse_r[2] = lse_r[2] + T.Cast(acc_t, o_r[o0 + i * VEC + e]) * T.Cast(acc_t, do_r[e])

    @T.macro
    def fused_rows(dO_l, dO_r, o_r, do_r, lse_r, rows_s, Lse2, Delta, DSink, b_i, s_i, h0, tx):
        # after the wait: Delta of row tx // 4 from its dO in shared memory, in a fixed order
        # (each lane its 2 PC products in column order, then the butterfly, which gives all
        # four lanes the same sum); lane 0 of the row writes it, Lse2 and DSink (0 at pad
        # heads, as the preprocess) and hands Lse2 / Delta to warpgroup 0 (rows_s)
        h = tx // 4
        p = tx % 4
        lse_r[2] = 0
        row_products(dO_l, o_r, do_r, lse_r, 0, h, p)
        row_products(dO_r, o_r, do_r, lse_r, PC, h, p)
        lse_r[2] = lse_r[2] + T.shfl_xor(lse_r[2], 1)
        lse_r[2] = lse_r[2] + T.shfl_xor(lse_r[2], 2)
        if p == 0:
            if h0 + h < H:
                lse_r[3] = sink_lse2(lse_r[0], lse_r[1], natural)
                Delta[b_i, s_i, h0 + h] = lse_r[2]
                Lse2[b_i, s_i, h0 + h] = lse_r[3]
                DSink[b_i, s_i, h0 + h] = -T.exp2(lse_r[1] - lse_r[3]) * lse_r[2]
                rows_s[0, h] = lse_r[3]
                rows_s[1, h] = lse_r[2]
            else:
                Delta[b_i, s_i, h0 + h] = 0.0
                Lse2[b_i, s_i, h0 + h] = 0.0
                DSink[b_i, s_i, h0 + h] = 0.0
                rows_s[0, h] = 0.0
                rows_s[1, h] = 0.0
        T.sync_threads()  # rows_s: written by every warp, read by warpgroup 0

    assert fused or not timeline, "timeline writes its stamps into DSink: the fused kernel only"
    start, stamp, _ = stampers(timeline)  # (timeline, a diagnostic) the stamps into DSink

    @T.macro
    def body(Q, KV, dO, Indices, Lse2, Delta, Scale, InvGrid, Counts, dQ, dKV_acc, Bound,
             BoundExp, O, Lse, Sink, DSink):
        # the kernel; O, Lse, Sink, DSink: None unless fused
        with T.Kernel(S, B, H_pad // M, threads=2 * WG,
                      prelude=RED_V4_SRC if pred_red else None) as (bx, b_i, g_i):
            s_i = last_row_first(bx, S) if row_extent else bx
            Q_l = T.alloc_shared([M, DH], dtype)
            Q_r = T.alloc_shared([M, DH], dtype)
            Q_t = T.alloc_shared([M, D_tail], dtype)
            dO_l = T.alloc_shared([M, DH], dtype)
            dO_r = T.alloc_shared([M, DH], dtype)
            K_l = T.alloc_shared([BK, DH], dtype)
            K_r = T.alloc_shared([BK, DH], dtype)
            K_t = T.alloc_shared([BK, D_tail], dtype)
            P_s = T.alloc_shared([M, BK], dtype)
            dS_s = T.alloc_shared([M, BK], dtype)
            inv = T.alloc_shared([2, BK], acc_t)  # block k's key grids in row k % 2
            u_w0 = T.alloc_shared([2, BK], acc_t)  # warpgroup 0's slot maxima, row k % 2
            # fused: the rows' Lse2 (row 0) and Delta (row 1) for warpgroup 0; the thread's O,
            # a 16-byte piece of dO, and (lse, sink2, Delta, Lse2)
            # (static shared memory: the liveness-based merge of the dynamic pool would hand
            # its bytes to a buffer that is written while a slow warp of warpgroup 0 reads it)
            rows_s = T.alloc_shared([2, M], acc_t, scope="shared") if fused else None
            o_r = T.alloc_local([2 * PC], dtype) if fused else None
            do_r = T.alloc_local([VEC], dtype) if fused else None
            lse_r = T.alloc_local([4], acc_t) if fused else None

            q_ready = T.alloc_barrier(arrive_count=2 * WG)
            kl_full = T.alloc_barrier(arrive_count=WG)
            kr_full = T.alloc_barrier(arrive_count=WG)
            kv_free = T.alloc_barrier(arrive_count=WG)
            pds_full = T.alloc_barrier(arrive_count=WG)
            pds_free = T.alloc_barrier(arrive_count=WG)
            u_ready = T.alloc_barrier(arrive_count=WG)

            acc_p = T.alloc_fragment([M, BK], acc_t)
            acc_dp = T.alloc_fragment([M, BK], acc_t)
            acc_dq_l = T.alloc_fragment([M, DH], acc_t)
            acc_dq_t = T.alloc_fragment([M, D_tail], acc_t)
            acc_dq_r = T.alloc_fragment([M, DH], acc_t)
            lse_f = T.alloc_fragment([M], acc_t)
            delta_f = T.alloc_fragment([M], acc_t)
            # one dKV accumulator (and its copies) per warpgroup: a fragment's layout binds it
            # to the warpgroup that uses it first
            acc_w0 = T.alloc_fragment([BK, CW], acc_t)
            w0_e = dkv_pieces()
            acc_w1 = T.alloc_fragment([BK, CW], acc_t)
            acc_w1b = T.alloc_fragment([BK, CW], acc_t)  # overlap: the second accumulator
            w1_chunks = w1_chunk_list(Q_l, dO_l, Q_r, dO_r)
            w1_e = dkv_pieces()
            sc = T.alloc_local([2], acc_t)
            r4 = T.alloc_local([4 if row_lanes == 4 else 16], acc_t)  # see scatter_chunk
            # the thread's two key rows of the block (own_slot): index, inverse grid, max
            slot = T.alloc_local([2 if row_lanes == 4 else 4], "int32")
            inv_l = T.alloc_local([2], acc_t)
            u_l = T.alloc_local([2], acc_t)
            ext_v, ext_last, ext_warps, nb = alloc_scratch(2 * WG)

            t0 = T.alloc_local([1], "int64")
            tx = T.get_thread_binding()
            h0 = g_i * M
            start(t0)
            if tx < WG and L // BK > 0:  # block 0's keys (always walked), under the tiles' load
                gather_left(KV, Indices, K_l, kl_full, b_i, s_i, 0, tx)
                gather_right(KV, Indices, InvGrid, K_r, K_t, inv, kr_full, b_i, s_i, 0, tx)
            if tma_tiles:
                tma_head_tile(Q, b_i, s_i, h0, Q_l, Q_r, Q_t, q_ready)
                tma_head_tile(dO, b_i, s_i, h0, dO_l, dO_r, None, q_ready)
                T.barrier_arrive(q_ready[0])  # see tma_head_tile
            else:
                load_head_tile(Q, b_i, s_i, h0, Q_l, Q_r, Q_t, tx, 2 * WG)
                load_head_tile(dO, b_i, s_i, h0, dO_l, dO_r, None, tx, 2 * WG)
                T.cp_async_barrier_noinc(q_ready[0])
            stamp(DSink, b_i, s_i, h0, t0, 0, tx == 0)
            if fused:
                fused_loads(O, Lse, Sink, o_r, lse_r, b_i, s_i, h0, tx)
            if row_extent:
                row_key_blocks(Indices, b_i, s_i, tx, 2 * WG, BK, ext_v, ext_last, ext_warps, nb)
            else:
                nb[0] = L // BK
            NB = nb[0]
            stamp(DSink, b_i, s_i, h0, t0, 1, tx == 0)
            T.barrier_wait(q_ready[0], 0)
            T.fence_proxy_async()
            stamp(DSink, b_i, s_i, h0, t0, 2, tx == 0)
            if fused:
                fused_rows(dO_l, dO_r, o_r, do_r, lse_r, rows_s, Lse2, Delta, DSink, b_i, s_i, h0,
                           tx)
            stamp(DSink, b_i, s_i, h0, t0, 3, tx == 0)

            if tx < WG:
                sc[0] = Scale[0] * LOG2E  # raw q.k -> base-2 logit
                sc[1] = Scale[0]
                if fused:
                    for h in T.Parallel(M):
                        lse_f[h] = rows_s[0, h]
                        delta_f[h] = rows_s[1, h]
                else:
                    for h in T.Parallel(M):
                        lse_f[h] = Lse2[b_i, s_i, h0 + h]
                        delta_f[h] = Delta[b_i, s_i, h0 + h]
                T.fill(acc_dq_l, 0)
                if not w1_right:
                    T.fill(acc_dq_t, 0)
                for k in T.serial(NB):
                    stamp(DSink, b_i, s_i, h0, t0, 16, T.And(tx == 0, k == 8))
                    stamp(DSink, b_i, s_i, h0, t0, 17, T.And(tx == 0, k == 24))
                    for h, j in T.Parallel(M, BK):
                        acc_p[h, j] = T.if_then_else(Indices[b_i, s_i, k * BK + j] >= 0, 0,
                                                     -T.infinity(acc_t))
                    # the left half's GEMMs as soon as it lands, the rest after the right half
                    T.barrier_wait(kl_full[0], k & 1)
                    stamp(DSink, b_i, s_i, h0, t0, 4, T.And(tx == 0, k == 0))
                    T.fence_proxy_async()  # cp.async wrote through the generic proxy
                    T.wgmma_gemm(Q_l, K_l, acc_p, transpose_B=True)
                    T.wgmma_gemm(dO_l, K_l, acc_dp, transpose_B=True, clear_accum=True)
                    T.barrier_wait(kr_full[0], k & 1)
                    T.fence_proxy_async()
                    T.wgmma_gemm(Q_r, K_r, acc_p, transpose_B=True)
                    T.wgmma_gemm(Q_t, K_t, acc_p, transpose_B=True)
                    T.gemm(dO_r, K_r, acc_dp, transpose_B=True)
                    for h, j in T.Parallel(M, BK):
                        acc_p[h, j] = T.exp2(acc_p[h, j] * sc[0] - lse_f[h])
                        acc_dp[h, j] = acc_p[h, j] * (acc_dp[h, j] - delta_f[h]) * sc[1]
                    # warpgroup 1 must be done with block k - 1's P / dS
                    T.barrier_wait(pds_free[0], (k & 1) ^ 1)
                    T.copy(acc_p, P_s)
                    T.copy(acc_dp, dS_s)
                    T.fence_proxy_async()  # read by wgmma (both warpgroups)
                    T.barrier_arrive(pds_full[0])
                    stamp(DSink, b_i, s_i, h0, t0, 5, T.And(tx == 0, k == 0))
                    if w1_right:
                        T.gemm(dS_s, K_l, acc_dq_l)
                    else:
                        T.wgmma_gemm(dS_s, K_l, acc_dq_l)
                        T.gemm(dS_s, K_t, acc_dq_t)
                        T.warpgroup_fence_operand(acc_dq_l, num_regs=M * DH // WG)
                    if k + 1 < NB:
                        gather_left(KV, Indices, K_l, kl_full, b_i, s_i, k + 1, tx)
                    if not w1_right:
                        # also in the last block: it keeps u_ready from running two phases ahead
                        # of warpgroup 1 (which arrives pds_free before it waits for u_ready)
                        T.barrier_wait(kv_free[0], k & 1)
                        if k + 1 < NB:
                            gather_right(KV, Indices, InvGrid, K_r, K_t, inv, kr_full, b_i, s_i,
                                         k + 1, tx)
                    if wg0_chunks > 0:
                        own_slot(Indices, inv, slot, inv_l, u_l, b_i, s_i, k, tx)
                        if wg0_chunks == 2:
                            dkv_chunks(Q_r, dO_r, P_s, dS_s, acc_w0, w0_e, r4, slot, inv_l,
                                       u_l, dKV_acc, b_i, DH // CW - 1, 1, DH)
                        T.gemm(dS_s, Q_t, acc_w0, transpose_A=True, clear_accum=True)
                        scatter_chunk(acc_w0, w0_e, r4, slot, inv_l, u_l, dKV_acc, b_i, D)
                        if exact:
                            slot_max(u_l)
                            if tx % 4 == 0:
                                for i in T.unroll(2):
                                    u_w0[k % 2, slot_row(tx) + 8 * i] = u_l[i]
                            T.barrier_arrive(u_ready[0])
                stamp(DSink, b_i, s_i, h0, t0, 6, tx == 0)
                T.copy(acc_dq_l, dQ[b_i, s_i, h0:h0 + M, :DH])
                if not w1_right:
                    T.copy(acc_dq_t, dQ[b_i, s_i, h0:h0 + M, D:])
                stamp(DSink, b_i, s_i, h0, t0, 7, tx == 0)
            else:
                t = tx - WG
                T.fill(acc_dq_r, 0)
                if w1_right:
                    T.fill(acc_dq_t, 0)
                for k in T.serial(NB):
                    T.barrier_wait(pds_full[0], k & 1)
                    stamp(DSink, b_i, s_i, h0, t0, 8, T.And(tx == WG, k == 0))
                    # the keys came by cp.async (generic proxy) and P / dS were fenced by
                    # their writer; both are read by wgmma
                    T.fence_proxy_async()
                    if w1_right:
                        # warpgroup 0 read K_r and K_t before it wrote P / dS: once these GEMMs
                        # are done nobody reads them, and the next block's go in
                        T.wgmma_gemm(dS_s, K_r, acc_dq_r)
                        T.gemm(dS_s, K_t, acc_dq_t)
                        T.warpgroup_fence_operand(acc_dq_r, num_regs=M * DH // WG)
                        if k + 1 < NB:
                            gather_right(KV, Indices, InvGrid, K_r, K_t, inv, kr_full, b_i, s_i,
                                         k + 1, t)
                    else:
                        T.gemm(dS_s, K_r, acc_dq_r)
                        T.barrier_arrive(kv_free[0])
                    own_slot(Indices, inv, slot, inv_l, u_l, b_i, s_i, k, t)
                    if overlap:
                        issue_chunk(Q_l, dO_l, 0, P_s, dS_s, acc_w1)
                        dkv_chunks_overlapped(w1_chunks, 0, P_s, dS_s, acc_w1, acc_w1b, w1_e, r4,
                                              slot, inv_l, u_l, dKV_acc, b_i, pds_free)
                    else:
                        dkv_chunks(Q_l, dO_l, P_s, dS_s, acc_w1, w1_e, r4, slot, inv_l, u_l,
                                   dKV_acc, b_i, 0, DH // CW, 0)
                        if wg0_chunks == 0:
                            dkv_chunks(Q_r, dO_r, P_s, dS_s, acc_w1, w1_e, r4, slot, inv_l,
                                       u_l, dKV_acc, b_i, 0, DH // CW, DH)
                            T.gemm(dS_s, Q_t, acc_w1, transpose_A=True, clear_accum=True)
                            # the last read of P / dS: warpgroup 0 may write block k + 1's
                            T.barrier_arrive(pds_free[0])
                            scatter_chunk(acc_w1, w1_e, r4, slot, inv_l, u_l, dKV_acc, b_i, D)
                        else:
                            dkv_chunks(Q_r, dO_r, P_s, dS_s, acc_w1, w1_e, r4, slot, inv_l,
                                       u_l, dKV_acc, b_i, 0, DH // CW - wg0_chunks + 1, DH)
                            T.barrier_arrive(pds_free[0])
                    if exact:
                        slot_max(u_l)
                        if wg0_chunks > 0:
                            T.barrier_wait(u_ready[0], k & 1)
                            for i in T.unroll(2):
                                u_l[i] = T.max(u_l[i], u_w0[k % 2, slot_row(t) + 8 * i])
                        add_slot_bound(u_l, slot, Bound, BoundExp, b_i, t)
                stamp(DSink, b_i, s_i, h0, t0, 9, tx == WG)
                T.copy(acc_dq_r, dQ[b_i, s_i, h0:h0 + M, DH:D])
                if w1_right:
                    T.copy(acc_dq_t, dQ[b_i, s_i, h0:h0 + M, D:])
                stamp(DSink, b_i, s_i, h0, t0, 10, tx == WG)

    if not fused:
        @T.prim_func
        def sparse_bwd_two_wg(
            Q: T.Tensor([B, S, H_pad, d_qk], dtype),
            KV: T.Tensor([B, S_kv, d_qk], dtype),
            dO: T.Tensor([B, S, H_pad, D], dtype),
            Indices: T.Tensor([B, S, L], "int32"),
            Lse2: T.Tensor([B, S, H_pad], acc_t),
            Delta: T.Tensor([B, S, H_pad], acc_t),
            Scale: T.Tensor([1], acc_t),
            InvGrid: T.Tensor([B, S_kv], acc_t),
            Counts: T.Tensor([B, S], "int32"),
            dQ: T.Tensor([B, S, H_pad, d_qk], dtype),
            dKV_acc: T.Tensor([B, S_kv, d_qk], acc_t),
            Bound: T.Tensor([B, S_kv], "int64"),
            BoundExp: T.Tensor([B, S_kv], "int32"),
        ):
            body(Q, KV, dO, Indices, Lse2, Delta, Scale, InvGrid, Counts, dQ, dKV_acc, Bound,
                 BoundExp, None, None, None, None)

        return sparse_bwd_two_wg

    @T.prim_func
    def sparse_bwd_two_wg(
        Q: T.Tensor([B, S, H_pad, d_qk], dtype),
        KV: T.Tensor([B, S_kv, d_qk], dtype),
        dO: T.Tensor([B, S, H_pad, D], dtype),
        Indices: T.Tensor([B, S, L], "int32"),
        Lse2: T.Tensor([B, S, H_pad], acc_t),  # written
        Delta: T.Tensor([B, S, H_pad], acc_t),  # written
        Scale: T.Tensor([1], acc_t),
        InvGrid: T.Tensor([B, S_kv], acc_t),
        Counts: T.Tensor([B, S], "int32"),
        dQ: T.Tensor([B, S, H_pad, d_qk], dtype),
        dKV_acc: T.Tensor([B, S_kv, d_qk], acc_t),
        Bound: T.Tensor([B, S_kv], "int64"),
        BoundExp: T.Tensor([B, S_kv], "int32"),
        O: T.Tensor([B, S, H, D], dtype),
        Lse: T.Tensor([B, S, H], acc_t),
        Sink: T.Tensor([H], acc_t),
        DSink: T.Tensor([B, S, H_pad], acc_t),
    ):
        body(Q, KV, dO, Indices, Lse2, Delta, Scale, InvGrid, Counts, dQ, dKV_acc, Bound,
             BoundExp, O, Lse, Sink, DSink)

    return sparse_bwd_two_wg
