"""The ``timeline`` diagnostic of the 64-head kernels: SM-cycle stamps of a CTA's stages, written
into one of the kernel's fp32 row buffers (the forward's ``Lse``, the fused backward's ``DSink``)
in place of its values, slot ``e`` of the CTA's row at ``[b, s, h0 + e]``.  Read by
``tools/experiments/fwd_timeline.py`` and ``bwd_timeline.py``; off (the default), the macros
emit nothing and the kernels read no clock.
"""

from ... import settings

tilelang = settings.import_tilelang()
from tilelang import language as T  # noqa: E402

__all__ = ["SMID_SRC", "stampers"]

#: a device function that reads the SM's id (``%smid``), for a kernel's ``prelude``
SMID_SRC = r"""
__device__ __forceinline__ int pf_smid() {
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return (int)r;
}
"""


def stampers(enabled: bool):
    """``(start, stamp, stamp_clock)`` macros, each a no-op unless ``enabled``.

    * ``start(t0)``: ``t0[0]`` (local int64) = the SM's clock, the CTA's time origin;
    * ``stamp(buf, b, s, h0, t0, e, cond)``: where ``cond``, cycles since ``t0`` into slot ``e``;
    * ``stamp_clock(buf, b, s, h0, clk, e, cond)``: where ``cond``, the clock value ``clk[0]``
      itself (local int64; read it first), exactly, as bits 24 and up in slot ``e`` and bits
      0-23 in slot ``e + 1`` (an fp32 holds 24 bits).
    """

    @T.macro
    def start(t0):
        if enabled:
            t0[0] = T.call_extern("int64", "clock64")

    @T.macro
    def stamp(buf, b_i, s_i, h0, t0, e, cond):
        if enabled:
            if cond:
                buf[b_i, s_i, h0 + e] = T.Cast("float32",
                                               T.call_extern("int64", "clock64") - t0[0])

    @T.macro
    def stamp_clock(buf, b_i, s_i, h0, clk, e, cond):
        if enabled:
            if cond:
                buf[b_i, s_i, h0 + e] = T.Cast("float32", T.shift_right(clk[0], T.int64(24)))
                buf[b_i, s_i, h0 + e + 1] = T.Cast("float32",
                                                   T.bitwise_and(clk[0], T.int64(0xFFFFFF)))

    return start, stamp, stamp_clock
