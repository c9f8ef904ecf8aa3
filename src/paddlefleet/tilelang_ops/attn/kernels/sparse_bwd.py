"""TileLang backward kernels: sparse MQA-latent attention with an attention sink.

Run in this order by ``attn/interface.py``:

``preprocess``   ``Delta[n] = sum_d O[n, d] * dO[n, d]`` (fp32) over the flattened rows
                 ``n = (b, s, h)`` of the real heads.
``main``         one CTA per (query row ``s``, batch ``b``, head group ``g``) walks the row's top-k
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

With 64-head tiles the first pass (with dQ) is :func:`_warp_specialized`: one warpgroup computes
P and dS and hands them to the other; each then adds its half of dQ and computes, stages and
scatters its half of the block's dKV, so that one warpgroup's scatter runs under the other's
GEMMs.

Static (one compile each): head tile ``M``, ``Dk``, ``Dv``, key block, mode, dQ on/off.  Dynamic:
``B``, ``S``, ``S_kv``, ``L`` (a multiple of the key block), ``H_pad``.  ``sm_scale`` is a runtime
value in the one-element tensor ``Scale``.  All kernels compile with ``settings.PASS_CONFIGS``.
"""

from ... import settings
from .async_copy import gather_key_block, load_head_tile

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["preprocess", "main"]

LOG2E = 1.4426950408889634
# exact mode: u above 2^24 already fails the bound; clamped at 2^40, n <= 2^23 of them sum
# exactly in int64.  BoundExp (a max, order-free too) covers the clamped ones: u <= 2^BoundExp.
U_CLAMP = float(2**40)
EXP_CLAMP = float(2**100)
U_FLOOR = float(2**-120)


@T.macro
def add_bounds(u_stage, Bound, BoundExp, Indices, b_i, s_i, k):
    """The atomics of :func:`add_key_bounds`, from each slot's ``u`` in ``u_stage [BK]``."""
    BK = u_stage.shape[0]
    for j in T.Parallel(BK):
        idx = Indices[b_i, s_i, k * BK + j]
        if idx >= 0:
            T.atomic_add(Bound[b_i, idx], T.Cast("int64", T.ceil(T.min(u_stage[j], U_CLAMP))))
            T.atomic_max(BoundExp[b_i, idx], T.Cast("int32", T.ceil(
                T.log2(T.max(T.min(u_stage[j], EXP_CLAMP), U_FLOOR)))) + 1)


@T.macro
def add_key_bounds(u_cols, u_frag, u_stage, Bound, BoundExp, Indices, b_i, s_i, k):
    """The exact mode's proof for key block ``k``: ``u_cols [BK, CW/4]`` holds each slot's
    running max ``|c / g|`` per 4-column group; per slot with a key, one int64 add of
    ``ceil(u) >= max |k|`` (an exact sum) and the exponent of the largest ``u`` (``>= 2^-120``,
    which bounds ``u`` when a clamp makes the sum short and sizes a grid that was too coarse)."""
    T.reduce_max(u_cols, u_frag, dim=1)
    T.copy(u_frag, u_stage)
    add_bounds(u_stage, Bound, BoundExp, Indices, b_i, s_i, k)


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def preprocess(d_v: int, block_rows: int = 32, block_d: int = 128, threads: int = 128):
    """``Delta [N] fp32 = rowsum(O [N, Dv] * dO [N, Dv])`` for a dynamic ``N``; rows past ``N``
    in the last CTA are neither read nor written."""
    assert d_v % block_d == 0, "Dv must be a multiple of the column block"
    N = T.dynamic("N")
    R = block_rows

    @T.prim_func
    def sparse_bwd_preprocess(
        O: T.Tensor([N, d_v], "bfloat16"),
        dO: T.Tensor([N, d_v], "bfloat16"),
        Delta: T.Tensor([N], "float32"),
    ):
        with T.Kernel(T.ceildiv(N, R), threads=threads) as r_blk:
            acc = T.alloc_fragment([R, block_d], "float32")
            part = T.alloc_fragment([R], "float32")
            total = T.alloc_fragment([R], "float32")
            T.fill(total, 0)
            for c in T.serial(d_v // block_d):
                for r, d in T.Parallel(R, block_d):
                    row = r_blk * R + r
                    acc[r, d] = T.if_then_else(
                        row < N,
                        T.Cast("float32", O[row, c * block_d + d])
                        * T.Cast("float32", dO[row, c * block_d + d]),
                        0,
                    )
                T.reduce_sum(acc, part, dim=1)
                for r in T.Parallel(R):
                    total[r] = total[r] + part[r]
            for r in T.Parallel(R):
                if r_blk * R + r < N:
                    Delta[r_blk * R + r] = total[r]

    return sparse_bwd_preprocess


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def main(heads_per_cta: int, d_qk: int, d_v: int, mode: str, with_dq: bool = True,
         block_k: int = 32, threads: int = 256, num_stages: int = 1, dkv_chunk: int = 128,
         dkv_transposed: bool | None = None, warp_specialized: bool | None = None):
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
    a row with ``Counts = 0`` does nothing).

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
    as :func:`_warp_specialized` instead (two warpgroups with different roles; runs 29-30:
    atomic `ref` 12.44 -> 9.74 ms, deterministic 15.79 -> 12.47 in trials); the other knobs then
    do not apply.
    """
    assert mode in ("atomic", "exact"), "mode is 'atomic' or 'exact'"
    assert heads_per_cta in (16, 32, 64), "the head tile is 16, 32 or 64 (tiling.head_plan)"
    assert d_qk > d_v and d_v % 64 == 0 and (d_qk - d_v) % 16 == 0, "unsupported Dk/Dv"
    if warp_specialized is None:  # measured faster for 64-head tiles (run 29)
        warp_specialized = heads_per_cta == 64
    if warp_specialized and with_dq:
        return _warp_specialized(heads_per_cta, d_qk, d_v, mode, block_k)
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

    @T.macro
    def scatter4(u_cols, r4, stage, inv_grid, dkv_acc, b_i, idx, col, j, d4):
        # one float4 of staged row j.  Exact mode: in grid units (c / g_j: exact, g_j a power
        # of two), the running max |c / g| taken before the rounding (so a grid too coarse
        # still shows the size), then the rounding, into registers: rounded in place, the
        # atomic's read of the staging row needed two CTA barriers per row (TileLang cannot
        # see that each thread reads only what it wrote)
        if exact:
            for t in T.serial(4):
                r4[t] = stage[j, d4 * 4 + t] * inv_grid[j]
            u_cols[j, d4] = T.max(u_cols[j, d4], T.max(T.max(T.abs(r4[0]), T.abs(r4[1])),
                                                       T.max(T.abs(r4[2]), T.abs(r4[3]))))
            for t in T.serial(4):
                r4[t] = T.round(r4[t])
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
        with T.Kernel(S, B, H_pad // M, threads=threads) as (s_i, b_i, g_i):
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

            h0 = g_i * M
            sc[0] = Scale[0] * LOG2E  # raw q.k -> base-2 logit
            sc[1] = Scale[0]
            T.copy(Q[b_i, s_i, h0:h0 + M, :D], Q_shared)
            T.copy(Q[b_i, s_i, h0:h0 + M, D:], Q_tail_shared)
            T.copy(dO[b_i, s_i, h0:h0 + M, :], dO_shared)
            if with_dq:
                T.clear(acc_dq)
                T.clear(acc_dq_tail)
            num_blocks = L // BK if with_dq else T.ceildiv(Counts[b_i, s_i], BK)

            for k_i in T.Pipelined(num_blocks, num_stages=num_stages):
                for j in T.Parallel(BK):
                    valid[j] = Indices[b_i, s_i, k_i * BK + j] >= 0
                # clamped gather: a -1 slot reads row 0; its score is masked to -inf (P = 0)
                for j, d in T.Parallel(BK, D):
                    KV_shared[j, d] = KV[b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0), d]
                for j, d in T.Parallel(BK, D_tail):
                    KV_tail_shared[j, d] = KV[b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0),
                                              D + d]
                if exact:
                    for j in T.Parallel(BK):
                        inv_grid[j] = InvGrid[b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0)]
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
                    acc_dp[h, j] = acc_p[h, j] * (acc_dp[h, j] - Delta[b_i, s_i, h0 + h]) * sc[1]
                T.copy(acc_dp, dS_shared)
                if with_dq:
                    # dQ before dKV: its GEMMs are KV_shared's last readers, so the pipeline
                    # issues the next block's gather here and it lands under the dKV chunks
                    # (with dQ last it was waited for at the top of the next block; run 28)
                    T.gemm(dS_shared, KV_shared, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                    T.gemm(dS_shared, KV_tail_shared, acc_dq_tail, policy=T.GemmWarpPolicy.FullCol)

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
                    # M = 64 splits N over the warpgroups: BK / 2 columns each, so TileLang
                    # narrows dS_shared's swizzle (64 -> 32 bytes for BK = 32) for every GEMM
                    T.gemm(Q_tail_shared, dS_shared, acc_dkv_tail, transpose_A=True,
                           policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                else:
                    T.gemm(dS_shared, Q_tail_shared, acc_dkv_tail, transpose_A=True,
                           policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                stage_rows(dkv_tail_stage, acc_dkv_tail, D_tail)
                # same (slot, 4-column) to thread map as the chunks' loop, so that u_cols keeps
                # one layout; the tail's 16 column groups use the first 16 of them
                for j, d4 in T.Parallel(BK, CW // 4):
                    if d4 < D_tail // 4:
                        scatter4(u_cols, r4, dkv_tail_stage, inv_grid, dKV_acc, b_i,
                                 Indices[b_i, s_i, k_i * BK + j], D, j, d4)
                if exact:
                    add_key_bounds(u_cols, u_frag, u_stage, Bound, BoundExp, Indices, b_i, s_i,
                                   k_i)

            if with_dq:
                T.copy(acc_dq, dQ[b_i, s_i, h0:h0 + M, :D])
                T.copy(acc_dq_tail, dQ[b_i, s_i, h0:h0 + M, D:])

    return sparse_bwd_main




def _warp_specialized(heads_per_cta: int, d_qk: int, d_v: int, mode: str, block_k: int = 32,
                      dkv_chunk: int = 64):
    """The 64-head main backward as two warpgroups (256 threads) with different roles, same
    arguments and results as :func:`main` with ``with_dq=True`` (the exact re-run, which has no
    dQ, keeps the one-role kernel).

    * warpgroup 0: waits for key block ``i``, computes ``S``, ``P``, ``dP``, ``dS`` on its own
      (``M = 64`` heads, ``N = BK`` keys: the query and dO tiles are read from shared memory once
      per block, where two warpgroups splitting ``N`` read them twice), hands ``P`` / ``dS``
      over in buffer ``i % 2``, adds dQ's left half (256 latent columns) and rope tail, then
      computes, stages and scatters the dKV chunks of the left half;
    * warpgroup 1: dQ's right half; then, once both are done with the keys, the gather of block
      ``i + 1`` (16-byte ``cp.async``, and the keys' grids in the exact mode); then block ``i``'s
      dKV chunks of the right half and the rope tail (a fifth chunk), staged and scattered.

    Every dKV chunk is 64 columns, ``[CW, BK] = Q_c^T dS + dO_c^T P`` on wgmma (the rope tail
    chunk: ``Q_t^T dS``; dO has the latent columns only), staged through
    the warpgroup's own fp32 rows and scattered with vector atomics (the exact mode's scaling,
    rounding and bound as in :func:`main`; warpgroup 0 hands its slots' maxima to warpgroup 1,
    which adds each key's bound once).  Each warpgroup's scatter overlaps the other one's GEMMs.

    mbarriers: ``kv_full`` (the gather landed), ``kv_free`` (both done with the keys),
    ``pds_full[b]`` / ``pds_free[b]`` (the P/dS buffer ``b`` handed over and back, and with it
    ``u_left[b]``), ``u_ready[b]`` (exact mode: warpgroup 0's slot maxima for the block in
    buffer ``b``).  Warpgroup 0 walks the
    blocks in one loop with the buffer chosen at run time (two unrolled copies of its body made
    ptxas spill ~900 bytes per thread).  A fragment's layout binds it to the threads of the
    warpgroup that first uses it, so each warpgroup has its own dKV accumulator: one shared
    fragment made TileLang drop the other warpgroup's staging loops (round 2, fifth session,
    trial 4; docs/performance.md).

    Balance (session 5, docs/performance.md): with warpgroup 1 doing all nine chunks, warpgroup 0
    waited for the gather 61% of its time (Nsight Compute); the left half on warpgroup 0 took
    atomic `ref` 10.90 -> 9.74 ms, deterministic 14.60 -> 12.47; three or five chunks on warpgroup
    0 were slower.
    """
    assert heads_per_cta == 64 and block_k == 32 and d_v % 256 == 0
    exact = mode == "exact"
    M = heads_per_cta
    D = d_v
    DH = d_v // 2
    D_tail = d_qk - d_v
    BK = block_k
    CW = dkv_chunk
    # the rope tail is one more chunk of warpgroup 1, in the same accumulator and staging rows
    assert DH % CW == 0 and D_tail == CW
    STAGE_PAD = 4
    WG = 128
    dtype = "bfloat16"
    acc_t = "float32"
    Q_CHUNKS = M * d_qk // 8
    DO_CHUNKS = M * D // 8
    assert Q_CHUNKS % (2 * WG) == 0 and DO_CHUNKS % (2 * WG) == 0

    B = T.dynamic("B")
    S = T.dynamic("S")
    S_kv = T.dynamic("S_kv")
    L = T.dynamic("L")
    H_pad = T.dynamic("H_pad")

    @T.macro
    def gather(KV, Indices, InvGrid, K_l, K_r, K_t, inv, kv_full, b_i, s_i, k, t):
        # block k of the row's slots, and in the exact mode the keys' grids (into inv[k % 2])
        gather_key_block(KV, Indices, K_l, K_r, K_t, b_i, s_i, k, t)
        if exact:
            if t < BK:
                T.ptx_cp_async(T.access_ptr(inv[k % 2, t], "w", 1),
                               T.access_ptr(InvGrid[b_i, T.max(Indices[b_i, s_i, k * BK + t], 0)],
                                            "r", 1), 1)
        T.cp_async_barrier_noinc(kv_full[0])

    @T.macro
    def scores(Q_l, Q_r, Q_t, dO_l, dO_r, K_l, K_r, K_t, P_all, dS_all, acc_p, acc_dp, acc_dq_l,
               acc_dq_t, kv_full, kv_free, pds_full, pds_free, Indices, lse_f, delta_f, sc, b_i,
               s_i, k):
        # one key block per iteration, the P/dS buffer and its barriers chosen at run time (two
        # unrolled copies of this body, one per buffer, made ptxas spill ~900 bytes)
        bsel = k % 2
        T.barrier_wait(kv_full[0], k & 1)
        T.fence_proxy_async()  # cp.async wrote through the generic proxy, wgmma reads async
        for h, j in T.Parallel(M, BK):
            acc_p[h, j] = T.if_then_else(Indices[b_i, s_i, k * BK + j] >= 0, 0,
                                         -T.infinity(acc_t))
        T.wgmma_gemm(Q_l, K_l, acc_p, transpose_B=True)
        T.wgmma_gemm(Q_r, K_r, acc_p, transpose_B=True)
        T.gemm(Q_t, K_t, acc_p, transpose_B=True)
        for h, j in T.Parallel(M, BK):
            acc_p[h, j] = T.exp2(acc_p[h, j] * sc[0] - lse_f[h])
        T.wgmma_gemm(dO_l, K_l, acc_dp, transpose_B=True, clear_accum=True)
        T.gemm(dO_r, K_r, acc_dp, transpose_B=True)
        for h, j in T.Parallel(M, BK):
            acc_dp[h, j] = acc_p[h, j] * (acc_dp[h, j] - delta_f[h]) * sc[1]
        # warpgroup 1 must be done with this buffer's previous block (two blocks ago)
        T.barrier_wait(pds_free[bsel], ((k // 2) & 1) ^ 1)
        T.copy(acc_p, P_all[bsel:bsel + 1, :, :])
        T.copy(acc_dp, dS_all[bsel:bsel + 1, :, :])
        T.fence_proxy_async()  # read by wgmma (both warpgroups)
        T.barrier_arrive(pds_full[bsel])
        # dQ's left half and rope tail, one wait for both
        T.wgmma_gemm(dS_all[bsel:bsel + 1, :, :], K_l, acc_dq_l)
        T.gemm(dS_all[bsel:bsel + 1, :, :], K_t, acc_dq_t)
        T.warpgroup_fence_operand(acc_dq_l, num_regs=M * DH // WG)
        T.barrier_arrive(kv_free[0])

    @T.macro
    def stage_scatter(acc, stage, inv, u_cols, r4, dKV_acc, Indices, b_i, s_i, k, col, width):
        # one chunk [width, BK] of block k: into the staging rows, then float4 atomics per slot
        # row (exact mode: scaled by the key's inverse grid inv[k % 2], max taken, rounded)
        for d, j in T.Parallel(width, BK):
            stage[j, d] = acc[d, j]
        for j, d4 in T.Parallel(BK, CW // 4):
            if d4 < width // 4:
                if exact:
                    for t in T.serial(4):
                        r4[t] = stage[j, d4 * 4 + t] * inv[k % 2, j]
                    u_cols[j, d4] = T.max(u_cols[j, d4], T.max(
                        T.max(T.abs(r4[0]), T.abs(r4[1])), T.max(T.abs(r4[2]), T.abs(r4[3]))))
                    for t in T.serial(4):
                        r4[t] = T.round(r4[t])
                    if Indices[b_i, s_i, k * BK + j] >= 0:
                        T.atomic_addx4(dKV_acc[b_i, Indices[b_i, s_i, k * BK + j],
                                               col + d4 * 4], r4[0])
                elif Indices[b_i, s_i, k * BK + j] >= 0:
                    T.atomic_addx4(dKV_acc[b_i, Indices[b_i, s_i, k * BK + j], col + d4 * 4],
                                   stage[j, d4 * 4])

    @T.macro
    def dkv_half(Q_h, dO_h, P_all, dS_all, bsel, inv, acc, stage, u_cols, r4, dKV_acc, Indices,
                 b_i, s_i, k, col0):
        # the DH // CW chunks of one half of the latent columns (Q_h / dO_h: that half's tiles)
        for c in T.serial(DH // CW):
            T.wgmma_gemm(Q_h[:, c * CW:(c + 1) * CW], dS_all[bsel:bsel + 1, :, :], acc,
                         transpose_A=True, clear_accum=True)
            T.gemm(dO_h[:, c * CW:(c + 1) * CW], P_all[bsel:bsel + 1, :, :], acc,
                   transpose_A=True)
            stage_scatter(acc, stage, inv, u_cols, r4, dKV_acc, Indices, b_i, s_i, k,
                          col0 + c * CW, CW)

    @T.macro
    def dkv_left(Q_l, dO_l, P_all, dS_all, inv, acc, stage, u_cols, u_frag, u_left, u_ready, r4,
                 dKV_acc, Indices, b_i, s_i, k):
        # warpgroup 0's share of block k's dKV; in the exact mode its slots' maxima go to
        # warpgroup 1 (u_left[k % 2], then u_ready[k % 2]), which adds each key's bound once
        bsel = k % 2
        if exact:
            T.fill(u_cols, 0)
        dkv_half(Q_l, dO_l, P_all, dS_all, bsel, inv, acc, stage, u_cols, r4, dKV_acc, Indices,
                 b_i, s_i, k, 0)
        if exact:
            T.reduce_max(u_cols, u_frag, dim=1)
            for j in T.Parallel(BK):
                u_left[bsel, j] = u_frag[j]
            T.barrier_arrive(u_ready[bsel])

    @T.macro
    def dkv_right(Q_r, Q_t, dO_r, K_l, K_r, K_t, P_all, dS_all, bsel, inv, acc_dq_r, acc_dkv,
                  stage, u_cols, u_frag, u_stage, u_left, u_ready, r4, kv_full, kv_free,
                  pds_full, pds_free, KV, Indices, InvGrid, dKV_acc, Bound, BoundExp, b_i, s_i,
                  k, buf_parity, NB, t):
        T.barrier_wait(pds_full[bsel], buf_parity)
        # the keys (cp.async), as in scores; P/dS were fenced by their writer
        T.fence_proxy_async()
        T.gemm(dS_all[bsel:bsel + 1, :, :], K_r, acc_dq_r)
        T.barrier_arrive(kv_free[0])
        # both warpgroups done with block k's keys: gather block k + 1 under this block's dKV
        T.barrier_wait(kv_free[0], bsel)  # bsel = k & 1: kv_free completes once per block
        if k + 1 < NB:
            gather(KV, Indices, InvGrid, K_l, K_r, K_t, inv, kv_full, b_i, s_i, k + 1, t)
        if exact:
            T.fill(u_cols, 0)
        dkv_half(Q_r, dO_r, P_all, dS_all, bsel, inv, acc_dkv, stage, u_cols, r4, dKV_acc,
                 Indices, b_i, s_i, k, DH)
        T.gemm(Q_t, dS_all[bsel:bsel + 1, :, :], acc_dkv, transpose_A=True, clear_accum=True)
        stage_scatter(acc_dkv, stage, inv, u_cols, r4, dKV_acc, Indices, b_i, s_i, k, D,
                      D_tail)
        if exact:
            # each slot's max over both halves; u_left[bsel] is free again with pds_free
            T.reduce_max(u_cols, u_frag, dim=1)
            T.barrier_wait(u_ready[bsel], buf_parity)
            for j in T.Parallel(BK):
                u_stage[j] = T.max(u_frag[j], u_left[bsel, j])
            add_bounds(u_stage, Bound, BoundExp, Indices, b_i, s_i, k)
        T.barrier_arrive(pds_free[bsel])

    @T.prim_func
    def sparse_bwd_ws(
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
        with T.Kernel(S, B, H_pad // M, threads=2 * WG) as (s_i, b_i, g_i):
            Q_l = T.alloc_shared([M, DH], dtype)
            Q_r = T.alloc_shared([M, DH], dtype)
            Q_t = T.alloc_shared([M, D_tail], dtype)
            dO_l = T.alloc_shared([M, DH], dtype)
            dO_r = T.alloc_shared([M, DH], dtype)
            K_l = T.alloc_shared([BK, DH], dtype)
            K_r = T.alloc_shared([BK, DH], dtype)
            K_t = T.alloc_shared([BK, D_tail], dtype)
            P_all = T.alloc_shared([2, M, BK], dtype)
            dS_all = T.alloc_shared([2, M, BK], dtype)
            inv = T.alloc_shared([2, BK], acc_t)  # block k's key grids in row k % 2
            stage_l = T.alloc_shared([BK, CW + STAGE_PAD], acc_t)
            stage_r = T.alloc_shared([BK, CW + STAGE_PAD], acc_t)
            u_left = T.alloc_shared([2, BK], acc_t)
            u_stage = T.alloc_shared([BK], acc_t)

            q_ready = T.alloc_barrier(arrive_count=2 * WG)
            kv_full = T.alloc_barrier(arrive_count=WG)
            kv_free = T.alloc_barrier(arrive_count=2 * WG)
            pds_full = T.alloc_barrier(arrive_count=[WG, WG])
            pds_free = T.alloc_barrier(arrive_count=[WG, WG])
            u_ready = T.alloc_barrier(arrive_count=[WG, WG])

            acc_p = T.alloc_fragment([M, BK], acc_t)
            acc_dp = T.alloc_fragment([M, BK], acc_t)
            acc_dq_l = T.alloc_fragment([M, DH], acc_t)
            acc_dq_t = T.alloc_fragment([M, D_tail], acc_t)
            acc_dq_r = T.alloc_fragment([M, DH], acc_t)
            # one dKV accumulator (and exact-mode maxima) per warpgroup: see the docstring
            acc_dkv_l = T.alloc_fragment([CW, BK], acc_t)
            acc_dkv_r = T.alloc_fragment([CW, BK], acc_t)
            u_cols_l = T.alloc_fragment([BK, CW // 4], acc_t)
            u_cols_r = T.alloc_fragment([BK, CW // 4], acc_t)
            u_frag_l = T.alloc_fragment([BK], acc_t)
            u_frag_r = T.alloc_fragment([BK], acc_t)
            lse_f = T.alloc_fragment([M], acc_t)
            delta_f = T.alloc_fragment([M], acc_t)
            sc = T.alloc_local([2], acc_t)
            r4 = T.alloc_local([4], acc_t)

            tx = T.get_thread_binding()
            h0 = g_i * M
            NB = L // BK
            load_head_tile(Q, b_i, s_i, h0, Q_l, Q_r, Q_t, tx, 2 * WG)
            load_head_tile(dO, b_i, s_i, h0, dO_l, dO_r, None, tx, 2 * WG)
            T.cp_async_barrier_noinc(q_ready[0])
            T.barrier_wait(q_ready[0], 0)
            T.fence_proxy_async()

            if tx < WG:
                sc[0] = Scale[0] * LOG2E
                sc[1] = Scale[0]
                # the row's LSE and Delta in registers once (per-block loads kept ~64 registers
                # of hoisted addresses live: ptxas spilled)
                for h in T.Parallel(M):
                    lse_f[h] = Lse2[b_i, s_i, h0 + h]
                    delta_f[h] = Delta[b_i, s_i, h0 + h]
                T.fill(acc_dq_l, 0)
                T.fill(acc_dq_t, 0)
                for k in T.serial(NB):
                    scores(Q_l, Q_r, Q_t, dO_l, dO_r, K_l, K_r, K_t, P_all, dS_all, acc_p, acc_dp,
                           acc_dq_l, acc_dq_t, kv_full, kv_free, pds_full, pds_free, Indices,
                           lse_f, delta_f, sc, b_i, s_i, k)
                    dkv_left(Q_l, dO_l, P_all, dS_all, inv, acc_dkv_l, stage_l, u_cols_l,
                             u_frag_l, u_left, u_ready, r4, dKV_acc, Indices, b_i, s_i, k)
                T.copy(acc_dq_l, dQ[b_i, s_i, h0:h0 + M, :DH])
                T.copy(acc_dq_t, dQ[b_i, s_i, h0:h0 + M, D:])
            else:
                T.fill(acc_dq_r, 0)
                if NB > 0:
                    gather(KV, Indices, InvGrid, K_l, K_r, K_t, inv, kv_full, b_i, s_i, 0,
                           tx - WG)
                for p in T.serial(T.ceildiv(NB, 2)):
                    dkv_right(Q_r, Q_t, dO_r, K_l, K_r, K_t, P_all, dS_all, 0, inv, acc_dq_r,
                              acc_dkv_r, stage_r, u_cols_r, u_frag_r, u_stage, u_left, u_ready,
                              r4, kv_full, kv_free, pds_full, pds_free, KV, Indices, InvGrid,
                              dKV_acc, Bound, BoundExp, b_i, s_i, 2 * p, p & 1, NB, tx - WG)
                    if 2 * p + 1 < NB:
                        dkv_right(Q_r, Q_t, dO_r, K_l, K_r, K_t, P_all, dS_all, 1, inv,
                                  acc_dq_r, acc_dkv_r, stage_r, u_cols_r, u_frag_r, u_stage,
                                  u_left, u_ready, r4, kv_full, kv_free, pds_full, pds_free, KV,
                                  Indices, InvGrid, dKV_acc, Bound, BoundExp, b_i, s_i,
                                  2 * p + 1, p & 1, NB, tx - WG)
                T.copy(acc_dq_r, dQ[b_i, s_i, h0:h0 + M, DH:D])

    return sparse_bwd_ws
