"""TileLang forward kernel: sparse MQA-latent attention with an attention sink.

One CTA per (query row ``s``, batch ``b``, head group ``g``).  The CTA keeps its ``M`` query
heads in shared memory and walks the row's top-k slots in key blocks of ``BK``: it gathers the
``BK`` latent rows through the indices (a ``-1`` slot reads row 0, a clamped address, and its
score is masked to ``-inf``), computes base-2 scores, and keeps an online softmax (running
maximum, running sum, fp32 output accumulator ``[M, Dv]``).  At the end the sink is folded in as
one extra softmax column with a zero value (``docs/conventions.md``) and the kernel writes

* ``O [B, S, H_pad, Dv]`` bf16 (0 for a row with no valid key),
* ``Lse [B, S, H_pad]`` fp32, natural log and sink-exclusive (``-inf`` for a row with no valid
  key), the form FlashMLA's sparse prefill returns.

Static (one compile each): the head tile ``M`` (``tiling.head_plan``), ``Dk``, ``Dv``, the
schedule (``schedule.fwd_schedule``: key block, threads, registers).  Dynamic (no recompile):
``B``, ``S``, ``S_kv``, ``L`` (a multiple of the key block; the host pads with ``-1``),
``H_pad`` (a multiple of ``M``).  ``sm_scale`` is a runtime value read
from the one-element tensor ``Scale``.  Every kernel compiles with ``settings.PASS_CONFIGS``.
"""


from ... import settings
from .async_copy import gather_key_block, load_key_rows, tma_head_tile
from .row_blocks import alloc_scratch, last_row_first, row_key_blocks
from .schedule import FwdSchedule, fwd_schedule

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["sparse_fwd"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def finite_shift(m):
    """The shift for a running max ``m``: ``m``, or 0 where no valid key came yet (``m = -inf``),
    so that no ``-inf - -inf`` (NaN) is formed; the scores and the previous max are then
    ``-inf`` and exp2 gives 0."""
    return T.if_then_else(m == -T.infinity("float32"), 0.0, m)


@T.macro
def scale_rows(acc, factor):
    """``acc [M, N] *= factor [M]`` row by row (the online softmax's rescaling)."""
    for h, d in T.Parallel(*acc.shape):
        acc[h, d] = acc[h, d] * factor[h]


@T.macro
def softmax_step(acc_s, row_max, row_max_prev, row_sum, blk_sum, alpha, m_shift, scale2,
                 start=None):
    """One key block of the online softmax: raw scores ``acc_s [M, BK]`` become the block's
    weights ``2^((s - m) scale2)``; the running max and sum move on, ``alpha`` is the factor for
    the output accumulated so far.  ``start`` (shared ``[M]``, at least ``row_max``): a running
    max that already covers other blocks (the other warpgroup's, in ``_warp_specialized``)."""
    M, BK = acc_s.shape
    T.copy(row_max, row_max_prev)
    if start is not None:
        for h in T.Parallel(M):
            row_max[h] = start[h]
    T.reduce_max(acc_s, row_max, dim=1, clear=False)
    for h in T.Parallel(M):
        row_max[h] = T.max(row_max[h], row_max_prev[h])
        m_shift[h] = finite_shift(row_max[h])
        alpha[h] = T.exp2((row_max_prev[h] - m_shift[h]) * scale2[0])
    for h, j in T.Parallel(M, BK):
        acc_s[h, j] = T.exp2((acc_s[h, j] - m_shift[h]) * scale2[0])
    T.reduce_sum(acc_s, blk_sum, dim=1)
    for h in T.Parallel(M):
        row_sum[h] = row_sum[h] * alpha[h] + blk_sum[h]


@T.macro
def fold_sink(row_max, row_sum, Sink, h0, scale2, alpha, lse_frag, alpha_shared=None):
    """The final factor ``alpha`` and ``lse_frag`` of each head row from the online softmax's
    raw running max and sum: the sink is one more softmax column with a zero value, in base 2,
    ``m = max(row_max * scale2, sink2)``, ``Z = row_sum 2^(row_max scale2 - m) + 2^(sink2 - m)``,
    ``out = acc_o 2^(row_max scale2 - m) / Z`` (0 when ``Z = 0``: no key and no sink).  Also
    into ``alpha_shared`` when given (the warp-specialised kernel's other consumer)."""
    for h in T.Parallel(row_max.shape[0]):
        m_key = row_max[h] * scale2[0]
        sink2 = Sink[h0 + h] * LOG2E
        m_all = T.max(m_key, sink2)
        # no key and no sink: m_all = -inf, every weight 0 (not exp2(-inf - -inf))
        w_key = T.if_then_else(m_all == -T.infinity("float32"), 0.0, T.exp2(m_key - m_all))
        z = row_sum[h] * w_key + T.if_then_else(m_all == -T.infinity("float32"), 0.0,
                                                T.exp2(sink2 - m_all))
        alpha[h] = T.if_then_else(z > 0, w_key / z, 0)
        if alpha_shared is not None:
            alpha_shared[h] = alpha[h]
        # natural, sink-exclusive: log2(0) = -inf for a row with no valid key
        lse_frag[h] = (T.log2(row_sum[h]) + m_key) * LN2


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def sparse_fwd(heads_per_cta: int, d_qk: int, d_v: int, schedule: FwdSchedule | None = None):
    """Build the forward kernel for one head tile.

    Args (all static):
        heads_per_cta: ``M``, the heads one CTA handles (16, 32 or 64): 64 builds the
            warp-specialised kernel (:func:`_warp_specialized`), 16 and 32 the one-role one.
        d_qk: ``Dk`` (576 or 512).  d_v: ``Dv`` (512); ``Dk - Dv`` is the rope tail, none
            when ``Dk = Dv`` (DeepSeek-V4: RoPE inside the value's columns; the value is then
            the whole gathered row, and no tail buffer, copy or GEMM is built).
        schedule: :func:`~.schedule.fwd_schedule` when ``None`` (the shipped one); ``L`` must
            be a multiple of its ``block_k``.

    Kernel arguments: ``Q [B, S, H_pad, Dk] bf16``, ``KV [B, S_kv, Dk] bf16``,
    ``Indices [B, S, L] int32``, ``Sink [H_pad] fp32`` (``-inf`` = no sink / pad head),
    ``Scale [1] fp32`` (``sm_scale``), outputs ``O [B, S, H_pad, Dv] bf16`` and
    ``Lse [B, S, H_pad] fp32``.
    """
    assert heads_per_cta in (16, 32, 64), "the head tile is 16, 32 or 64 (tiling.head_plan)"
    assert d_qk >= d_v and d_v % 64 == 0 and (d_qk - d_v) % 16 == 0, "unsupported Dk/Dv"
    schedule = fwd_schedule() if schedule is None else schedule
    if heads_per_cta == 64:
        return _warp_specialized(heads_per_cta, d_qk, d_v, schedule)
    block_k, threads, num_stages = schedule.block_k, schedule.threads, schedule.num_stages
    M = heads_per_cta
    D = d_v
    D_tail = d_qk - d_v
    # a static choice (a Python bool: TileLang resolves the `if` while tracing); without a tail
    # nothing zero-sized may reach TIR, so its buffers are None and its statements skipped
    has_tail = d_qk > d_v
    BK = block_k
    dtype = "bfloat16"
    acc_t = "float32"

    B = T.dynamic("B")
    S = T.dynamic("S")
    S_kv = T.dynamic("S_kv")
    L = T.dynamic("L")
    H_pad = T.dynamic("H_pad")

    @T.prim_func
    def sparse_fwd_main(
        Q: T.Tensor([B, S, H_pad, d_qk], dtype),
        KV: T.Tensor([B, S_kv, d_qk], dtype),
        Indices: T.Tensor([B, S, L], "int32"),
        Sink: T.Tensor([H_pad], acc_t),
        Scale: T.Tensor([1], acc_t),
        O: T.Tensor([B, S, H_pad, D], dtype),
        Lse: T.Tensor([B, S, H_pad], acc_t),
    ):
        with T.Kernel(S, B, H_pad // M, threads=threads) as (s_i, b_i, g_i):
            Q_shared = T.alloc_shared([M, D], dtype)
            Q_tail_shared = T.alloc_shared([M, D_tail], dtype) if has_tail else None
            KV_shared = T.alloc_shared([BK, D], dtype)
            K_tail_shared = T.alloc_shared([BK, D_tail], dtype) if has_tail else None
            P_shared = T.alloc_shared([M, BK], dtype)
            O_shared = T.alloc_shared([M, D], dtype)
            valid = T.alloc_fragment([BK], "bool")

            acc_s = T.alloc_fragment([M, BK], acc_t)
            acc_o = T.alloc_fragment([M, D], acc_t)
            row_max = T.alloc_fragment([M], acc_t)
            row_max_prev = T.alloc_fragment([M], acc_t)
            row_sum = T.alloc_fragment([M], acc_t)
            blk_sum = T.alloc_fragment([M], acc_t)
            alpha = T.alloc_fragment([M], acc_t)
            m_shift = T.alloc_fragment([M], acc_t)
            lse_frag = T.alloc_fragment([M], acc_t)
            scale2 = T.alloc_local([1], acc_t)

            h0 = g_i * M
            # scores are kept raw (q.k); scale2 turns them into base-2 logits
            scale2[0] = Scale[0] * LOG2E
            T.fill(acc_o, 0)
            T.fill(row_sum, 0)
            # -inf, not a finite floor: a floor above every logit of a row (all far below zero)
            # left m at the floor and every exp2 at 0; the -inf cases are guarded below
            T.fill(row_max, -T.infinity(acc_t))
            T.copy(Q[b_i, s_i, h0:h0 + M, :D], Q_shared)
            if has_tail:
                T.copy(Q[b_i, s_i, h0:h0 + M, D:], Q_tail_shared)

            for k_i in T.Pipelined(L // BK, num_stages=num_stages):
                for j in T.Parallel(BK):
                    valid[j] = Indices[b_i, s_i, k_i * BK + j] >= 0
                # gather through a clamped address: a -1 slot reads row 0 and is masked below
                for j, d in T.Parallel(BK, D):
                    KV_shared[j, d] = KV[b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0), d]
                if has_tail:
                    for j, d in T.Parallel(BK, D_tail):
                        K_tail_shared[j, d] = KV[b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0),
                                                 D + d]
                for h, j in T.Parallel(M, BK):
                    acc_s[h, j] = T.if_then_else(valid[j], 0, -T.infinity(acc_t))
                T.gemm(Q_shared, KV_shared, acc_s, transpose_B=True,
                       policy=T.GemmWarpPolicy.FullRow)
                if has_tail:
                    T.gemm(Q_tail_shared, K_tail_shared, acc_s, transpose_B=True,
                           policy=T.GemmWarpPolicy.FullRow)

                softmax_step(acc_s, row_max, row_max_prev, row_sum, blk_sum, alpha, m_shift,
                             scale2)
                scale_rows(acc_o, alpha)
                T.copy(acc_s, P_shared)
                T.gemm(P_shared, KV_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)

            fold_sink(row_max, row_sum, Sink, h0, scale2, alpha, lse_frag)
            scale_rows(acc_o, alpha)
            T.copy(acc_o, O_shared)
            T.copy(O_shared, O[b_i, s_i, h0:h0 + M, :])
            T.copy(lse_frag, Lse[b_i, s_i, h0:h0 + M])

    return sparse_fwd_main


def _warp_specialized(heads_per_cta: int, d_qk: int, d_v: int, schedule: FwdSchedule):
    """The 64-head forward as three warpgroups (384 threads), same arguments and results.

    Warpgroups 0 and 1, the consumers, take alternate key blocks: warpgroup 0 the even ones (key
    buffer 0), warpgroup 1 the odd ones (buffer 1); each keeps half of the output columns of
    all 64 heads (``O_l`` / ``O_r``).  Per pair of blocks ``(2i, 2i + 1)``:

    * warpgroup 0: block ``2i``'s scores ``Q K^T`` and its softmax against its running max,
      which it hands to warpgroup 1 through shared memory; ``O_l += P_0 V_0[:, :Dv/2]`` with
      ``P_0`` from registers (an RS wgmma: no shared-memory read of ``P``); once warpgroup 1's
      max of the pair is back, ``P_0`` rescaled to it into shared memory (buffer 0's rope tail,
      whose scores are done; at ``Dk = Dv`` a buffer of its own), and ``O_l += P_1 V_1[:, :Dv/2]`` from warpgroup 1's ``P`` (issued
      with the next pair's scores);
    * warpgroup 1: block ``2i + 1``'s scores, its softmax starting from warpgroup 0's max (so
      the pair's max), ``O_r += P_1 V_1[:, Dv/2:]`` from registers and ``O_r += P_0
      V_0[:, Dv/2:]``;
    * warpgroup 2, the producer: gathers each block with 16-byte ``cp.async`` (a ``-1`` slot
      copies row 0 and is masked), its rows' indices loaded once per block and ahead of the
      waits, in two parts per buffer in the order they come free: buffer 0's left half (after
      warpgroup 0's RS), buffer 1's right half and tail (after warpgroup 1's RS), buffer 0's
      right half and tail, buffer 1's left half (after the SS ones).  Block 0 is gathered
      after the prologue: sent out beside the query tile it made the forward 1-2% slower
      (probably its loads delay the query tile's, which the consumers need first).

    Warpgroup 1's score GEMM (at the shared-memory rate) runs under warpgroup 0's softmax and
    ``P V``, warpgroup 0's under warpgroup 1's ``P V``, and both do the same tensor work.  This
    is the schedule of FlashMLA's SM90 sparse prefill (``csrc/sm90/prefill/sparse/phase1.cuh``),
    written here in TileLang; it is faster than a split by output columns in which warpgroup 0
    computed every score and softmax and warpgroup 1 only the right ``P V``: per block, the
    score GEMM and softmax stood in a chain there.  The row sums of the two consumers add at
    the end, in the final pair's max (both end with it); the sink is folded in as in
    :func:`sparse_fwd`.

    Registers (``setmaxnreg``): ``schedule.consumer_regs`` per consumer thread, the rest for the
    producer (:func:`~.schedule.fwd_schedule`).  Each pair's ``O_l += P_1 V_1`` is issued at the
    top of the next pair (the final pair's after the loop), not at the end of its own: a wgmma
    in flight across the loop's back edge made ptxas serialise every wgmma of the kernel (its
    warning C7514).  The query tile comes by TMA, nine boxes from one elected thread: issued by
    384 threads as 16-byte ``cp.async``, the CTA took 3.4 us just to issue them and its first
    pair of softmaxes ended 7.2 us after it began, against 0.44 and 4.4 us by TMA (-4 to -13%
    on the whole forward).  Every role walks the row's blocks only up to the one holding its
    last slot with a key (the blocks after it add nothing), and the rows go last-first
    (``row_blocks``).
    """
    assert heads_per_cta == 64 and d_v % 128 == 0, "64-head tiles, Dv a multiple of 128"
    block_k, consumer_regs = schedule.block_k, schedule.consumer_regs
    # setmaxnreg takes multiples of 8 in [24, 256]; the three warpgroups share 3 x 168 (65536
    # registers / 384 threads, rounded down to 8), and a raise above what the others give back
    # waits forever
    assert consumer_regs % 8 == 0 and 168 <= consumer_regs <= 240, "consumer_regs: 168..240"
    M = heads_per_cta
    D = d_v
    DH = d_v // 2
    D_tail = d_qk - d_v
    has_tail = d_qk > d_v  # static, as in sparse_fwd
    BK = block_k
    # warpgroup 0's P goes through buffer 0's rope tail: [BK, D_tail] must be [M, BK]; without
    # a tail P_0 has a buffer of its own
    assert BK == M and D_tail in (0, BK), "the rope tail holds P: Dk - Dv = block_k = 64, or 0"
    dtype = "bfloat16"
    acc_t = "float32"
    WG = 128

    B = T.dynamic("B")
    S = T.dynamic("S")
    S_kv = T.dynamic("S_kv")
    L = T.dynamic("L")
    H_pad = T.dynamic("H_pad")

    @T.macro
    def masked_scores(Indices, b_i, s_i, k, acc_s):
        for h, j in T.Parallel(M, BK):
            acc_s[h, j] = T.if_then_else(Indices[b_i, s_i, k * BK + j] >= 0, 0,
                                         -T.infinity(acc_t))

    @T.macro
    def refill(free, ready, parity, KV, rows, K_l, K_r, K_t, b_i, t):
        # the producer: once the consumers are done with a buffer part, gather a block into it
        T.barrier_wait(free[0], parity ^ 1)
        gather_key_block(KV, rows, K_l, K_r, K_t, b_i, t)
        T.cp_async_barrier_noinc(ready[0])

    @T.prim_func
    def sparse_fwd_ws(
        Q: T.Tensor([B, S, H_pad, d_qk], dtype),
        KV: T.Tensor([B, S_kv, d_qk], dtype),
        Indices: T.Tensor([B, S, L], "int32"),
        Sink: T.Tensor([H_pad], acc_t),
        Scale: T.Tensor([1], acc_t),
        O: T.Tensor([B, S, H_pad, D], dtype),
        Lse: T.Tensor([B, S, H_pad], acc_t),
    ):
        with T.Kernel(S, B, H_pad // M, threads=3 * WG) as (bx, b_i, g_i):
            s_i = last_row_first(bx, S)
            Q_l = T.alloc_shared([M, DH], dtype)
            Q_r = T.alloc_shared([M, DH], dtype)
            Q_tail = T.alloc_shared([M, D_tail], dtype) if has_tail else None
            K_l0 = T.alloc_shared([BK, DH], dtype)
            K_r0 = T.alloc_shared([BK, DH], dtype)
            K_t0 = T.alloc_shared([BK, D_tail], dtype) if has_tail else None
            K_l1 = T.alloc_shared([BK, DH], dtype)
            K_r1 = T.alloc_shared([BK, DH], dtype)
            K_t1 = T.alloc_shared([BK, D_tail], dtype) if has_tail else None
            P_1 = T.alloc_shared([M, BK], dtype)
            # written once warpgroup 0's scores of the block are done.  Without a tail, a buffer
            # of its own: wg0 writes P_0 of pair i + 1 after ready_rt0 of i + 1, which the
            # producer gives after free_rt0 of pair i, which wg1 arrives at after its P_0 V_0
            # wgmma is done (the chain that protects P_1)
            P_0 = K_t0 if has_tail else T.alloc_shared([M, BK], dtype)
            m_shared = T.alloc_shared([M], acc_t)  # the running max, handed back and forth
            sum_shared = T.alloc_shared([M], acc_t)
            alpha_shared = T.alloc_shared([M], acc_t)
            O_l = Q_l
            O_r = Q_r

            q_ready = T.alloc_barrier(arrive_count=3 * WG)
            ready_l0 = T.alloc_barrier(arrive_count=WG)
            ready_rt0 = T.alloc_barrier(arrive_count=WG)
            ready_l1 = T.alloc_barrier(arrive_count=WG)
            ready_rt1 = T.alloc_barrier(arrive_count=WG)
            free_l0 = T.alloc_barrier(arrive_count=WG)  # warpgroup 0's RS
            free_rt0 = T.alloc_barrier(arrive_count=WG)  # warpgroup 1's SS (reads P_0 too)
            free_l1 = T.alloc_barrier(arrive_count=WG)  # warpgroup 0's SS
            free_rt1 = T.alloc_barrier(arrive_count=WG)  # warpgroup 1's RS
            m0_ready = T.alloc_barrier(arrive_count=WG)
            m1_ready = T.alloc_barrier(arrive_count=WG)
            p0_ready = T.alloc_barrier(arrive_count=WG)
            p1_ready = T.alloc_barrier(arrive_count=WG)
            sum_ready = T.alloc_barrier(arrive_count=WG)
            fin_ready = T.alloc_barrier(arrive_count=WG)

            acc_s0 = T.alloc_fragment([M, BK], acc_t)
            acc_s1 = T.alloc_fragment([M, BK], acc_t)
            p_0 = T.alloc_fragment([M, BK], dtype)
            p_1 = T.alloc_fragment([M, BK], dtype)
            acc_o0 = T.alloc_fragment([M, DH], acc_t)
            acc_o1 = T.alloc_fragment([M, DH], acc_t)
            row_max = T.alloc_fragment([M], acc_t)
            row_max_prev = T.alloc_fragment([M], acc_t)
            row_sum = T.alloc_fragment([M], acc_t)
            blk_sum = T.alloc_fragment([M], acc_t)
            alpha = T.alloc_fragment([M], acc_t)
            m_shift = T.alloc_fragment([M], acc_t)
            lse_frag = T.alloc_fragment([M], acc_t)
            row_max1 = T.alloc_fragment([M], acc_t)
            row_max_prev1 = T.alloc_fragment([M], acc_t)
            row_sum1 = T.alloc_fragment([M], acc_t)
            blk_sum1 = T.alloc_fragment([M], acc_t)
            alpha1 = T.alloc_fragment([M], acc_t)
            m_shift1 = T.alloc_fragment([M], acc_t)
            scale2 = T.alloc_local([1], acc_t)
            rows0 = T.alloc_local([BK // 16], "int32")
            rows1 = T.alloc_local([BK // 16], "int32")
            ext_v, ext_last, ext_warps, nb = alloc_scratch(3 * WG)

            tx = T.get_thread_binding()
            h0 = g_i * M
            tma_head_tile(Q, b_i, s_i, h0, Q_l, Q_r, Q_tail, q_ready)
            T.barrier_arrive(q_ready[0])  # see tma_head_tile
            row_key_blocks(Indices, b_i, s_i, tx, 3 * WG, BK, ext_v, ext_last, ext_warps, nb)
            NB = nb[0]
            T.barrier_wait(q_ready[0], 0)
            T.fence_proxy_async()

            scale2[0] = Scale[0] * LOG2E  # both consumers compute weights
            if tx < WG:
                T.set_max_nreg(consumer_regs, 1)
                T.fill(acc_o0, 0)
                T.fill(row_sum, 0)
                T.fill(row_max, -T.infinity(acc_t))
                for i in T.serial(T.ceildiv(NB, 2)):
                    masked_scores(Indices, b_i, s_i, 2 * i, acc_s0)
                    T.barrier_wait(ready_l0[0], i & 1)
                    T.fence_proxy_async()
                    if i > 0:
                        # the previous pair's O_l += P_1 V_1, issued here and not at the end
                        # of that pair: a wgmma in flight across the loop's back edge made ptxas
                        # serialise every wgmma of the kernel (C7514)
                        T.wgmma_gemm(P_1, K_l1, acc_o0)
                        T.wgmma_gemm(Q_l, K_l0, acc_s0, transpose_B=True)
                        T.wait_wgmma(1)  # P_1 V_1 done: buffer 1's left half is free
                        T.barrier_arrive(free_l1[0])
                    else:
                        T.wgmma_gemm(Q_l, K_l0, acc_s0, transpose_B=True)
                    T.barrier_wait(ready_rt0[0], i & 1)
                    T.fence_proxy_async()
                    T.wgmma_gemm(Q_r, K_r0, acc_s0, transpose_B=True)
                    if has_tail:
                        T.wgmma_gemm(Q_tail, K_t0, acc_s0, transpose_B=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_s0, num_regs=M * BK // WG)
                    softmax_step(acc_s0, row_max, row_max_prev, row_sum, blk_sum, alpha,
                                 m_shift, scale2)
                    for h in T.Parallel(M):
                        m_shared[h] = row_max[h]
                    T.barrier_arrive(m0_ready[0])
                    scale_rows(acc_o0, alpha)
                    T.copy(acc_s0, p_0)
                    T.wgmma_gemm(p_0, K_l0, acc_o0)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_o0, num_regs=M * DH // WG)
                    T.barrier_arrive(free_l0[0])
                    # the pair's max from warpgroup 1: P_0 and what is summed so far move to it
                    T.barrier_wait(m1_ready[0], i & 1)
                    for h in T.Parallel(M):
                        m_shift[h] = finite_shift(m_shared[h])
                        alpha[h] = T.exp2((row_max[h] - m_shift[h]) * scale2[0])
                        row_max[h] = m_shared[h]
                        row_sum[h] = row_sum[h] * alpha[h]
                    scale_rows(acc_s0, alpha)
                    T.copy(acc_s0, P_0)
                    T.fence_proxy_async()  # P_0 is read by warpgroup 1's wgmma
                    T.barrier_arrive(p0_ready[0])
                    scale_rows(acc_o0, alpha)
                    if 2 * i + 1 < NB:
                        T.barrier_wait(p1_ready[0], i & 1)
                # the final pair's P_1 V_1 (NB >= 1: row_key_blocks, or L >= BK from the host)
                if NB % 2 == 0:
                    T.wgmma_gemm(P_1, K_l1, acc_o0)
                    T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc_o0, num_regs=M * DH // WG)
                # both warpgroups' sums are in the same (the last pair's) max
                T.barrier_wait(sum_ready[0], 0)
                for h in T.Parallel(M):
                    row_sum[h] = row_sum[h] + sum_shared[h]
                fold_sink(row_max, row_sum, Sink, h0, scale2, alpha, lse_frag, alpha_shared)
                T.barrier_arrive(fin_ready[0])
                scale_rows(acc_o0, alpha)
                T.copy(acc_o0, O_l)
                T.copy(O_l, O[b_i, s_i, h0:h0 + M, :DH])
                T.copy(lse_frag, Lse[b_i, s_i, h0:h0 + M])
            elif tx < 2 * WG:
                T.set_max_nreg(consumer_regs, 1)
                T.fill(acc_o1, 0)
                T.fill(row_sum1, 0)
                T.fill(row_max1, -T.infinity(acc_t))
                for i in T.serial(T.ceildiv(NB, 2)):
                    if 2 * i + 1 < NB:
                        masked_scores(Indices, b_i, s_i, 2 * i + 1, acc_s1)
                        T.barrier_wait(ready_rt1[0], i & 1)
                        T.fence_proxy_async()
                        T.wgmma_gemm(Q_r, K_r1, acc_s1, transpose_B=True)
                        if has_tail:
                            T.wgmma_gemm(Q_tail, K_t1, acc_s1, transpose_B=True)
                        T.barrier_wait(ready_l1[0], i & 1)
                        T.fence_proxy_async()
                        T.wgmma_gemm(Q_l, K_l1, acc_s1, transpose_B=True)
                        T.wait_wgmma(0)
                    else:
                        # an odd count: no block 2i + 1, its weights all 0
                        T.fill(acc_s1, -T.infinity(acc_t))
                    T.warpgroup_fence_operand(acc_s1, num_regs=M * BK // WG)
                    T.barrier_wait(m0_ready[0], i & 1)
                    softmax_step(acc_s1, row_max1, row_max_prev1, row_sum1, blk_sum1, alpha1,
                                 m_shift1, scale2, start=m_shared)
                    for h in T.Parallel(M):
                        m_shared[h] = row_max1[h]
                    T.barrier_arrive(m1_ready[0])
                    scale_rows(acc_o1, alpha1)
                    if 2 * i + 1 < NB:
                        T.copy(acc_s1, p_1)
                        T.wgmma_gemm(p_1, K_r1, acc_o1)
                        T.copy(p_1, P_1)  # the RS reads p_1 too: reading it is safe
                        T.fence_proxy_async()  # P_1 is read by warpgroup 0's wgmma
                        T.barrier_arrive(p1_ready[0])
                    T.barrier_wait(p0_ready[0], i & 1)
                    T.wgmma_gemm(P_0, K_r0, acc_o1)
                    if 2 * i + 1 < NB:
                        T.wait_wgmma(1)
                        T.barrier_arrive(free_rt1[0])
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_o1, num_regs=M * DH // WG)
                    T.barrier_arrive(free_rt0[0])
                for h in T.Parallel(M):
                    sum_shared[h] = row_sum1[h]
                T.barrier_arrive(sum_ready[0])
                T.barrier_wait(fin_ready[0], 0)
                scale_rows(acc_o1, alpha_shared)
                T.copy(acc_o1, O_r)
                T.copy(O_r, O[b_i, s_i, h0:h0 + M, DH:])
            else:
                T.set_max_nreg(504 - 2 * consumer_regs, 0)  # the rest of 3 x 168
                t = tx - 2 * WG
                for i in T.serial(T.ceildiv(NB, 2)):
                    par = i & 1
                    # both blocks' rows, loaded once and under the first wait
                    load_key_rows(Indices, b_i, s_i, 2 * i, t, rows0)
                    if 2 * i + 1 < NB:
                        load_key_rows(Indices, b_i, s_i, 2 * i + 1, t, rows1)
                    refill(free_l0, ready_l0, par, KV, rows0, K_l0, None, None, b_i, t)
                    if 2 * i + 1 < NB:
                        refill(free_rt1, ready_rt1, par, KV, rows1, None, K_r1, K_t1, b_i, t)
                    refill(free_rt0, ready_rt0, par, KV, rows0, None, K_r0, K_t0, b_i, t)
                    if 2 * i + 1 < NB:
                        refill(free_l1, ready_l1, par, KV, rows1, K_l1, None, None, b_i, t)

    return sparse_fwd_ws
