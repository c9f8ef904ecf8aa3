"""Host wrappers of the TileLang sparse MQA-latent attention kernels.

``mqa_latent_sparse_fwd`` and ``mqa_latent_sparse_bwd`` take Paddle or PyTorch CUDA tensors and
return tensors of the same framework.  Each one: validates the inputs (``checks.validate_inputs``),
picks the head plan (``tiling.head_plan``), makes inputs contiguous, zero-pads the head axis to
the plan's ``H_pad`` and the top-k axis to a multiple of the key block (with ``-1``), launches
the kernels through a *provider* and slices the pad heads off.  The math is
``docs/conventions.md``; the exact definition is ``attn/reference.py``.

The provider (:class:`TileLangKernels` by default) is the only place that touches TileLang, so
the padding / slicing / LSE-bridge logic can be tested on CPU against stand-ins that implement
each kernel's math (``tests/test_interface.py``).

Determinism of the backward (``deterministic=True``): ``dq`` is written once per (row, head) by
the CTA that owns it; ``d_sink`` is a fixed-order sum of per-(b, s, h) partials; ``dkv`` is
summed in a fixed order (``det_method="ordered"``, :func:`_ordered_dkv`) or accumulated exactly
in int64 fixed point (``det_method="fixed_point"``, see :func:`fixed_point_scale` for the scale,
the bound and the precision argument), so all three are bitwise identical across calls and
processes.
"""

from __future__ import annotations

import math
from typing import Any

from . import tiling
from .adapter import ops_for
from .checks import check_sm_scale, validate_inputs
from .reference import lse_natural_to_log2_sink

__all__ = [
    "mqa_latent_sparse_fwd",
    "mqa_latent_sparse_bwd",
    "fixed_point_scale",
    "TileLangKernels",
    "FIXED_POINT_BITS",
]

_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)
_NEG_INF = float("-inf")

#: Scratch budget of the ordered deterministic mode: query rows are processed in chunks whose
#: slot partials ``[rows, G, L, Dk]`` fp32 fit in it (8 GiB: 1,820 rows at topk=2048, H<=64).
ORDERED_SCRATCH_BYTES = 8 << 30

#: |dKV total| * scale stays below 2**FIXED_POINT_BITS (int64 holds 2**63 - 1).
FIXED_POINT_BITS = 62
# Clamp of the fixed-point exponent: keeps the scale a normal fp32 number.
_SCALE_EXP_RANGE = (-100, 100)


class TileLangKernels:
    """Default provider: launches the TileLang kernels (CUDA tensors of either framework).

    A provider has ``device`` (the device kind its tensors must be on) and four launchers; each
    fills its output arguments in place.  Compiled kernels are cached by TileLang per static
    specialisation (head tile, Dk, Dv, deterministic flag); shapes are dynamic.
    """

    device = "cuda"

    def __init__(self):
        # compiled kernels by static key: skips TileLang's argument binding on every call
        self._kernels = {}

    def _kernel(self, key):
        kernel = self._kernels.get(key)
        if kernel is None:
            from .kernels import sparse_bwd, sparse_fwd

            name, args = key[0], key[1:]
            if name == "fwd":
                kernel = sparse_fwd.sparse_fwd(*args)
            elif name == "pre":
                kernel = sparse_bwd.preprocess(*args)
            elif name == "main":
                kernel = sparse_bwd.main(*args[:-1], slot_partials=args[-1])
            elif name == "reduce":
                kernel = sparse_bwd.slot_reduce(*args)
            else:
                kernel = sparse_bwd.postprocess(*args)
            self._kernels[key] = kernel
        return kernel

    def fwd(self, heads_per_cta, q, kv, indices, sink, scale, out, lse):
        key = ("fwd", heads_per_cta, int(q.shape[-1]), int(out.shape[-1]))
        self._kernel(key)(q, kv, indices, sink, scale, out, lse)

    def bwd_preprocess(self, out2d, grad_out2d, delta):
        self._kernel(("pre", int(out2d.shape[-1])))(out2d, grad_out2d, delta)

    def bwd_main(self, heads_per_cta, deterministic, q, kv, grad_out, indices, lse2, delta,
                 scale, dq, dkv_acc, slot_partials=False):
        key = ("main", heads_per_cta, int(q.shape[-1]), int(grad_out.shape[-1]),
               bool(deterministic), tiling.bwd_key_block(heads_per_cta), bool(slot_partials))
        self._kernel(key)(q, kv, grad_out, indices, lse2, delta, scale, dq, dkv_acc)

    def bwd_slot_reduce(self, parts, perm, offsets, dkv):
        self._kernel(("reduce", int(parts.shape[-1])))(parts, perm, offsets, dkv)

    def bwd_postprocess(self, dkv_acc, scale, dkv):
        self._kernel(("post", int(dkv_acc.shape[-1])))(dkv_acc, scale, dkv)


_DEFAULT_PROVIDER = TileLangKernels()


def _check_bool(value, name):
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def _pad_heads(ops, t, h_pad):
    """Zero-pad axis 2 (heads) of a ``[B, S, H, D]`` tensor to ``h_pad``."""
    b, s, h, d = ops.shape(t)
    if h == h_pad:
        return t
    return ops.concat([t, ops.zeros((b, s, h_pad - h, d), ops.dtype(t), t)], axis=2)


def _pad_rows(ops, t, h_pad, value):
    """Pad the last axis (heads) of a ``[B, S, H]`` fp32 tensor to ``h_pad`` with ``value``."""
    b, s, h = ops.shape(t)
    if h == h_pad:
        return t
    return ops.concat([t, ops.full((b, s, h_pad - h), value, ops.dtype(t), t)], axis=2)


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


def _absmax(ops, t):
    """``max |t|`` as a 1-element fp64 tensor on ``t``'s device (no host sync).

    The infinity norm reads ``t`` once (``abs().amax()`` would write and re-read a full copy:
    0.8 ms instead of ~0.2 ms for q and dO at the reference shape)."""
    if ops.device_kind(t) == "cpu":  # Paddle's CPU build has no bf16 math
        t = ops.cast(t, "float32")
    return ops.cast(ops.reshape(t.norm(p=float("inf")), (1,)), "float64")


def _sort_slots_by_key(ops, idx, num_groups, s_kv):
    """CSR of the ordered deterministic mode: for keys ``idx [B, S, L]`` repeated over the head
    groups (rows ``((s * G) + g) * L + l`` of the slot partials), a stable sort by key gives
    ``perm [B, R] int32`` and ``offsets [B, S_kv + 1] int32`` (key ``j`` owns sorted positions
    ``offsets[j] .. offsets[j+1]``; the ``-1`` slots sort first and belong to no key).  Both are
    integer and stable, so the summation order they fix is the same on every call."""
    b, s, l = ops.shape(idx)
    keys = ops.reshape(idx, (b, s, 1, l))
    if num_groups > 1:
        keys = ops.concat([keys] * num_groups, axis=2)
    keys = ops.reshape(keys, (b, s * num_groups * l))
    if ops.name == "torch":
        import torch

        vals, perm = torch.sort(keys, dim=-1, stable=True)
        targets = torch.arange(s_kv + 1, dtype=torch.int32, device=keys.device)
        offsets = torch.searchsorted(vals, targets.expand(b, s_kv + 1).contiguous(),
                                     out_int32=True)
    else:
        import paddle

        perm = paddle.argsort(keys, axis=-1, stable=True)
        vals = paddle.take_along_axis(keys, perm, axis=-1)
        targets = paddle.arange(s_kv + 1, dtype="int32").expand([b, s_kv + 1])
        if targets.place != keys.place:
            targets = targets.to(keys.place)
        offsets = paddle.searchsorted(vals, targets.contiguous(), out_int32=True)
    return ops.contiguous(ops.cast(perm, "int32")), ops.contiguous(offsets)


def _d_sink(ops, attn_sink, lse2, delta):
    """``d_sink[h] = -sum_{b,s} P_sink * Delta`` (``[H]`` fp32; zeros without a sink): per-row
    partials ``P_sink = exp(sink - lse2 ln 2)`` times ``Delta``, then one framework reduction
    over ``B*S`` rows, whose order is fixed for a given shape (no atomics)."""
    b, s, h = ops.shape(delta)
    if attn_sink is None:
        return ops.zeros((h,), "float32", delta)
    sink = ops.reshape(ops.cast(attn_sink, "float32"), (1, 1, h))
    p_sink = ops.exp(sink - lse2 * _LN2)
    return -ops.sum(ops.reshape(p_sink * delta, (b * s, h)), axis=0)


def _ordered_dkv(ops, provider, plan, q, kv, do, idx, lse2, delta, scale, dims):
    """dq and dKV of the ordered deterministic mode, in chunks of query rows.

    Per batch element and chunk of rows (at most :data:`ORDERED_SCRATCH_BYTES` of slot
    partials): the main kernel writes every (row, head group, slot) dKV row to the scratch and
    its rows of dq; a stable sort of the chunk's keys gives each key's run; ``slot_reduce`` adds
    the run, in order, into an fp32 ``dKV``.  Chunks go in row order, so every dKV element
    receives its contributions in one fixed sequence (sorted by key, then by row, group and
    slot) whatever the chunking: bitwise repeatable, and equal to an unchunked run.
    """
    B, S, Dk = dims.B, dims.S, dims.Dk
    g, m = plan.num_groups, plan.heads_per_cta
    l_pad = ops.shape(idx)[-1]
    rows = max(1, min(S, ORDERED_SCRATCH_BYTES // (g * l_pad * Dk * 4)))
    # The kernels address the scratch with int32 offsets (largest offset = elements - 1).
    if rows * g * l_pad * Dk > 2**31:
        raise ValueError(
            f"token_indices: L={l_pad} (padded) x {g} head group(s) x Dk={Dk} is too wide for the "
            f"ordered deterministic mode's int32 scratch offsets; use det_method='fixed_point'"
        )
    scratch = ops.empty((1, rows, g, l_pad, Dk), "float32", q)
    dkv32 = ops.zeros((B, dims.S_kv, Dk), "float32", q)
    whole = B == 1 and rows == S
    dq_parts = []
    for b in range(B):
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            n = s1 - s0
            if whole:
                pick = lambda t: t  # noqa: E731
            else:
                pick = lambda t: ops.contiguous(t[b:b + 1, s0:s1])  # noqa: E731
            parts = scratch if n == rows else ops.contiguous(scratch[:, :n])
            dq_c = ops.empty((1, n, plan.padded_heads, Dk), "bfloat16", q)
            idx_c = pick(idx)
            provider.bwd_main(m, True, pick(q), kv if whole else ops.contiguous(kv[b:b + 1]),
                              pick(do), idx_c, pick(lse2), pick(delta), scale, dq_c, parts,
                              slot_partials=True)
            perm, offsets = _sort_slots_by_key(ops, idx_c, g, dims.S_kv)
            acc = dkv32 if B == 1 else ops.contiguous(dkv32[b:b + 1])
            provider.bwd_slot_reduce(ops.reshape(parts, (1, n * g * l_pad, Dk)), perm, offsets,
                                     acc)
            if B > 1:
                dkv32[b:b + 1] = acc
            dq_parts.append(dq_c)
    dq = dq_parts[0] if len(dq_parts) == 1 else ops.reshape(
        ops.concat(dq_parts, axis=1), (B, S, plan.padded_heads, Dk))
    return dq, ops.cast(dkv32, "bfloat16")


def fixed_point_scale(ops, query, kv, grad_out, delta, sm_scale, num_rows):
    """The fixed-point scale of the deterministic dKV accumulation, on the device.

    Bound.  For one row ``(b, s, h)`` with probabilities ``P_l`` (``sum_l P_l <= 1``, the sink
    taking the rest) and ``dP_l = <dO, v_l>``:
    ``|dP_l| <= ||dO||_2 ||v_l||_2 <= Dv * max|dO| * max|kv|`` (``||x||_2 <= sqrt(n) ||x||_inf``)
    and ``dS_l = P_l (dP_l - Delta)``, so ``sum_l |dS_l| <= Dv max|dO| max|kv| + |Delta|``.  The
    row adds to ``dKV[i_l, c]`` the terms ``sm_scale dS_l q_c`` and ``P_l dO_c``; summed over its
    slots these are at most ``R = sm_scale max|q| (Dv max|dO| max|kv| + max|Delta|) + max|dO|``.
    Every dKV element, every partial sum of its contributions and every single contribution is
    therefore at most ``num_rows * R`` in magnitude (``num_rows = B*S*H``).  We double it to cover
    the bf16 rounding of ``P`` and ``dS`` inside the kernel and fp32 rounding of the lse, and take
    ``scale = 2^(62 - ceil(log2(2 num_rows R)))`` (exponent clamped to ``[-100, 100]``), so that
    every partial sum times ``scale`` stays below ``2^62 < 2^63``: no int64 overflow.  The bound
    assumes ``lse`` belongs to these inputs (as a forward returns it); an unrelated ``lse`` can
    give ``sum_l P_l > 1`` and void it.

    Precision.  A contribution ``x`` (fp32) is stored as ``round(x * scale)``; with a power-of-two
    scale ``x * scale`` is exact, so each contribution is off by at most ``0.5 / scale``, and a
    dKV element summing ``n`` contributions by ``n * 0.5 / scale <= n * 2 num_rows R / 2^62``.
    At B=1, S=4096, H=64, randn inputs (R ~ 2e3) the scale is ~2^33 and the error ~1e-10 per
    contribution, far below the final bf16 rounding (2^-9 relative).

    Returns:
        ``[1]`` fp32 tensor ``scale`` (a power of two) on the inputs' device.
    """
    d_v = ops.shape(grad_out)[-1]
    per_row = (
        _absmax(ops, query) * sm_scale
        * (_absmax(ops, grad_out) * _absmax(ops, kv) * float(d_v) + _absmax(ops, delta))
        + _absmax(ops, grad_out)
    )
    bound = per_row * (2.0 * float(num_rows))
    exponent = (float(FIXED_POINT_BITS) - bound.log2().ceil()).clip(*_SCALE_EXP_RANGE)
    two = ops.full((1,), 2.0, "float64", exponent)
    return ops.cast(two ** exponent, "float32")


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
            NaN lse; ``checks.validate_inputs(check_values=...)``): a few device->host reads.
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
    dims = validate_inputs(
        query, kv, token_indices, attn_sink=attn_sink, d_v=d_v, float_dtypes=("bfloat16",),
        device=provider.device, check_values=_check_bool(check_indices, "check_indices"),
    )
    sm_scale = check_sm_scale(sm_scale)  # finite and > 0, also in fp32: the kernels need it
    tiling.check_head_dims(dims.Dk, dims.Dv)
    plan = tiling.head_plan(dims.H, block_h)
    ops = ops_for(query, kv, token_indices, attn_sink)

    q = _pad_heads(ops, ops.contiguous(query), plan.padded_heads)
    kv_c = ops.contiguous(kv)
    idx = _prepare_indices(ops, token_indices)
    sink = _sink_vector(ops, attn_sink, dims.H, plan.padded_heads, q)
    scale = ops.full((1,), sm_scale, "float32", q)
    out = ops.empty((dims.B, dims.S, plan.padded_heads, dims.Dv), "bfloat16", q)
    lse = ops.empty((dims.B, dims.S, plan.padded_heads), "float32", q)
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
    det_method: str = "ordered",
    check_indices: bool = True,
    provider: Any = None,
):
    """Backward of sparse MQA-latent attention with an optional attention sink (TileLang).

    Args:
        query: ``[B, S, H, Dk]`` bf16 CUDA.  kv: ``[B, S_kv, Dk]`` bf16.
        out: ``[B, S, H, Dv]`` bf16, the forward output.  grad_out: ``[B, S, H, Dv]`` bf16.
        lse: ``[B, S, H]`` fp32 in the form named by ``lse_format``:
            ``"natural"``: natural log, sink-exclusive (our forward, FlashMLA's sparse prefill);
            ``"log2_sink"``: base 2, sink-inclusive (``log2`` of the full softmax denominator).
            Never guessed; the bridge is ``docs/conventions.md``.
        attn_sink: ``[H]`` fp32 or ``None`` (no sink: ``d_sink`` is zeros).
        token_indices: ``[B, S, L]`` int32/int64, ``-1`` = empty slot, else in ``[0, S_kv)``.
        sm_scale: positive float.
        block_h: 16, 32 or ``None`` (see :func:`mqa_latent_sparse_fwd`).
        deterministic: ``True``: ``dq``, ``dkv``, ``d_sink`` bitwise identical across calls and
            processes (dKV summed as ``det_method`` says); ``False``: fp32 atomics for dKV
            (faster, last-bit differences between calls).
        lse_format: ``"natural"`` or ``"log2_sink"``.
        det_method: how ``deterministic=True`` sums dKV (both bitwise repeatable; they round
            differently, each within fp32 accumulation error):
            ``"ordered"`` (default): every (query row, head group, slot) writes its dKV row to a
            scratch, a stable sort by key fixes the order, one kernel adds each key's rows in
            that order in fp32 (rows in chunks: scratch at most ``ORDERED_SCRATCH_BYTES``,
            8 GiB); 1.35x the atomic backward at B=1 S=4096 S_kv=8192 H=64 topk=2048 (H200).
            ``"fixed_point"``: int64 fixed-point atomics (:func:`fixed_point_scale`); scratch
            ``B*S_kv*Dk*8`` bytes only, but 1.9x the atomic backward (8-byte atomics).
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
    if det_method not in ("fixed_point", "ordered"):
        raise ValueError(f"det_method: expected 'fixed_point' or 'ordered', got {det_method!r}")
    ordered = deterministic and det_method == "ordered"
    dims = validate_inputs(
        query, kv, token_indices, attn_sink=attn_sink, d_v=_dv_of(grad_out), out=out,
        grad_out=grad_out, lse=lse, float_dtypes=("bfloat16",), device=provider.device,
        check_values=_check_bool(check_indices, "check_indices"),
        required=("out", "grad_out", "lse"),
    )
    sm_scale = check_sm_scale(sm_scale)  # finite and > 0, also in fp32: the kernels need it
    tiling.check_head_dims(dims.Dk, dims.Dv)
    plan = tiling.head_plan(dims.H, block_h)
    ops = ops_for(query, kv, out, grad_out, lse, attn_sink, token_indices)
    B, S, H, h_pad = dims.B, dims.S, dims.H, plan.padded_heads

    # Delta over the real heads (flattened rows, no padding copy of out / grad_out).
    out_c = ops.contiguous(out)
    do_c = ops.contiguous(grad_out)
    n_rows = B * S * H
    delta = ops.empty((n_rows,), "float32", do_c)
    provider.bwd_preprocess(ops.reshape(out_c, (n_rows, dims.Dv)),
                            ops.reshape(do_c, (n_rows, dims.Dv)), delta)
    delta = ops.reshape(delta, (B, S, H))

    # Base-2 sink-inclusive lse, finite (a row with no key and no sink has every P = 0: any
    # finite lse2 gives exp2(-inf - lse2) = 0, so use 0).  Only -inf is replaced: a NaN lse
    # (possible with check_indices=False) must stay NaN, never turn into a plausible 0.
    lse_f = ops.contiguous(lse)
    lse2 = lse_natural_to_log2_sink(lse_f, attn_sink) if lse_format == "natural" else lse_f
    zero = ops.zeros((1,), "float32", lse_f)
    lse2 = ops.where(lse2 == _NEG_INF, zero, lse2)

    q = _pad_heads(ops, ops.contiguous(query), h_pad)
    do_p = _pad_heads(ops, do_c, h_pad)
    kv_c = ops.contiguous(kv)
    idx = _prepare_indices(ops, token_indices)
    lse2_p = ops.contiguous(_pad_rows(ops, lse2, h_pad, 0.0))
    delta_p = ops.contiguous(_pad_rows(ops, delta, h_pad, 0.0))

    sm = ops.full((1,), sm_scale, "float32", q)
    if deterministic and not ordered:
        fx = fixed_point_scale(ops, query, kv, grad_out, delta, sm_scale, n_rows)
    else:
        fx = ops.full((1,), 1.0, "float32", q)
    scale = ops.concat([sm, fx], axis=0)

    if ordered:
        dq, dkv = _ordered_dkv(ops, provider, plan, q, kv_c, do_p, idx, lse2_p, delta_p, scale,
                               dims)
        return _slice_heads(ops, dq, H), dkv, _d_sink(ops, attn_sink, lse2, delta)
    dq = ops.empty((B, S, h_pad, dims.Dk), "bfloat16", q)
    acc = ops.zeros((B, dims.S_kv, dims.Dk), "int64" if deterministic else "float32", q)
    provider.bwd_main(plan.heads_per_cta, deterministic, q, kv_c, do_p, idx, lse2_p, delta_p,
                      scale, dq, acc)
    # queued behind the main kernel: its host time overlaps the kernel
    d_sink = _d_sink(ops, attn_sink, lse2, delta)
    if deterministic:
        dkv = ops.empty((B, dims.S_kv, dims.Dk), "bfloat16", q)
        provider.bwd_postprocess(acc, scale, dkv)
    else:
        dkv = ops.cast(acc, "bfloat16")
    return _slice_heads(ops, dq, H), dkv, d_sink


def _dv_of(grad_out) -> int:
    """``Dv`` from ``grad_out``'s last dim (validated afterwards); 512 when it is not a tensor,
    so that ``validate_inputs`` reports the bad argument itself."""
    try:
        return int(grad_out.shape[-1])
    except (AttributeError, IndexError, TypeError):
        return 512
