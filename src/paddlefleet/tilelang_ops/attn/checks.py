"""Input validation shared by the reference, the host wrappers and the Paddle op.

Two functions check the tensors of a sparse MQA-latent attention call (shapes and dtypes of
``docs/conventions.md``); every public entry point calls each at most once:

* :func:`check_tensors`, metadata only (no device sync), in a fixed order, so that the first
  problem found is always the most basic one:

  1. tensor type and framework (``TypeError``): every tensor is a ``paddle.Tensor`` or a
     ``torch.Tensor``, all from one framework;
  2. ``ndim`` (``ValueError``);
  3. device (``ValueError``): all tensors on one device kind, and on ``device`` if given;
  4. dtype (``TypeError``): float tensors in ``float_dtypes`` (if given), ``query`` and ``kv``
     alike, ``token_indices`` int32/int64, ``attn_sink`` and ``lse`` float32;
  5. shapes agree (``ValueError``, the named dims and their values in the message);
  6. the value width ``Dv``: the ``d_v`` argument (``1 <= d_v <= Dk``; ``TypeError`` when not
     an int), or, in a backward call, the last dim of ``out`` (else of ``grad_out``), then the
     shapes of ``out``/``grad_out``, whose last dim is ``Dv``.

* :func:`check_values` (``ValueError``), which reads a few scalars back in one transfer (a GPU
  stream sync, so callers can skip it): indices in ``[-1, S_kv)`` (one ``amin``/``amax``);
  ``attn_sink`` finite or ``-inf`` (``-inf`` = that head has no sink; NaN and ``+inf`` are
  rejected: a NaN sink would otherwise be masked into a plausible finite output and ``+inf``
  gives a NaN ``d_sink``); ``lse`` not NaN (``+inf``, FlashMLA's marker of a row with no key,
  and ``-inf`` are allowed).

``None`` for an optional tensor means "not given"; ``required`` names the optional tensors a
caller needs (the backward needs ``grad_out``; the kernels' also ``out`` and ``lse``), and a
missing one is a ``TypeError`` naming it.

Every message names the argument, what was expected and what was got.  The layout of the checks
follows the usual entry-point style of attention kernels (ndim, device, dtype, shape).

Packed variable-length documents (the THD layout: ``B = 1``, documents back to back along the
rows, their boundaries in ``cu_seqlens``) add two checks: :func:`check_cu_seqlens` (the
boundaries themselves, read to the host) and :func:`check_indices_in_documents` (every top-k
index stays inside its query's own document; a value check, run where the index range check
runs); :func:`check_packed` runs both with the packed layout's shape rules.

:func:`prepare_indices` runs the value checks (and, with ``cu_seqlens``, the packed ones) once
and keeps the result, the int32 indices the compute reads, in a :class:`PreparedIndices`: the
op's forward saves it for the backward, which neither checks nor casts them again.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .adapter import framework_of, ops_for, type_name

__all__ = [
    "Dims",
    "check_tensors",
    "check_values",
    "start_value_checks",
    "PendingValueChecks",
    "check_sm_scale",
    "check_compute_dtype",
    "check_cu_seqlens",
    "check_indices_in_documents",
    "check_packed",
    "PreparedIndices",
    "prepare_indices",
]

_INDEX_DTYPES = ("int32", "int64")
_OPTIONAL = ("attn_sink", "out", "grad_out", "lse")
_FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
#: name -> layout; its length is the expected ndim
_LAYOUTS = {
    "query": ("B", "S", "H", "Dk"), "kv": ("B", "S_kv", "Dk"), "token_indices": ("B", "S", "L"),
    "attn_sink": ("H",), "out": ("B", "S", "H", "Dv"), "grad_out": ("B", "S", "H", "Dv"),
    "lse": ("B", "S", "H"),
}


@dataclass(frozen=True)
class Dims:
    """The named sizes of one call (``docs/conventions.md``, "Shapes and dtypes").

    B: batch; S: query rows; H: query heads; Dk: query/key width (576 for DeepSeek-V3.2, 512
    for DeepSeek-V4); Dv: value width (the first ``Dv`` columns of ``kv``; 512 for both, so
    V4's value is the whole kv row); S_kv: key rows; L: top-k width.
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


def check_tensors(
    query: Any,
    kv: Any,
    token_indices: Any,
    *,
    attn_sink: Any = None,
    d_v: int | None = None,
    out: Any = None,
    grad_out: Any = None,
    lse: Any = None,
    float_dtypes: Iterable[str] | None = None,
    aux_float_dtypes: Iterable[str] = ("float32",),
    device: str | None = None,
    required: Iterable[str] = (),
    prepared: "PreparedIndices | None" = None,
) -> Dims:
    """Check the tensors of a call (type, ndim, device, dtype, shapes; no values) and return
    their sizes.  Reads metadata only: no device sync.

    Args:
        query: ``[B, S, H, Dk]`` float.
        kv: ``[B, S_kv, Dk]`` float, same dtype as ``query``.
        token_indices: ``[B, S, L]`` int32 or int64.
        attn_sink: ``[H]`` float32 per-head sink logits, or ``None``.
        d_v: value width ``Dv``, a Python int with ``1 <= d_v <= Dk`` (a forward's argument);
            ``None`` takes ``Dv`` from the last dim of ``out``, else of ``grad_out`` (a
            backward), which must then be in ``[1, Dk]``.
        out, grad_out: ``[B, S, H, Dv]`` float, or ``None``.
        lse: ``[B, S, H]`` float32, or ``None``.
        float_dtypes: allowed dtypes of ``query``, ``kv``, ``out`` and ``grad_out`` (canonical
            names such as ``"bfloat16"``); ``None`` allows any float dtype.
        aux_float_dtypes: allowed dtypes of ``attn_sink`` and ``lse``; float32 unless a caller
            (the fp64 reference) widens it.
        device: required device kind of every tensor (``"cuda"``, ``"cpu"``), or ``None``.
        required: names among ``"attn_sink"``, ``"out"``, ``"grad_out"``, ``"lse"`` that must
            not be ``None`` (``query``, ``kv`` and ``token_indices`` always must).
        prepared: the :class:`PreparedIndices` these tensors are used with, or ``None``.
            Given, ``token_indices`` is its ``indices`` (``L`` padded) and every tensor's shape
            must be the one ``prepared.dims`` was made for (``d_v``: ``prepared.dims.Dv``);
            checked after the dtypes, before the shapes' mutual agreement.

    Returns:
        :class:`Dims`.

    Raises:
        TypeError: a tensor argument is not a Paddle/PyTorch tensor, the tensors mix
            frameworks, a required tensor is ``None``, a dtype is not allowed, or ``d_v`` is
            not an int (``None`` without ``out`` or ``grad_out`` included).
        ValueError: wrong ndim, device or shape, ``Dv`` out of ``[1, Dk]``, an unknown name
            in ``required``, or (``prepared``) a shape other than the one it was made for (the
            argument and both shapes are named).
    """
    named = {"query": query, "kv": kv, "token_indices": token_indices, "attn_sink": attn_sink,
             "out": out, "grad_out": grad_out, "lse": lse}
    present = _present(named, tuple(required))
    ops = ops_for(*present.values())
    shapes = _check_ndims(ops, present)
    _check_device(ops, present, device)
    _check_dtypes(ops, present, float_dtypes, tuple(aux_float_dtypes))
    if prepared is not None:
        _check_prepared_shapes(shapes, prepared)
        d_v = prepared.dims.Dv
    B, S, H, Dk, S_kv, L = _check_shapes(shapes)
    Dv = _check_value_width(shapes, d_v, B, S, H, Dk)
    return Dims(B=B, S=S, H=H, Dk=Dk, Dv=Dv, S_kv=S_kv, L=L)


def _present(named: dict, required: tuple) -> dict:
    """Step 1: the tensors given, each a Paddle/PyTorch tensor, all of one framework."""
    unknown = [r for r in required if r not in _OPTIONAL]
    if unknown:
        raise ValueError(f"required: expected names among {list(_OPTIONAL)}, got {unknown}")
    required = ("query", "kv", "token_indices") + required
    present = {}
    for name, t in named.items():
        if t is None:
            if name in required:
                raise TypeError(f"{name}: expected a paddle.Tensor or torch.Tensor, got None")
            continue
        if framework_of(t) is None:
            raise TypeError(
                f"{name}: expected a paddle.Tensor or torch.Tensor, got {type_name(t)}"
            )
        present[name] = t
    frameworks = {name: framework_of(t) for name, t in present.items()}
    if len(set(frameworks.values())) != 1:
        got = ", ".join(f"{n}={fw}" for n, fw in frameworks.items())
        raise TypeError(f"all tensors must come from one framework, got {got}")
    return present


def _check_ndims(ops, present: dict) -> dict:
    """Step 2: every tensor has the ndim of its layout; returns the shapes."""
    shapes = {}
    for name, t in present.items():
        shape, layout = ops.shape(t), _LAYOUTS[name]
        if len(shape) != len(layout):
            raise ValueError(
                f"{name}: expected {len(layout)} dims [{', '.join(layout)}], "
                f"got {len(shape)} dims with shape {_fmt(shape)}"
            )
        shapes[name] = shape
    return shapes


def _check_device(ops, present: dict, device: str | None) -> None:
    """Step 3: one device kind, ``device`` when given."""
    kinds = {name: ops.device_kind(t) for name, t in present.items()}
    if device is not None:
        for name, kind in kinds.items():
            if kind != device:
                raise ValueError(f"{name}: expected a tensor on {device}, got one on {kind}")
    elif len(set(kinds.values())) != 1:
        got = ", ".join(f"{n} on {k}" for n, k in kinds.items())
        raise ValueError(f"all tensors must be on one device kind, got {got}")


def _check_dtypes(ops, present: dict, float_dtypes, aux_allowed: tuple) -> None:
    """Step 4: the float, index and auxiliary (sink, lse) dtypes."""
    allowed = tuple(float_dtypes) if float_dtypes is not None else _FLOAT_DTYPES
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


def _check_prepared_shapes(shapes: dict, prepared: "PreparedIndices") -> None:
    """Step 5 with a :class:`PreparedIndices`: every tensor has the shape its ``dims`` were made
    for.  A ``PreparedIndices`` holds indices checked against one call's sizes (``S_kv`` bounds
    them); used with other tensors it would give a wrong-shaped answer or read out of range."""
    if not isinstance(prepared, PreparedIndices) or not isinstance(prepared.dims, Dims):
        raise TypeError(f"token_indices: expected a checks.PreparedIndices, got "
                        f"{type_name(prepared)}")
    d = prepared.dims
    want = {"query": (d.B, d.S, d.H, d.Dk), "kv": (d.B, d.S_kv, d.Dk), "attn_sink": (d.H,),
            "out": (d.B, d.S, d.H, d.Dv), "grad_out": (d.B, d.S, d.H, d.Dv),
            "lse": (d.B, d.S, d.H)}
    for name, shape in shapes.items():
        if name == "token_indices":
            ok = shape[:2] == (d.B, d.S) and shape[2] >= d.L
            expected = f"[{d.B}, {d.S}, >= {d.L}]"
        else:
            ok = tuple(shape) == want[name]
            expected = _fmt(want[name])
        if not ok:
            raise ValueError(
                f"{name}: shape {_fmt(shape)} differs from the shape {expected} the "
                f"PreparedIndices (token_indices) was made for ({_dims_text(d)}); prepare the "
                f"indices for these tensors"
            )


def _dims_text(d: Dims) -> str:
    return ", ".join(f"{k}={getattr(d, k)}" for k in ("B", "S", "H", "Dk", "Dv", "S_kv", "L"))


def _check_shapes(shapes: dict) -> tuple:
    """Step 5: the shapes of everything but ``out``/``grad_out`` agree with ``query``'s;
    returns ``(B, S, H, Dk, S_kv, L)``."""
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
    return B, S, H, Dk, S_kv, L


def _check_value_width(shapes: dict, d_v, B: int, S: int, H: int, Dk: int) -> int:
    """Step 6: ``Dv`` (from ``d_v``, else from ``out``, else from ``grad_out``), then the shapes
    of ``out`` and ``grad_out``."""
    source = ""
    if d_v is None:
        # A backward call: Dv is what the forward produced, so out (when given) defines it and
        # a grad_out that disagrees is the one named.
        name = next((n for n in ("out", "grad_out") if n in shapes), None)
        if name is None:
            raise TypeError("d_v: expected a Python int (or out / grad_out to take Dv from), "
                            "got None")
        shape = shapes[name]
        if shape[:3] != (B, S, H):
            raise ValueError(
                f"{name}: expected [B, S, H, Dv] with B={B}, S={S} and H={H} (from query), got "
                f"shape {_fmt(shape)}"
            )
        d_v, source = shape[3], f" (Dv from {name})"
        if not 1 <= d_v <= Dk:
            raise ValueError(
                f"{name}: expected a last dim Dv with 1 <= Dv <= Dk={Dk}, got shape {_fmt(shape)}"
            )
    else:
        if isinstance(d_v, bool) or not isinstance(d_v, numbers.Integral):
            raise TypeError(f"d_v: expected a Python int, got {type(d_v).__name__}")
        d_v = int(d_v)
        if not 1 <= d_v <= Dk:
            raise ValueError(f"d_v: expected 1 <= d_v <= Dk={Dk}, got {d_v}")
    for name in ("out", "grad_out"):
        if name in shapes and shapes[name] != (B, S, H, d_v):
            raise ValueError(
                f"{name}: expected shape [B, S, H, Dv] = {_fmt((B, S, H, d_v))}{source}, got "
                f"{_fmt(shapes[name])}"
            )
    return d_v


def check_values(dims: Dims, token_indices: Any, *, attn_sink: Any = None,
                 lse: Any = None, stats: Any = None) -> None:
    """Check the values of a call's tensors, already accepted by :func:`check_tensors`.

    One device-to-host transfer of a few scalars (a GPU stream sync): every read is a sync that
    exposes the caller's host-side launch time (four separate reads cost the kernels' wrappers
    0.5-1.2 ms per call on the H200; docs/performance.md).

    Args:
        dims: what :func:`check_tensors` returned for these tensors.
        token_indices: ``[B, S, L]``; every value must be ``-1`` (empty slot) or in
            ``[0, S_kv)``.
        attn_sink: ``[H]`` or ``None``; finite or ``-inf`` (that head has no sink).
        lse: ``[B, S, H]`` or ``None``; no NaN (``+inf`` and ``-inf`` are allowed).
        stats: optional ``stats(token_indices, attn_sink, lse, S_kv)`` giving, in one kernel
            launch, a device tensor of rows ``(min index, max index, NaN/+inf sinks, NaN lse)``
            and a copy of the indices safe to dereference (the wrappers pass their provider's
            ``value_stats``), or ``None`` where it does not apply; then framework reductions
            compute those numbers.

    Raises:
        ValueError: an index outside ``[-1, S_kv)`` (the range found is named), a NaN or
            ``+inf`` in ``attn_sink`` (the heads and values are named), a NaN in ``lse`` (the
            count is named).
    """
    start_value_checks(dims, token_indices, attn_sink=attn_sink, lse=lse, stats=stats).finish()


@dataclass(frozen=True)
class PendingValueChecks:
    """What :func:`start_value_checks` launched.

    ``finish()`` waits for the numbers and raises as :func:`check_values` does.  ``indices`` is
    ``None``, or (when ``stats`` made one) a copy of ``token_indices`` (same shape, int32) with
    every value outside ``[0, S_kv)`` replaced by ``-1``: kernels that read that copy never
    dereference an index out of range, so a caller may launch them before ``finish()``.
    Without it, ``finish()`` must come before the first kernel that dereferences an index."""

    finish: Any
    indices: Any = None


def start_value_checks(dims: Dims, token_indices: Any, *, attn_sink: Any = None,
                       lse: Any = None, stats: Any = None) -> PendingValueChecks:
    """:func:`check_values` in two steps: launch the reductions and the copy of their numbers to
    the host now, and return them pending (:class:`PendingValueChecks`).  Between the launch
    and ``finish()`` a caller may launch work that reads no index (the backward's
    preprocess), or any work at all on the safe copy of the indices where there is one, so
    that the GPU is busy while the numbers travel; the wait is a stream sync on Paddle
    (``adapter.read_later``).  Arguments as :func:`check_values`."""
    ops = ops_for(token_indices, attn_sink, lse)
    got = stats(token_indices, attn_sink, lse, dims.S_kv) if stats is not None else None
    safe = None
    if got is not None:
        rows, safe = got
        read = ops.read_later(rows)

        def numbers():
            p = np.asarray(read(), dtype=np.int64).reshape(-1, 4)
            vals = [p[:, 0].min(), p[:, 1].max()]
            vals += [p[:, 2].sum()] if attn_sink is not None else []
            vals += [p[:, 3].sum()] if lse is not None else []
            return [int(v) for v in vals]
    else:
        def _one(t):
            return ops.reshape(ops.cast(t, "int64"), [1])

        parts = [_one(ops.amin(token_indices)), _one(ops.amax(token_indices))]
        if attn_sink is not None:
            parts.append(_one(ops.sum(ops.cast(~(attn_sink < math.inf), "int64"))))  # NaN, +inf
        if lse is not None:
            parts.append(_one(ops.sum(ops.cast(lse != lse, "int64"))))  # NaN != NaN
        read = ops.read_later(ops.concat(parts, 0))

        def numbers():
            return [int(v) for v in np.asarray(read()).tolist()]

    def finish():
        vals = numbers()
        lo, hi = vals[0], vals[1]
        if lo < -1 or hi >= dims.S_kv:
            raise ValueError(
                f"token_indices: expected values -1 (empty slot) or in [0, S_kv={dims.S_kv}), "
                f"got values in [{lo}, {hi}]"
            )
        if attn_sink is not None and vals[2]:
            # Error path only: read the [H] sink back whole to name the bad heads.
            sink = np.asarray(ops.to_numpy(attn_sink), dtype=np.float64)
            bad = np.flatnonzero(~(sink < math.inf))  # NaN and +inf; -inf passes
            raise ValueError(
                "attn_sink: expected finite values or -inf (-inf = no sink for that head); "
                f"NaN and +inf are not allowed, got {sink[bad].tolist()} at heads "
                f"{bad.tolist()}"
            )
        if lse is not None and vals[-1]:
            raise ValueError(
                f"lse: expected no NaN (+inf marks a row with no key, -inf is allowed), "
                f"got {vals[-1]} NaN value(s)"
            )

    return PendingValueChecks(finish, safe)


def check_sm_scale(sm_scale: Any) -> float:
    """``sm_scale`` as a Python float that is finite and ``> 0``, also once rounded to float32.

    The kernels take the scale as a float32 scalar and keep running maxima of the unscaled
    ``q.k`` (so a non-positive scale would flip them); a value that overflows to ``inf`` or
    underflows to 0 in float32 (``1e39``, ``1e-46``) would silently change the math, so it is
    rejected on every path (reference, op, kernels) alike.

    Raises:
        TypeError: not a real number (bool and tensors included).
        ValueError: NaN, infinite, ``<= 0``, or not finite and ``> 0`` in float32.
    """
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale: expected a Python float, got {type(sm_scale).__name__}")
    value = float(sm_scale)
    with np.errstate(over="ignore", under="ignore"):
        as_fp32 = float(np.float32(value))
    if not (math.isfinite(value) and value > 0.0 and math.isfinite(as_fp32) and as_fp32 > 0.0):
        raise ValueError(
            "sm_scale: expected a finite float > 0 (also finite and > 0 in float32), got "
            f"{value!r} (float32: {as_fp32!r})"
        )
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


def check_cu_seqlens(cu_seqlens: Any, seq_len: int | None = None, *,
                     name: str = "cu_seqlens") -> np.ndarray:
    """Check the boundaries of packed documents and return them as a host array.

    Document ``d`` holds rows ``cu_seqlens[d] .. cu_seqlens[d+1] - 1`` (FlashAttention's varlen
    convention); a document may be empty (two equal boundaries).

    Args:
        cu_seqlens: ``[num_docs + 1]`` int32, a ``paddle.Tensor`` / ``torch.Tensor`` on any
            device (read back to the host: a device sync for a GPU tensor, none for a CPU one)
            or a ``numpy.ndarray``; starts at 0, non-decreasing.
        seq_len: the packed length ``S`` it must end at, or ``None`` (any end).
        name: the argument's name in messages.

    Returns:
        ``numpy.ndarray [num_docs + 1]`` int64 (a copy).

    Raises:
        TypeError: not a tensor or numpy array, or its dtype is not int32.
        ValueError: not 1-D with at least 2 entries, ``cu_seqlens[0] != 0``, a decrease (the
            first one is named), or ``cu_seqlens[-1] != seq_len``.
    """
    if isinstance(cu_seqlens, np.ndarray):
        shape, dtype = cu_seqlens.shape, cu_seqlens.dtype.name
        to_host = lambda: np.array(cu_seqlens, dtype=np.int64)  # noqa: E731
    elif framework_of(cu_seqlens) is not None:
        ops = ops_for(cu_seqlens)
        shape, dtype = ops.shape(cu_seqlens), ops.dtype(cu_seqlens)
        to_host = lambda: np.asarray(ops.to_numpy(cu_seqlens), dtype=np.int64)  # noqa: E731
    else:
        raise TypeError(
            f"{name}: expected an int32 paddle.Tensor, torch.Tensor or numpy.ndarray "
            f"[num_docs + 1], got {type_name(cu_seqlens)}"
        )
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(
            f"{name}: expected 1 dim [num_docs + 1] with num_docs >= 1, got shape {_fmt(shape)}"
        )
    if dtype != "int32":
        raise TypeError(f"{name}: expected dtype int32, got {dtype}")
    cu = to_host()
    if cu[0] != 0:
        raise ValueError(f"{name}: expected {name}[0] == 0, got {int(cu[0])}")
    drops = np.flatnonzero(np.diff(cu) < 0)
    if drops.size:
        i = int(drops[0])
        raise ValueError(
            f"{name}: expected non-decreasing values, got {name}[{i + 1}]={int(cu[i + 1])} < "
            f"{name}[{i}]={int(cu[i])} (document {i} would have length {int(cu[i + 1] - cu[i])})"
        )
    if seq_len is not None and cu[-1] != seq_len:
        raise ValueError(
            f"{name}: expected {name}[-1] == S={int(seq_len)} (the packed rows), got "
            f"{int(cu[-1])}"
        )
    return cu


def check_indices_in_documents(token_indices: Any, cu_seqlens: np.ndarray, *,
                               name: str = "token_indices") -> None:
    """Every top-k index of a packed batch points inside its query's own document.

    A value check: it reads one int per row back to the host (a device sync for a GPU tensor),
    so callers run it where they run the index range check.

    Args:
        token_indices: ``[1, S, L]`` int32/int64 tensor (Paddle or PyTorch, any device); ``-1``
            is an empty slot and always allowed.
        cu_seqlens: the checked host boundaries from :func:`check_cu_seqlens`, ending at ``S``.
        name: the argument's name in messages.

    Raises:
        ValueError: ``B != 1``, ``S`` differs from ``cu_seqlens[-1]``, or an index outside its
            row's document (the first bad row, its document and the offending key are named).
    """
    ops = ops_for(token_indices)
    B, S, _ = ops.shape(token_indices)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    if B != 1:
        raise ValueError(
            f"{name}: packed documents need B=1 (all documents back to back in one row), got "
            f"shape {_fmt(ops.shape(token_indices))}"
        )
    if int(cu[-1]) != S:
        raise ValueError(
            f"{name}: expected S = cu_seqlens[-1] = {int(cu[-1])} rows, got shape "
            f"{_fmt(ops.shape(token_indices))}"
        )
    doc = np.repeat(np.arange(cu.size - 1), np.diff(cu))  # document of every row
    idt = ops.dtype(token_indices)
    lo = ops.from_numpy(cu[doc].astype(idt).reshape(1, S, 1), like=token_indices)
    hi = ops.from_numpy(cu[doc + 1].astype(idt).reshape(1, S, 1), like=token_indices)
    outside = (token_indices != -1) & ((token_indices < lo) | (token_indices >= hi))
    per_row = np.asarray(ops.to_numpy(ops.sum(ops.cast(outside, "int32"), axis=-1)))[0]
    bad = np.flatnonzero(per_row)
    if bad.size:
        s = int(bad[0])
        d, a, b = int(doc[s]), int(cu[doc[s]]), int(cu[doc[s] + 1])
        row = np.asarray(ops.to_numpy(token_indices[0, s]), dtype=np.int64)
        key = int(row[(row != -1) & ((row < a) | (row >= b))][0])
        raise ValueError(
            f"{name}: row {s} (document {d}, rows [{a}, {b}) of cu_seqlens) holds key {key}, "
            f"outside its document ({bad.size} such row(s)); with cu_seqlens every index must "
            f"be -1 or a row of the query's own document"
        )


def check_packed(dims: Dims, token_indices: Any, cu_seqlens: Any) -> np.ndarray:
    """The packed-documents checks of a call whose tensors :func:`check_tensors` accepted (the
    index range already checked): :func:`check_cu_seqlens` (ending at ``S``), ``B = 1``,
    ``S_kv = S`` (the packed tokens are both the queries and the keys), then
    :func:`check_indices_in_documents`.

    Returns:
        the checked host boundaries (``numpy.ndarray [num_docs + 1]`` int64).

    Raises:
        TypeError, ValueError: as :func:`check_cu_seqlens`; ``ValueError`` naming ``query``
            (``B != 1``), ``kv`` (``S_kv != S``) or ``token_indices`` (an index outside its
            row's document).
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
    return cu


@dataclass(frozen=True)
class PreparedIndices:
    """The top-k indices of one call, checked once, in the form the compute reads.

    Made by :func:`prepare_indices` (the kernels' rules: ``interface.check_inputs``); the op's
    forward saves it for its backward, so the indices are checked and cast once per call.

    dims: the call's sizes (:class:`Dims`, ``L`` the top-k width as given).
    indices: ``[B, S, L_pad]`` int32, contiguous, every value ``-1`` or in ``[0, S_kv)``; the
        ``L_pad - L`` slots after ``L`` are ``-1`` (``L_pad``: ``L`` rounded up to the
        ``pad_to`` of :func:`prepare_indices`).  Never the caller's tensor: a copy of it, so
        that editing the caller's indices later changes nothing here.

    Whoever accepts one (the reference, the kernels' wrappers) checks the tensors it comes with
    against ``dims`` (``check_tensors(..., prepared=...)``, metadata only): indices checked for
    one call's sizes are never used with another's.
    cu_seqlens: the checked host boundaries of packed documents (``numpy`` int64), or
        ``None``.
    """

    dims: Dims
    indices: Any
    cu_seqlens: Any = None


def int32_indices(token_indices: Any, pad_to: int = 1) -> Any:
    """``token_indices [B, S, L]`` as int32, contiguous, ``L`` padded with ``-1`` to a multiple
    of ``pad_to`` (one cast, no copy where nothing changes).  Cast only values already checked
    (an int64 index past int32 would wrap)."""
    ops = ops_for(token_indices)
    idx = ops.contiguous(ops.cast(token_indices, "int32"))
    b, s, l = ops.shape(idx)
    l_pad = -(-l // pad_to) * pad_to
    if l_pad != l:
        idx = ops.concat([idx, ops.full((b, s, l_pad - l), -1, "int32", idx)], axis=2)
    return idx


def prepare_indices(dims: Dims, token_indices: Any, *, attn_sink: Any = None,
                    cu_seqlens: Any = None, stats: Any = None,
                    pad_to: int = 1) -> PreparedIndices:
    """Check the values of a call's indices (and sink) once and keep them in the form the
    compute reads: :func:`check_values` (with ``stats``, the index range from one kernel and
    the safe int32 copy it makes), then with ``cu_seqlens`` :func:`check_packed`, then one
    cast to int32 (:func:`int32_indices`, padded with ``-1`` to a multiple of ``pad_to``).

    The result never shares memory with ``token_indices``: where neither the cast, the padding
    nor the safe copy made a new tensor (int32 input, ``L`` already a multiple of ``pad_to``),
    the indices are copied, ``4 * B * S * L`` bytes on their device, held as long as the
    :class:`PreparedIndices` is (by the op: until its backward).

    Args:
        dims: what :func:`check_tensors` returned for these tensors.
        token_indices: ``[B, S, L]`` int32/int64.
        attn_sink: ``[H]`` or ``None`` (its values are checked too).
        cu_seqlens: boundaries of packed documents (see :func:`check_cu_seqlens`), or ``None``.
        stats: as in :func:`check_values`.
        pad_to: the top-k width of :attr:`PreparedIndices.indices` is a multiple of this.

    Returns:
        :class:`PreparedIndices`.

    Raises:
        TypeError, ValueError: as :func:`check_values` and :func:`check_packed`, in that order.
    """
    pending = start_value_checks(dims, token_indices, attn_sink=attn_sink, stats=stats)
    pending.finish()
    cu = None if cu_seqlens is None else check_packed(dims, token_indices, cu_seqlens)
    checked = token_indices if pending.indices is None else pending.indices
    idx = int32_indices(checked, pad_to)
    if idx is token_indices:
        # Nothing was cast, padded or made safe: the caller's own buffer.  Keep a copy, so that
        # a later write to it (``set_value``, ``copy_``, which Paddle does not version) cannot
        # reach what was checked, nor the op's backward that reads these indices.
        idx = idx.clone()
    return PreparedIndices(dims, idx, cu)
