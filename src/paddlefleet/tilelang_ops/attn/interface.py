"""Host wrappers of the TileLang sparse MQA-latent attention kernels.

``mqa_latent_sparse_fwd`` and ``mqa_latent_sparse_bwd`` take Paddle or PyTorch CUDA tensors and
return tensors of the same framework.  Each one: checks the inputs once
(``checks.check_tensors``, ``checks.check_values``), picks the head plan (``tiling.head_plan``),
makes inputs contiguous and 16-byte aligned (a copy where they are not:
``adapter.TensorOps.contiguous``), zero-pads the head axis to the plan's ``H_pad`` and the top-k
axis to a multiple of the key block (with ``-1``), launches the kernels through a *provider* and
slices the pad heads off.  The op (``op.py``) checks with the same rules once and then calls the
unchecked bodies ``_fwd`` / ``_bwd``.  The math is
``docs/conventions.md``; the exact definition is ``attn/reference.py``.

The provider (:class:`TileLangKernels` by default) is the only place that touches TileLang, so
the padding / slicing / LSE-bridge logic can be tested on CPU against stand-ins that implement
each kernel's math (``tests/test_interface.py``).

Determinism of the backward (``deterministic=True``): ``dq`` is written once per (row, head) by
the CTA that owns it; ``d_sink`` is a fixed-order sum of per-(b, s, h) partials; ``dkv`` is summed
exactly on a per-key power-of-two grid (:func:`_exact_dkv`; ``docs/conventions.md`` states the
precision), so the order in which CTAs add does not matter: all three are bitwise identical
across calls and processes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from typing import Any, NamedTuple

from . import tiling
from .adapter import ops_for, type_name
from .checks import check_sm_scale, check_tensors, start_value_checks
from .kernels import FUSED_TILES

__all__ = [
    "mqa_latent_sparse_fwd",
    "mqa_latent_sparse_bwd",
    "TileLangKernels",
    "FusedPreprocess",
    "FUSED_PREPROCESS",
    "EXACT_BITS",
    "GRID_MARGIN_BITS",
    "RERUN_COARSE_BITS",
]

_NEG_INF = float("-inf")

#: Every partial sum of one dKV column, counted in units of its key's grid, stays within
#: ``2**EXACT_BITS``: fp32 (24-bit significand) adds such integers exactly.
EXACT_BITS = 24
#: Head-room of the first pass's grid over its estimate of each key's sum (bits); a key whose
#: contributions are larger than that is re-run on a grid fitted to its exact bound.
GRID_MARGIN_BITS = 2
#: A key whose first-pass grid is this many bits (or more) coarser than its proven fit is re-run
#: on the finer grid too, so that a guess far too high never costs precision.
RERUN_COARSE_BITS = 6
# Clamp of the grid exponent: keeps 1 / g a normal fp32 number.
_GRID_EXP_RANGE = (-100, 100)
#: The atomic backward hands the preprocess's work to its main kernel (``bwd_main(...,
#: pre=FusedPreprocess(...))``) where the provider can (:class:`TileLangKernels`: 64-head
#: tiles): one launch fewer, and ``out`` / ``dO`` are not streamed from HBM a second time.
#: ``False``: the separate ``bwd_preprocess`` launch everywhere (A/B trials:
#: ``tools/experiments/kernel_trial.py --unfused``).
FUSED_PREPROCESS = True


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


class TileLangKernels:
    """Default provider: launches the TileLang kernels (CUDA tensors of either framework).

    A provider has ``device`` (the device kind its tensors must be on) and one launcher per
    kernel: ``fwd``, ``bwd_preprocess``, ``bwd_main``, ``bwd_finish`` and, around the
    deterministic backward's exact dKV passes, ``exact_grid_rows``, ``exact_grid_scatter``,
    ``exact_grid_keys``, ``exact_rerun_plan`` and ``exact_rerun_slots``
    (``kernels/exact_grid.py``).  Each fills its output arguments in place; the static
    arguments come first (head tile, mode, ``natural``, ``Dv``), then the tensors in the
    kernel's order, then its scalar arguments.  ``exact_rerun_plan(bound, bound_exp, inv_grid,
    dkv_acc, over, any_over, ...)`` also sets ``any_over [B] int32`` (zeroed by the caller) to
    1 for each batch with a re-run key; ``exact_rerun_slots(indices, over, any_over, indices2,
    counts)`` writes ``counts`` whole and ``indices2`` only where the re-run reads it: in each
    row of a flagged batch, its re-run slots and ``-1`` after them to the end of their
    ``tiling.INDEX_PAD``-slot block (nothing in a row or batch with ``counts = 0``).  The
    deterministic backward launches no ``bwd_preprocess``: ``exact_grid_rows(natural, q, out,
    grad_out, lse, sink, indices, kv_norm, delta, lse2, d_sink_rows, c_row, kv_coef)`` writes
    the preprocess's three outputs too, in the same pass as the rows' grid weights.  ``bwd_main``
    takes an optional last argument ``pre``, a :class:`FusedPreprocess`, for the head tiles in the
    provider's ``fused_preprocess_tiles`` (here the 64-head tile, whose two-warpgroup kernel
    has the preprocess as a prologue): the atomic backward then launches no
    ``bwd_preprocess`` (:data:`FUSED_PREPROCESS`).  A provider without that attribute, or whose
    ``bwd_main`` has no ``pre`` parameter (e.g. a subclass that overrides it), always gets the
    separate ``bwd_preprocess``.  The column order of the fp32 dKV accumulator between
    ``bwd_main`` and ``bwd_finish`` is the provider's own (these kernels permute the 64-head
    tiles', ``tiling.dkv_column``); ``bwd_finish`` writes the bf16 dKV in the real order.
    Compiled kernels are cached by TileLang per static specialisation (head tile, Dk, Dv, dKV
    mode, dQ on/off, the preprocess's lse format, fused or not); shapes are dynamic.
    """

    device = "cuda"
    #: head tiles whose ``bwd_main`` takes ``pre`` (``sparse_bwd._two_warpgroups``, ``fused``)
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

    def fwd(self, heads_per_cta, q, kv, indices, sink, scale, out, lse):
        key = ("fwd", heads_per_cta, int(q.shape[-1]), int(out.shape[-1]))
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

    def bwd_main(self, heads_per_cta, mode, with_dq, q, kv, grad_out, indices, lse2, delta,
                 scale, inv_grid, counts, dq, dkv_acc, bound, bound_exp, pre=None):
        from .kernels import main_args

        key = ("bwd_main",) + main_args(heads_per_cta, mode == "exact", bool(with_dq),
                                        int(q.shape[-1]),
                                        int(grad_out.shape[-1]), fused=pre is not None,
                                        natural=pre is None or pre.natural)
        args = (q, kv, grad_out, indices, lse2, delta, scale, inv_grid, counts, dq, dkv_acc,
                bound, bound_exp)
        if pre is None:
            self._kernel(key)(*args)
        else:
            self._kernel(key)(*args, pre.out, pre.lse, pre.sink, pre.d_sink_rows)

    def bwd_finish(self, heads_per_cta, scaled, dkv_acc, inv_grid, dkv):
        from .kernels import finish_args

        key = ("bwd_finish",) + finish_args(heads_per_cta, scaled, int(dkv_acc.shape[-1]))
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


_DEFAULT_PROVIDER = TileLangKernels()


@functools.lru_cache(maxsize=None)
def _takes_pre(bwd_main) -> bool:
    try:
        return "pre" in inspect.signature(bwd_main).parameters
    except (TypeError, ValueError):  # no signature to read: not assumed
        return False


def _fuses_preprocess(provider, heads_per_cta) -> bool:
    """Whether ``provider.bwd_main`` does the preprocess's work for this head tile
    (``pre=``, :class:`TileLangKernels`): listed in its ``fused_preprocess_tiles`` and a
    ``pre`` parameter in its ``bwd_main`` (a subclass overriding it without one is not)."""
    if heads_per_cta not in getattr(provider, "fused_preprocess_tiles", ()):
        return False
    bwd_main = provider.bwd_main
    return _takes_pre(getattr(bwd_main, "__func__", bwd_main))


def _check_bool(value, name):
    if not isinstance(value, bool):
        # type_name: numpy's bool prints as "numpy.bool", not a confusing bare "bool"
        raise TypeError(f"{name}: expected a Python bool, got {type_name(value)}")
    return value


def _pad_heads(ops, t, h_pad):
    """Zero-pad axis 2 (heads) of a ``[B, S, H, D]`` tensor to ``h_pad``."""
    b, s, h, d = ops.shape(t)
    if h == h_pad:
        return t
    return ops.concat([t, ops.zeros((b, s, h_pad - h, d), ops.dtype(t), t)], axis=2)


def _prepare_indices(ops, token_indices):
    """int32, contiguous, ``L`` padded with ``-1`` to a multiple of ``tiling.INDEX_PAD``."""
    idx = ops.contiguous(ops.cast(token_indices, "int32"))
    b, s, l = ops.shape(idx)
    l_pad = tiling.padded_topk(l)
    if l_pad != l:
        idx = ops.concat([idx, ops.full((b, s, l_pad - l), -1, "int32", idx)], axis=2)
    return idx


def _sink_vector(ops, attn_sink, h, h_pad, like):
    """``[H_pad] fp32``: the sink, ``-inf`` for pad heads (or everywhere without a sink)."""
    if attn_sink is None:
        return ops.full((h_pad,), _NEG_INF, "float32", like)
    sink = ops.contiguous(ops.cast(attn_sink, "float32"))
    if h_pad == h:
        return sink
    return ops.concat([sink, ops.full((h_pad - h,), _NEG_INF, "float32", like)], axis=0)


def _slice_heads(ops, t, h):
    return t if ops.shape(t)[2] == h else ops.contiguous(t[:, :, :h])


def _pending_checks(values, token_indices):
    """Launch the deferred value checks (``values`` from :func:`_check_inputs`, or ``None``).

    Returns ``(indices, before, after)``: the indices the kernels are to read (the checks' safe
    copy, every value outside ``[0, S_kv)`` made ``-1``, where the provider made one; else
    ``token_indices``) and where the wrapper waits for the numbers (and raises): ``after`` the
    kernels are queued when they read the safe copy (the GPU then never idles while the host
    waits and launches: docs/performance.md, run 43), else ``before`` the first kernel that
    dereferences an index.  The one not used is ``None``."""
    if values is None:
        return token_indices, None, None
    pending = values()
    if pending.indices is None:
        return token_indices, pending.finish, None
    return pending.indices, None, pending.finish


@contextlib.contextmanager
def _checks_last(after):
    """Around the launches that read the checks' safe copy: ``after`` (their wait, see
    :func:`_pending_checks`; ``None``: nothing) runs when the block is done.  Should a launch
    fail in the block (out of memory, a failed compile), the checks' ``ValueError`` for bad
    inputs is raised instead, as it was when the checks came first; otherwise the failure
    itself."""
    try:
        yield
    except Exception:
        if after is not None:
            try:
                after()
            except ValueError:
                raise
            except Exception:  # the checks cannot tell (e.g. the device is gone): the failure
                pass
        raise
    if after is not None:
        after()


def _grid_estimate(ops, provider, query, grad_out, pre, delta, lse2, kv, idx, sm_scale,
                   finish=None, groups=1):
    """``inv_grid [B, S_kv] fp32``: ``1 / g_j = 2**-e_j`` of the first pass's per-key grids, for
    ``query [B, S, H, Dk]`` and ``grad_out [B, S, H, Dv]`` (the real heads, contiguous) and
    ``idx [B, S, L]`` int32 (``-1``: no key); its first kernel (``grid_rows``) is also the
    deterministic backward's preprocess: from ``pre`` (:class:`FusedPreprocess`: ``out``,
    ``lse``, ``sink``, the lse format) it writes ``delta``, ``lse2`` and ``pre.d_sink_rows``
    (``[B, S, H_pad] fp32``) as ``bwd_preprocess`` would.

    A deterministic guess of each key's sum of contributions if attention were uniform: a row
    ``s`` with ``L_s`` valid slots gives each key about ``c_s = 4 / L_s * sqrt(sum_h |dO_sh|^2
    ((sm_scale kv_rms |q_sh|)^2 / Dk + 1 / Dv))`` per column (the per-head terms of
    ``dS^T Q + P^T dO`` at ``P = 1 / L_s``, 4 for the largest of the 576 columns), in fp64 from
    the bf16 inputs (kernel ``grid_rows``, which streams ``out`` and ``dO`` for the preprocess
    anyway).  The sum over a key's rows ``E_j`` is taken
    in int64 fixed point, in units of ``2^-F`` with ``F = 40 - ceil(log2 max_s c_s)`` (exact,
    so order-free; ``grid_scatter``), and ``e_j = ceil(log2 E_j) - F + GRID_MARGIN_BITS -
    EXACT_BITS + ceil(log2 groups)``, clipped to ``_GRID_EXP_RANGE`` (``grid_keys``).  ``groups``
    (the head groups per row, ``plan.num_groups``): each group's part of a row adds to the key
    as a contribution of its own, whose column maximum the bound counts separately, so the sum
    of the parts' bounds exceeds the row's (up to ``sqrt(groups)`` times for the norms,
    Cauchy-Schwarz; measured about twice at H=128, two groups: run 46 re-ran 83 keys, 0.75 ms,
    with 1.1 bits less head-room than at H=64); one bit per doubling of the groups keeps a single
    group's grids as they were.  Framework ops: the Frobenius
    norm of kv (``kv_rms`` is it over ``sqrt(numel)``), the largest ``c_s`` and a zeroed ``E``;
    no host sync.  Only
    speed depends on this guess: the kernel proves the bound for every key, and keys whose grid
    proves too fine (the bound fails) or too coarse (``RERUN_COARSE_BITS``) are re-run on a grid
    fitted to it.
    """
    b, s, _ = ops.shape(idx)
    _, s_kv, d_k = ops.shape(kv)
    kv_f = ops.cast(kv, "float32") if ops.device_kind(kv) == "cpu" else kv
    kv_norm = ops.row_norm(ops.reshape(kv_f, (1, -1)))  # [1] fp32: ||kv||_F
    # (sm_scale kv_rms)^2 / Dk = ||kv||_F^2 kv_coef (the kernel squares the norm in fp64)
    kv_coef = sm_scale * sm_scale / (max(1, b * s_kv * d_k) * d_k)
    c_row = ops.empty((b, s), "float64", idx)
    provider.exact_grid_rows(pre.natural, query, pre.out, grad_out, pre.lse, pre.sink, idx,
                             kv_norm, delta, lse2, pre.d_sink_rows, c_row, kv_coef)
    if finish is not None:
        # the deferred value checks: grid_rows only counts a row's slots >= 0; grid_scatter is
        # the first kernel that dereferences an index
        finish()
    top = ops.reshape(ops.amax(c_row), (1,))
    est = ops.zeros((b, s_kv), "int64", idx)
    provider.exact_grid_scatter(c_row, top, idx, est)
    inv_grid = ops.empty((b, s_kv), "float32", idx)
    provider.exact_grid_keys(est, top, inv_grid,
                             GRID_MARGIN_BITS - EXACT_BITS + (groups - 1).bit_length(),
                             *_GRID_EXP_RANGE)
    return inv_grid


def _exact_dkv(ops, provider, plan, q, kv, do, idx, lse2, delta, scale, dq, query, grad_out,
               pre, sm_scale, finish=None):
    """Deterministic dKV and dq, exact on per-key grids: returns ``(acc, inv_grid)``, the
    accumulator (fp32 ``[B, S_kv, Dk]``, in grid units, the provider's column order) and the
    inverse grids (fp32 ``[B, S_kv]``); ``dKV = acc / inv_grid`` (``bwd_finish``).  Writes
    ``lse2``, ``delta`` and ``pre.d_sink_rows`` first (the preprocess, in
    :func:`_grid_estimate`'s first kernel).

    Pass 1 (``main``, exact mode, with dq) on the grids of :func:`_grid_estimate` (from
    ``query`` and ``grad_out``, the real heads): every
    contribution ``c`` to key ``j`` becomes the integer ``k = round(c / g_j)`` and is added in
    fp32; the kernel also sums exactly, in int64,
    ``Bound_j = sum over contributions of ceil(u)``, ``u = max_d |c_d / g_j|`` taken before the
    rounding, and keeps ``BoundExp_j``, the largest ``ceil(log2 max(u, 2^-120)) + 1``.
    ``Bound_j <= 2^24`` bounds every partial sum of every column of key ``j`` by ``2^24`` grid
    units, so all those fp32 additions were exact and the result does not depend on their order.
    With ``U_j >= sum u`` (``Bound_j``, or ``S G 2^BoundExp_j`` if a ``u`` was clamped at
    ``2^40``), the grid ``g_j 2^-t`` keeps the bound for ``2^t U_j <= 2^24 - S G``; keys whose
    first grid was too fine (``Bound_j > 2^24``) or ``RERUN_COARSE_BITS`` or more too coarse
    are cleared and re-run (``with_dq=False``, on their slots only, moved to the front of each
    row) on the grid of the largest such ``t``: kernel ``rerun_plan`` decides per key (fp64,
    ``t`` from ``floor(log2)`` checked with an exact ``ldexp``) and clears the re-run keys'
    accumulator rows and flags each batch that has any (``any_over``), ``rerun_slots``
    compacts each row's slots (only in flagged batches: the rows of the others get ``counts =
    0`` and read nothing).  Everything stays on the device, no host sync, no data-dependent
    shape; a re-run with no keys costs near-empty launches.  ``docs/conventions.md`` has the
    proof.
    """
    b, s, l = ops.shape(idx)
    s_kv, d_k = ops.shape(kv)[1], ops.shape(kv)[2]
    if s * plan.num_groups > 2 ** (EXACT_BITS - 1):
        raise ValueError(
            f"query: S={s} x {plan.num_groups} head group(s) rows may add to one key, more than "
            f"the exact dKV accumulation proves (2^{EXACT_BITS - 1})")
    # the real heads; finish: the deferred value checks (see _grid_estimate)
    inv_grid = _grid_estimate(ops, provider, query, grad_out, pre, delta, lse2, kv, idx,
                              sm_scale, finish, plan.num_groups)
    acc = ops.zeros((b, s_kv, d_k), "float32", q)
    bound = ops.zeros((b, s_kv), "int64", q)
    bound_exp = ops.full((b, s_kv), -(2**30), "int32", q)  # atomic max: starts far below
    # the first pass (with dq) walks every slot and reads no counts
    provider.bwd_main(plan.heads_per_cta, "exact", True, q, kv, do, idx, lse2, delta, scale,
                      inv_grid, ops.empty((b, s), "int32", q), dq, acc, bound, bound_exp)

    # per key: re-run or not (over), the re-run grid (inv_grid *= 2^t), its accumulator cleared;
    # per batch: any key re-run (any_over: the plan only ever raises it, so it starts at 0)
    over = ops.empty((b, s_kv), "int32", q)
    any_over = ops.zeros((b,), "int32", q)
    provider.exact_rerun_plan(bound, bound_exp, inv_grid, acc, over, any_over,
                              float(s * plan.num_groups), EXACT_BITS, RERUN_COARSE_BITS)
    # the re-run keys' slots first in each row (stable), -1 after them to the end of their
    # 64-slot block and nothing past it; a row or batch with no re-run key: counts = 0 and idx2
    # left unwritten (the re-run reads a row's first ceil(counts / BK) key blocks only)
    idx2 = ops.empty((b, s, l), "int32", idx)
    counts = ops.empty((b, s), "int32", idx)
    provider.exact_rerun_slots(idx, over, any_over, idx2, counts)
    provider.bwd_main(plan.heads_per_cta, "exact", False, q, kv, do, idx2, lse2, delta, scale,
                      inv_grid, counts, dq, acc, bound, bound_exp)
    return acc, inv_grid


def mqa_latent_sparse_fwd(
    query: Any,
    kv: Any,
    token_indices: Any,
    sm_scale: float,
    attn_sink: Any = None,
    d_v: int = 512,
    block_h: int | None = None,
    *,
    check_indices: bool = True,
    provider: Any = None,
):
    """Forward of sparse MQA-latent attention with an optional attention sink (TileLang).

    Args:
        query: ``[B, S, H, Dk]`` bf16, CUDA (Paddle or PyTorch); any strides.
        kv: ``[B, S_kv, Dk]`` bf16; the value is ``kv[..., :d_v]``.
        token_indices: ``[B, S, L]`` int32/int64, ``-1`` = empty slot (never dereferenced),
            else in ``[0, S_kv)``; any ``L >= 1``.
        sm_scale: positive float multiplying ``q.k`` (not the sink).
        attn_sink: ``[H]`` fp32 sink logits, or ``None``.
        d_v: value width ``Dv``; the kernels are built for ``(Dk, Dv) = (576, 512)``.
        block_h: 16, 32 or ``None`` (32 when it divides ``H``, else 16): head padding
            granularity (``tiling.head_plan``).
        check_indices: check the values (every index in ``[-1, S_kv)``, no NaN/+inf sink, no
            NaN lse; ``checks.check_values``): one device->host read of a few scalars.
        provider: kernel launchers (tests); default :class:`TileLangKernels`.

    Returns:
        ``(out, lse)``: ``out [B, S, H, Dv]`` bf16 (0 for a row without valid keys) and
        ``lse [B, S, H]`` fp32, natural log, sink-exclusive (``-inf`` for a row without valid
        keys), the form FlashMLA's sparse prefill returns.

    Raises:
        TypeError: non-tensor inputs, mixed frameworks, wrong dtypes (``query``/``kv`` not
            bf16, indices not int32/int64, ``attn_sink`` not fp32), ``block_h`` not an int.
        ValueError: wrong ndim/shapes, CPU tensors, unsupported ``(Dk, Dv)``, indices out of
            range, ``block_h`` other than 16/32, ``sm_scale <= 0``.
    """
    provider = provider or _DEFAULT_PROVIDER
    if d_v is None:  # (None would make _check_inputs take this for a backward and ask for out)
        raise TypeError("d_v: expected a Python int (the value width Dv), got None")
    dims, sm_scale, values = _check_inputs(query, kv, token_indices, sm_scale, attn_sink,
                                           check_indices, provider, d_v=d_v, defer=True)
    return _fwd(provider, dims, query, kv, token_indices, sm_scale, attn_sink, block_h, values)


def _fwd(provider, dims, query, kv, token_indices, sm_scale, attn_sink, block_h, values=None):
    """:func:`mqa_latent_sparse_fwd` on inputs :func:`_check_inputs` accepted (the op checks
    once with it, then calls this); ``values``: the deferred value checks, launched first and
    finished (raising on bad values) before the call returns (:func:`_pending_checks`)."""
    tiling.check_head_dims(dims.Dk, dims.Dv)
    plan = tiling.head_plan(dims.H, block_h)
    ops = ops_for(query, kv, token_indices, attn_sink)
    indices, before, after = _pending_checks(values, token_indices)
    with _checks_last(after):
        q = _pad_heads(ops, ops.contiguous(query), plan.padded_heads)
        kv_c = ops.contiguous(kv)
        idx = _prepare_indices(ops, indices)
        sink = _sink_vector(ops, attn_sink, dims.H, plan.padded_heads, q)
        scale = ops.full((1,), sm_scale, "float32", q)
        out = ops.empty((dims.B, dims.S, plan.padded_heads, dims.Dv), "bfloat16", q)
        lse = ops.empty((dims.B, dims.S, plan.padded_heads), "float32", q)
        if before is not None:
            before()  # no safe copy of the indices: the numbers before the kernel reads one
        provider.fwd(plan.heads_per_cta, q, kv_c, idx, sink, scale, out, lse)
    return _slice_heads(ops, out, dims.H), _slice_heads(ops, lse, dims.H)


def mqa_latent_sparse_bwd(
    query: Any,
    kv: Any,
    out: Any,
    grad_out: Any,
    lse: Any,
    attn_sink: Any,
    token_indices: Any,
    sm_scale: float,
    block_h: int | None = None,
    deterministic: bool = True,
    lse_format: str = "natural",
    *,
    check_indices: bool = True,
    provider: Any = None,
):
    """Backward of sparse MQA-latent attention with an optional attention sink (TileLang).

    Args:
        query: ``[B, S, H, Dk]`` bf16 CUDA.  kv: ``[B, S_kv, Dk]`` bf16.
        out: ``[B, S, H, Dv]`` bf16, the forward output; ``Dv`` is its last dim.
        grad_out: ``[B, S, H, Dv]`` bf16, the same shape as ``out``.
        lse: ``[B, S, H]`` fp32 in the form named by ``lse_format``:
            ``"natural"``: natural log, sink-exclusive (our forward, FlashMLA's sparse prefill);
            ``"log2_sink"``: base 2, sink-inclusive (``log2`` of the full softmax denominator).
            Never guessed; the bridge is ``docs/conventions.md``.
        attn_sink: ``[H]`` fp32 or ``None`` (no sink: ``d_sink`` is zeros).
        token_indices: ``[B, S, L]`` int32/int64, ``-1`` = empty slot, else in ``[0, S_kv)``.
        sm_scale: positive float.
        block_h: 16, 32 or ``None`` (see :func:`mqa_latent_sparse_fwd`).
        deterministic: ``True``: ``dq``, ``dkv``, ``d_sink`` bitwise identical across calls and
            processes: each key's dKV is summed exactly on a power-of-two grid of its own
            (:func:`_exact_dkv`; the precision is stated in ``docs/conventions.md``), with the
            atomic path's scatter and ``B*S_kv*(Dk*4 + 28) + B*S*(4*L + 16) + 4*B`` bytes of
            scratch (``L`` padded; ``4*B``: the re-run's per-batch flag).  ``False``: plain
            fp32 atomics for dKV (last-bit differences between calls).
        lse_format: ``"natural"`` or ``"log2_sink"``.
        check_indices, provider: as in :func:`mqa_latent_sparse_fwd`.

    Returns:
        ``(dq [B, S, H, Dk] bf16, dkv [B, S_kv, Dk] bf16, d_sink [H] fp32)``.

    Raises:
        TypeError: as the forward, plus ``out``/``grad_out`` not bf16, ``lse`` not fp32,
            ``deterministic`` not a bool.
        ValueError: as the forward, plus shapes of ``out``/``grad_out``/``lse`` and an unknown
            ``lse_format``.
    """
    provider = provider or _DEFAULT_PROVIDER
    if lse_format not in ("natural", "log2_sink"):
        raise ValueError(f"lse_format: expected 'natural' or 'log2_sink', got {lse_format!r}")
    _check_bool(deterministic, "deterministic")
    dims, sm_scale, values = _check_inputs(query, kv, token_indices, sm_scale, attn_sink,
                                           check_indices, provider, out=out, grad_out=grad_out,
                                           lse=lse, defer=True)
    return _bwd(provider, dims, query, kv, out, grad_out, lse, attn_sink, token_indices,
                sm_scale, block_h, deterministic, lse_format, values)


def _bwd(provider, dims, query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale,
         block_h, deterministic, lse_format, values=None):
    """:func:`mqa_latent_sparse_bwd` on checked inputs (the op calls this with the tensors its
    forward checked and saved); ``values``: the deferred value checks, launched after the
    atomic mode's separate preprocess (which reads no index; the deterministic mode's
    ``grid_rows`` comes after them: it reads the indices, if only to count them) and finished
    (raising on bad values) before the call returns, or, without a safe copy of the indices
    (:func:`_pending_checks`), before the first kernel that dereferences one (the
    deterministic mode's ``grid_scatter``, the atomic mode's ``main``), so that the GPU works
    while their numbers reach the host (run 41: a sync first had left it idle for ~0.3-0.5 ms
    of host time per call).  The atomic mode on a tile the provider fuses
    (:func:`_fuses_preprocess`, :data:`FUSED_PREPROCESS`) launches no preprocess: its main
    kernel does that work (it reads indices, so it still waits for the checks first when there
    is no safe copy)."""
    tiling.check_head_dims(dims.Dk, dims.Dv)
    plan = tiling.head_plan(dims.H, block_h)
    ops = ops_for(query, kv, out, grad_out, lse, attn_sink, token_indices)
    B, S, H, h_pad = dims.B, dims.S, dims.H, plan.padded_heads

    # The preprocess: one pass over the real heads (no padding copy of out / grad_out) that
    # writes, for the padded heads (0 at pad heads): Delta; the base-2, sink-inclusive lse,
    # finite (a row with no key and no sink has every P = 0: any finite lse2 gives
    # exp2(-inf - lse2) = 0, so 0; a NaN lse, possible with check_indices=False, stays NaN,
    # never a plausible 0); each row's term of d_sink, -P_sink Delta (docs/conventions.md).
    # Its own launch (bwd_preprocess) only in the atomic mode on tiles the provider does not
    # fuse; fused: the atomic main kernel's prologue; deterministic: grid_rows, the first
    # kernel of the grid estimate (it reads q for the grids in the same pass).
    out_c = ops.contiguous(out)
    do_c = ops.contiguous(grad_out)
    lse_f = ops.contiguous(lse)
    delta_p = ops.empty((B, S, h_pad), "float32", do_c)
    lse2_p = ops.empty((B, S, h_pad), "float32", do_c)
    d_sink_rows = ops.empty((B * S, h_pad), "float32", do_c)
    sink_h = _sink_vector(ops, attn_sink, H, H, lse_f)
    pre = FusedPreprocess(lse_format == "natural", out_c, lse_f, sink_h,
                          ops.reshape(d_sink_rows, (B, S, h_pad)))
    fused = (FUSED_PREPROCESS and not deterministic
             and _fuses_preprocess(provider, plan.heads_per_cta))
    if not fused and not deterministic:
        provider.bwd_preprocess(pre.natural, ops.reshape(out_c, (B * S * H, dims.Dv)),
                                ops.reshape(do_c, (B * S * H, dims.Dv)),
                                ops.reshape(lse_f, (B * S * H,)), sink_h,
                                ops.reshape(delta_p, (B * S, h_pad)),
                                ops.reshape(lse2_p, (B * S, h_pad)), d_sink_rows)
    indices, before, after = _pending_checks(values, token_indices)
    with _checks_last(after):
        query_c = ops.contiguous(query)
        q = _pad_heads(ops, query_c, h_pad)
        do_p = _pad_heads(ops, do_c, h_pad)
        kv_c = ops.contiguous(kv)
        idx = _prepare_indices(ops, indices)

        scale = ops.full((1,), sm_scale, "float32", q)
        dq = ops.empty((B, S, h_pad, dims.Dk), "bfloat16", q)
        if deterministic:
            acc, inv_grid = _exact_dkv(ops, provider, plan, q, kv_c, do_p, idx, lse2_p, delta_p,
                                       scale, dq, query_c, do_c, pre, sm_scale, before)
        else:
            acc = ops.zeros((B, dims.S_kv, dims.Dk), "float32", q)
            inv_grid = ops.empty((B, dims.S_kv), "float32", q)  # the atomic mode reads no grid
            # fused: lse2_p, delta_p and d_sink_rows are written by the main kernel
            if before is not None:
                before()  # before the first kernel that dereferences an index
            provider.bwd_main(plan.heads_per_cta, "atomic", True, q, kv_c, do_p, idx, lse2_p,
                              delta_p, scale, inv_grid, ops.empty((B, S), "int32", q), dq, acc,
                              ops.empty((B, dims.S_kv), "int64", q),
                              ops.empty((B, dims.S_kv), "int32", q),
                              **({"pre": pre} if fused else {}))
        dkv = ops.empty((B, dims.S_kv, dims.Dk), "bfloat16", q)
        provider.bwd_finish(plan.heads_per_cta, deterministic, acc, inv_grid, dkv)
        # d_sink[h] = -sum over rows of P_sink Delta: one framework reduction over B*S rows, whose
        # order is fixed for a given shape (no atomics); queued behind the kernels
        if attn_sink is None:
            d_sink = ops.zeros((H,), "float32", lse_f)
        else:
            d_sink = ops.sum(d_sink_rows, axis=0)[:H]
    return _slice_heads(ops, dq, H), dkv, d_sink


# --- the wrappers' input checks, run once per call --------------------------------------------
def _check_inputs(query, kv, token_indices, sm_scale, attn_sink, check_indices, provider, *,
                  d_v=None, out=None, grad_out=None, lse=None, defer=False):
    """The wrappers' checks: tensors (bf16 on ``provider.device``), their values unless
    ``check_indices`` is False, ``sm_scale``.  A forward passes ``d_v``; a backward passes
    ``out``, ``grad_out`` and ``lse`` (required) and no ``d_v``: ``Dv`` is ``out``'s last dim.
    Returns ``(dims, sm_scale as a float)``; with ``defer``, ``(dims, sm_scale, values)`` and
    the value checks are left to the caller: ``pending = values()`` launches them
    (``checks.start_value_checks``), ``pending.finish()`` raises on bad values (``values`` is
    ``None`` when ``check_indices`` is False; :func:`_pending_checks`)."""
    check = _check_bool(check_indices, "check_indices")
    dims = check_tensors(query, kv, token_indices, attn_sink=attn_sink, d_v=d_v, out=out,
                         grad_out=grad_out, lse=lse, float_dtypes=("bfloat16",),
                         device=provider.device,
                         required=() if d_v is not None else ("out", "grad_out", "lse"))
    sm_scale = check_sm_scale(sm_scale)  # finite and > 0, also in fp32: the kernels need it
    values = None
    if check:
        def values():
            return start_value_checks(dims, token_indices, attn_sink=attn_sink, lse=lse,
                                      stats=getattr(provider, "value_stats", None))
        if not defer:
            values().finish()  # check_values, launched and finished here
    return (dims, sm_scale, values) if defer else (dims, sm_scale)
