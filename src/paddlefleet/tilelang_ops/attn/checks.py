"""Input validation shared by the reference, the host wrappers and the Paddle op.

One function, :func:`validate_inputs`, checks the tensors of a sparse MQA-latent attention call
(shapes and dtypes of ``docs/conventions.md``) in a fixed order, so that the first problem found
is always the most basic one:

1. tensor type and framework (``TypeError``): every tensor is a ``paddle.Tensor`` or a
   ``torch.Tensor``, all from one framework;
2. ``ndim`` (``ValueError``);
3. device (``ValueError``): all tensors on one device kind, and on ``device`` if given;
4. dtype (``TypeError``): float tensors in ``float_dtypes`` (if given), ``query`` and ``kv``
   alike, ``token_indices`` int32/int64, ``attn_sink`` and ``lse`` float32;
5. shapes agree (``ValueError``, the named dims and their values in the message);
6. ``1 <= d_v <= Dk`` (``ValueError``; ``TypeError`` when ``d_v`` is not an int), then the
   shapes of ``out``/``grad_out``, whose last dim is ``d_v``;
7. index values in ``[-1, S_kv)`` (``ValueError``; one ``amin``/``amax`` each, skipped when
   ``check_index_values=False`` because it synchronises a GPU stream).

Every message names the argument, what was expected and what was got.  The layout of the checks
follows the usual entry-point style of attention kernels (ndim, device, dtype, shape).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterable

from .adapter import framework_of, ops_for

__all__ = ["Dims", "validate_inputs", "check_sm_scale", "check_compute_dtype"]

_INDEX_DTYPES = ("int32", "int64")
_FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


@dataclass(frozen=True)
class Dims:
    """The named sizes of one call (``docs/conventions.md``, "Shapes and dtypes").

    B: batch; S: query rows; H: query heads; Dk: query/key width (576 for DeepSeek-V3.2);
    Dv: value width (the first ``Dv`` columns of ``kv``; 512); S_kv: key rows; L: top-k width.
    """

    B: int
    S: int
    H: int
    Dk: int
    Dv: int
    S_kv: int
    L: int


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def validate_inputs(
    query: Any,
    kv: Any,
    token_indices: Any,
    *,
    attn_sink: Any = None,
    d_v: int = 512,
    out: Any = None,
    grad_out: Any = None,
    lse: Any = None,
    float_dtypes: Iterable[str] | None = None,
    device: str | None = None,
    check_index_values: bool = True,
    aux_float_dtypes: Iterable[str] = ("float32",),
) -> Dims:
    """Check a sparse MQA-latent attention call and return its sizes.

    Args:
        query: ``[B, S, H, Dk]`` float.
        kv: ``[B, S_kv, Dk]`` float, same dtype as ``query``.
        token_indices: ``[B, S, L]`` int32 or int64; values ``-1`` (empty slot) or in
            ``[0, S_kv)``.
        attn_sink: ``[H]`` float32 per-head sink logits, or ``None``.
        d_v: value width ``Dv``, a Python int with ``1 <= d_v <= Dk``.
        out, grad_out: ``[B, S, H, Dv]`` float, or ``None``.
        lse: ``[B, S, H]`` float32, or ``None``.
        float_dtypes: allowed dtypes of ``query``, ``kv``, ``out`` and ``grad_out`` (canonical
            names such as ``"bfloat16"``); ``None`` allows any float dtype.
        device: required device kind of every tensor (``"cuda"``, ``"cpu"``), or ``None``.
        check_index_values: check the range of ``token_indices`` (reads two scalars back).
        aux_float_dtypes: allowed dtypes of ``attn_sink`` and ``lse``; float32 unless a caller
            (the fp64 reference) widens it.

    Returns:
        :class:`Dims`.

    Raises:
        TypeError: a tensor argument is not a Paddle/PyTorch tensor, the tensors mix
            frameworks, a dtype is not allowed, or ``d_v`` is not an int.
        ValueError: wrong ndim, device, shape, ``d_v`` out of range, or an index outside
            ``[-1, S_kv)``.
    """
    named = {
        "query": query,
        "kv": kv,
        "token_indices": token_indices,
        "attn_sink": attn_sink,
        "out": out,
        "grad_out": grad_out,
        "lse": lse,
    }
    required = ("query", "kv", "token_indices")
    present = {}
    # 1. type and framework
    for name, t in named.items():
        if t is None:
            if name in required:
                raise TypeError(f"{name}: expected a paddle.Tensor or torch.Tensor, got None")
            continue
        if framework_of(t) is None:
            raise TypeError(
                f"{name}: expected a paddle.Tensor or torch.Tensor, got {type(t).__name__}"
            )
        present[name] = t
    frameworks = {name: framework_of(t) for name, t in present.items()}
    if len(set(frameworks.values())) != 1:
        got = ", ".join(f"{n}={fw}" for n, fw in frameworks.items())
        raise TypeError(f"all tensors must come from one framework, got {got}")
    ops = ops_for(*present.values())

    # 2. ndim
    expected_ndim = {
        "query": 4, "kv": 3, "token_indices": 3, "attn_sink": 1, "out": 4, "grad_out": 4,
        "lse": 3,
    }
    layouts = {
        "query": "[B, S, H, Dk]", "kv": "[B, S_kv, Dk]", "token_indices": "[B, S, L]",
        "attn_sink": "[H]", "out": "[B, S, H, Dv]", "grad_out": "[B, S, H, Dv]",
        "lse": "[B, S, H]",
    }
    shapes = {}
    for name, t in present.items():
        shape = ops.shape(t)
        if len(shape) != expected_ndim[name]:
            raise ValueError(
                f"{name}: expected {expected_ndim[name]} dims {layouts[name]}, "
                f"got {len(shape)} dims with shape {_fmt(shape)}"
            )
        shapes[name] = shape

    # 3. device
    kinds = {name: ops.device_kind(t) for name, t in present.items()}
    if device is not None:
        for name, kind in kinds.items():
            if kind != device:
                raise ValueError(f"{name}: expected a tensor on {device}, got one on {kind}")
    elif len(set(kinds.values())) != 1:
        got = ", ".join(f"{n} on {k}" for n, k in kinds.items())
        raise ValueError(f"all tensors must be on one device kind, got {got}")

    # 4. dtype
    allowed = tuple(float_dtypes) if float_dtypes is not None else _FLOAT_DTYPES
    aux_allowed = tuple(aux_float_dtypes)
    dtypes = {name: ops.dtype(t) for name, t in present.items()}
    for name in ("query", "kv", "out", "grad_out"):
        if name in dtypes and dtypes[name] not in allowed:
            raise TypeError(f"{name}: expected dtype in {list(allowed)}, got {dtypes[name]}")
    if dtypes["query"] != dtypes["kv"]:
        raise TypeError(
            f"kv: expected the dtype of query ({dtypes['query']}), got {dtypes['kv']}"
        )
    if dtypes["token_indices"] not in _INDEX_DTYPES:
        raise TypeError(
            f"token_indices: expected dtype int32 or int64, got {dtypes['token_indices']}"
        )
    for name in ("attn_sink", "lse"):
        if name in dtypes and dtypes[name] not in aux_allowed:
            raise TypeError(f"{name}: expected dtype in {list(aux_allowed)}, got {dtypes[name]}")

    # 5. shapes
    B, S, H, Dk = shapes["query"]
    kb, S_kv, kdk = shapes["kv"]
    ib, is_, L = shapes["token_indices"]
    if min(B, S, H, Dk) < 1:
        raise ValueError(
            f"query: expected B, S, H, Dk >= 1 in [B, S, H, Dk], got shape "
            f"{_fmt(shapes['query'])}"
        )
    if kb != B or kdk != Dk:
        raise ValueError(
            f"kv: expected [B, S_kv, Dk] with B={B} and Dk={Dk} (from query), got shape "
            f"{_fmt(shapes['kv'])}"
        )
    if S_kv < 1:
        raise ValueError(f"kv: expected S_kv >= 1, got shape {_fmt(shapes['kv'])}")
    if ib != B or is_ != S:
        raise ValueError(
            f"token_indices: expected [B, S, L] with B={B} and S={S} (from query), got shape "
            f"{_fmt(shapes['token_indices'])}"
        )
    if L < 1:
        raise ValueError(
            f"token_indices: expected L >= 1 in [B, S, L], got shape "
            f"{_fmt(shapes['token_indices'])}"
        )
    if "attn_sink" in shapes and shapes["attn_sink"] != (H,):
        raise ValueError(
            f"attn_sink: expected shape [H] with H={H} (from query), got "
            f"{_fmt(shapes['attn_sink'])}"
        )
    if "lse" in shapes and shapes["lse"] != (B, S, H):
        raise ValueError(
            f"lse: expected shape [B, S, H] = {_fmt((B, S, H))}, got {_fmt(shapes['lse'])}"
        )

    # 6. d_v (checked before out/grad_out shapes, which depend on it)
    if isinstance(d_v, bool) or not isinstance(d_v, numbers.Integral):
        raise TypeError(f"d_v: expected a Python int, got {type(d_v).__name__}")
    d_v = int(d_v)
    if not 1 <= d_v <= Dk:
        raise ValueError(f"d_v: expected 1 <= d_v <= Dk={Dk}, got {d_v}")
    for name in ("out", "grad_out"):
        if name in shapes and shapes[name] != (B, S, H, d_v):
            raise ValueError(
                f"{name}: expected shape [B, S, H, Dv] = {_fmt((B, S, H, d_v))}, got "
                f"{_fmt(shapes[name])}"
            )

    # 7. index values
    if check_index_values:
        lo = int(ops.to_numpy(ops.amin(token_indices)))
        hi = int(ops.to_numpy(ops.amax(token_indices)))
        if lo < -1 or hi >= S_kv:
            raise ValueError(
                f"token_indices: expected values -1 (empty slot) or in [0, S_kv={S_kv}), "
                f"got values in [{lo}, {hi}]"
            )
    return Dims(B=B, S=S, H=H, Dk=Dk, Dv=d_v, S_kv=S_kv, L=L)


def check_sm_scale(sm_scale: Any) -> float:
    """``sm_scale`` as a finite Python float.

    Raises:
        TypeError: not a real number (bool and tensors included).
        ValueError: NaN or infinite.
    """
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale: expected a Python float, got {type(sm_scale).__name__}")
    value = float(sm_scale)
    if not math.isfinite(value):
        raise ValueError(f"sm_scale: expected a finite float, got {value}")
    return value


def check_compute_dtype(dtype: Any, name: str = "dtype") -> str:
    """The reference's compute dtype: ``"float32"`` or ``"float64"``.

    Raises:
        TypeError: not a string.
        ValueError: any other name.
    """
    if not isinstance(dtype, str):
        raise TypeError(f"{name}: expected 'float32' or 'float64', got {type(dtype).__name__}")
    if dtype not in ("float32", "float64"):
        raise ValueError(f"{name}: expected 'float32' or 'float64', got {dtype!r}")
    return dtype
