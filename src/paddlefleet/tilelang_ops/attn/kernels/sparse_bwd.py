"""TileLang backward kernels: sparse MQA-latent attention with an attention sink.

Run in this order by ``attn/interface.py``:

``preprocess``   ``Delta[n] = sum_d O[n, d] * dO[n, d]`` (fp32) over the flattened rows
                 ``n = (b, s, h)`` of the real heads.
``main``         one CTA per (query row ``s``, batch ``b``, head group ``g``) walks the row's top-k
                 slots in key blocks of ``BK``; per block it gathers the latent rows through
                 clamped indices, recomputes ``P = exp2(s * sm_scale * log2(e) - lse2)`` (``lse2``
                 base-2, sink-inclusive, finite), then ``dP = dO V^T``, ``dS = P (dP - Delta)
                 sm_scale``, ``dQ += dS K`` (registers, written once at the end: deterministic)
                 and ``dKV_blk = dS^T Q + P^T dO`` (the second term on the first ``Dv`` columns).
                 Where ``dKV_blk`` goes is static:

                 * ordered (``slot_partials=True``, the default deterministic mode): plain
                   stores to a per-(row, head group, slot) scratch that this CTA alone owns;
                   ``slot_reduce`` then adds each key's rows in a fixed (sorted) order.
                 * fixed point (``deterministic=True``): each fp32 contribution ``x`` becomes
                   ``round(x * scale)`` and is added with an int64 atomic into the accumulator,
                   skipping ``-1`` slots.  Integer addition is associative, so the sum is exact
                   and independent of the order in which CTAs arrive.  ``scale`` (a power of two
                   chosen per call from a bound on ``|dKV|``, ``interface.fixed_point_scale``)
                   keeps every partial sum below ``2^62``; each contribution is rounded by at
                   most ``0.5 / scale``.
                 * atomic (``deterministic=False``): fp32 ``atomic_addx4`` (fast, order-dependent
                   rounding).
``slot_reduce``  (ordered) ``dKV[b, j] += sum of its slot rows, in sorted order`` (fp32).
``postprocess``  (fixed point) int64 accumulator -> fp64 -> ``* (1 / scale)`` -> bf16 ``dKV``.

Static (one compile each): head tile ``M``, ``Dk``, ``Dv``, key block, mode.  Dynamic: ``B``,
``S``, ``S_kv``, ``L`` (a multiple of the key block), ``H_pad``, ``G``.  ``sm_scale`` and the
fixed-point scale are runtime values in the two-element tensor ``Scale``.  All kernels compile
with ``settings.PASS_CONFIGS``.
"""

from ... import settings

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["preprocess", "main", "postprocess", "slot_reduce"]

LOG2E = 1.4426950408889634


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
def main(heads_per_cta: int, d_qk: int, d_v: int, deterministic: bool, block_k: int = 32,
         threads: int = 256, scatter_early=None, num_stages: int = 1,
         slot_partials: bool = False):
    """Build the main backward kernel for one head tile.

    Kernel arguments: ``Q [B, S, H_pad, Dk] bf16``, ``KV [B, S_kv, Dk] bf16``,
    ``dO [B, S, H_pad, Dv] bf16``, ``Indices [B, S, L] int32``, ``Lse2 [B, S, H_pad] fp32``
    (base-2, sink-inclusive, finite), ``Delta [B, S, H_pad] fp32``, ``Scale [2] fp32``
    (``sm_scale``, fixed-point scale), outputs ``dQ [B, S, H_pad, Dk] bf16`` and the accumulator
    ``dKV_acc [B, S_kv, Dk]`` (int64 when ``deterministic`` else fp32; zeroed by the caller).

    Schedule knobs (static; defaults measured on H200 at B=1 S=4096 S_kv=8192 H=64 topk=2048,
    see docs/performance.md): ``num_stages=1`` issues the next block's KV gather (cp.async)
    right after the last GEMM that reads the current one, so it overlaps the dKV GEMMs and the
    scatter (det 33.5 -> 30.5 ms); ``scatter_early`` (default: the atomic and the ordered
    paths, not the int64 one) runs dQ's two GEMMs after the dKV scatter or stores (atomic
    19.1 -> 15.6 ms with ``num_stages=1``; the int64 path was slower that way, 32.0 ms).

    ``slot_partials=True`` (ordered deterministic mode) replaces the scatter by plain coalesced
    stores of each block's dKV rows into ``dKV_acc [B, S, G, L, Dk] fp32`` (one row per query
    row, head group and top-k slot; ``G = H_pad / M``): nothing is shared between CTAs, and
    :func:`slot_reduce` sums the rows of each key in a fixed order afterwards.
    """
    if scatter_early is None:
        scatter_early = not deterministic or slot_partials
    assert heads_per_cta in (16, 32, 64), "the head tile is 16, 32 or 64 (tiling.head_plan)"
    assert d_qk > d_v and d_v % 64 == 0 and (d_qk - d_v) % 16 == 0, "unsupported Dk/Dv"
    assert block_k % 2 == 0
    M = heads_per_cta
    D = d_v
    D_tail = d_qk - d_v
    BK = block_k
    HALF = BK // 2  # the dKV block is staged through shared memory in two halves (smem budget)
    dtype = "bfloat16"
    acc_t = "float32"
    dkv_t = "int64" if deterministic and not slot_partials else "float32"

    B = T.dynamic("B")
    S = T.dynamic("S")
    S_kv = T.dynamic("S_kv")
    L = T.dynamic("L")
    H_pad = T.dynamic("H_pad")
    G = T.dynamic("G")
    acc_shape = [B, S, G, L, d_qk] if slot_partials else [B, S_kv, d_qk]

    @T.prim_func
    def sparse_bwd_main(
        Q: T.Tensor([B, S, H_pad, d_qk], dtype),
        KV: T.Tensor([B, S_kv, d_qk], dtype),
        dO: T.Tensor([B, S, H_pad, D], dtype),
        Indices: T.Tensor([B, S, L], "int32"),
        Lse2: T.Tensor([B, S, H_pad], acc_t),
        Delta: T.Tensor([B, S, H_pad], acc_t),
        Scale: T.Tensor([2], acc_t),
        dQ: T.Tensor([B, S, H_pad, d_qk], dtype),
        dKV_acc: T.Tensor(acc_shape, dkv_t),
    ):
        with T.Kernel(S, B, H_pad // M, threads=threads) as (s_i, b_i, g_i):
            Q_shared = T.alloc_shared([M, D], dtype)
            Q_tail_shared = T.alloc_shared([M, D_tail], dtype)
            dO_shared = T.alloc_shared([M, D], dtype)
            KV_shared = T.alloc_shared([BK, D], dtype)
            KV_tail_shared = T.alloc_shared([BK, D_tail], dtype)
            P_shared = T.alloc_shared([M, BK], dtype)
            dS_shared = T.alloc_shared([M, BK], dtype)
            dkv_stage = T.alloc_shared([HALF, D], acc_t)
            dkv_tail_stage = T.alloc_shared([HALF, D_tail], acc_t)
            valid = T.alloc_fragment([BK], "bool")

            acc_p = T.alloc_fragment([M, BK], acc_t)
            acc_dp = T.alloc_fragment([M, BK], acc_t)
            acc_dq = T.alloc_fragment([M, D], acc_t)
            acc_dq_tail = T.alloc_fragment([M, D_tail], acc_t)
            acc_dkv = T.alloc_fragment([BK, D], acc_t)
            acc_dkv_tail = T.alloc_fragment([BK, D_tail], acc_t)
            sc = T.alloc_local([3], acc_t)

            h0 = g_i * M
            sc[0] = Scale[0] * LOG2E  # raw q.k -> base-2 logit
            sc[1] = Scale[0]
            sc[2] = Scale[1]  # fixed-point scale (unused on the atomic path)
            T.copy(Q[b_i, s_i, h0:h0 + M, :D], Q_shared)
            T.copy(Q[b_i, s_i, h0:h0 + M, D:], Q_tail_shared)
            T.copy(dO[b_i, s_i, h0:h0 + M, :], dO_shared)
            T.clear(acc_dq)
            T.clear(acc_dq_tail)

            for k_i in T.Pipelined(L // BK, num_stages=num_stages):
                for j in T.Parallel(BK):
                    valid[j] = Indices[b_i, s_i, k_i * BK + j] >= 0
                # clamped gather: a -1 slot reads row 0; its score is masked to -inf (P = 0)
                for j, d in T.Parallel(BK, D):
                    KV_shared[j, d] = KV[b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0), d]
                for j, d in T.Parallel(BK, D_tail):
                    KV_tail_shared[j, d] = KV[b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0),
                                              D + d]
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

                if not scatter_early:
                    T.gemm(dS_shared, KV_shared, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                    T.gemm(dS_shared, KV_tail_shared, acc_dq_tail, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(dS_shared, Q_shared, acc_dkv, transpose_A=True,
                       policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                T.gemm(P_shared, dO_shared, acc_dkv, transpose_A=True,
                       policy=T.GemmWarpPolicy.FullCol)
                T.gemm(dS_shared, Q_tail_shared, acc_dkv_tail, transpose_A=True,
                       policy=T.GemmWarpPolicy.FullCol, clear_accum=True)

                if slot_partials:
                    # plain stores straight from the fragments: this CTA owns these slot rows
                    T.copy(acc_dkv, dKV_acc[b_i, s_i, g_i, k_i * BK:(k_i + 1) * BK, :D])
                    T.copy(acc_dkv_tail, dKV_acc[b_i, s_i, g_i, k_i * BK:(k_i + 1) * BK, D:])
                else:
                    for half in T.serial(2):
                        for j, d in T.Parallel(BK, D):
                            if j < HALF:
                                dkv_stage[j, d] = acc_dkv[half * HALF + j, d]
                        for j, d in T.Parallel(BK, D_tail):
                            if j < HALF:
                                dkv_tail_stage[j, d] = acc_dkv_tail[half * HALF + j, d]
                        if deterministic:
                            for j, d in T.Parallel(HALF, D):
                                idx = Indices[b_i, s_i, k_i * BK + half * HALF + j]
                                if idx >= 0:
                                    T.atomic_add(
                                        dKV_acc[b_i, idx, d],
                                        T.Cast("int64", T.round(dkv_stage[j, d] * sc[2])),
                                    )
                            for j, d in T.Parallel(HALF, D_tail):
                                idx = Indices[b_i, s_i, k_i * BK + half * HALF + j]
                                if idx >= 0:
                                    T.atomic_add(
                                        dKV_acc[b_i, idx, D + d],
                                        T.Cast("int64", T.round(dkv_tail_stage[j, d] * sc[2])),
                                    )
                        else:
                            for j, d4 in T.Parallel(HALF, D // 4):
                                idx = Indices[b_i, s_i, k_i * BK + half * HALF + j]
                                if idx >= 0:
                                    T.atomic_addx4(dKV_acc[b_i, idx, d4 * 4], dkv_stage[j, d4 * 4])
                            for j, d4 in T.Parallel(HALF, D_tail // 4):
                                idx = Indices[b_i, s_i, k_i * BK + half * HALF + j]
                                if idx >= 0:
                                    T.atomic_addx4(dKV_acc[b_i, idx, D + d4 * 4],
                                                   dkv_tail_stage[j, d4 * 4])

                if scatter_early:
                    # dQ's GEMMs after the scatter: the fire-and-forget atomics drain while the
                    # tensor cores work, instead of stalling the next block's gather
                    T.gemm(dS_shared, KV_shared, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                    T.gemm(dS_shared, KV_tail_shared, acc_dq_tail, policy=T.GemmWarpPolicy.FullCol)

            T.copy(acc_dq, dQ[b_i, s_i, h0:h0 + M, :D])
            T.copy(acc_dq_tail, dQ[b_i, s_i, h0:h0 + M, D:])

    return sparse_bwd_main


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def postprocess(d_qk: int, block_rows: int = 32, threads: int = 256):
    """``dKV [B, S_kv, Dk] bf16 = bf16(fp64(dKV_acc int64) * (1 / Scale[1]))``; rows past
    ``S_kv`` in the last CTA are neither read nor written."""
    B = T.dynamic("B")
    S_kv = T.dynamic("S_kv")
    R = block_rows

    @T.prim_func
    def sparse_bwd_postprocess(
        dKV_acc: T.Tensor([B, S_kv, d_qk], "int64"),
        Scale: T.Tensor([2], "float32"),
        dKV: T.Tensor([B, S_kv, d_qk], "bfloat16"),
    ):
        with T.Kernel(T.ceildiv(S_kv, R), B, threads=threads) as (r_blk, b_i):
            inv = T.alloc_local([1], "float64")
            # 1 / 2^e is exact in fp64
            inv[0] = T.Cast("float64", 1.0) / T.Cast("float64", Scale[1])
            for r, d in T.Parallel(R, d_qk):
                if r_blk * R + r < S_kv:
                    # fp64 product is exact up to 53 bits; one rounding to fp32, one to bf16
                    dKV[b_i, r_blk * R + r, d] = T.Cast("bfloat16", T.Cast(
                        "float32", T.Cast("float64", dKV_acc[b_i, r_blk * R + r, d]) * inv[0]))

    return sparse_bwd_postprocess


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def slot_reduce(d_qk: int, threads: int = 144):
    """Ordered deterministic dKV: ``dKV[b, j] += Parts[b, Perm[b, e]]`` for ``e`` from
    ``Off[b, j]`` to ``Off[b, j + 1] - 1``, one after the other, in fp32.

    ``Parts [B, R, Dk] fp32`` are the per-(query row, head group, slot) dKV rows written by
    ``main(..., slot_partials=True)`` (``R = S * G * L``); ``Perm [B, R] int32`` sorts them by key
    (stable, so ties stay in row order); ``Off [B, S_kv + 1] int32`` delimits each key's run.  One
    CTA per key row, each thread 4 columns; a fixed summation order makes it bitwise repeatable.
    """
    assert d_qk % threads == 0 or d_qk % (threads // 2) == 0
    B = T.dynamic("B")
    R = T.dynamic("R")
    S_kv = T.dynamic("S_kv")
    S_kv1 = T.dynamic("S_kv1")

    @T.prim_func
    def sparse_bwd_slot_reduce(
        Parts: T.Tensor([B, R, d_qk], "float32"),
        Perm: T.Tensor([B, R], "int32"),
        Off: T.Tensor([B, S_kv1], "int32"),
        dKV: T.Tensor([B, S_kv, d_qk], "float32"),
    ):
        with T.Kernel(S_kv, B, threads=threads) as (j, b_i):
            acc = T.alloc_fragment([d_qk], "float32")
            for d in T.Parallel(d_qk):
                acc[d] = dKV[b_i, j, d]
            for e in T.serial(Off[b_i, j + 1] - Off[b_i, j]):
                r = Perm[b_i, Off[b_i, j] + e]
                for d in T.Parallel(d_qk):
                    acc[d] = acc[d] + Parts[b_i, r, d]
            for d in T.Parallel(d_qk):
                dKV[b_i, j, d] = acc[d]

    return sparse_bwd_slot_reduce
