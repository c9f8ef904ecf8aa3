"""How many key blocks of its top-k row a CTA of the warp-specialised kernels has to walk.

A DSA indexer fills a row that sees fewer than ``topk`` keys (the first ``topk`` rows of a
causal sequence with ``S = S_kv``) with ``-1`` after its keys.  Blocks past the row's last
slot with a key add exactly nothing (every ``P`` is 0, no slot is scattered), so the 64-head
forward and backward stop after the block that holds it: at ``S = S_kv = 8192``, ``topk = 640``
the first 640 rows walk 1-10 blocks instead of 10 (3.5% of all blocks).  The rows are also
walked last-row-first (``last_row_first``), so that those short CTAs come last and fill the
final wave instead of leaving SMs idle behind a full-length one.
"""

from ... import settings

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["alloc_scratch", "row_key_blocks", "last_row_first"]

WARP = 32
VEC = 4  # slots per thread and unrolled group (loaded together, guarded by L: not vectorised)


def last_row_first(bx, S):
    """The query row of CTA ``bx`` (``blockIdx.x``): the last row first.  The hardware starts
    CTAs in ``blockIdx`` order; a causal row's work grows with its position, so the longest
    rows start first and the shortest fill the last wave."""
    return S - 1 - bx


def alloc_scratch(threads):
    """``(v, last, warp_last, nb)`` of :func:`row_key_blocks`.  ``warp_last`` is static shared
    memory (scope ``"shared"``), which TileLang's shared-memory merge leaves alone: in the
    dynamic pool its liveness-based reuse put it under a buffer that another warpgroup writes
    later, while a slow warp may still read it."""
    return (T.alloc_local([2 * VEC], "int32"), T.alloc_local([1], "int32"),
            T.alloc_shared([threads // WARP], "int32", scope="shared"),
            T.alloc_local([1], "int32"))


@T.macro
def row_key_blocks(Indices, b_i, s_i, tx, threads, block, v, last, warp_last, nb):
    """``nb[0]``: the blocks of ``block`` slots of row ``(b_i, s_i)`` up to and including the
    one that holds its last slot with a key (``>= 0``), at least 1 (a row without keys walks
    one masked block, as before).  Every one of the CTA's ``threads`` threads calls it (it ends
    in a CTA barrier) and gets the same value; scratch from :func:`alloc_scratch`.  The kernels
    need ``L >= block`` (the host pads the top-k to a multiple of it): ``nb >= 1`` always walks
    block 0, which the 64-head backward gathers before this count.  Each thread
    loads 8 slots per pass, all before it looks at them (a 2048-slot row is one pass of 256
    threads), then a warp butterfly and the warps' maxima through shared memory.  Call it
    before a long wait (the query tile's), so that its loads fly under that one (a scan by
    every warp of the whole row, one load latency per 128 slots, cost 0.2 ms at ref)."""
    L = Indices.shape[2]
    last[0] = 0
    for p in T.serial(T.ceildiv(L, threads * 2 * VEC)):
        for u in T.unroll(2):
            for e in T.unroll(VEC):
                v[u * VEC + e] = -1
                if ((p * 2 + u) * threads + tx) * VEC + e < L:
                    v[u * VEC + e] = Indices[b_i, s_i, ((p * 2 + u) * threads + tx) * VEC + e]
        for u in T.unroll(2):
            for e in T.unroll(VEC):  # slots grow with p, u and e: the last hit is the largest
                if v[u * VEC + e] >= 0:
                    last[0] = ((p * 2 + u) * threads + tx) * VEC + e + 1
    for k in T.unroll(5):
        last[0] = T.max(last[0], T.shfl_xor(last[0], 16 >> k))
    if tx % WARP == 0:
        warp_last[tx // WARP] = last[0]
    T.sync_threads()
    for w in T.serial(threads // WARP):
        last[0] = T.max(last[0], warp_last[w])
    nb[0] = T.max(1, T.ceildiv(last[0], block))
