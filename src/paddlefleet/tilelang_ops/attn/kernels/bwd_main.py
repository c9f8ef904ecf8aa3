"""The one-role main backward kernel: 16- and 32-head tiles, and every re-run without dQ.

One CTA per (query row ``s``, batch ``b``, head group ``g``) walks the row's top-k slots in key
blocks of ``BK``; per block it gathers the latent rows through clamped indices, recomputes
``P = exp2(s * sm_scale * log2(e) - lse2)`` (``lse2`` base-2, sink-inclusive, finite), then
``dP = dO V^T``, ``dS = P (dP - Delta) sm_scale``, ``dQ += dS K`` (registers, written once at
the end: deterministic) and ``dKV_blk = dS^T Q + P^T dO`` (the second term on the first ``Dv``
columns: every column when ``Dk = Dv``, DeepSeek-V4, where the value is the whole row and no
rope-tail buffer, GEMM or chunk is built) in column chunks, each staged in shared memory and scattered into the fp32
accumulator with 16-byte atomics.  The 64-head tiles' first pass is ``bwd_two_warpgroups``;
the registry (``kernels/__init__.py``) picks the kernel per head tile.

Static (one compile each): head tile ``M``, ``Dk``, ``Dv``, ``deterministic``, dQ on/off and
the :class:`~.schedule.BwdSchedule`.  Dynamic: ``B``, ``S``, ``S_kv``, ``L`` (a multiple of the
key block), ``H_pad``.  ``sm_scale`` is a runtime value in the one-element tensor ``Scale``.
Compiles with ``settings.PASS_CONFIGS``.
"""

from ... import settings
from ..tiling import INDEX_PAD, dkv_columns_permuted, dkv_source_column
from .bwd_preprocess import LOG2E
from .exact_bounds import add_key_bounds
from .schedule import BwdSchedule

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["RERUN_CTAS", "main"]

#: The deterministic backward's re-run (``with_dq=False``) runs on this many CTAs per (batch,
#: head group), each owning every ``RERUN_CTAS``-th row: one wave on the 132 SMs of an H100 SXM /
#: H200 (one CTA each: its shared memory).  Any value is correct; another GPU's SM count only
#: changes how the rare re-run's rows spread.
RERUN_CTAS = 132


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def main(heads_per_cta: int, d_qk: int, d_v: int, deterministic: bool, with_dq: bool,
         schedule: BwdSchedule):
    """Build the one-role main backward kernel for one head tile.

    Kernel arguments: ``Q [B, S, H_pad, Dk] bf16``, ``KV [B, S_kv, Dk] bf16``,
    ``dO [B, S, H_pad, Dv] bf16``, ``Indices [B, S, L] int32``, ``Lse2 [B, S, H_pad] fp32``
    (base-2, sink-inclusive, finite), ``Delta [B, S, H_pad] fp32``, ``Scale [1] fp32``
    (``sm_scale``), ``InvGrid [B, S_kv] fp32`` (deterministic: ``1 / g_j``, a power of two per
    key row), ``Counts [B, S] int32`` (``with_dq=False``: slots to process per row, a prefix of
    ``Indices``), outputs ``dQ [B, S, H_pad, Dk] bf16``, the accumulator
    ``dKV_acc [B, S_kv, Dk] fp32`` (zeroed by the caller), ``Bound [B, S_kv] int64`` and
    ``BoundExp [B, S_kv] int32`` (deterministic; zeroed by the caller).  Arguments a
    specialisation does not use are not read.

    ``deterministic``:

    * ``False``: fp32 ``atomic_addx4`` of each block's dKV rows (fast; the order in which CTAs
      arrive changes the last bits).
    * ``True``: each contribution ``c`` to key ``j`` is rounded to the key's power-of-two grid,
      ``k = round(c / g_j)`` (exact scaling, one rounding), and the integer-valued floats ``k``
      are added with the same ``atomic_addx4``.  While every partial sum of a column stays within
      ``2^24`` in magnitude, every fp32 addition is exact, so the sum does not depend on the
      order: bitwise repeatable at the atomic path's speed.  The kernel also sums the bound that
      proves it (``exact_bounds``); the host re-runs the keys that exceed it on a coarser grid,
      and those whose grid proves far too coarse on a finer one.

    ``with_dq=False`` (the deterministic backward's re-run) skips dQ's GEMMs and store and walks
    only the first ``Counts[b, s]`` slots of each row (the host moves the re-run keys' slots to
    the front; a row with ``Counts = 0`` does nothing), on a fixed grid of :data:`RERUN_CTAS`
    CTAs per (batch, head group): CTA ``x`` loads the ``Counts`` of its rows ``x, x +
    RERUN_CTAS, ...`` together into shared memory (256 rows at a time) and, only if one is
    positive, walks those with a count one after another (a call that re-runs no key costs one
    wave of CTAs that each read a few counts).  It reads ``Indices`` in whole key blocks, the
    first ``ceil(Counts / BK)`` of a row and none at ``Counts = 0``: ``exact_grid.rerun_slots``
    writes ``-1`` past ``Counts`` to the end of that 64-slot block (``BK`` divides 64) and
    nothing else.

    The schedule (:func:`~.schedule.bwd_schedule`): the next block's KV gather (``cp.async``,
    ``num_stages = 1``) is issued right after the last GEMM that reads the current one, and
    dQ's two GEMMs run right after dS, so that the gather overlaps the dKV GEMMs and the
    scatter.  ``dkv_transposed`` computes each dKV chunk transposed, ``[CW, BK] = Q_c^T dS +
    dO_c^T P`` (the tail ``[Dk - Dv, BK]``): the GEMM's M is then ``CW`` instead of ``BK = 32``
    (too few rows for wgmma), so it runs on wgmma from shared memory instead of ``mma_sync``,
    whose 8 warps each re-read dS^T / P^T through ldmatrix (the kernel is bound by shared
    memory); the staging writes it back untransposed.  (With 16 heads, ``BK = 64``, both forms
    are wgmma.)
    """
    assert heads_per_cta in (16, 32, 64), "the head tile is 16, 32 or 64 (tiling.head_plan)"
    assert d_qk >= d_v and d_v % 64 == 0 and (d_qk - d_v) % 16 == 0, "unsupported Dk/Dv"
    threads, num_stages = schedule.threads, schedule.num_stages
    block_k, dkv_chunk, dkv_transposed = (schedule.block_k, schedule.dkv_chunk,
                                          schedule.dkv_transposed)
    M = heads_per_cta
    D = d_v
    D_tail = d_qk - d_v
    # static (a Python bool, resolved while tracing): without a rope tail its buffers are None
    # and its copies, GEMMs and scatter are not built (nothing zero-sized reaches TIR)
    has_tail = d_qk > d_v
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
        # shared-memory read per element here: 10% off the deterministic backward)
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
        # one float4 of staged row j.  Deterministic: in grid units (c / g_j: exact, g_j a power
        # of two), the running max |c / g| taken before the rounding (so a grid too coarse
        # still shows the size), then the rounding, into registers: rounded in place, the
        # atomic's read of the staging row needed two CTA barriers per row (TileLang cannot
        # see that each thread reads only what it wrote).  A permuted accumulator
        # (dkv_columns_permuted: 64-head tiles) takes at d4 * 4 + t the staged column
        # dkv_source_column(d4 * 4 + t)
        if deterministic:
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
            Q_tail_shared = T.alloc_shared([M, D_tail], dtype) if has_tail else None
            dO_shared = T.alloc_shared([M, D], dtype)
            KV_shared = T.alloc_shared([BK, D], dtype)
            KV_tail_shared = T.alloc_shared([BK, D_tail], dtype) if has_tail else None
            P_shared = T.alloc_shared([M, BK], dtype)
            dS_shared = T.alloc_shared([M, BK], dtype)
            dkv_stage = T.alloc_shared([BK, CW + STAGE_PAD], acc_t)
            dkv_tail_stage = T.alloc_shared([BK, D_tail + STAGE_PAD], acc_t) if has_tail else None
            inv_grid = T.alloc_shared([BK], acc_t)
            u_stage = T.alloc_shared([BK], acc_t)
            valid = T.alloc_fragment([BK], "bool")

            acc_p = T.alloc_fragment([M, BK], acc_t)
            acc_dp = T.alloc_fragment([M, BK], acc_t)
            acc_dq = T.alloc_fragment([M, D], acc_t)
            acc_dq_tail = T.alloc_fragment([M, D_tail], acc_t) if has_tail else None
            acc_dkv = T.alloc_fragment(dkv_shape(CW), acc_t)
            acc_dkv_tail = T.alloc_fragment(dkv_shape(D_tail), acc_t) if has_tail else None
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
            # ~60 waves of CTAs that only read Counts (0.05 ms at fleet).  The CTA loads
            # the Counts of `threads` of its rows together (a thread per row) into shared memory
            # and walks them one after another only if one of them has a slot (walking them all
            # cost ~0.1 ms; reading each row's Counts from global memory during the walk
            # cost ~0.5 us a row).  (The chunk loop's `c` is not the dKV
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
                    # loads nothing (the empty re-run's tile loads cost 0.16 ms)
                    if with_dq or cnt_s[r] > 0:
                        T.copy(Q[b_i, s_i, h0:h0 + M, :D], Q_shared)
                        if has_tail:
                            T.copy(Q[b_i, s_i, h0:h0 + M, D:], Q_tail_shared)
                        T.copy(dO[b_i, s_i, h0:h0 + M, :], dO_shared)
                    if with_dq:
                        T.clear(acc_dq)
                        if has_tail:
                            T.clear(acc_dq_tail)
                    num_blocks = L // BK if with_dq else T.ceildiv(cnt_s[r], BK)

                    for k_i in T.Pipelined(num_blocks, num_stages=num_stages):
                        for j in T.Parallel(BK):
                            valid[j] = Indices[b_i, s_i, k_i * BK + j] >= 0
                        # clamped gather: a -1 slot reads row 0; its score is masked to -inf (P = 0)
                        for j, d in T.Parallel(BK, D):
                            KV_shared[j, d] = KV[b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0), d]
                        if has_tail:
                            for j, d in T.Parallel(BK, D_tail):
                                KV_tail_shared[j, d] = KV[
                                    b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0), D + d]
                        if deterministic:
                            for j in T.Parallel(BK):
                                inv_grid[j] = InvGrid[
                                    b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0)]
                        for h, j in T.Parallel(M, BK):
                            acc_p[h, j] = T.if_then_else(valid[j], 0, -T.infinity(acc_t))
                        T.gemm(Q_shared, KV_shared, acc_p, transpose_B=True,
                               policy=T.GemmWarpPolicy.FullCol)
                        if has_tail:
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
                            # (with dQ last it was waited for at the top of the next block)
                            T.gemm(dS_shared, KV_shared, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                            if has_tail:
                                T.gemm(dS_shared, KV_tail_shared, acc_dq_tail,
                                       policy=T.GemmWarpPolicy.FullCol)

                        # dKV in column chunks: a [BK, CW] accumulator instead of [BK, Dk] keeps the
                        # registers under the cap (the whole-row version spilled when deterministic)
                        if deterministic:
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

                        if has_tail:  # the rope tail's dKV: dS^T Q_tail only
                            if dkv_transposed:
                                # M = 64 splits N over the warpgroups: BK / 2 columns each, so
                                # TileLang narrows dS_shared's swizzle (64 -> 32 bytes for
                                # BK = 32) for every GEMM
                                T.gemm(Q_tail_shared, dS_shared, acc_dkv_tail, transpose_A=True,
                                       policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                            else:
                                T.gemm(dS_shared, Q_tail_shared, acc_dkv_tail, transpose_A=True,
                                       policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                            stage_rows(dkv_tail_stage, acc_dkv_tail, D_tail)
                            # same (slot, 4-column) to thread map as the chunks' loop, so that
                            # u_cols keeps one layout; the tail's 16 column groups use the
                            # first 16
                            for j, d4 in T.Parallel(BK, CW // 4):
                                if d4 < D_tail // 4:
                                    scatter4(u_cols, r4, dkv_tail_stage, inv_grid, dKV_acc, b_i,
                                             Indices[b_i, s_i, k_i * BK + j], D, j, d4)
                        if deterministic:
                            add_key_bounds(u_cols, u_frag, u_stage, Bound, BoundExp, Indices,
                                           b_i, s_i, k_i)

                    if with_dq:
                        T.copy(acc_dq, dQ[b_i, s_i, h0:h0 + M, :D])
                        if has_tail:
                            T.copy(acc_dq_tail, dQ[b_i, s_i, h0:h0 + M, D:])
                if not with_dq:
                    T.sync_threads()  # cnt_s is rewritten by the next chunk

    return sparse_bwd_main


