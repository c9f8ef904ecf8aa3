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

__all__ = ["row_key_blocks", "last_row_first"]

WARP = 32
VEC = 4  # int32 per 16-byte load


def last_row_first(bx, S):
    """The query row of CTA ``bx`` (``blockIdx.x``): the last row first.  The hardware starts
    CTAs in ``blockIdx`` order; a causal row's work grows with its position, so the longest
    rows start first and the shortest fill the last wave."""
    return S - 1 - bx


@T.macro
def row_key_blocks(Indices, b_i, s_i, lane, block, v, last, nb):
    """``nb[0]``: the blocks of ``block`` slots of row ``(b_i, s_i)`` up to and including the
    one that holds its last slot with a key (``>= 0``), at least 1 (a row without keys walks
    one masked block, as before).  Each warp scans the whole row by itself (the row's ``4 L``
    bytes, L1 hits after the first warp) and ends with the same value on every lane: no
    shared memory and no CTA barrier (a shared scratch would be reused by the liveness-based
    merge for buffers the other warpgroups write while a slow warp may still read it).
    Scratch: ``v`` local ``[4]`` int32, ``last`` local ``[1]`` int32.  Call it before a long
    wait (the query tile's), so that its loads fly under that one."""
    L = Indices.shape[2]
    last[0] = 0
    for p in T.serial(T.ceildiv(L, WARP * VEC)):
        base = (p * WARP + lane) * VEC
        if base < L:
            for e in T.unroll(VEC):
                v[e] = Indices[b_i, s_i, base + e]
            for e in T.unroll(VEC):  # slots grow with p and e: the last hit is the largest
                if v[e] >= 0:
                    last[0] = base + e + 1
    for k in T.unroll(5):
        last[0] = T.max(last[0], T.shfl_xor(last[0], 16 >> k))
    nb[0] = T.max(1, T.ceildiv(last[0], block))
