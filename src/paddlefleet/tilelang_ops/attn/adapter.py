"""One small adapter so host-side code takes ``paddle.Tensor`` or ``torch.Tensor``.

The host wrappers, the reference and the benchmarks only need a handful of tensor operations.
:func:`ops_for` returns the backend object for a tensor; every method takes and returns tensors
of that backend.  Dtypes are named by canonical strings (``"bfloat16"``, ``"float32"``,
``"float64"``, ``"int32"``, ``"int64"``, ``"bool"``...), shapes are tuples of ints and
``device_kind`` is ``"cpu"``, ``"cuda"`` or another lower-case word.

Neither framework is imported until a tensor of it is seen, so Paddle-only (CI) and
PyTorch-only (the GPU host) environments both work.

Note: Paddle's CPU build has no bf16 arithmetic kernels (matmul/add/exp fail on bf16); only
layout ops (creation, cast, concat, slice, pad) work there, so CPU math runs in fp32.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

__all__ = ["TensorOps", "ops_for", "is_tensor", "framework_of", "type_name"]

#: bytes: where :meth:`TensorOps.contiguous` puts a tensor's first element (16-byte copies, TMA)
ALIGN = 16


def framework_of(t: Any) -> str | None:
    """``"paddle"``, ``"torch"`` or ``None`` for anything else (no import is triggered)."""
    mod = type(t).__module__ or ""
    if mod.startswith("paddle") and "paddle" in sys.modules:
        import paddle

        if isinstance(t, paddle.Tensor):
            return "paddle"
    if mod.startswith("torch") and "torch" in sys.modules:
        import torch

        if isinstance(t, torch.Tensor):
            return "torch"
    return None


def type_name(obj: Any) -> str:
    """The type of ``obj`` as an error message should name it: qualified by its module, so that
    a ``torch.Tensor`` or ``numpy.ndarray`` is not reported as a bare "Tensor" or "ndarray"
    (``"None"`` for None, bare names for builtins such as ``list``)."""
    if obj is None:
        return "None"
    cls = type(obj)
    module = cls.__module__ or ""
    if module == "builtins":
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"


def is_tensor(t: Any) -> bool:
    return framework_of(t) is not None


class TensorOps:
    """Backend interface; see :class:`_PaddleOps` and :class:`_TorchOps`."""

    name: str

    # --- queries -------------------------------------------------------------------------
    def dtype(self, t) -> str: ...
    def shape(self, t) -> tuple: ...
    def device_kind(self, t) -> str: ...
    def is_contiguous(self, t) -> bool: ...

    # --- creation (on the device of ``like``) ---------------------------------------------
    def empty(self, shape: Sequence[int], dtype: str, like): ...
    def zeros(self, shape: Sequence[int], dtype: str, like): ...
    def full(self, shape: Sequence[int], value: float, dtype: str, like): ...
    def from_numpy(self, array, like): ...
    def to_numpy(self, t):
        """A host numpy copy; bfloat16 comes back as float32 (exact), since numpy has no bf16."""
    def read_later(self, t):
        """Start copying ``t`` to the host and return a function that gives its numpy copy,
        waiting for that copy only (PyTorch CUDA: an asynchronous copy into pinned memory and an
        event); elsewhere (Paddle, CPU) the copy is made now, as :meth:`to_numpy`."""

    # --- layout ---------------------------------------------------------------------------
    def concat(self, ts: Sequence, axis: int): ...
    def contiguous(self, t):
        """``t`` in row-major order with its first element on a 16-byte boundary; a copy where it
        is not.  The GPU kernels read bf16 tiles with 16-byte ``cp.async`` and TMA, which need
        both; a view that starts inside an allocation (``x[1:]``) can be contiguous and not
        aligned (a ``misaligned address`` fault, or a TMA descriptor the driver refuses)."""
        t = self._row_major(t)
        return t if t.data_ptr() % ALIGN == 0 else t.clone()

    def _row_major(self, t):
        """``t``, or a row-major copy where it is not contiguous."""

    def cast(self, t, dtype: str): ...
    def reshape(self, t, shape: Sequence[int]): ...

    # --- math -----------------------------------------------------------------------------
    def logaddexp(self, a, b): ...
    def sum(self, t, axis=None, keepdim: bool = False): ...
    def amax(self, t, axis=None, keepdim: bool = False): ...
    def amin(self, t, axis=None, keepdim: bool = False): ...
    def exp(self, t): ...
    def log(self, t): ...
    def expm1(self, t): ...
    def where(self, cond, a, b): ...
    def einsum(self, eq: str, *ts): ...
    def log2(self, t): ...
    def ceil(self, t): ...
    def floor(self, t): ...
    def sqrt(self, t): ...
    def ldexp(self, x, e):
        """``x * 2**e`` (``e`` an integer tensor): exact for a power-of-two result."""
    def cumsum(self, t, axis: int): ...
    def row_norm(self, t):
        """fp32 Euclidean norm over the last axis (bf16 read without a full fp32 copy)."""
    def take_along_axis(self, src, index, axis: int): ...
    def put_along_axis(self, dst, index, src, axis: int, reduce: str = "assign"):
        """``dst`` with ``src`` written (``"assign"``) or added (``"add"``) at ``index`` along
        ``axis`` (out of place; equal indices must carry equal values under ``"assign"``)."""
    def gather_rows(self, src, index):
        """``src [B, N, D]``, ``index [B, S, L]`` (all in ``[0, N)``) -> ``[B, S, L, D]``."""
    def scatter_add_rows(self, dst, index, src):
        """Returns ``dst`` with ``src [B, S, L, D]`` added at rows ``index [B, S, L]`` of
        ``dst [B, N, D]`` (out of place)."""


def _canon(name: str) -> str:
    # "paddle.bfloat16" / "torch.bfloat16" / "paddle.float32" -> "bfloat16" / "float32"
    return str(name).rsplit(".", 1)[-1]


# log of the smallest normal number: exp below this is subnormal (or 0) in IEEE arithmetic.
_LOG_TINY = {"float32": -87.33654475055310898657, "float64": -708.39641853226410622}


class _PaddleOps(TensorOps):
    name = "paddle"

    def __init__(self):
        import paddle

        self.p = paddle

    def _dt(self, dtype: str):
        return getattr(self.p, dtype)

    def dtype(self, t):
        return _canon(t.dtype)

    def shape(self, t):
        return tuple(int(s) for s in t.shape)

    def device_kind(self, t):
        place = t.place
        if place.is_gpu_place():
            return "cuda"
        if place.is_cpu_place():
            return "cpu"
        return str(place).lower()

    def is_contiguous(self, t):
        return bool(t.is_contiguous())

    def empty(self, shape, dtype, like):
        out = self.p.empty(list(shape), dtype=self._dt(dtype))
        return out.to(like.place) if out.place != like.place else out

    def zeros(self, shape, dtype, like):
        out = self.p.zeros(list(shape), dtype=self._dt(dtype))
        return out.to(like.place) if out.place != like.place else out

    def full(self, shape, value, dtype, like):
        out = self.p.full(list(shape), value, dtype=self._dt(dtype))
        return out.to(like.place) if out.place != like.place else out

    def from_numpy(self, array, like):
        out = self.p.to_tensor(array)
        return out.to(like.place) if out.place != like.place else out

    def to_numpy(self, t):
        # Paddle's .numpy() of a bf16 tensor is its raw bits as uint16: widen first (exact).
        if self.dtype(t) == "bfloat16":
            t = t.astype(self.p.float32)
        return t.numpy()

    def read_later(self, t):
        host = self.to_numpy(t)  # a stream sync, now (no GPU Paddle to measure an async one)
        return lambda: host

    def concat(self, ts, axis):
        return self.p.concat(list(ts), axis=axis)

    def _row_major(self, t):
        return t if t.is_contiguous() else t.contiguous()

    def cast(self, t, dtype):
        return t if self.dtype(t) == dtype else t.astype(self._dt(dtype))

    def reshape(self, t, shape):
        return self.p.reshape(t, list(shape))

    def logaddexp(self, a, b):
        # paddle.logaddexp(-inf, -inf) is NaN (3.3.1); shift by a finite max so it is -inf
        # (this relies on the guarded exp below: exp(-inf) must be exactly 0).
        m = self.p.maximum(a, b)
        m = self.p.where(self.p.isinf(m), self.p.zeros_like(m), m)
        return m + self.p.log(self.exp(a - m) + self.exp(b - m))

    def sum(self, t, axis=None, keepdim=False):
        return self.p.sum(t, axis=axis, keepdim=keepdim)

    def amax(self, t, axis=None, keepdim=False):
        return self.p.amax(t, axis=axis, keepdim=keepdim)

    def amin(self, t, axis=None, keepdim=False):
        return self.p.amin(t, axis=axis, keepdim=keepdim)

    def exp(self, t):
        # Paddle 3.3.1's vectorised CPU exp does not underflow to 0: below log(tiny) (-inf
        # included) it returns a constant near tiny/4 (2.9e-39 fp32, 5.6e-309 fp64), which
        # turns log(sum(exp(-inf))) into -88/-708 instead of -inf.  Flush those to 0.
        out = self.p.exp(t)
        dt = self.dtype(t)
        if dt in _LOG_TINY:
            under = t < _LOG_TINY[dt]
        else:
            under = t == float("-inf")
        return self.p.where(under, self.p.zeros_like(out), out)

    def log(self, t):
        return self.p.log(t)

    def expm1(self, t):
        return self.p.expm1(t)

    def where(self, cond, a, b):
        return self.p.where(cond, a, b)

    def einsum(self, eq, *ts):
        return self.p.einsum(eq, *ts)

    def log2(self, t):
        return self.p.log2(t)

    def ceil(self, t):
        return self.p.ceil(t)

    def floor(self, t):
        return self.p.floor(t)

    def sqrt(self, t):
        return self.p.sqrt(t)

    def ldexp(self, x, e):
        return self.p.ldexp(x, e.astype("int32"))

    def cumsum(self, t, axis):
        return self.p.cumsum(t, axis=axis)

    def row_norm(self, t):
        if self.dtype(t) != "float32":  # Paddle's CPU build has no bf16 math
            t = t.astype("float32")
        return self.p.linalg.norm(t, p=2, axis=-1)

    def take_along_axis(self, src, index, axis):
        return self.p.take_along_axis(src, index.astype("int64"), axis=axis)

    def put_along_axis(self, dst, index, src, axis, reduce="assign"):
        return self.p.put_along_axis(dst, index.astype("int64"), src, axis=axis, reduce=reduce,
                                     include_self=True)

    def gather_rows(self, src, index):
        b, s, l = self.shape(index)
        flat = self.p.reshape(index, [b, s * l, 1]).astype("int64")
        out = self.p.take_along_axis(src, flat, axis=1, broadcast=True)
        return self.p.reshape(out, [b, s, l, self.shape(src)[-1]])

    def scatter_add_rows(self, dst, index, src):
        b, s, l = self.shape(index)
        d = self.shape(dst)[-1]
        flat_idx = self.p.reshape(index, [b, s * l, 1]).astype("int64")
        flat_idx = self.p.expand(flat_idx, [b, s * l, d])
        flat_src = self.p.reshape(src, [b, s * l, d])
        return self.p.put_along_axis(dst, flat_idx, flat_src, axis=1, reduce="add", include_self=True)


class _TorchOps(TensorOps):
    name = "torch"

    def __init__(self):
        import torch

        self.t = torch

    def _dt(self, dtype):
        return getattr(self.t, dtype)

    def dtype(self, t):
        return _canon(t.dtype)

    def shape(self, t):
        return tuple(int(s) for s in t.shape)

    def device_kind(self, t):
        return t.device.type

    def is_contiguous(self, t):
        return bool(t.is_contiguous())

    def empty(self, shape, dtype, like):
        return self.t.empty(tuple(shape), dtype=self._dt(dtype), device=like.device)

    def zeros(self, shape, dtype, like):
        return self.t.zeros(tuple(shape), dtype=self._dt(dtype), device=like.device)

    def full(self, shape, value, dtype, like):
        return self.t.full(tuple(shape), value, dtype=self._dt(dtype), device=like.device)

    def from_numpy(self, array, like):
        # torch.from_numpy rejects negative strides and warns on read-only arrays.
        import numpy as np

        return self.t.from_numpy(np.array(array, copy=True, order="C")).to(like.device)

    def to_numpy(self, t):
        t = t.detach()
        if t.dtype == self.t.bfloat16:  # numpy has no bf16 (torch raises): widen, exactly
            t = t.float()
        return t.cpu().numpy()

    def read_later(self, t):
        if t.device.type != "cuda" or t.dtype == self.t.bfloat16:
            host = self.to_numpy(t).copy()  # a CPU tensor's numpy() shares its memory
            return lambda: host
        pinned = self.t.empty(t.shape, dtype=t.dtype, pin_memory=True)  # cached by torch
        pinned.copy_(t.detach(), non_blocking=True)
        done = self.t.cuda.Event()
        done.record(self.t.cuda.current_stream(t.device))

        def get():
            done.synchronize()
            return pinned.numpy().copy()

        return get

    def concat(self, ts, axis):
        return self.t.cat(list(ts), dim=axis)

    def _row_major(self, t):
        return t.contiguous()

    def cast(self, t, dtype):
        return t.to(self._dt(dtype))

    def reshape(self, t, shape):
        return t.reshape(tuple(shape))

    def logaddexp(self, a, b):
        return self.t.logaddexp(a, b)

    def sum(self, t, axis=None, keepdim=False):
        return t.sum() if axis is None else t.sum(dim=axis, keepdim=keepdim)

    def amax(self, t, axis=None, keepdim=False):
        return t.amax() if axis is None else t.amax(dim=axis, keepdim=keepdim)

    def amin(self, t, axis=None, keepdim=False):
        return t.amin() if axis is None else t.amin(dim=axis, keepdim=keepdim)

    def exp(self, t):
        return self.t.exp(t)

    def log(self, t):
        return self.t.log(t)

    def expm1(self, t):
        return self.t.expm1(t)

    def where(self, cond, a, b):
        return self.t.where(cond, a, b)

    def einsum(self, eq, *ts):
        return self.t.einsum(eq, *ts)

    def log2(self, t):
        return self.t.log2(t)

    def ceil(self, t):
        return self.t.ceil(t)

    def floor(self, t):
        return self.t.floor(t)

    def sqrt(self, t):
        return self.t.sqrt(t)

    def ldexp(self, x, e):
        return self.t.ldexp(*self.t.broadcast_tensors(x, e))

    def cumsum(self, t, axis):
        return self.t.cumsum(t, dim=axis)

    def row_norm(self, t):
        return self.t.linalg.vector_norm(t, dim=-1, dtype=self.t.float32)

    def take_along_axis(self, src, index, axis):
        return self.t.take_along_dim(src, index.long(), dim=axis)

    def put_along_axis(self, dst, index, src, axis, reduce="assign"):
        if reduce == "add":
            return dst.scatter_add(axis, index.long(), src)
        return dst.scatter(axis, index.long(), src)

    def gather_rows(self, src, index):
        b, s, l = self.shape(index)
        d = self.shape(src)[-1]
        flat = index.reshape(b, s * l, 1).long().expand(b, s * l, d)
        return self.t.gather(src, 1, flat).reshape(b, s, l, d)

    def scatter_add_rows(self, dst, index, src):
        b, s, l = self.shape(index)
        d = self.shape(dst)[-1]
        flat = index.reshape(b, s * l, 1).long().expand(b, s * l, d)
        return dst.scatter_add(1, flat, src.reshape(b, s * l, d))


_BACKENDS: dict = {}


def ops_for(*tensors) -> TensorOps:
    """The backend of the given tensors.

    Raises:
        TypeError: if a tensor is neither paddle.Tensor nor torch.Tensor, or they mix frameworks.
    """
    names = set()
    for t in tensors:
        if t is None:
            continue
        fw = framework_of(t)
        if fw is None:
            raise TypeError(f"expected a paddle.Tensor or torch.Tensor, got {type_name(t)}")
        names.add(fw)
    if len(names) != 1:
        raise TypeError(
            f"all tensors must come from one framework, got {sorted(names) or 'no tensors'}"
        )
    (name,) = names
    if name not in _BACKENDS:
        _BACKENDS[name] = _PaddleOps() if name == "paddle" else _TorchOps()
    return _BACKENDS[name]
