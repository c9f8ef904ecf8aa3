"""The kernel provider: what the host wrappers launch their kernels through.

:class:`KernelProvider` states what a provider must offer; :class:`TileLangKernels` is the one
that launches the TileLang kernels (CUDA tensors of either framework) and the only place in the
host code that touches TileLang, so that the wrappers' padding / slicing / LSE-bridge logic can
be tested on CPU against stand-ins that implement each kernel's math (``tests/helpers.py``,
``CpuStandIn``).  :data:`DEFAULT_PROVIDER` is what the wrappers use when given none.

One name for the backward's choice, ``deterministic``, from the public API down to the
provider: ``bwd_main`` and ``bwd_finish`` take it as their second argument (``True``: the dKV
summed exactly on per-key grids, ``exact_dkv.py``; ``False``: fp32 atomics).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, NamedTuple, Protocol, runtime_checkable

from .adapter import ops_for
from .kernels import FUSED_TILES

__all__ = ["KernelProvider", "TileLangKernels", "FusedPreprocess", "DEFAULT_PROVIDER",
           "fuses_preprocess"]


class FusedPreprocess(NamedTuple):
    """What ``bwd_main(..., pre=...)`` needs to do the preprocess's work itself: with it the
    main kernel writes ``lse2`` and ``delta`` (``[B, S, H_pad] fp32``, otherwise its inputs)
    and ``d_sink_rows`` from these, with the values and pad-head zeros of ``bwd_preprocess``.
    The deterministic backward's ``exact_grid_rows`` takes the same fields (it writes the same
    three outputs).

    natural: the format of ``lse`` (``True``: natural log, sink-exclusive; ``False``: base 2,
        sink-inclusive).
    out: ``[B, S, H, Dv] bf16``, the forward output (the real heads, contiguous).
    lse: ``[B, S, H] fp32`` (contiguous).
    sink: ``[H] fp32``, ``-inf`` for no sink.
    d_sink_rows: ``[B, S, H_pad] fp32``, written: each row's term of ``d_sink``.
    """

    natural: bool
    out: Any
    lse: Any
    sink: Any
    d_sink_rows: Any


@runtime_checkable
class KernelProvider(Protocol):
    """What a kernel provider offers the host wrappers (``interface.py``, ``exact_dkv.py``).

    ``device``: the device kind (``"cuda"``, ``"cpu"``) its tensors must be on.  One launcher
    per kernel; each fills its output arguments in place.  The static arguments come first
    (head tile ``heads_per_cta``, ``deterministic``, ``with_dq``, the lse format ``natural``),
    then the tensors in the kernel's order, then its scalar arguments.  Shapes (``H_pad``: the
    padded heads of ``tiling.head_plan``; ``L``: the top-k width padded to
    ``tiling.INDEX_PAD`` with ``-1``; indices int32):

    * ``fwd(heads_per_cta, q [B,S,H_pad,Dk], kv [B,S_kv,Dk], indices [B,S,L], sink [H_pad],
      scale [1], out [B,S,H_pad,Dv], lse [B,S,H_pad])``: the forward, natural sink-exclusive
      ``lse``.
    * ``bwd_preprocess(natural, out [R,Dv], grad_out [R,Dv], lse [R], sink [H], delta, lse2,
      d_sink_rows)`` (``R = B*S*H``; outputs ``[B*S, H_pad]``): Delta, the base-2 sink-inclusive
      lse, each row's term of ``d_sink`` (the atomic backward where not fused).
    * ``bwd_main(heads_per_cta, deterministic, with_dq, q, kv, grad_out [B,S,H_pad,Dv],
      indices, lse2, delta, scale, inv_grid [B,S_kv], counts [B,S], dq, dkv_acc [B,S_kv,Dk]
      fp32, bound [B,S_kv] int64, bound_exp [B,S_kv] int32, pre=None)``: dq and the dKV
      accumulator; ``deterministic`` adds each contribution on its key's grid
      (``inv_grid``) and sums ``bound`` / ``bound_exp``; ``with_dq=False`` (the exact re-run)
      reads the first ``counts`` slots of each row only.  ``pre`` (a :class:`FusedPreprocess`)
      only for the tiles in the provider's optional ``fused_preprocess_tiles``, and only where
      ``bwd_main`` has that parameter (:func:`fuses_preprocess`).
    * ``bwd_finish(heads_per_cta, deterministic, dkv_acc, inv_grid, dkv)``: the bf16 dKV in
      the real column order (``dkv_acc / inv_grid`` when ``deterministic``).  The accumulator's
      column order between ``bwd_main`` and ``bwd_finish`` is the provider's own
      (``tiling.dkv_column`` for the TileLang 64-head tiles).
    * the exact dKV's bookkeeping (``kernels/exact_grid.py``; ``exact_dkv.py`` says when each
      runs): ``exact_grid_rows(natural, q, out, grad_out, lse, sink, indices, kv_norm, delta,
      lse2, d_sink_rows, c_row, kv_coef)`` (also the deterministic backward's preprocess),
      ``exact_grid_scatter(c_row, top, indices, est)``, ``exact_grid_keys(est, top, inv_grid,
      shift, e_lo, e_hi)``, ``exact_rerun_plan(bound, bound_exp, inv_grid, dkv_acc, over,
      any_over, n_max, exact_bits, coarse_bits)`` (sets ``any_over [B]``, zeroed by the
      caller, to 1 for each batch with a re-run key) and ``exact_rerun_slots(indices, over,
      any_over, indices2, counts)`` (writes ``counts`` whole and ``indices2`` only where the
      re-run reads it: in each row of a flagged batch its re-run slots, then ``-1`` to the end
      of their ``tiling.INDEX_PAD``-slot block).

    Optional: ``value_stats(token_indices, attn_sink, lse, s_kv)`` (one launch of the value
    checks, ``checks.start_value_checks``) and ``fused_preprocess_tiles``.
    """

    device: str

    def fwd(self, heads_per_cta, q, kv, indices, sink, scale, out, lse) -> None: ...

    def bwd_preprocess(self, natural, out, grad_out, lse, sink, delta, lse2,
                       d_sink_rows) -> None: ...

    def bwd_main(self, heads_per_cta, deterministic, with_dq, q, kv, grad_out, indices, lse2,
                 delta, scale, inv_grid, counts, dq, dkv_acc, bound, bound_exp,
                 pre=None) -> None: ...

    def bwd_finish(self, heads_per_cta, deterministic, dkv_acc, inv_grid, dkv) -> None: ...

    def exact_grid_rows(self, natural, q, out, grad_out, lse, sink, indices, kv_norm, delta,
                        lse2, d_sink_rows, c_row, kv_coef) -> None: ...

    def exact_grid_scatter(self, c_row, top, indices, est) -> None: ...

    def exact_grid_keys(self, est, top, inv_grid, shift, e_lo, e_hi) -> None: ...

    def exact_rerun_plan(self, bound, bound_exp, inv_grid, dkv_acc, over, any_over, n_max,
                         exact_bits, coarse_bits) -> None: ...

    def exact_rerun_slots(self, indices, over, any_over, indices2, counts) -> None: ...


class TileLangKernels:
    """The :class:`KernelProvider` that launches the TileLang kernels (CUDA tensors of either
    framework; ``device = "cuda"``).

    Its ``bwd_main`` takes ``pre`` for the 64-head tile (``fused_preprocess_tiles``), whose
    two-warpgroup kernel has the preprocess as a prologue; it permutes the 64-head tiles'
    accumulator columns (``tiling.dkv_column``), ``bwd_finish`` writes the real order.  Compiled
    kernels are cached by TileLang per static specialisation (head tile, Dk, Dv, dKV mode, dQ
    on/off, the preprocess's lse format, fused or not); shapes are dynamic.
    """

    device = "cuda"
    #: head tiles whose ``bwd_main`` takes ``pre`` (``bwd_two_warpgroups``, ``fused``)
    fused_preprocess_tiles = FUSED_TILES

    def __init__(self):
        # compiled kernels by static key: skips TileLang's argument binding on every call
        self._kernels = {}

    def _kernel(self, key):
        kernel = self._kernels.get(key)
        if kernel is None:
            from . import kernels

            kernel = self._kernels[key] = kernels.build(key[0], key[1:])
        return kernel

    def fwd_key(self, heads_per_cta, d_qk, d_v) -> tuple:
        """The registry key (``kernels.build``'s name and arguments) of the forward; a subclass
        that tries another schedule changes the key only."""
        return ("fwd", heads_per_cta, d_qk, d_v)

    def fwd(self, heads_per_cta, q, kv, indices, sink, scale, out, lse):
        key = self.fwd_key(heads_per_cta, int(q.shape[-1]), int(out.shape[-1]))
        self._kernel(key)(q, kv, indices, sink, scale, out, lse)

    def value_stats(self, token_indices, attn_sink, lse, s_kv):
        """``(rows, safe)``: ``rows`` ``[CTAS, 4] int32`` on the device, ``(min index, max index,
        NaN/+inf sinks, NaN lse)`` per CTA of one kernel (``kernels/value_stats.py``; the caller
        reduces them on the host: ``checks.start_value_checks``), and ``safe``, the indices with
        every value outside ``[0, s_kv)`` replaced by ``-1`` (same shape, int32).  ``None`` (the
        caller falls back to framework reductions) unless every tensor is on CUDA, has at most
        ``MAX_ELEMENTS`` elements, and the indices are contiguous int32 (int64 values must be
        checked before any cast to int32)."""
        ts = [t for t in (token_indices, attn_sink, lse) if t is not None]
        ops = ops_for(*ts)
        if (any(ops.device_kind(t) != "cuda" for t in ts) or ops.dtype(token_indices) != "int32"
                or not ops.is_contiguous(token_indices)):
            return None
        from .kernels.value_stats import CTAS, MAX_ELEMENTS

        if max(math.prod(ops.shape(t)) for t in ts) > MAX_ELEMENTS:
            return None  # its loop bounds are int32

        part = ops.empty((CTAS, 4), "int32", token_indices)
        safe = ops.empty(ops.shape(token_indices), "int32", token_indices)
        dummy = None if attn_sink is not None and lse is not None else \
            ops.empty((1,), "float32", token_indices)
        flat = [ops.reshape(ops.contiguous(t), (-1,)) if t is not None else dummy
                for t in (attn_sink, lse)]
        self._kernel(("value_stats", attn_sink is not None, lse is not None))(
            ops.reshape(token_indices, (-1,)), flat[0], flat[1], part, ops.reshape(safe, (-1,)),
            int(s_kv))
        return part, safe

    def bwd_preprocess(self, natural, out, grad_out, lse, sink, delta, lse2, d_sink_rows):
        from .kernels import pre_args

        key = ("bwd_pre",) + pre_args(natural, int(out.shape[-1]))
        self._kernel(key)(out, grad_out, lse, sink, delta, lse2, d_sink_rows)

    def bwd_main_key(self, heads_per_cta, deterministic, with_dq, d_qk, d_v, pre=None) -> tuple:
        """The registry key of the main backward (``pre``: the fused preprocess's inputs, or
        ``None``); a subclass that tries another schedule changes the key only."""
        from .kernels import main_args

        return ("bwd_main",) + main_args(heads_per_cta, bool(deterministic), bool(with_dq), d_qk,
                                         d_v, fused=pre is not None,
                                         natural=pre is None or pre.natural)

    def bwd_main(self, heads_per_cta, deterministic, with_dq, q, kv, grad_out, indices, lse2,
                 delta, scale, inv_grid, counts, dq, dkv_acc, bound, bound_exp, pre=None):
        key = self.bwd_main_key(heads_per_cta, deterministic, with_dq, int(q.shape[-1]),
                                int(grad_out.shape[-1]), pre)
        args = (q, kv, grad_out, indices, lse2, delta, scale, inv_grid, counts, dq, dkv_acc,
                bound, bound_exp)
        if pre is None:
            self._kernel(key)(*args)
        else:
            self._kernel(key)(*args, pre.out, pre.lse, pre.sink, pre.d_sink_rows)

    def bwd_finish(self, heads_per_cta, deterministic, dkv_acc, inv_grid, dkv):
        from .kernels import finish_args

        key = ("bwd_finish",) + finish_args(heads_per_cta, bool(deterministic),
                                            int(dkv_acc.shape[-1]))
        self._kernel(key)(dkv_acc, inv_grid, dkv)

    # --- the exact dKV's bookkeeping (kernels/exact_grid.py) --------------------------------
    def exact_grid_rows(self, natural, q, out, grad_out, lse, sink, indices, kv_norm, delta,
                        lse2, d_sink_rows, c_row, kv_coef):
        from .kernels import grid_rows_args

        key = ("grid_rows",) + grid_rows_args(natural, int(q.shape[-1]), int(out.shape[-1]))
        self._kernel(key)(q, out, grad_out, lse, sink, indices, kv_norm, delta, lse2,
                          d_sink_rows, c_row, float(kv_coef))

    def exact_grid_scatter(self, c_row, top, indices, est):
        self._kernel(("grid_scatter",))(c_row, top, indices, est)

    def exact_grid_keys(self, est, top, inv_grid, shift, e_lo, e_hi):
        self._kernel(("grid_keys",))(est, top, inv_grid, int(shift), int(e_lo), int(e_hi))

    def exact_rerun_plan(self, bound, bound_exp, inv_grid, dkv_acc, over, any_over, n_max,
                         exact_bits, coarse_bits):
        self._kernel(("rerun_plan", int(dkv_acc.shape[-1])))(
            bound, bound_exp, inv_grid, dkv_acc, over, any_over, float(n_max), int(exact_bits),
            int(coarse_bits))

    def exact_rerun_slots(self, indices, over, any_over, indices2, counts):
        self._kernel(("rerun_slots",))(indices, over, any_over, indices2, counts)


#: The provider the wrappers use when given none (tests put a stand-in here).
DEFAULT_PROVIDER: KernelProvider = TileLangKernels()


@functools.lru_cache(maxsize=None)
def _takes_pre(bwd_main) -> bool:
    try:
        return "pre" in inspect.signature(bwd_main).parameters
    except (TypeError, ValueError):  # no signature to read: not assumed
        return False


def fuses_preprocess(provider, heads_per_cta) -> bool:
    """Whether ``provider.bwd_main`` does the preprocess's work for this head tile
    (``pre=``, :class:`TileLangKernels`): listed in its ``fused_preprocess_tiles`` and a
    ``pre`` parameter in its ``bwd_main`` (a subclass overriding it without one is not)."""
    if heads_per_cta not in getattr(provider, "fused_preprocess_tiles", ()):
        return False
    bwd_main = provider.bwd_main
    return _takes_pre(getattr(bwd_main, "__func__", bwd_main))
