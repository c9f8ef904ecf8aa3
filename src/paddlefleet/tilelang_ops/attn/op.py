"""Paddle autograd op for sparse MQA-latent attention with an attention sink.

Reads top to bottom: backend choice -> plain forward/backward dispatch functions ->
:class:`MQALatentSparseAttentionFunction` (a ``paddle.autograd.PyLayer`` that only does ``ctx``
bookkeeping) -> the public :func:`mqa_latent_sparse_attention`.

Forward: the TileLang kernel (``interface.mqa_latent_sparse_fwd``) for CUDA tensors, the
reference (``reference.mqa_latent_sparse_fwd_ref``) for CPU tensors, computed in fp64 for fp64
inputs and in fp32 otherwise.  Backward: chosen by ``backward_backend``; the top-k indices,
``out`` and the natural-log, sink-exclusive ``lse`` are saved by the forward and reused, never
recomputed.  The math is docs/conventions.md; the exact definition is ``attn/reference.py``.

Inputs are checked once, when the op is called (on CUDA with the kernel wrapper's rules); the
PyLayer then runs the wrapper's or the reference's unchecked bodies (``_fwd`` / ``_bwd``).

The kernel module is imported lazily, on the CUDA path only, so CPU-only installs work.

Former names, deprecated until the next release: ``sparse_mqa_attention`` and
``SparseMQAAttentionFunction`` (the same objects).
"""

from __future__ import annotations

from importlib import import_module

import paddle
from paddle.autograd import PyLayer

from .adapter import framework_of, ops_for, type_name
from .checks import (
    check_cu_seqlens,
    check_indices_in_documents,
    check_sm_scale,
    check_tensors,
    check_values,
)
from .config import BACKWARD_BACKENDS
from .reference import _bwd as _reference_bwd
from .reference import _fwd as _reference_fwd

__all__ = [
    "mqa_latent_sparse_attention",
    "MQALatentSparseAttentionFunction",
    "resolve_backward_backend",
    "sparse_mqa_attention",
    "SparseMQAAttentionFunction",
]


def resolve_backward_backend(backward_backend: str | None, device_kind: str) -> str:
    """The backward implementation for tensors on ``device_kind`` (``"cuda"``/``"cpu"``).

    ``None`` -> ``"tilelang"`` on CUDA, ``"reference"`` elsewhere.

    Raises:
        ValueError: an unknown name (the message lists the choices), or ``"tilelang"`` for
            tensors that are not on CUDA (the kernels are Hopper-only).
    """
    if backward_backend is None:
        return "tilelang" if device_kind == "cuda" else "reference"
    if backward_backend not in BACKWARD_BACKENDS:
        raise ValueError(
            f"backward_backend: expected one of {list(BACKWARD_BACKENDS)} or None, got "
            f"{backward_backend!r}"
        )
    if backward_backend == "tilelang" and device_kind != "cuda":
        raise ValueError(
            "backward_backend='tilelang' needs CUDA tensors (the TileLang kernels target "
            f"sm_90a), got tensors on {device_kind}; use backward_backend='reference' on CPU"
        )
    return backward_backend


# --- plain forward / backward ----------------------------------------------------------------
def _ref_dtype(query) -> str:
    """The reference's compute dtype: fp64 for fp64 inputs (no silent narrowing), else fp32."""
    return "float64" if ops_for(query).dtype(query) == "float64" else "float32"


def _interface():
    """The kernels' host wrappers, imported on the CUDA path only (CPU-only installs may lack
    TileLang); through ``sys.modules``, so that tests can put a stand-in there."""
    return import_module(".interface", __package__)


def _check_inputs(query, kv, token_indices, sm_scale, attn_sink, d_v, device_kind):
    """The op's input checks, the only ones of a call: on CUDA the kernel wrapper's rules (bf16,
    values included: one device->host read), on CPU the generic ones.  Returns the sizes."""
    if device_kind == "cuda":
        iface = _interface()
        dims, _ = iface._check_inputs(query, kv, token_indices, sm_scale, attn_sink, True,
                                      iface._DEFAULT_PROVIDER, d_v=d_v)
        return dims
    dims = check_tensors(query, kv, token_indices, attn_sink=attn_sink, d_v=d_v)
    check_values(dims, token_indices, attn_sink=attn_sink)
    return dims


def _forward(dims, query, kv, token_indices, sm_scale, attn_sink, device_kind):
    """-> ``(out [B,S,H,Dv] in query's dtype, lse [B,S,H] natural, sink-exclusive)``; ``lse``
    is fp32 (fp64 for fp64 inputs on CPU).  The inputs were checked by the op."""
    if device_kind == "cuda":
        kernels = _interface()
        out, lse = kernels._fwd(kernels._DEFAULT_PROVIDER, dims, query, kv, token_indices,
                                sm_scale, attn_sink, None)
    else:
        out, lse = _reference_fwd(dims, query, kv, token_indices, sm_scale, attn_sink,
                                  _ref_dtype(query))
    ops = ops_for(query)
    lse_dtype = "float64" if ops.dtype(lse) == "float64" else "float32"
    return ops.cast(out, ops.dtype(query)), ops.cast(lse, lse_dtype)


def _backward(backend, dims, query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale):
    """-> ``(dq in query's dtype, dkv in kv's dtype, d_sink fp32 [H])``.  The forward checked
    every input but ``grad_out``, which Paddle gives in ``out``'s shape."""
    ops = ops_for(query)
    if backend == "tilelang":
        kernels = _interface()
        grad_out = ops.contiguous(ops.cast(grad_out, ops.dtype(out)))
        dq, dkv, d_sink = kernels._bwd(
            kernels._DEFAULT_PROVIDER, dims, query, kv, out, grad_out, lse, attn_sink,
            token_indices, sm_scale, None, True, "natural",
        )
    else:
        # The reference recomputes P from (query, kv, token_indices); the saved indices are
        # what it gets, so the top-k selection is still never recomputed.
        dq, dkv, d_sink = _reference_bwd(dims, query, kv, grad_out, attn_sink, token_indices,
                                         sm_scale, _ref_dtype(query))
    return ops.cast(dq, ops.dtype(query)), ops.cast(dkv, ops.dtype(kv)), d_sink


# --- PyLayer ---------------------------------------------------------------------------------
class MQALatentSparseAttentionFunction(PyLayer):
    """``ctx`` bookkeeping around :func:`_forward` / :func:`_backward`.

    Tensor inputs, in order: ``query``, ``kv``, ``token_indices`` and, when given,
    ``attn_sink``.  Paddle requires one return value per Tensor input, and ``None`` for every
    input with ``stop_gradient=True`` (the int indices always get ``None``), so the backward
    returns ``None`` for each input that was not differentiable at forward time and returns
    nothing for an absent sink.
    """

    @staticmethod
    def forward(ctx, query, kv, token_indices, attn_sink, sm_scale, dims, backend, device_kind):
        out, lse = _forward(dims, query, kv, token_indices, sm_scale, attn_sink, device_kind)
        ctx.sm_scale = sm_scale
        ctx.dims = dims
        ctx.backend = backend
        ctx.has_sink = attn_sink is not None
        ctx.needs_grad = (
            not query.stop_gradient,
            not kv.stop_gradient,
            attn_sink is not None and not attn_sink.stop_gradient,
        )
        ctx.save_for_backward(query, kv, token_indices, out, lse, attn_sink)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, kv, token_indices, out, lse, attn_sink = ctx.saved_tensor()
        dq, dkv, d_sink = _backward(
            ctx.backend, ctx.dims, query, kv, out, grad_out, lse, attn_sink, token_indices,
            ctx.sm_scale,
        )
        need_q, need_kv, need_sink = ctx.needs_grad
        grads = [dq if need_q else None, dkv if need_kv else None, None]
        if ctx.has_sink:
            grads.append(ops_for(d_sink).cast(d_sink, ops_for(attn_sink).dtype(attn_sink))
                         if need_sink else None)
        return tuple(grads)


def _check_packed(dims, token_indices, cu_seqlens) -> None:
    """The packed-documents checks of the forward (see :func:`mqa_latent_sparse_attention`).

    Run after :func:`_check_inputs` (whose value checks include the index range) on every
    device; the in-document check is one more value check.  The backward reuses the checked
    indices and checks nothing.
    """
    cu = check_cu_seqlens(cu_seqlens, dims.S)
    if dims.B != 1:
        raise ValueError(
            f"query: packed documents (cu_seqlens) need B=1, all documents back to back in one "
            f"row, got B={dims.B}"
        )
    if dims.S_kv != dims.S:
        raise ValueError(
            f"kv: with cu_seqlens expected S_kv = S = {dims.S} (the packed tokens are both the "
            f"queries and the keys), got S_kv={dims.S_kv}"
        )
    check_indices_in_documents(token_indices, cu)


def mqa_latent_sparse_attention(
    query: paddle.Tensor,
    kv: paddle.Tensor,
    token_indices: paddle.Tensor,
    sm_scale: float,
    attn_sink: paddle.Tensor | None = None,
    backward_backend: str | None = None,
    *,
    d_v: int = 512,
    cu_seqlens=None,
) -> paddle.Tensor:
    """Sparse MQA-latent attention (DeepSeek-V3.2 DSA, absorbed MLA) with an attention sink,
    differentiable with respect to ``query``, ``kv`` and ``attn_sink``.

    Args:
        query: ``[B, S, H, Dk]``; bf16 on CUDA (the kernel's dtype).  On CPU fp32 is the
            normal choice (Paddle's CPU build has no bf16 math); bf16 also works there because
            the reference computes in fp32 and only the results are rounded back.  fp64 inputs
            are computed in fp64.
            ``Dk = kv_lora_rank + qk_rope_head_dim`` (576).
        kv: ``[B, S_kv, Dk]``, same dtype as ``query``: the shared latent; the value is
            ``kv[..., :d_v]``.
        token_indices: ``[B, S, L]`` int32/int64 top-k key rows, ``-1`` = empty slot.  Causality
            is carried by the indices (the op applies no mask).
        sm_scale: multiplies ``q.k`` (not the sink), e.g. ``(qk_nope + qk_rope) ** -0.5``;
            finite and ``> 0`` (also in float32) on every device.
        attn_sink: ``[H]`` fp32 per-head sink logits, or ``None``; finite or ``-inf`` (that
            head has no sink), never NaN or ``+inf``.
        backward_backend: ``"tilelang"`` (CUDA kernels), ``"reference"`` (reference in fp32,
            fp64 for fp64 inputs; any device) or ``None`` (``"tilelang"`` on CUDA,
            ``"reference"`` on CPU).  It chooses the *backward* only: on CUDA the forward is
            always the TileLang kernel (see the limit below).
        d_v: value width ``Dv`` (keyword only; 512 = DeepSeek-V3.2's ``kv_lora_rank``; with
            ``Dk = Dv = 512``, DeepSeek-V4, the value is the whole kv row).
        cu_seqlens: ``[num_docs + 1]`` int32 boundaries of packed documents (keyword only), or
            ``None``; a ``paddle.Tensor`` on any place or a ``numpy.ndarray``, starting at 0,
            non-decreasing, ending at ``S``.  Only checked, never read by the kernels (see
            "Packed documents").

    Packed documents (the THD layout): several variable-length documents packed back to back
    in one row are a call with ``B = 1``, ``S_kv = S`` (the same packed tokens are queries and
    keys) and top-k indices that stay inside each query's own document; the math needs nothing
    else, because every key a row attends to comes from its indices.  For a query row ``t`` of
    document ``d`` (rows ``cu_seqlens[d] <= t < cu_seqlens[d+1]``) every index is ``-1`` or in
    ``[cu_seqlens[d], cu_seqlens[d+1])``; ``indices.varlen_causal_topk_indices`` builds such
    indices.  Passing ``cu_seqlens`` makes the forward check exactly that, alongside its other
    value checks (one more device->host read on CUDA).  Documents of 100 and 412 tokens::

        from paddlefleet.tilelang_ops.attn.indices import (
            cu_seqlens_from_lengths, varlen_causal_topk_indices)
        cu = cu_seqlens_from_lengths([100, 412])                      # int32 [0, 100, 512]
        idx = paddle.to_tensor(varlen_causal_topk_indices(cu, 64))    # [1, 512, 64]
        out = mqa_latent_sparse_attention(q, kv, idx, scale, sink, cu_seqlens=cu)
        # q [1, 512, H, Dk], kv [1, 512, Dk]: out[:, :100] equals the first document run
        # alone (q[:, :100], kv[:, :100]), out[:, 100:] the second (indices shifted by -100)

    CUDA limit: the forward on CUDA tensors always runs the TileLang kernel, which is built for
    ``(Dk, Dv) = (576, 512)`` only (``tiling.kernel_dims()``) and bf16 inputs; DeepSeek-V4's
    ``(512, 512)`` (``tiling.SUPPORTED_DIMS``) runs on CPU tensors, and on CUDA raises a
    ``ValueError`` saying its kernels are not built yet.  Any other head
    dims on CUDA (e.g. the ``deepseek_v32_small`` preset, Dk 80 / Dv 64) raise ``ValueError``
    in the forward *even with* ``backward_backend="reference"``: there is no reference
    fallback for the CUDA forward.  Run such configs on CPU tensors (reference forward and
    backward).

    Returns:
        ``out``: ``[B, S, H, Dv]`` in ``query``'s dtype.

    Raises:
        TypeError / ValueError: bad tensors (``checks.check_tensors``, ``checks.check_values``;
            on CUDA with the kernel wrapper's rules, so ``TypeError`` for non-bf16 inputs),
            ``sm_scale`` not finite and ``> 0``, an unknown ``backward_backend``, or
            ``"tilelang"`` on CPU tensors.  On CUDA also (from the kernel's forward, whatever
            ``backward_backend``): ``ValueError`` for ``(Dk, Dv) != (576, 512)``.
            With ``cu_seqlens``: ``TypeError`` when it is not an int32 tensor/array;
            ``ValueError`` when it is not 1-D with >= 2 entries, does not start at 0, decreases,
            does not end at ``S``, when ``B != 1`` or ``S_kv != S``, or when an index points
            outside its query's document (the message names the first such row).

    Gradients: ``dq`` in ``query``'s dtype, ``dkv`` in ``kv``'s dtype, ``d_sink`` fp32 (zero
    contribution from rows whose weight is all on the sink); see docs/conventions.md.
    """
    sm_scale = check_sm_scale(sm_scale)
    if framework_of(query) != "paddle":
        hint = (" (this is Paddle's autograd op; mqa_latent_sparse_fwd/_bwd take torch.Tensor)"
                if framework_of(query) == "torch" else "")
        raise TypeError(f"query: expected a paddle.Tensor, got {type_name(query)}{hint}")
    ops = ops_for(query)
    device_kind = ops.device_kind(query)
    backend = resolve_backward_backend(backward_backend, device_kind)
    dims = _check_inputs(query, kv, token_indices, sm_scale, attn_sink, d_v, device_kind)
    if cu_seqlens is not None:
        _check_packed(dims, token_indices, cu_seqlens)
    return MQALatentSparseAttentionFunction.apply(
        query, kv, token_indices, attn_sink, sm_scale, dims, backend, device_kind
    )


# Deprecated (until the next release): the former names of the op and its PyLayer.
sparse_mqa_attention = mqa_latent_sparse_attention
SparseMQAAttentionFunction = MQALatentSparseAttentionFunction
