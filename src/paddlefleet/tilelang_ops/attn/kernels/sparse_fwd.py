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

Static (one compile each): the head tile ``M`` (``tiling.head_plan``), ``Dk``, ``Dv``, the key
block.  Dynamic (no recompile): ``B``, ``S``, ``S_kv``, ``L`` (a multiple of the key block; the
host pads with ``-1``), ``H_pad`` (a multiple of ``M``).  ``sm_scale`` is a runtime value read
from the one-element tensor ``Scale``.  Every kernel compiles with ``settings.PASS_CONFIGS``.
"""


from ... import settings

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["sparse_fwd"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def sparse_fwd(heads_per_cta: int, d_qk: int, d_v: int, block_k: int = 64, threads: int = 256,
               num_stages: int = 1):
    """Build the forward kernel for one head tile.

    Args (all static):
        heads_per_cta: ``M``, the heads one CTA handles (16, 32 or 64).
        d_qk: ``Dk`` (576).  d_v: ``Dv`` (512); ``Dk - Dv`` is the rope tail.
        block_k: key block ``BK``; ``L`` must be a multiple of it.

    Kernel arguments: ``Q [B, S, H_pad, Dk] bf16``, ``KV [B, S_kv, Dk] bf16``,
    ``Indices [B, S, L] int32``, ``Sink [H_pad] fp32`` (``-inf`` = no sink / pad head),
    ``Scale [1] fp32`` (``sm_scale``), outputs ``O [B, S, H_pad, Dv] bf16`` and
    ``Lse [B, S, H_pad] fp32``.
    """
    assert heads_per_cta in (16, 32, 64), "the head tile is 16, 32 or 64 (tiling.head_plan)"
    assert d_qk > d_v and d_v % 64 == 0 and (d_qk - d_v) % 16 == 0, "unsupported Dk/Dv"
    M = heads_per_cta
    D = d_v
    D_tail = d_qk - d_v
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
            Q_tail_shared = T.alloc_shared([M, D_tail], dtype)
            KV_shared = T.alloc_shared([BK, D], dtype)
            K_tail_shared = T.alloc_shared([BK, D_tail], dtype)
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
            T.copy(Q[b_i, s_i, h0:h0 + M, D:], Q_tail_shared)

            for k_i in T.Pipelined(L // BK, num_stages=num_stages):
                for j in T.Parallel(BK):
                    valid[j] = Indices[b_i, s_i, k_i * BK + j] >= 0
                # gather through a clamped address: a -1 slot reads row 0 and is masked below
                for j, d in T.Parallel(BK, D):
                    KV_shared[j, d] = KV[b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0), d]
                for j, d in T.Parallel(BK, D_tail):
                    K_tail_shared[j, d] = KV[b_i, T.max(Indices[b_i, s_i, k_i * BK + j], 0),
                                             D + d]
                for h, j in T.Parallel(M, BK):
                    acc_s[h, j] = T.if_then_else(valid[j], 0, -T.infinity(acc_t))
                T.gemm(Q_shared, KV_shared, acc_s, transpose_B=True,
                       policy=T.GemmWarpPolicy.FullRow)
                T.gemm(Q_tail_shared, K_tail_shared, acc_s, transpose_B=True,
                       policy=T.GemmWarpPolicy.FullRow)

                T.copy(row_max, row_max_prev)
                T.reduce_max(acc_s, row_max, dim=1, clear=False)
                for h in T.Parallel(M):
                    row_max[h] = T.max(row_max[h], row_max_prev[h])
                    # no valid key yet (m = -inf): shift by 0 instead, so that no -inf - -inf
                    # (NaN) is formed; the scores and the previous max are -inf, exp2 gives 0
                    m_shift[h] = T.if_then_else(row_max[h] == -T.infinity(acc_t), 0.0,
                                                row_max[h])
                    alpha[h] = T.exp2((row_max_prev[h] - m_shift[h]) * scale2[0])
                for h, j in T.Parallel(M, BK):
                    acc_s[h, j] = T.exp2((acc_s[h, j] - m_shift[h]) * scale2[0])
                T.reduce_sum(acc_s, blk_sum, dim=1)
                for h in T.Parallel(M):
                    row_sum[h] = row_sum[h] * alpha[h] + blk_sum[h]
                for h, d in T.Parallel(M, D):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
                T.copy(acc_s, P_shared)
                T.gemm(P_shared, KV_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)

            # Fold in the sink (a softmax column with a zero value), in base 2:
            #   m = max(row_max * scale2, sink2); Z = row_sum * 2^(row_max*scale2 - m) + 2^(sink2 - m)
            # out = acc_o * 2^(row_max*scale2 - m) / Z  (0 when Z = 0: no key and no sink).
            for h in T.Parallel(M):
                m_key = row_max[h] * scale2[0]
                sink2 = Sink[h0 + h] * LOG2E
                m_all = T.max(m_key, sink2)
                # no key and no sink: m_all = -inf, every weight 0 (not exp2(-inf - -inf))
                w_key = T.if_then_else(m_all == -T.infinity(acc_t), 0.0, T.exp2(m_key - m_all))
                z = row_sum[h] * w_key + T.if_then_else(m_all == -T.infinity(acc_t), 0.0,
                                                        T.exp2(sink2 - m_all))
                alpha[h] = T.if_then_else(z > 0, w_key / z, 0)
                # natural, sink-exclusive: log2(0) = -inf for a row with no valid key
                lse_frag[h] = (T.log2(row_sum[h]) + m_key) * LN2
            for h, d in T.Parallel(M, D):
                acc_o[h, d] = acc_o[h, d] * alpha[h]
            T.copy(acc_o, O_shared)
            T.copy(O_shared, O[b_i, s_i, h0:h0 + M, :])
            T.copy(lse_frag, Lse[b_i, s_i, h0:h0 + M])

    return sparse_fwd_main
