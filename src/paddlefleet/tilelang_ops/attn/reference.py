"""The exact definition of sparse MQA-latent attention with an attention sink.

This module is the executable form of ``docs/conventions.md``: every kernel, host wrapper and
Paddle op in the package is tested against it.  It runs on any framework and device the
adapter knows (Paddle on CPU in CI, PyTorch on CUDA on the GPU host), in float32 by default or
float64 on request, and never materialises more than a bounded slice of the problem: query rows
are processed in chunks whose gathered keys and per-slot gradient terms fit in
``_CHUNK_BYTES`` (256 MiB by default; the temporaries of one chunk stay well under 1 GiB).

Sources of the conventions: DeepSeek Sparse Attention (top-k keys per query row) from the
DeepSeek-V3.2 report, in MLA's absorbed MQA form; the sink-exclusive natural-log LSE is the
one FlashMLA's sparse prefill returns; the sink is the learned per-head softmax column with a
zero value of Xiao et al. (arXiv:2309.17453) and gpt-oss.

Public functions:
    mqa_latent_sparse_fwd_ref, mqa_latent_sparse_bwd_ref (the arguments of the kernels'
    ``mqa_latent_sparse_fwd`` / ``mqa_latent_sparse_bwd``, in the same order).  The LSE bridge
    is ``attn/lse.py``.
"""

from __future__ import annotations

from typing import Any

from .adapter import ops_for
from .checks import (
    PreparedIndices,
    check_compute_dtype,
    check_sm_scale,
    check_tensors,
    check_values,
)

__all__ = [
    "mqa_latent_sparse_fwd_ref",
    "mqa_latent_sparse_bwd_ref",
]

#: Bytes of per-row intermediates one chunk may hold (tests shrink it to force many chunks).
_CHUNK_BYTES = 256 << 20

_NEG_INF = float("-inf")

# Any float dtype may come in (bf16 too: it is cast before any arithmetic, since Paddle's CPU
# build has no bf16 math); sink and lse may be fp32 or fp64 here.
_REF_FLOATS = ("bfloat16", "float16", "float32", "float64")
_REF_AUX = ("float32", "float64")


def _chunk_rows(dims, dtype: str, backward: bool) -> int:
    """Query rows per chunk so that one chunk's intermediates fit in ``_CHUNK_BYTES``."""
    itemsize = 8 if dtype == "float64" else 4
    # Per query row: the gathered keys [L, Dk] (twice: the gather and its -1 rows zeroed),
    # scores/probabilities [H, L] (a few of them), the query (cast and scaled) and the output
    # and, in backward, the per-slot dKV terms [L, Dk] and [L, Dv], their sum and its -1 rows
    # zeroed, before the scatter.
    per_row = 2 * dims.L * dims.Dk + 4 * dims.H * dims.L + dims.H * (2 * dims.Dk + dims.Dv)
    if backward:
        per_row += dims.L * (3 * dims.Dk + dims.Dv) + 3 * dims.H * dims.L
    per_row *= dims.B * itemsize
    return max(1, min(dims.S, _CHUNK_BYTES // per_row))


def _chunk_probs(ops, q_c, kv_c, idx_c, sink_c, sm_scale, dims):
    """Probabilities of one chunk of query rows.

    Returns ``(kv_g, safe, P, lse, p_sink)``: gathered keys ``[B, c, L, Dk]``, the indices with
    ``-1`` replaced by 0 ``[B, c, L]``, ``P [B, c, H, L]`` (0 on ``-1`` slots), the
    sink-exclusive natural LSE ``[B, c, H]`` (``-inf`` without keys) and the sink's probability
    ``[B, c, H]`` (``None`` without a sink).

    The probabilities are ``exp(s - m) / Z`` with ``m`` the row's largest logit (the sink
    included) and ``Z = sum exp(s - m)``: every exponent is ``<= 0`` and one is 0, whatever the
    size of the logits.  ``exp(s - lse)`` instead loses ``|lse| * eps`` in the exponent (1% of
    ``P`` at logits ~3e5 in fp32; ``docs/conventions.md``, "Range").
    """
    valid = idx_c >= 0
    # -1 is never dereferenced: gather row 0 instead, zero it (so that a non-finite value in
    # row 0 cannot reach a -1 slot's 0 * x) and mask its score to -inf.
    safe = ops.where(valid, idx_c, ops.zeros(ops.shape(idx_c), ops.dtype(idx_c), idx_c))
    B, c, L = ops.shape(idx_c)
    dt = ops.dtype(q_c)
    kv_g = ops.where(ops.reshape(valid, (B, c, L, 1)), ops.gather_rows(kv_c, safe),
                     ops.zeros((1,), dt, q_c))
    # (q sm_scale) . k, not (q . k) sm_scale: the raw q . k overflows where the logits need
    # not (fp32 inputs at 3e19 with sm_scale 1e-30: logits ~1e9, q . k ~1e41).  For sm_scale
    # <= 1, q sm_scale cannot overflow, and the scores overflow only where the partial sums of
    # sm_scale q_d k_d do (docs/conventions.md, "Range").  [B, c, H, Dk]: small next to kv_g.
    scores = ops.einsum("bshd,bsld->bshl", q_c * sm_scale, kv_g)
    H = dims.H
    valid4 = ops.reshape(valid, (B, c, 1, L))
    neg_inf = ops.full((1,), _NEG_INF, dt, q_c)
    scores = ops.where(valid4, scores, neg_inf)
    zero = ops.zeros((1,), dt, q_c)
    # All-masked row: shift by 0, exp(-inf) = 0.  The test is "== -inf", not "> -inf", so that
    # a NaN is never replaced by a plausible 0 (validation rejects NaN before this point).
    m_key = ops.amax(scores, axis=-1, keepdim=True)
    m_key = ops.where(m_key == _NEG_INF, zero, m_key)
    lse = ops.log(ops.sum(ops.exp(scores - m_key), axis=-1)) + ops.reshape(m_key, (B, c, H))
    if sink_c is None:
        m, sink_w = m_key, None
    else:
        sink4 = ops.reshape(sink_c, (1, 1, H, 1))
        m = ops.where(sink4 > m_key, sink4 + zero, m_key)  # (-inf sink: m stays m_key)
        sink_w = ops.exp(ops.reshape(sink_c, (1, 1, H)) - ops.reshape(m, (B, c, H)))
    e = ops.exp(scores - m)
    z = ops.sum(e, axis=-1)
    if sink_w is not None:
        z = z + sink_w
    # z = 0 only for a row with no key and no sink: every P is 0 there
    z_safe = ops.where(z == 0, ops.full((1,), 1.0, dt, q_c), z)
    P = e / ops.reshape(z_safe, (B, c, H, 1))
    p_sink = None if sink_w is None else sink_w / z_safe
    return kv_g, safe, P, lse, p_sink


def _checked(query, kv, token_indices, attn_sink, **kw):
    """``(dims, indices)`` of a call, checked: the tensors' metadata (``checks.check_tensors``;
    with a ``checks.PreparedIndices``, against the sizes it was made for, ``L`` then the width
    of its indices, the kernels' ``-1`` padding included), then the values (index range, sink:
    ``checks.check_values``; a prepared call checks them again, which costs two reductions
    next to the attention itself and keeps a sink other than the one prepared from passing
    unchecked)."""
    prepared = token_indices if isinstance(token_indices, PreparedIndices) else None
    if prepared is not None:
        kw.pop("d_v", None)  # the prepared Dv
        token_indices = prepared.indices
    dims = check_tensors(query, kv, token_indices, attn_sink=attn_sink, float_dtypes=_REF_FLOATS,
                         aux_float_dtypes=_REF_AUX, prepared=prepared, **kw)
    check_values(dims, token_indices, attn_sink=attn_sink)
    return dims, token_indices


def _cast_kv_sink(ops, kv, attn_sink, dtype):
    return ops.cast(kv, dtype), (None if attn_sink is None else ops.cast(attn_sink, dtype))


def mqa_latent_sparse_fwd_ref(
    query: Any,
    kv: Any,
    token_indices: Any,
    sm_scale: float,
    attn_sink: Any = None,
    d_v: int = 512,
    dtype: str = "float32",
):
    """Reference forward of sparse MQA-latent attention (``docs/conventions.md``, "Forward").

    Args:
        query: ``[B, S, H, Dk]`` any float dtype (bf16 allowed; cast to ``dtype`` first).
        kv: ``[B, S_kv, Dk]`` same dtype as ``query``; the value is ``kv[..., :d_v]``.
        token_indices: ``[B, S, L]`` int32/int64, ``-1`` for an empty slot, else in
            ``[0, S_kv)``; or a ``checks.PreparedIndices`` made for these tensors (the op's
            path): their shapes must be those it was made for (``ValueError`` naming the
            tensor and both shapes), ``Dv`` is its ``dims.Dv`` (``d_v`` not used), and the
            values (index range, sink) are checked as for a tensor.
        sm_scale: multiplies ``q.k`` only (not the sink); finite and ``> 0``, also in float32
            (:func:`checks.check_sm_scale`).  Applied to the query before the dot product, so
            a raw ``q.k`` beyond the dtype's range does not overflow where the logits are
            finite (``docs/conventions.md``, "Range of logits handled exactly").
        attn_sink: ``[H]`` float32/float64 sink logits (raw, not scaled), or ``None``; finite
            or ``-inf`` (that head has no sink), never NaN or ``+inf``.
        d_v: value width ``Dv``, ``1 <= d_v <= Dk`` (``Dv = Dk``: the value is the whole kv
            row, as in DeepSeek-V4's ``(512, 512)``).
        dtype: compute and output dtype, ``"float32"`` or ``"float64"``.

    Returns:
        ``(out, lse)``: ``out [B, S, H, Dv]`` and ``lse [B, S, H]``, both in ``dtype``, on the
        inputs' device and framework.  ``lse`` is the natural-log, sink-exclusive LSE of the
        scaled scores, ``-inf`` for a row with no valid key (whose ``out`` is 0).

    Raises:
        TypeError, ValueError: bad input, see :func:`checks.check_tensors` and
        :func:`checks.check_values` (index range and sink values are always checked here);
        ``sm_scale`` not a finite real ``> 0``; ``dtype`` not ``"float32"``/``"float64"``.
    """
    dims, token_indices = _checked(query, kv, token_indices, attn_sink, d_v=d_v)
    return _fwd(dims, query, kv, token_indices, check_sm_scale(sm_scale), attn_sink,
                check_compute_dtype(dtype))


def _fwd(dims, query, kv, token_indices, sm_scale, attn_sink, dtype):
    """The forward on checked inputs (the public function checks them once)."""
    ops = ops_for(query, kv, token_indices, attn_sink)
    kv_c, sink_c = _cast_kv_sink(ops, kv, attn_sink, dtype)
    step = _chunk_rows(dims, dtype, backward=False)
    # Outputs are filled in place, chunk by chunk, so they are never held twice.
    out = ops.zeros((dims.B, dims.S, dims.H, dims.Dv), dtype, kv_c)
    lse = ops.zeros((dims.B, dims.S, dims.H), dtype, kv_c)
    for s0 in range(0, dims.S, step):
        s1 = min(dims.S, s0 + step)
        q_c = ops.cast(query[:, s0:s1], dtype)
        idx_c = token_indices[:, s0:s1]
        kv_g, _, P, lse_c, _ = _chunk_probs(ops, q_c, kv_c, idx_c, sink_c, sm_scale, dims)
        out[:, s0:s1] = ops.einsum("bshl,bsld->bshd", P, kv_g[..., : dims.Dv])
        lse[:, s0:s1] = lse_c
    return out, lse


def mqa_latent_sparse_bwd_ref(
    query: Any,
    kv: Any,
    out: Any,
    grad_out: Any,
    lse: Any,
    attn_sink: Any,
    token_indices: Any,
    sm_scale: float,
    *,
    dtype: str = "float32",
):
    """Reference backward (``docs/conventions.md``, "Backward"), written out explicitly.  The
    eight tensor and scale arguments are those of the kernel's
    :func:`~.interface.mqa_latent_sparse_bwd`, in the same order, so a kernel call's
    ``(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale)`` can be handed to the
    reference unchanged.

    Recomputes the forward probabilities chunk by chunk, then per row and head:
    ``Delta = <out, grad_out>``, ``dP_l = <grad_out, v_l>``, ``dS_l = P_l (dP_l - Delta)``,
    ``dq = sm_scale sum_l dS_l kv_l``, ``dkv[i_l] += sm_scale dS_l q + [P_l grad_out, 0]``
    (the last ``Dk - Dv`` columns get no value term; with ``Dv = Dk`` every column gets both) and ``d_sink[h] = -sum P_sink Delta``.

    Args:
        query, kv: as in :func:`mqa_latent_sparse_fwd_ref`.
        out: ``[B, S, H, Dv]`` float, the forward output, or ``None``; when given, its last dim
            is ``Dv``.
        grad_out: ``[B, S, H, Dv]`` float, gradient of the loss with respect to ``out``
            (required: ``None`` raises ``TypeError``); ``Dv`` is its last dim when ``out`` is
            ``None``.
        lse: ``[B, S, H]`` float32/float64, the forward's LSE (any ``lse_format``), or ``None``.
            ``out`` and ``lse`` are checked for type and shape only: the reference recomputes
            both in ``dtype`` from ``query`` and ``kv``, so its gradient is the exact one and
            does not inherit the rounding (or errors) of a given ``out``/``lse``.
        attn_sink, token_indices, sm_scale: as in :func:`mqa_latent_sparse_fwd_ref`
            (``attn_sink`` may be ``None``; with a ``PreparedIndices`` every tensor is checked
            as without one, against the sizes it was made for: ``grad_out`` in the forward
            output's shape).
        dtype: compute and output dtype, ``"float32"`` or ``"float64"`` (keyword only).

    Returns:
        ``(dq [B, S, H, Dk], dkv [B, S_kv, Dk], d_sink [H])`` in ``dtype``; ``dkv`` sums over
        every head and query row that selected a key (duplicates count separately); ``d_sink``
        is zeros when ``attn_sink`` is ``None``.  Rows with no valid key contribute 0.

    Raises:
        TypeError, ValueError: as :func:`mqa_latent_sparse_fwd_ref`, plus ``grad_out``, ``out`` and
        ``lse`` checks (type, framework, device, dtype, shape; a ``grad_out`` whose shape
        differs from ``out``'s is named).
    """
    # out and lse: type, device, dtype and shape only (their values are not used).
    dims, token_indices = _checked(query, kv, token_indices, attn_sink, out=out,
                                   grad_out=grad_out, lse=lse, required=("grad_out",))
    return _bwd(dims, query, kv, grad_out, attn_sink, token_indices, check_sm_scale(sm_scale),
                check_compute_dtype(dtype))


def _bwd(dims, query, kv, grad_out, attn_sink, token_indices, sm_scale, dtype):
    """The backward on checked inputs (the public function checks them once)."""
    ops = ops_for(query, kv, token_indices, attn_sink, grad_out)
    kv_c, sink_c = _cast_kv_sink(ops, kv, attn_sink, dtype)
    B, H, Dk, Dv = dims.B, dims.H, dims.Dk, dims.Dv
    step = _chunk_rows(dims, dtype, backward=True)
    dq = ops.zeros((B, dims.S, H, Dk), dtype, kv_c)
    dkv = ops.zeros((B, dims.S_kv, Dk), dtype, kv_c)
    d_sink = ops.zeros((H,), dtype, kv_c)
    for s0 in range(0, dims.S, step):
        s1 = min(dims.S, s0 + step)
        c = s1 - s0
        q_c = ops.cast(query[:, s0:s1], dtype)
        do_c = ops.cast(grad_out[:, s0:s1], dtype)
        idx_c = token_indices[:, s0:s1]
        kv_g, safe, P, _, p_sink = _chunk_probs(ops, q_c, kv_c, idx_c, sink_c, sm_scale, dims)
        v_g = kv_g[..., :Dv]
        out_c = ops.einsum("bshl,bsld->bshd", P, v_g)
        valid = idx_c >= 0
        zero = ops.zeros((1,), dtype, kv_c)
        # Delta = <out, grad_out> is 0 in a row with no valid key (out = 0 there), also where
        # that row's grad_out is not finite (not 0 * NaN): such a row adds 0 to d_sink
        has_key = ops.reshape(ops.amax(ops.cast(valid, dtype), axis=-1) > 0, (B, c, 1))
        delta = ops.where(has_key, ops.sum(out_c * do_c, axis=-1), zero)  # [B, c, H]
        dP = ops.einsum("bshd,bsld->bshl", do_c, v_g)
        # 0 on -1 slots, not P * (...) = 0 * x: a NaN in a padding row's grad_out must not reach
        # dq's or dkv's -1 terms
        dS = ops.where(ops.reshape(valid, (B, c, 1, dims.L)),
                       P * (dP - ops.reshape(delta, (B, c, H, 1))), zero)
        dq[:, s0:s1] = ops.einsum("bshl,bsld->bshd", dS, kv_g) * sm_scale
        term_qk = ops.einsum("bshl,bshd->bsld", dS, q_c) * sm_scale  # [B, c, L, Dk]
        term_v = ops.einsum("bshl,bshd->bsld", P, do_c)  # [B, c, L, Dv]
        if Dv < Dk:
            pad = ops.zeros((B, c, dims.L, Dk - Dv), dtype, term_v)
            term_v = ops.concat([term_v, pad], axis=-1)
        # -1 slots add exactly 0 at row 0 (their terms zeroed, not 0 * x, which a NaN in a
        # padding row's query or grad_out would make NaN)
        terms = ops.where(ops.reshape(valid, (B, c, dims.L, 1)), term_qk + term_v, zero)
        dkv = ops.scatter_add_rows(dkv, safe, terms)
        if sink_c is not None:
            d_sink = d_sink - ops.sum(ops.reshape(p_sink * delta, (B * c, H)), axis=0)
    return dq, dkv, d_sink

