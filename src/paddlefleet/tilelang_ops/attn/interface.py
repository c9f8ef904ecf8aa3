"""Host wrappers of the TileLang sparse MQA-latent attention kernels.

``mqa_latent_sparse_fwd`` and ``mqa_latent_sparse_bwd`` take Paddle or PyTorch CUDA tensors and
return tensors of the same framework.  Each one: checks the inputs once
(``checks.check_tensors``, ``checks.start_value_checks``), picks the head plan
(``tiling.head_plan``), makes inputs contiguous and 16-byte aligned (a copy where they are not:
``adapter.TensorOps.contiguous``), zero-pads the head axis to the plan's ``H_pad`` and the top-k
axis to a multiple of the key block (with ``-1``), launches the kernels through a provider
(``kernel_provider.py``) and slices the pad heads off.  The math is ``docs/conventions.md``; the
exact definition is ``attn/reference.py``.

Checked once per call: :func:`check_inputs` checks a forward's inputs by the kernels' rules and
returns a ``checks.PreparedIndices`` (the checked int32 indices, padded, the sizes, the checked
``cu_seqlens``); handed to either wrapper in place of ``token_indices`` it skips every check
(the op's path: its forward saves it for its backward).

Determinism of the backward (``deterministic=True``): ``dq`` is written once per (row, head) by
the CTA that owns it; ``d_sink`` is a fixed-order sum of per-(b, s, h) partials; ``dkv`` is summed
exactly on a per-key power-of-two grid (``exact_dkv.py``; ``docs/conventions.md`` states the
precision), so the order in which CTAs add does not matter: all three are bitwise identical
across calls and processes.
"""

from __future__ import annotations

import contextlib
from typing import Any

from . import exact_dkv, kernel_provider, tiling
from .adapter import ops_for, type_name
from .checks import (
    PreparedIndices,
    check_sm_scale,
    check_tensors,
    int32_indices,
    prepare_indices,
    start_value_checks,
)
from .kernel_provider import FusedPreprocess

__all__ = ["mqa_latent_sparse_fwd", "mqa_latent_sparse_bwd", "check_inputs", "FUSED_PREPROCESS"]

_NEG_INF = float("-inf")

#: The atomic backward hands the preprocess's work to its main kernel (``bwd_main(...,
#: pre=FusedPreprocess(...))``) where the provider can (``kernel_provider.fuses_preprocess``:
#: the TileLang 64-head tiles): one launch fewer, and ``out`` / ``dO`` are not streamed from HBM
#: a second time.  ``False``: the separate ``bwd_preprocess`` launch everywhere (A/B trials:
#: ``tools/experiments/kernel_trial.py --unfused``).
FUSED_PREPROCESS = True


def _provider(provider):
    # read at call time: tests put a stand-in in kernel_provider.DEFAULT_PROVIDER
    return provider if provider is not None else kernel_provider.DEFAULT_PROVIDER


def _check_bool(value, name):
    if not isinstance(value, bool):
        # type_name: numpy's bool prints as "numpy.bool", not a confusing bare "bool"
        raise TypeError(f"{name}: expected a Python bool, got {type_name(value)}")
    return value


def _check_tensors(query, kv, token_indices, attn_sink, provider, **kw):
    """The kernels' tensor rules: bf16 on ``provider.device`` (``kw``: ``d_v``, or a backward's
    ``out``, ``grad_out``, ``lse``, all required)."""
    return check_tensors(query, kv, token_indices, attn_sink=attn_sink,
                         float_dtypes=("bfloat16",), device=provider.device,
                         required=() if kw.get("d_v") is not None else ("out", "grad_out", "lse"),
                         **kw)


def check_inputs(query: Any, kv: Any, token_indices: Any, attn_sink: Any = None, *,
                 d_v: int = 512, cu_seqlens: Any = None, provider: Any = None) -> PreparedIndices:
    """Check a forward's inputs once by the kernels' rules and prepare its indices.

    The tensor checks of :func:`mqa_latent_sparse_fwd` (bf16 on the provider's device), its
    value checks finished here (one device->host read; the provider's ``value_stats`` makes
    the safe int32 copy the kernels then read) and, with ``cu_seqlens``, the packed-documents
    checks (``checks.check_packed``).  ``sm_scale`` is checked by each wrapper.

    Args:
        query, kv, token_indices, attn_sink, d_v, provider: as in :func:`mqa_latent_sparse_fwd`.
        cu_seqlens: ``[num_docs + 1]`` int32 boundaries of packed documents, or ``None``.

    Returns:
        ``checks.PreparedIndices``: the sizes, the indices as int32 ``[B, S, L_pad]``
        (``tiling.padded_topk``, ``-1`` padded) and the checked host ``cu_seqlens``.  Pass it
        as ``token_indices`` to :func:`mqa_latent_sparse_fwd` / :func:`mqa_latent_sparse_bwd`
        with these same tensors: they check nothing again.

    Raises:
        TypeError, ValueError: as :func:`mqa_latent_sparse_fwd`, plus ``checks.check_packed``'s.
    """
    provider = _provider(provider)
    if d_v is None:
        raise TypeError("d_v: expected a Python int (the value width Dv), got None")
    dims = _check_tensors(query, kv, token_indices, attn_sink, provider, d_v=d_v)
    return prepare_indices(dims, token_indices, attn_sink=attn_sink, cu_seqlens=cu_seqlens,
                           stats=getattr(provider, "value_stats", None),
                           pad_to=tiling.INDEX_PAD)


def _pad_heads(ops, t, h_pad):
    """Zero-pad axis 2 (heads) of a ``[B, S, H, D]`` tensor to ``h_pad``."""
    b, s, h, d = ops.shape(t)
    if h == h_pad:
        return t
    return ops.concat([t, ops.zeros((b, s, h_pad - h, d), ops.dtype(t), t)], axis=2)


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


class _Indices:
    """The indices a wrapper's kernels read, and when it waits for its value checks.

    From a ``PreparedIndices``: ready, nothing to wait for.  From a tensor, :meth:`launch`
    launches the checks (``start``: ``checks.start_value_checks``; ``None`` with
    ``check_indices=False``) and :meth:`get` casts and pads the indices they let through (their
    safe copy, every value outside ``[0, S_kv)`` made ``-1``, where the provider made one; else
    the tensor).  The wrapper waits for the numbers (and raises) ``after`` the kernels are
    queued when they read the safe copy (the GPU then never idles while the host waits and
    launches: docs/performance.md, "Design decisions and why"), else ``before`` the first kernel that dereferences
    an index.  The one not used is ``None``."""

    def __init__(self, token_indices, start=None):
        self.before = self.after = None
        self._start = start
        prepared = isinstance(token_indices, PreparedIndices)
        self._idx = token_indices.indices if prepared else None
        self._raw = None if prepared else token_indices

    def launch(self):
        if self._start is None:
            return
        pending, self._start = self._start(), None
        if pending.indices is None:
            self.before = pending.finish
        else:
            self._raw, self.after = pending.indices, pending.finish

    def get(self):
        if self._idx is None:
            self._idx = int32_indices(self._raw, tiling.INDEX_PAD)
        return self._idx


def _checked(query, kv, token_indices, attn_sink, check_indices, provider, **kw):
    """``(dims, indices)``: the sizes and the :class:`_Indices` of a wrapper call.  With a
    ``PreparedIndices`` (:func:`check_inputs`) the tensors' metadata is checked against the
    sizes it was made for (no device sync: indices checked for one ``S_kv`` would otherwise be
    read against another kv) and its values are taken as checked: :func:`check_inputs`
    checked the indices and the sink it was given, and ``lse`` is the forward's."""
    check = _check_bool(check_indices, "check_indices")
    if isinstance(token_indices, PreparedIndices):
        _check_tensors(query, kv, token_indices.indices, attn_sink, provider,
                       prepared=token_indices, **kw)
        return token_indices.dims, _Indices(token_indices)
    dims = _check_tensors(query, kv, token_indices, attn_sink, provider, **kw)
    lse = kw.get("lse")

    def start():
        return start_value_checks(dims, token_indices, attn_sink=attn_sink, lse=lse,
                                  stats=getattr(provider, "value_stats", None))

    return dims, _Indices(token_indices, start if check else None)


@contextlib.contextmanager
def _checks_last(after):
    """Around the launches that read the checks' safe copy: ``after`` (their wait, see
    :class:`_Indices`; ``None``: nothing) runs when the block is done.  Should a launch fail in
    the block (out of memory, a failed compile), the checks' ``ValueError`` for bad inputs is
    raised instead, as it was when the checks came first; otherwise the failure itself."""
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
            else in ``[0, S_kv)``; any ``L >= 1``.  Or the ``checks.PreparedIndices`` that
            :func:`check_inputs` returned for these tensors: then the tensors' metadata is
            checked against the sizes it was made for (``ValueError`` naming the tensor and
            both shapes; no device sync) and no value again (``d_v`` and ``check_indices`` are
            not used; pass the ``attn_sink`` it was prepared with, whose values it checked).
        sm_scale: positive float multiplying ``q.k`` (not the sink).
        attn_sink: ``[H]`` fp32 sink logits, or ``None``.
        d_v: value width ``Dv``; the kernels are built for the ``(Dk, Dv)`` pairs of
            ``tiling.kernel_dims()``: (576, 512) and (512, 512).
        block_h: 16, 32 or ``None`` (32 when it divides ``H``, else 16): head padding
            granularity (``tiling.head_plan``).
        check_indices: check the values (every index in ``[-1, S_kv)``, no NaN/+inf sink, no
            NaN lse; ``checks.check_values``): one device->host read of a few scalars.
        provider: a ``kernel_provider.KernelProvider`` (tests: a CPU stand-in); ``None``:
            ``kernel_provider.DEFAULT_PROVIDER``, the TileLang kernels.

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
    provider = _provider(provider)
    if d_v is None:  # (None would take this for a backward and ask for out)
        raise TypeError("d_v: expected a Python int (the value width Dv), got None")
    dims, indices = _checked(query, kv, token_indices, attn_sink, check_indices, provider,
                             d_v=d_v)
    sm_scale = check_sm_scale(sm_scale)  # finite and > 0, also in fp32: the kernels need it
    tiling.check_head_dims(dims.Dk, dims.Dv)
    plan = tiling.head_plan(dims.H, block_h)
    ops = ops_for(query, kv, attn_sink)
    indices.launch()
    with _checks_last(indices.after):
        q = _pad_heads(ops, ops.contiguous(query), plan.padded_heads)
        kv_c = ops.contiguous(kv)
        idx = indices.get()
        sink = _sink_vector(ops, attn_sink, dims.H, plan.padded_heads, q)
        scale = ops.full((1,), sm_scale, "float32", q)
        out = ops.empty((dims.B, dims.S, plan.padded_heads, dims.Dv), "bfloat16", q)
        lse = ops.empty((dims.B, dims.S, plan.padded_heads), "float32", q)
        if indices.before is not None:
            indices.before()  # no safe copy of the indices: the numbers before the kernel
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
        token_indices: ``[B, S, L]`` int32/int64, ``-1`` = empty slot, else in ``[0, S_kv)``;
            or the ``checks.PreparedIndices`` of the forward (:func:`check_inputs`): then the
            tensors' metadata is checked against the sizes it was made for, and no value
            (``out`` and ``lse`` must be that forward's, ``attn_sink`` the one prepared with).
        sm_scale: positive float.
        block_h: 16, 32 or ``None`` (see :func:`mqa_latent_sparse_fwd`).
        deterministic: ``True``: ``dq``, ``dkv``, ``d_sink`` bitwise identical across calls and
            processes: each key's dKV is summed exactly on a power-of-two grid of its own
            (``exact_dkv.py``; the precision is stated in ``docs/conventions.md``), with the
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

    The value checks are launched after the atomic backward's separate preprocess (which
    reads no index; the deterministic backward's ``grid_rows`` comes after them: it reads the
    indices, if only to count them) and finished (raising on bad values) before the call
    returns, or, without a safe copy of the indices, before the first kernel that dereferences
    one (the deterministic backward's ``grid_scatter``, the atomic one's ``bwd_main``), so that
    the GPU works while their numbers reach the host (a sync first left it idle for ~0.3-0.5 ms
    of host time per call: docs/performance.md).  The atomic backward on a tile the provider fuses
    (``kernel_provider.fuses_preprocess``, :data:`FUSED_PREPROCESS`) launches no preprocess:
    its main kernel does that work (it reads indices, so it still waits for the checks first
    when there is no safe copy).
    """
    provider = _provider(provider)
    if lse_format not in ("natural", "log2_sink"):
        raise ValueError(f"lse_format: expected 'natural' or 'log2_sink', got {lse_format!r}")
    _check_bool(deterministic, "deterministic")
    dims, indices = _checked(query, kv, token_indices, attn_sink, check_indices, provider,
                             out=out, grad_out=grad_out, lse=lse)
    sm_scale = check_sm_scale(sm_scale)
    tiling.check_head_dims(dims.Dk, dims.Dv)
    plan = tiling.head_plan(dims.H, block_h)
    ops = ops_for(query, kv, out, grad_out, lse, attn_sink)
    B, S, H, h_pad = dims.B, dims.S, dims.H, plan.padded_heads

    # The preprocess: one pass over the real heads (no padding copy of out / grad_out) that
    # writes, for the padded heads (0 at pad heads): Delta; the base-2, sink-inclusive lse,
    # finite (a row with no key and no sink has every P = 0: any finite lse2 gives
    # exp2(-inf - lse2) = 0, so 0; a NaN lse, possible with check_indices=False, stays NaN,
    # never a plausible 0); each row's term of d_sink, -P_sink Delta (docs/conventions.md).
    # Its own launch (bwd_preprocess) only in the atomic backward on tiles the provider does
    # not fuse; fused: the atomic main kernel's prologue; deterministic: grid_rows, the first
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
             and kernel_provider.fuses_preprocess(provider, plan.heads_per_cta))
    if not fused and not deterministic:
        provider.bwd_preprocess(pre.natural, ops.reshape(out_c, (B * S * H, dims.Dv)),
                                ops.reshape(do_c, (B * S * H, dims.Dv)),
                                ops.reshape(lse_f, (B * S * H,)), sink_h,
                                ops.reshape(delta_p, (B * S, h_pad)),
                                ops.reshape(lse2_p, (B * S, h_pad)), d_sink_rows)
    indices.launch()
    with _checks_last(indices.after):
        query_c = ops.contiguous(query)
        q = _pad_heads(ops, query_c, h_pad)
        do_p = _pad_heads(ops, do_c, h_pad)
        kv_c = ops.contiguous(kv)
        idx = indices.get()

        scale = ops.full((1,), sm_scale, "float32", q)
        dq = ops.empty((B, S, h_pad, dims.Dk), "bfloat16", q)
        if deterministic:
            acc, inv_grid = exact_dkv.exact_dkv(ops, provider, plan, q, kv_c, do_p, idx, lse2_p,
                                                delta_p, scale, dq, query_c, do_c, pre, sm_scale,
                                                indices.before)
        else:
            acc = ops.zeros((B, dims.S_kv, dims.Dk), "float32", q)
            inv_grid = ops.empty((B, dims.S_kv), "float32", q)  # the atomic path reads no grid
            # fused: lse2_p, delta_p and d_sink_rows are written by the main kernel
            if indices.before is not None:
                indices.before()  # before the first kernel that dereferences an index
            provider.bwd_main(plan.heads_per_cta, False, True, q, kv_c, do_p, idx, lse2_p,
                              delta_p, scale, inv_grid, ops.empty((B, S), "int32", q), dq, acc,
                              ops.empty((B, dims.S_kv), "int64", q),
                              ops.empty((B, dims.S_kv), "int32", q),
                              **({"pre": pre} if fused else {}))
        dkv = ops.empty((B, dims.S_kv, dims.Dk), "bfloat16", q)
        provider.bwd_finish(plan.heads_per_cta, deterministic, acc, inv_grid, dkv)
        # d_sink[h] = -sum over rows of P_sink Delta: one framework reduction over B*S rows,
        # whose order is fixed for a given shape (no atomics); queued behind the kernels
        if attn_sink is None:
            d_sink = ops.zeros((H,), "float32", lse_f)
        else:
            d_sink = ops.sum(d_sink_rows, axis=0)[:H]
    return _slice_heads(ops, dq, H), dkv, d_sink
