"""Asynchronous copies of the warp-specialised kernels.

* ``tma_head_tile``: a query (or dO) head tile by TMA, one elected thread issuing the boxes
  (issued as 16-byte ``cp.async`` by every thread, the forward's 384 threads took 3.4 us just to
  issue its 4,608 pieces);
* ``load_key_rows`` / ``gather_key_block``: a key block's latent rows through the top-k indices,
  16-byte ``cp.async`` by the forward's producer warpgroup, which the caller commits to an
  mbarrier (``T.cp_async_barrier_noinc``).

Why by hand: a ``T.copy`` by a thread count that does not divide the tile lowered to two-byte
loads (~65 us per CTA in the forward), and the gather's rows come through the top-k indices.
"""

from ... import settings

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["tma_head_tile", "gather_key_block", "load_key_rows"]


@T.macro
def tma_head_tile(src, b_i, s_i, h0, dst_l, dst_r, dst_t, barrier):
    """``src[b_i, s_i, h0:h0 + M, :]`` (``[M, width]`` bf16) into shared memory by TMA (one
    elected thread issues the boxes): columns ``[0, DH)`` into ``dst_l``, ``[DH, 2 DH)`` into
    ``dst_r`` and the rest (a rope tail) into ``dst_t`` (``None`` when ``width = 2 DH``), its
    bytes expected on ``barrier``.  The expect is no arrive: after the last tile every calling
    thread arrives on ``barrier`` (its arrive count), so the phase cannot end before the
    elected thread's expect (its own arrive comes after it)."""
    M, DH = dst_l.shape
    T.tma_copy(src[b_i, s_i, h0:h0 + M, :DH], dst_l, barrier=barrier[0])
    T.tma_copy(src[b_i, s_i, h0:h0 + M, DH:2 * DH], dst_r, barrier=barrier[0])
    if dst_t is not None:
        T.tma_copy(src[b_i, s_i, h0:h0 + M, 2 * DH:], dst_t, barrier=barrier[0])


@T.macro
def copy_key_row(KV, row, j, K_l, K_r, K_t, b_i, t):
    """Thread ``t``'s 16-byte pieces of latent row ``row`` into row ``j`` of the buffers of
    :func:`gather_key_block` (8 threads per row)."""
    DH = K_l.shape[1] if K_l is not None else K_r.shape[1]
    for u in T.serial(DH // 64):
        if K_l is not None:
            T.ptx_cp_async(T.access_ptr(K_l[j, 64 * u + (t % 8) * 8], "w", 8),
                           T.access_ptr(KV[b_i, row, 64 * u + (t % 8) * 8], "r", 8), 8)
        if K_r is not None:
            T.ptx_cp_async(T.access_ptr(K_r[j, 64 * u + (t % 8) * 8], "w", 8),
                           T.access_ptr(KV[b_i, row, DH + 64 * u + (t % 8) * 8], "r", 8), 8)
    if K_t is not None:
        D_tail = K_t.shape[1]
        for u in T.serial(-(-D_tail // 64)):
            if (t % 8) * 8 + 64 * u < D_tail:
                T.ptx_cp_async(T.access_ptr(K_t[j, 64 * u + (t % 8) * 8], "w", 8),
                               T.access_ptr(KV[b_i, row, 2 * DH + 64 * u + (t % 8) * 8],
                                            "r", 8), 8)


@T.macro
def gather_key_block(KV, rows, K_l, K_r, K_t, b_i, t):
    """A key block's latent rows into ``K_l`` / ``K_r`` (the two halves of the first ``2 DH``
    columns) and ``K_t`` (the rope tail), by 128 threads (``t`` in ``[0, 128)``, 8 per row);
    ``rows`` is thread ``t``'s share of the block's rows from :func:`load_key_rows`.  ``K_l``
    may be ``None`` (only the right half and the tail), or ``K_r`` and ``K_t`` (only the left
    half): a caller that frees the two parts at different times gathers them separately.  A
    ``-1`` slot copies row 0 (``load_key_rows`` clamps it; the index is never an address);
    the kernel masks its score to ``-inf``."""
    for r in T.unroll(rows.shape[0]):
        copy_key_row(KV, rows[r], r * 16 + t // 8, K_l, K_r, K_t, b_i, t)


@T.macro
def load_key_rows(Indices, b_i, s_i, k, t, rows):
    """The clamped latent rows ``max(Indices[b_i, s_i, k BK + j], 0)`` that thread ``t`` of
    :func:`gather_key_block` copies (``rows [BK / 16]`` int32, local), all loads in flight at
    once: a caller that gathers a block in parts loads its indices once, early."""
    for r in T.unroll(rows.shape[0]):
        rows[r] = T.max(Indices[b_i, s_i, k * rows.shape[0] * 16 + r * 16 + t // 8], 0)
