"""Paddle autograd op for sparse MQA-latent attention with an attention sink.

Reads top to bottom: backend and determinism choices -> the one input check of a call ->
plain forward/backward dispatch functions -> :class:`MQALatentSparseAttentionFunction` (a
``paddle.autograd.PyLayer`` that only does ``ctx`` bookkeeping) -> the public
:func:`mqa_latent_sparse_attention`.

Forward: the TileLang kernel (``interface.mqa_latent_sparse_fwd``) for CUDA tensors, the
reference (``reference.mqa_latent_sparse_fwd_ref``) for CPU tensors, computed in fp64 for fp64
inputs and in fp32 otherwise.  Backward: chosen by ``backward_backend``; the top-k indices,
``out`` and the natural-log, sink-exclusive ``lse`` are saved by the forward and reused, never
recomputed.  The math is docs/conventions.md; the exact definition is ``attn/reference.py``.

Inputs are checked once, when the op is called (on CUDA with the kernel wrapper's rules,
``interface.check_inputs``), into a ``checks.PreparedIndices`` (the checked int32 indices, the
sizes, the checked ``cu_seqlens``) that the forward saves for the backward; both hand it to the
public wrappers / reference in place of ``token_indices``.  Its indices are the op's own copy,
so the backward never reads the caller's index tensor.  The backward refuses to run on
``query``, ``kv``, ``attn_sink`` edited in place after the forward by an op that Paddle versions
(as Paddle's own ops do; writes Paddle does not version cannot be seen, see the op's docstring).

The kernel module is imported lazily, on the CUDA path only, so CPU-only installs work.
"""

from __future__ import annotations

import os
from importlib import import_module

import numpy as np
import paddle
from paddle.autograd import PyLayer

from .adapter import framework_of, ops_for, type_name
from .checks import check_sm_scale, check_tensors, prepare_indices
from .config import BACKWARD_BACKENDS
from .reference import mqa_latent_sparse_bwd_ref, mqa_latent_sparse_fwd_ref

__all__ = [
    "mqa_latent_sparse_attention",
    "MQALatentSparseAttentionFunction",
    "resolve_backward_backend",
    "resolve_deterministic",
]

#: Paddle's switch for deterministic GPU kernels, which ``deterministic=None`` follows.
DETERMINISM_FLAG = "FLAGS_cudnn_deterministic"
# gflags' spellings of a bool (Paddle reads FLAGS_* from the environment with gflags, which
# refuses anything else): matched case-insensitively
_TRUE = ("1", "true", "t", "yes", "y")
_FALSE = ("0", "false", "f", "no", "n")


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


def _determinism_flag() -> bool | None:
    """``FLAGS_cudnn_deterministic`` where the user set it, else ``None``: its value
    (``paddle.get_flags``) when true, or when false and given in the environment (Paddle cannot
    tell a ``False`` set with ``paddle.set_flags`` from the flag's default).  Paddle's CPU
    builds register no cuDNN flag: there the environment variable is read as gflags reads it
    (:func:`_env_flag`)."""
    env = os.environ.get(DETERMINISM_FLAG)
    if env is not None and not env.strip():
        env = None  # set but empty: as unset
    try:
        value = bool(paddle.get_flags([DETERMINISM_FLAG])[DETERMINISM_FLAG])
    except ValueError:  # "cannot get its value": a build without the flag
        value = None
    if value is None:  # read outside the except: an unreadable value's error stands alone
        return None if env is None else _env_flag(env)
    return value if value or env is not None else None


def _env_flag(env: str) -> bool:
    """gflags' reading of a bool flag's environment value: t/f, true/false, y/n, yes/no, 1/0,
    any case (surrounding spaces ignored); anything else is an error, as gflags makes it."""
    word = env.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(
        f"{DETERMINISM_FLAG}={env!r} in the environment: expected a bool as gflags reads it "
        f"(1/0, true/false, t/f, yes/no, y/n, any case)"
    )


def resolve_deterministic(deterministic: bool | None) -> bool:
    """Whether the TileLang backward sums dKV exactly (bitwise repeatable) or with fp32
    atomics.

    ``None`` follows Paddle's ``FLAGS_cudnn_deterministic`` where the user set it (true: set
    with ``paddle.set_flags`` or in the environment; false: in the environment), else ``True``,
    this package's default.  A ``numpy.bool_`` is taken by value (as the configs take it).

    Raises:
        TypeError: not a bool (Python's or numpy's) or ``None``.
        ValueError: ``None`` and ``FLAGS_cudnn_deterministic`` in the environment holds no bool
            gflags accepts (the variable and its value are named; empty counts as unset).
    """
    if deterministic is None:
        flag = _determinism_flag()
        return True if flag is None else flag
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(
            f"deterministic: expected True, False or None, got {type_name(deterministic)}"
        )
    return bool(deterministic)


# --- the call's one input check; plain forward / backward ------------------------------------
def _ref_dtype(query) -> str:
    """The reference's compute dtype: fp64 for fp64 inputs (no silent narrowing), else fp32."""
    return "float64" if ops_for(query).dtype(query) == "float64" else "float32"


def _interface():
    """The kernels' host wrappers, imported on the CUDA path only (CPU-only installs may lack
    TileLang); through ``sys.modules``, so that tests can put a stand-in there."""
    return import_module(".interface", __package__)


def _prepare(query, kv, token_indices, attn_sink, d_v, cu_seqlens, device_kind):
    """The op's input checks, the only ones of a call: on CUDA the kernel wrapper's rules (bf16,
    values included: one device->host read), on CPU the generic ones; with ``cu_seqlens`` the
    packed-documents checks too.  Returns the ``checks.PreparedIndices``."""
    if device_kind == "cuda":
        return _interface().check_inputs(query, kv, token_indices, attn_sink, d_v=d_v,
                                         cu_seqlens=cu_seqlens)
    dims = check_tensors(query, kv, token_indices, attn_sink=attn_sink, d_v=d_v)
    return prepare_indices(dims, token_indices, attn_sink=attn_sink, cu_seqlens=cu_seqlens)


def _forward(prepared, query, kv, sm_scale, attn_sink, device_kind):
    """-> ``(out [B,S,H,Dv] in query's dtype, lse [B,S,H] natural, sink-exclusive)``; ``lse``
    is fp32 (fp64 for fp64 inputs on CPU)."""
    if device_kind == "cuda":
        out, lse = _interface().mqa_latent_sparse_fwd(query, kv, prepared, sm_scale, attn_sink)
    else:
        out, lse = mqa_latent_sparse_fwd_ref(query, kv, prepared, sm_scale, attn_sink,
                                             dtype=_ref_dtype(query))
    ops = ops_for(query)
    lse_dtype = "float64" if ops.dtype(lse) == "float64" else "float32"
    return ops.cast(out, ops.dtype(query)), ops.cast(lse, lse_dtype)


def _backward(backend, deterministic, prepared, query, kv, out, grad_out, lse, attn_sink,
              sm_scale):
    """-> ``(dq in query's dtype, dkv in kv's dtype, d_sink fp32 [H])``.  The forward checked
    every input but ``grad_out``, which Paddle gives in ``out``'s shape."""
    ops = ops_for(query)
    if backend == "tilelang":
        grad_out = ops.contiguous(ops.cast(grad_out, ops.dtype(out)))
        dq, dkv, d_sink = _interface().mqa_latent_sparse_bwd(
            query, kv, out, grad_out, lse, attn_sink, prepared, sm_scale,
            deterministic=deterministic)
    else:
        # The reference recomputes P from (query, kv, indices); the saved indices are what it
        # gets, so the top-k selection is still never recomputed.  It is deterministic anyway.
        dq, dkv, d_sink = mqa_latent_sparse_bwd_ref(query, kv, None, grad_out, None, attn_sink,
                                                    prepared, sm_scale, dtype=_ref_dtype(query))
    return ops.cast(dq, ops.dtype(query)), ops.cast(dkv, ops.dtype(kv)), d_sink


# --- PyLayer ---------------------------------------------------------------------------------
_READ_BY_BACKWARD = ("query", "kv", "attn_sink")


class MQALatentSparseAttentionFunction(PyLayer):
    """``ctx`` bookkeeping around :func:`_forward` / :func:`_backward`.

    Tensor inputs, in order: ``query``, ``kv``, ``token_indices`` and, when given,
    ``attn_sink``; then ``sm_scale``, the ``checks.PreparedIndices`` of the op's check, the
    backward backend, the device kind and ``deterministic``.  Paddle requires one return value
    per Tensor input, and ``None`` for every input with ``stop_gradient=True`` (the int indices
    always get ``None``), so the backward returns ``None`` for each input that was not
    differentiable at forward time and returns nothing for an absent sink.

    The backward reads ``query``, ``kv``, ``attn_sink`` as the forward saved them (and, on the
    TileLang path, ``out``): it raises if any of them was edited in place since by an op Paddle
    versions (``Tensor._inplace_version``), where it would silently give wrong gradients.  The
    indices it reads are the ``PreparedIndices``' own copy, never ``token_indices`` itself, so
    ``token_indices`` is neither saved nor watched.
    """

    @staticmethod
    def forward(ctx, query, kv, token_indices, attn_sink, sm_scale, prepared, backend,
                device_kind, deterministic):
        out, lse = _forward(prepared, query, kv, sm_scale, attn_sink, device_kind)
        ctx.sm_scale = sm_scale
        ctx.prepared = prepared
        ctx.backend = backend
        ctx.deterministic = deterministic
        ctx.has_sink = attn_sink is not None
        ctx.needs_grad = (
            not query.stop_gradient,
            not kv.stop_gradient,
            attn_sink is not None and not attn_sink.stop_gradient,
        )
        watched = dict(zip(_READ_BY_BACKWARD, (query, kv, attn_sink)))
        if backend == "tilelang":  # the kernels' backward reads out (Delta); the reference not
            watched["out"] = out
        ctx.versions = {name: t._inplace_version() for name, t in watched.items()
                        if t is not None}
        ctx.save_for_backward(query, kv, out, lse, attn_sink)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, kv, out, lse, attn_sink = ctx.saved_tensor()
        _check_versions(ctx.versions, dict(query=query, kv=kv, attn_sink=attn_sink, out=out))
        dq, dkv, d_sink = _backward(ctx.backend, ctx.deterministic, ctx.prepared, query, kv,
                                    out, grad_out, lse, attn_sink, ctx.sm_scale)
        need_q, need_kv, need_sink = ctx.needs_grad
        grads = [dq if need_q else None, dkv if need_kv else None, None]
        if ctx.has_sink:
            grads.append(ops_for(d_sink).cast(d_sink, ops_for(attn_sink).dtype(attn_sink))
                         if need_sink else None)
        return tuple(grads)


def _check_versions(saved: dict, tensors: dict) -> None:
    """Raise where a tensor the backward reads was edited in place after the forward
    (``saved``: its ``_inplace_version()`` then)."""
    for name, version in saved.items():
        now = tensors[name]._inplace_version()
        if now != version:
            raise RuntimeError(
                f"mqa_latent_sparse_attention: {name} was modified by an inplace operation "
                f"after the forward (inplace version {version} at the forward, {now} now); "
                f"the backward reads it and would give wrong gradients. Edit a copy "
                f"({name}.clone()) or do the edit before the forward"
            )


def index_tensor(token_indices, like: paddle.Tensor):
    """``token_indices`` as a paddle.Tensor: a numpy int32/int64 array (what
    ``indices.causal_topk_indices`` returns) is copied once to ``like``'s place; anything else
    is returned as it is, for the tensor checks.

    Raises:
        TypeError: a numpy array of another dtype.
    """
    if not isinstance(token_indices, np.ndarray):
        return token_indices
    if token_indices.dtype not in (np.int32, np.int64):
        raise TypeError(f"token_indices: expected dtype int32 or int64 (a numpy array is "
                        f"accepted), got numpy {token_indices.dtype}")
    return paddle.to_tensor(token_indices, place=like.place)


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
    deterministic: bool | None = None,
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
            is carried by the indices (the op applies no mask).  A paddle.Tensor, or a numpy
            int32/int64 array (as ``indices.causal_topk_indices`` returns), copied once to
            ``query``'s place.  The forward keeps its own checked int32 copy for the backward
            (``4 * B * S * L`` bytes on ``query``'s place until the backward; an int64 input is
            cast into it anyway), so editing ``token_indices`` after the forward, by any means,
            does not change the gradients.
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
        deterministic: (keyword only) the TileLang backward's dKV: ``True`` summed exactly on
            per-key grids, bitwise repeatable across calls and processes (``exact_dkv.py``);
            ``False`` fp32 atomics (faster, last-bit differences between calls); ``None``
            (default) follows Paddle's ``FLAGS_cudnn_deterministic`` where the user set it,
            else ``True`` (:func:`resolve_deterministic`).  The reference backward is
            deterministic either way.

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
    the ``(Dk, Dv)`` pairs of ``tiling.kernel_dims()`` only, (576, 512) and DeepSeek-V4's
    (512, 512) (built and compiled, not yet run on a GPU: ``docs/deepseek_v4.md``), and bf16
    inputs.  Any other head
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
            ``"tilelang"`` on CPU tensors, ``deterministic`` not a bool or ``None``
            (``TypeError``), or ``None`` with an unreadable ``FLAGS_cudnn_deterministic`` in
            the environment (``ValueError``).  On CUDA also (from the kernel's forward, whatever
            ``backward_backend``): ``ValueError`` for a ``(Dk, Dv)`` not in
            ``tiling.kernel_dims()``.
            With ``cu_seqlens``: ``TypeError`` when it is not an int32 tensor/array;
            ``ValueError`` when it is not 1-D with >= 2 entries, does not start at 0, decreases,
            does not end at ``S``, when ``B != 1`` or ``S_kv != S``, or when an index points
            outside its query's document (the message names the first such row).

    Gradients: ``dq`` in ``query``'s dtype, ``dkv`` in ``kv``'s dtype, ``d_sink`` fp32 (zero
    contribution from rows whose weight is all on the sink); see docs/conventions.md.

    In-place edits between the forward and the backward: the backward reads ``query``, ``kv``,
    ``attn_sink`` and, on the TileLang path, ``out`` as they are then.  An edit by one of
    Paddle's in-place ops, those that bump the tensor's inplace version (``add_``, ``scale_``,
    ``fill_``, ``zero_``, setitem ``t[i] = v``, ``paddle.assign(x, output=t)``, ...), makes the
    backward raise (Paddle reports it as an ``OSError`` naming the tensor).  Writes that Paddle
    does not version (``Tensor.set_value``, ``Tensor.copy_``, an optimizer's update of a
    parameter, a layer's ``load_full_weights``) cannot be detected, as with Paddle's own ops, and
    give wrong gradients: do not edit these inputs between the forward and the backward.
    ``token_indices`` may be edited freely (the forward keeps its own copy).
    """
    sm_scale = check_sm_scale(sm_scale)
    if framework_of(query) != "paddle":
        hint = (" (this is Paddle's autograd op; mqa_latent_sparse_fwd/_bwd take torch.Tensor)"
                if framework_of(query) == "torch" else "")
        raise TypeError(f"query: expected a paddle.Tensor, got {type_name(query)}{hint}")
    ops = ops_for(query)
    device_kind = ops.device_kind(query)
    backend = resolve_backward_backend(backward_backend, device_kind)
    deterministic = resolve_deterministic(deterministic)
    token_indices = index_tensor(token_indices, query)
    prepared = _prepare(query, kv, token_indices, attn_sink, d_v, cu_seqlens, device_kind)
    return MQALatentSparseAttentionFunction.apply(
        query, kv, token_indices, attn_sink, sm_scale, prepared, backend, device_kind,
        deterministic,
    )

