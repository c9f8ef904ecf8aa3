"""The two forms of the log-sum-exp of sparse MQA-latent attention, and the bridge between them
(``docs/conventions.md``, "The two LSE forms and the bridge").

* natural, sink-exclusive: ``lse = log(sum_l exp(s_l))``, what the forward returns (FlashMLA's
  sparse-prefill form);
* base 2, sink-inclusive: ``lse2 = log2(Z)`` with ``Z`` the whole softmax denominator, sink
  included, what the backward kernels consume.

Its own module because both the reference and the kernels' host wrappers (production code)
need it, and neither should import the other for it.  Paddle or PyTorch tensors, any device.
"""

from __future__ import annotations

import math
from typing import Any

from .adapter import framework_of, ops_for, type_name

__all__ = ["lse_natural_to_log2_sink", "lse_log2_sink_to_natural"]

_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)
_NEG_INF = float("-inf")


def _check_bridge(lse: Any, attn_sink: Any, lse_name: str):
    for name, t in ((lse_name, lse), ("attn_sink", attn_sink)):
        if t is not None and framework_of(t) is None:
            raise TypeError(
                f"{name}: expected a paddle.Tensor or torch.Tensor, got {type_name(t)}"
            )
    if attn_sink is not None and framework_of(attn_sink) != framework_of(lse):
        raise TypeError(
            f"attn_sink: expected a {framework_of(lse)} tensor like {lse_name}, got a "
            f"{framework_of(attn_sink)} one"
        )
    ops = ops_for(lse, attn_sink)
    dt = ops.dtype(lse)
    if dt not in ("float32", "float64"):
        raise TypeError(f"{lse_name}: expected dtype float32 or float64, got {dt}")
    shape = ops.shape(lse)
    if len(shape) < 1:
        raise ValueError(f"{lse_name}: expected shape [..., H], got a 0-d tensor")
    if attn_sink is None:
        return ops, None
    sink_shape = ops.shape(attn_sink)
    if sink_shape != (shape[-1],):
        raise ValueError(
            f"attn_sink: expected shape [H] with H={shape[-1]} (last dim of {lse_name}), got "
            f"{list(sink_shape)}"
        )
    sdt = ops.dtype(attn_sink)
    if sdt not in ("float32", "float64"):
        raise TypeError(f"attn_sink: expected dtype float32 or float64, got {sdt}")
    return ops, ops.cast(attn_sink, dt)


def lse_natural_to_log2_sink(lse: Any, attn_sink: Any = None):
    """Natural sink-exclusive LSE -> base-2 sink-inclusive LSE (``docs/conventions.md``).

    ``lse2 = log2(e) * logaddexp(lse, attn_sink[h])`` with a sink, ``log2(e) * lse`` without.

    Args:
        lse: ``[..., H]`` float32/float64, natural log, ``-inf`` for rows without keys.
        attn_sink: ``[H]`` float32/float64 or ``None``.

    Returns:
        ``lse2``, same shape and dtype as ``lse``; ``-inf`` only without a sink and keys.

    Raises:
        TypeError: a non-tensor ``lse`` or ``attn_sink`` (the message names which), tensors of
            two frameworks, or a non-fp32/fp64 dtype.
        ValueError: ``attn_sink`` not ``[H]`` with ``H = lse.shape[-1]``.
    """
    ops, sink = _check_bridge(lse, attn_sink, "lse")
    total = lse if sink is None else ops.logaddexp(lse, sink)
    return total * _LOG2E


def lse_log2_sink_to_natural(lse2: Any, attn_sink: Any = None):
    """Base-2 sink-inclusive LSE -> natural sink-exclusive LSE; inverse of
    :func:`lse_natural_to_log2_sink`.

    With a sink: ``total = lse2 * ln 2`` and ``lse = total + log(-expm1(sink - total))``
    (``expm1`` keeps precision when the keys weigh little next to the sink).  A row whose
    total is the sink alone to within 4 ulps of ``max(1, |total|)`` gives ``-inf`` (the keys'
    weight is below the rounding of ``lse2``, so it cannot be recovered), as does a ``-inf``
    sink over a ``-inf`` total.  Without a sink: ``lse = lse2 * ln 2``.

    Args:
        lse2: ``[..., H]`` float32/float64.
        attn_sink: ``[H]`` float32/float64 or ``None``.

    Returns:
        ``lse``, same shape and dtype as ``lse2``.

    Raises:
        TypeError, ValueError: as :func:`lse_natural_to_log2_sink`.
    """
    ops, sink = _check_bridge(lse2, attn_sink, "lse2")
    total = lse2 * _LN2
    if sink is None:
        return total
    dt = ops.dtype(lse2)
    zero = ops.zeros((1,), dt, lse2)
    gap = sink - total  # <= 0 mathematically: the total includes the sink
    # -inf sink (pad heads): the total is the keys alone.  (Tested as "== -inf" so that a NaN
    # sink stays NaN instead of becoming "no sink".)
    gap = ops.where(sink == _NEG_INF, ops.full((1,), _NEG_INF, dt, lse2), gap)
    # The forward bridge rounds lse2 to a few ulps of |total|, so a gap that small means the
    # keys weigh nothing measurable next to the sink: call it exactly 0 (lse = -inf) rather
    # than turning rounding noise into lse ~ sink - 37 (fp64) / sink - 16 (fp32).
    ulps = 4.0 * (2.0**-52 if dt == "float64" else 2.0**-23)
    scale = ops.where(total.abs() > 1.0, total.abs(), ops.full((1,), 1.0, dt, lse2))
    gap = ops.where(gap > -ulps * scale, zero, gap)
    return total + ops.log(-ops.expm1(gap))
