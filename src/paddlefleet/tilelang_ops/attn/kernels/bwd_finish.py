"""The last backward kernel: the fp32 dKV accumulator to bf16.

The main backward kernels add every key's dKV into an fp32 accumulator ``[B, S_kv, Dk]``, in
the permuted column order of ``tiling.dkv_column`` for 64-head tiles and, in the
deterministic backward, in units of each key's power-of-two grid.  ``finish`` undoes both and
rounds to bf16.  Compiles with ``settings.PASS_CONFIGS``.
"""

from ... import settings
from ..tiling import dkv_column

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["finish"]


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def finish(d_qk: int, permuted: bool, deterministic: bool, block_rows: int = 8,
           threads: int = 128):
    """``dKV [B, S_kv, Dk] bf16`` from the main kernel's fp32 accumulator ``Acc [B, S_kv,
    Dk]``: column ``c`` read at :func:`dkv_column` ``(c)`` when ``permuted``, times the key's grid
    ``g_j = 1 / InvGrid[b, j]`` when ``deterministic`` (the accumulator holds grid units: an
    exact division by a power of two), rounded to bf16.  ``InvGrid [B, S_kv] fp32`` is not read
    unless ``deterministic``."""
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
                    if deterministic:
                        dKV[b_i, row, c] = T.Cast("bfloat16",
                                                  Acc[b_i, row, col_of(c)] / InvGrid[b_i, row])
                    else:
                        dKV[b_i, row, c] = T.Cast("bfloat16", Acc[b_i, row, col_of(c)])

    return sparse_bwd_finish

