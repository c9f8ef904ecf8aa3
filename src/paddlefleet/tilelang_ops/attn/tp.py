"""Megatron-style tensor-parallel collectives as small Paddle PyLayers.

Two conjugate operators (Shoeybi et al., *Megatron-LM*, arXiv:1909.08053, the ``f``/``g``
pair) over ``paddle.distributed`` collectives on a group passed in:

    copy_to_tensor_parallel(x, group)      forward identity,   backward all-reduce (sum)
    reduce_from_tensor_parallel(x, group)  forward all-reduce, backward identity

Why our own and not fleet's ``mp_ops`` / ``ColumnParallelLinear`` / ``RowParallelLinear``:
Paddle 3.3.1's CPU build has no ``c_identity``/``c_split`` kernels, its gloo process group
rejects the ``use_calc_stream`` all-reduce those layers issue, and gloo sub-groups
(``new_group``) are broken there, so fleet's layers cannot run in CPU tests (measured on the
Paddle 3.3.1 CPU wheel).  Plain ``dist.all_reduce`` on the group works on gloo
and NCCL alike.

With a group of one rank (or no distributed environment) every collective is a no-op.
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

__all__ = [
    "default_tensor_parallel_group",
    "group_world_size",
    "group_rank",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "CopyToTensorParallel",
    "ReduceFromTensorParallel",
]


def default_tensor_parallel_group():
    """Fleet's model-parallel group when hybrid parallel is initialised, else ``None`` (the
    world group of ``paddle.distributed``)."""
    try:
        from paddle.distributed import fleet

        hcg = fleet.get_hybrid_communicate_group()
    except Exception:  # fleet not initialised: Paddle raises or returns None depending on path
        hcg = None
    if hcg is None:
        return None
    return hcg.get_model_parallel_group()


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_world_size(group=None) -> int:
    """Ranks in ``group`` (``None``: the world; 1 when distributed is not initialised)."""
    if group is not None:
        return int(group.nranks)
    return int(dist.get_world_size()) if _dist_ready() else 1


def group_rank(group=None) -> int:
    """This process's rank inside ``group`` (``None``: the world; 0 when not initialised)."""
    if group is not None:
        return int(group.rank)
    return int(dist.get_rank()) if _dist_ready() else 0


def _all_reduce_sum(x, group):
    # Out of place: the input may be used elsewhere in the graph.
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class CopyToTensorParallel(PyLayer):
    """Forward identity, backward all-reduce (sum) of the gradient over ``group``.

    Put it on a replicated activation right before it enters per-rank (column-parallel)
    computation: each rank's gradient is then partial, and the sum is the full gradient.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_sum(grad, ctx.group)


class ReduceFromTensorParallel(PyLayer):
    """Forward all-reduce (sum) over ``group``, backward identity (row-parallel output)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad


def copy_to_tensor_parallel(x: paddle.Tensor, group=None) -> paddle.Tensor:
    """Identity forward; the backward sums the gradient over ``group`` (no-op on one rank)."""
    if group_world_size(group) == 1:
        return x
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: paddle.Tensor, group=None) -> paddle.Tensor:
    """All-reduce (sum) forward over ``group``; identity backward (no-op on one rank)."""
    if group_world_size(group) == 1:
        return x
    return ReduceFromTensorParallel.apply(x, group)
