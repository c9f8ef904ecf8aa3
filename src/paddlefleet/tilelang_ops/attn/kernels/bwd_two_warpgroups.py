"""The 64-head main backward's first pass (with dQ): two warpgroups, 64-key blocks.

The registry (``kernels/__init__.py``) builds this kernel for 64-head tiles with dQ; their
re-run without dQ, and the 16- and 32-head tiles, use the one-role kernel (``bwd_main``).
Compiles with ``settings.PASS_CONFIGS``.
"""

from ... import settings
from .async_copy import tma_head_tile
from .bwd_preprocess import LOG2E, sink_lse2
from .exact_bounds import add_slot_bound, slot_max, to_grid
from .ptx import RED_V4_SRC
from .row_blocks import alloc_scratch, last_row_first, row_key_blocks
from .schedule import TwoWarpgroupSchedule

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["main"]


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def main(heads_per_cta: int, d_qk: int, d_v: int, deterministic: bool, with_dq: bool,
         schedule: TwoWarpgroupSchedule, fused: bool = False, natural: bool = True):
    """The 64-head main backward on 64-key blocks, two warpgroups (256 threads), dKV added
    straight from the accumulator registers; the arguments, results and ``deterministic`` of
    ``bwd_main.main`` (``with_dq`` must be true), and with ``fused`` the preprocess's too.

    * warpgroup 0 (scores): waits for key block ``i``; ``S = Q K^T`` and ``dP = dO V^T`` as one
      batch of GEMMs, then ``P`` and ``dS``, handed over through shared memory once warpgroup 1
      is done with block ``i - 1``'s; ``dQ[:, :Dv/2] += dS K_l`` and the rope tail's
      ``dS K_t``; then it gathers block ``i + 1`` (the left half of the latent columns at once:
      only it reads them; the right half and the rope tail once warpgroup 1 has added its part
      of dQ, ``kv_free``) and, under the gather's latency, adds block ``i``'s last
      ``wg0_chunks`` dKV chunks: the rope tail (``dS^T Q_t``) where there is one and the
      right half's last ``wg0_chunks - 1``; at ``Dk = Dv`` (DeepSeek-V4: no tail, the value
      is the whole row) the right half's last ``wg0_chunks``.
    * warpgroup 1 (dKV): ``dQ[:, Dv/2:] += dS K_r``; then the block's other dKV chunks, each
      ``[BK, 64] = dS^T Q_c + P^T dO_c``.  With ``overlap`` it holds two accumulators and
      issues chunk ``c + 1``'s GEMMs before it adds chunk ``c``, so that the tensor cores run
      while the atomics drain.

    The schedule's fields by mode: :func:`~.schedule.two_warpgroup_schedule`.  Each chunk is
    added into ``dKV_acc`` from the wgmma accumulator, with 16-byte atomics at the permuted
    columns of ``tiling.dkv_column`` (``scatter_chunk`` inside), no staging in shared memory:
    each lane's own float4s (``row_lanes = 4``) or, with 8, after one exchange of half of them
    with lane ``t ^ 4``; the deterministic mode scales, takes each slot's maximum and rounds in
    registers (``exact_bounds``), and warpgroup 0 hands its chunks' maxima to warpgroup 1
    (``u_w0``, ``u_ready``), which adds each key's bound once.

    Why two warpgroups: with 32-key blocks the dKV GEMM has ``M = 32`` (too few rows for a
    row-major wgmma), so it ran transposed through fp32 staging rows in shared memory, and
    every 32-key GEMM re-read its 64-row operand for half the work.  Shared memory holds one
    64-key block (Q, dO, K: 208 KB; P and dS: 16 KB), so block ``i + 1``'s gather waits until
    block ``i``'s K is read.  The query and dO tiles come by TMA (``async_copy.tma_head_tile``:
    issuing them as 16-byte ``cp.async`` took the CTA microseconds); each CTA walks its row only
    up to the block that holds its last slot with a key, rows last-first (``row_blocks``).

    mbarriers, each completing once per block: ``kl_full`` / ``kr_full`` (the gather's two parts
    landed), ``kv_free`` (warpgroup 1 done with K_r), ``pds_full`` (P, dS written), ``pds_free``
    (warpgroup 1 done reading them; waited on with parity ``(i & 1) ^ 1``, i.e. not at all
    before block 0), ``u_ready`` (deterministic: warpgroup 0's slot maxima written); the
    others are waited on with parity ``i & 1``.  No waiter may fall two phases behind:
    warpgroup 0 waits for ``kv_free`` in every block, the last included, which holds it back
    until warpgroup 1 has read the previous block's ``u_w0`` (a conditional wait let
    ``u_ready`` run ahead in the last block).

    ``fused`` (the preprocess in the prologue): ``Lse2`` and ``Delta`` become outputs, and the
    kernel takes four more arguments after ``BoundExp``: ``O [B, S, H, Dv] bf16`` (the forward
    output, the real heads, ``H <= H_pad``), ``Lse [B, S, H] fp32`` (natural and
    sink-exclusive when ``natural``, else base-2 and sink-inclusive), ``Sink [H] fp32``
    (``-inf``: no sink) and the output ``DSink [B, S, H_pad] fp32`` (each row's ``d_sink``
    term).  The CTA's ``dO`` tile is in shared memory anyway, so ``Delta``, ``Lse2`` and
    ``DSink`` of its 64 rows come from it and the ``O`` tile, read once, instead of a launch
    that streams both from HBM.  Thread ``t`` of 256 takes row ``t // 4`` and columns
    ``[p 64, p 64 + 64)`` of each half (``p = t % 4``): its 16-byte loads of ``O`` (0 at pad
    heads) are issued before the wait for the query tile, so that they fly with it; after it,
    the products with ``dO`` in fp32, added in a fixed order, then a butterfly over the row's
    four lanes.  Lane 0 of each row applies ``sink_lse2``, writes the row's three values to
    global memory (0 at pad heads, as the preprocess) and ``Lse2`` / ``Delta`` to static shared
    memory (``rows_s``, 512 bytes), where warpgroup 0 reads them after a CTA barrier.
    Deterministic (no atomics); ``Delta`` is summed in another order than the preprocess's, so
    the results differ from the unfused kernel's at fp32 rounding only.  With ``rows_s`` in the
    dynamic pool ptxas spilled ~180 bytes in warpgroup 0's key loop.  The deterministic
    backward does not fuse it: its ``exact_grid.grid_rows`` is the preprocess, which reads q, O
    and dO once for the grids too.
    """
    assert heads_per_cta == 64 and d_v % 128 == 0 and d_qk - d_v in (0, 64), "Dk - Dv: 64 or 0"
    assert with_dq, "the re-run without dQ is the one-role kernel's (bwd_main)"
    wg0_chunks, overlap = schedule.wg0_chunks, schedule.overlap
    row_lanes, pred_red = schedule.row_lanes, schedule.pred_red
    M = heads_per_cta
    D = d_v
    DH = d_v // 2
    D_tail = d_qk - d_v
    # static (a Python bool, resolved while tracing): without a rope tail its buffers are None
    # and its copies and GEMMs are not built (nothing zero-sized reaches TIR)
    has_tail = d_qk > d_v
    BK = 64
    CW = 64
    # warpgroup 0 adds the block's last wg0_chunks chunks, the rope tail first where there is
    # one: the right half's last wg0_right of them (576: 0 or 1, 512: 1 or 2); warpgroup 1 the
    # left half and the rest of the right
    wg0_right = wg0_chunks - int(has_tail)
    assert 0 <= wg0_right < DH // CW, "wg0_chunks: the tail and fewer than a half's chunks"
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
        # the right half, the rope tail and, if deterministic, the keys' grids (inv[k % 2])
        gather_cols(KV, Indices, K_r, DH, b_i, s_i, k, t)
        if has_tail:
            gather_cols(KV, Indices, K_t, D, b_i, s_i, k, t)
        if deterministic:
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
            if deterministic:
                inv_l[i] = inv[k % 2, slot_row(t) + 8 * i]
                u_l[i] = 0
        if row_lanes == 8:
            for i in T.unroll(2):
                slot[2 + i] = T.shfl_xor(slot[i], 4)

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
        # and waited for each of their results (11% of a profile's samples, short scoreboard).
        # The row's offset from the batch's first row, not an index into dKV_acc:
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
                if deterministic:
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
                if deterministic:
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
                + [(Q_r, dO_r, c, DH + c * CW) for c in range(DH // CW - wg0_right)])

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

    @T.macro
    def body(Q, KV, dO, Indices, Lse2, Delta, Scale, InvGrid, Counts, dQ, dKV_acc, Bound,
             BoundExp, O, Lse, Sink, DSink):
        # the kernel; O, Lse, Sink, DSink: None unless fused
        with T.Kernel(S, B, H_pad // M, threads=2 * WG,
                      prelude=RED_V4_SRC if pred_red else None) as (bx, b_i, g_i):
            s_i = last_row_first(bx, S)
            Q_l = T.alloc_shared([M, DH], dtype)
            Q_r = T.alloc_shared([M, DH], dtype)
            Q_t = T.alloc_shared([M, D_tail], dtype) if has_tail else None
            dO_l = T.alloc_shared([M, DH], dtype)
            dO_r = T.alloc_shared([M, DH], dtype)
            K_l = T.alloc_shared([BK, DH], dtype)
            K_r = T.alloc_shared([BK, DH], dtype)
            K_t = T.alloc_shared([BK, D_tail], dtype) if has_tail else None
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
            acc_dq_t = T.alloc_fragment([M, D_tail], acc_t) if has_tail else None
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

            tx = T.get_thread_binding()
            h0 = g_i * M
            if tx < WG and L // BK > 0:  # block 0's keys (always walked), under the tiles' load
                gather_left(KV, Indices, K_l, kl_full, b_i, s_i, 0, tx)
                gather_right(KV, Indices, InvGrid, K_r, K_t, inv, kr_full, b_i, s_i, 0, tx)
            tma_head_tile(Q, b_i, s_i, h0, Q_l, Q_r, Q_t, q_ready)
            tma_head_tile(dO, b_i, s_i, h0, dO_l, dO_r, None, q_ready)
            T.barrier_arrive(q_ready[0])  # see tma_head_tile
            if fused:
                fused_loads(O, Lse, Sink, o_r, lse_r, b_i, s_i, h0, tx)
            row_key_blocks(Indices, b_i, s_i, tx, 2 * WG, BK, ext_v, ext_last, ext_warps, nb)
            NB = nb[0]
            T.barrier_wait(q_ready[0], 0)
            T.fence_proxy_async()
            if fused:
                fused_rows(dO_l, dO_r, o_r, do_r, lse_r, rows_s, Lse2, Delta, DSink, b_i, s_i, h0,
                           tx)

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
                if has_tail:
                    T.fill(acc_dq_t, 0)
                for k in T.serial(NB):
                    for h, j in T.Parallel(M, BK):
                        acc_p[h, j] = T.if_then_else(Indices[b_i, s_i, k * BK + j] >= 0, 0,
                                                     -T.infinity(acc_t))
                    # the left half's GEMMs as soon as it lands, the rest after the right half
                    T.barrier_wait(kl_full[0], k & 1)
                    T.fence_proxy_async()  # cp.async wrote through the generic proxy
                    T.wgmma_gemm(Q_l, K_l, acc_p, transpose_B=True)
                    T.wgmma_gemm(dO_l, K_l, acc_dp, transpose_B=True, clear_accum=True)
                    T.barrier_wait(kr_full[0], k & 1)
                    T.fence_proxy_async()
                    T.wgmma_gemm(Q_r, K_r, acc_p, transpose_B=True)
                    if has_tail:
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
                    T.wgmma_gemm(dS_s, K_l, acc_dq_l)
                    # dS K_l must be done before gather_left refills K_l (warpgroup 0 is its
                    # only reader and writer: no barrier guards it); with a tail, the tail
                    # GEMM's own wait retires it
                    if has_tail:
                        T.gemm(dS_s, K_t, acc_dq_t)
                    else:
                        T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_dq_l, num_regs=M * DH // WG)
                    if k + 1 < NB:
                        gather_left(KV, Indices, K_l, kl_full, b_i, s_i, k + 1, tx)
                    # also in the last block: it keeps u_ready from running two phases ahead
                    # of warpgroup 1 (which arrives pds_free before it waits for u_ready)
                    T.barrier_wait(kv_free[0], k & 1)
                    if k + 1 < NB:
                        gather_right(KV, Indices, InvGrid, K_r, K_t, inv, kr_full, b_i, s_i,
                                     k + 1, tx)
                    own_slot(Indices, inv, slot, inv_l, u_l, b_i, s_i, k, tx)
                    if wg0_right > 0:
                        dkv_chunks(Q_r, dO_r, P_s, dS_s, acc_w0, w0_e, r4, slot, inv_l,
                                   u_l, dKV_acc, b_i, DH // CW - wg0_right, wg0_right, DH)
                    if has_tail:
                        T.gemm(dS_s, Q_t, acc_w0, transpose_A=True, clear_accum=True)
                        scatter_chunk(acc_w0, w0_e, r4, slot, inv_l, u_l, dKV_acc, b_i, D)
                    if deterministic:
                        slot_max(u_l)
                        if tx % 4 == 0:
                            for i in T.unroll(2):
                                u_w0[k % 2, slot_row(tx) + 8 * i] = u_l[i]
                        T.barrier_arrive(u_ready[0])
                T.copy(acc_dq_l, dQ[b_i, s_i, h0:h0 + M, :DH])
                if has_tail:
                    T.copy(acc_dq_t, dQ[b_i, s_i, h0:h0 + M, D:])
            else:
                t = tx - WG
                T.fill(acc_dq_r, 0)
                for k in T.serial(NB):
                    T.barrier_wait(pds_full[0], k & 1)
                    # the keys came by cp.async (generic proxy) and P / dS were fenced by
                    # their writer; both are read by wgmma
                    T.fence_proxy_async()
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
                        dkv_chunks(Q_r, dO_r, P_s, dS_s, acc_w1, w1_e, r4, slot, inv_l,
                                   u_l, dKV_acc, b_i, 0, DH // CW - wg0_right, DH)
                        T.barrier_arrive(pds_free[0])  # the last read of P / dS
                    if deterministic:
                        slot_max(u_l)
                        T.barrier_wait(u_ready[0], k & 1)
                        for i in T.unroll(2):
                            u_l[i] = T.max(u_l[i], u_w0[k % 2, slot_row(t) + 8 * i])
                        add_slot_bound(u_l, slot, Bound, BoundExp, b_i, t)
                T.copy(acc_dq_r, dQ[b_i, s_i, h0:h0 + M, DH:D])

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
