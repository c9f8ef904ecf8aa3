"""TileLang kernel behind the wrappers' value checks (``checks.check_values``): one launch
instead of ~10 framework reductions before the check's device-to-host read (which is a stream
sync, so every launch before it is exposed host time: docs/performance.md).

``value_stats``   a fixed grid of ``CTAS`` CTAs strides over the (contiguous, int32) top-k
                  indices and the lse; CTA ``g`` writes ``Part[g] = (min index, max index,
                  NaN/+inf sinks, NaN lse)`` (the sinks are counted by CTA 0 only).  The host
                  reduces the ``CTAS`` rows (min, max, sum): no atomics, no zeroed output.
                  On the way it writes ``Safe``, a copy of the indices with every value outside
                  ``[0, S_kv)`` replaced by ``-1``: the attention kernels read that copy, so no
                  index is ever dereferenced out of range, and the wrappers can wait for the
                  numbers (and raise) after the kernels are queued instead of before (a wait
                  before them left the GPU idle while the host launched them).
"""

from ... import settings

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["value_stats", "CTAS", "MAX_ELEMENTS"]

#: 8 CTAs of 256 threads per SM of an H200 (132 SMs): enough loads in flight to stream the
#: indices (256 CTAs took 24-26 us at the reference shape, ~1.5x the bytes' time)
CTAS = 1024
#: The most elements of one input it handles: its loop bounds are int32 (with a CTA's stride to
#: spare); the wrappers check larger tensors with framework reductions.
MAX_ELEMENTS = 2**31 - 1 - 2**20
INT_MAX = 2**31 - 1
INT_MIN = -(2**31)


@T.macro
def _warp_step(acc, off):
    # one butterfly step of the four statistics (min, max, sum, sum) over the warp
    acc[0] = T.min(acc[0], T.shfl_xor(acc[0], off))
    acc[1] = T.max(acc[1], T.shfl_xor(acc[1], off))
    acc[2] = acc[2] + T.shfl_xor(acc[2], off)
    acc[3] = acc[3] + T.shfl_xor(acc[3], off)


@tilelang.jit(pass_configs=settings.PASS_CONFIGS)
def value_stats(has_sink: bool, has_lse: bool, threads: int = 256):
    """``Part [CTAS, 4] int32`` and ``Safe [N] int32`` from ``Indices [N] int32``, ``Sink [H]
    fp32`` (read if ``has_sink``), ``Lse [M] fp32`` (read if ``has_lse``) and the scalar
    ``s_kv``; ``N``, ``H``, ``M`` dynamic.  ``Safe[i] = Indices[i]`` if it is in ``[0, s_kv)``,
    else ``-1``.  A CTA with no index to read reports ``(INT_MAX, INT_MIN, ...)``."""
    N = T.dynamic("N")
    H = T.dynamic("H")
    M = T.dynamic("M")
    stride = CTAS * threads
    NW = threads // 32

    @T.prim_func
    def value_stats_kernel(
        Indices: T.Tensor([N], "int32"),
        Sink: T.Tensor([H], "float32"),
        Lse: T.Tensor([M], "float32"),
        Part: T.Tensor([CTAS, 4], "int32"),
        Safe: T.Tensor([N], "int32"),
        s_kv: T.int32,
    ):
        with T.Kernel(CTAS, threads=threads) as g:
            acc = T.alloc_local([4], "int32")
            red = T.alloc_shared([NW, 4], "int32")
            tx = T.get_thread_binding()
            first = g * threads + tx
            acc[0] = INT_MAX
            acc[1] = INT_MIN
            acc[2] = 0
            acc[3] = 0
            for i in T.serial(T.ceildiv(N - first, stride)):
                v = Indices[first + i * stride]
                acc[0] = T.min(acc[0], v)
                acc[1] = T.max(acc[1], v)
                Safe[first + i * stride] = T.if_then_else(v < s_kv, T.max(v, -1), -1)
            if has_lse:
                for i in T.serial(T.ceildiv(M - first, stride)):
                    x = Lse[first + i * stride]
                    # T.isnan: the simplifier folds x != x to false
                    acc[3] = acc[3] + T.if_then_else(T.isnan(x), 1, 0)
            if has_sink:
                if g == 0:
                    for i in T.serial(T.ceildiv(H - tx, threads)):
                        x = Sink[tx + i * threads]
                        # NaN and +inf (not x < inf); -inf is allowed (no sink for that head)
                        acc[2] = acc[2] + T.if_then_else(x < T.infinity("float32"), 0, 1)
            # the CTA's numbers: warp butterflies, then thread 0 over the warps (a serial pass
            # over all 256 threads' numbers was a long dependent chain)
            _warp_step(acc, 16)
            _warp_step(acc, 8)
            _warp_step(acc, 4)
            _warp_step(acc, 2)
            _warp_step(acc, 1)
            if tx % 32 == 0:
                for e in T.serial(4):
                    red[tx // 32, e] = acc[e]
            T.sync_threads()
            if tx == 0:
                for r in T.serial(NW - 1):
                    acc[0] = T.min(acc[0], red[r + 1, 0])
                    acc[1] = T.max(acc[1], red[r + 1, 1])
                    acc[2] = acc[2] + red[r + 1, 2]
                    acc[3] = acc[3] + red[r + 1, 3]
                for e in T.serial(4):
                    Part[g, e] = acc[e]

    return value_stats_kernel
