"""Inline PTX the kernels put in their ``prelude`` (``T.Kernel(..., prelude=...)``), in one place.

Each snippet is a ``__device__`` function that a kernel calls with ``T.call_extern``; the name
starts with ``pf_`` so that it cannot clash with TileLang's own helpers.
"""

__all__ = ["RED_V4_SRC"]

#: ``pf_red_add_v4_if(p, base, off, x, y, z, w)``: ``base[off:off + 4] += (x, y, z, w)`` as one
#: 16-byte fp32 reduction under the predicate ``p`` (PTX ISA 8.1+, sm_90), with no branch: the
#: 64-head atomic backward's dKV scatter (``bwd_two_warpgroups``, ``pred_red``)
RED_V4_SRC = r"""
__device__ __forceinline__ void pf_red_add_v4_if(bool p, float* base, long long off, float x,
                                                 float y, float z, float w) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %0, 0;\n"
               "@q red.relaxed.gpu.global.add.v4.f32 [%1], {%2, %3, %4, %5};\n}\n"
               :: "r"((int)p), "l"(base + off), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}
"""
