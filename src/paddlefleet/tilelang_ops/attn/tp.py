"""Megatron-style tensor-parallel collectives as small Paddle PyLayers.

Two conjugate operators (Shoeybi et al., *Megatron-LM*, arXiv:1909.08053, the ``f``/``g``
pair) over ``paddle.distributed`` collectives on a group passed in:

    copy_to_tensor_parallel(x, group)      forward identity,   backward all-reduce (sum)
    reduce_from_tensor_parallel(x, group)  forward all-reduce, backward identity

and two for the ``"sequence"`` attention partition (docs/layer.md):

    all_to_all(x, split_axis, concat_axis, group)   forward all-to-all, backward the reverse one
    gather_from_tensor_parallel(x, group)           forward all-gather (axis 0), backward
                                                    all-reduce (sum) and this rank's slice

All-to-all on gloo: Paddle 3.3.1's ``ProcessGroupGLOO`` implements no all-to-all
(``dist.alltoall`` and ``dist.alltoall_single``, synchronous or not, raise
``NotImplementedError``; probed with two CPU ranks), so on a gloo group the exchange is built from
``dist.all_gather``, which gloo has: every rank gathers every rank's send buffer and keeps the
pieces addressed to it.  That moves ``TP`` times the data of an all-to-all and is meant for CPU
tests only; every other backend (NCCL on GPUs) uses ``dist.alltoall``.  Both are pure data
movement, so they give the same bits.

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
    "all_to_all",
    "gather_from_tensor_parallel",
    "has_all_to_all",
    "CopyToTensorParallel",
    "ReduceFromTensorParallel",
    "AllToAll",
    "GatherFromTensorParallel",
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
    """This process's rank inside ``group`` (``None``: the world; 0 when not initialised).

    Raises:
        ValueError: this process is not a member of ``group`` (Paddle reports rank -1).
    """
    if group is None:
        return int(dist.get_rank()) if _dist_ready() else 0
    rank = int(group.rank)
    if rank < 0 and int(group.nranks) == 1:
        # Paddle 3.3.1 gives a group of one rank no process group of its own and reports
        # rank -1 even to its member: fleet's mp group at mp_degree 1, every dp group of a pure
        # mp run.  Such a group's only member is rank 0 of it.
        me = int(dist.get_rank()) if _dist_ready() else 0
        if me in list(group.ranks):
            return 0
    if rank < 0:
        raise ValueError(
            f"group: this process (global rank {dist.get_rank()}) is not a member of the "
            f"tensor-parallel group (ranks {list(group.ranks)})"
        )
    return rank


def _all_reduce_sum(x, group):
    # Out of place: the input may be used elsewhere in the graph.
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def has_all_to_all(group=None) -> bool:
    """Whether ``group``'s backend implements all-to-all (every backend but gloo; see the
    module docstring)."""
    return str(dist.get_backend(group)).upper() != "GLOO"


def _exchange(chunks: list, group) -> list:
    """``chunks[j]`` (equal shapes) goes to rank ``j``; returns ``received`` with
    ``received[i]`` the chunk rank ``i`` addressed to this rank."""
    if has_all_to_all(group):
        received = []  # filled by Paddle, one tensor per rank
        dist.alltoall(received, chunks, group=group)
        return received
    # gloo: no all-to-all in Paddle 3.3.1; all-gather every rank's chunks, keep ours.
    gathered = []
    dist.all_gather(gathered, paddle.stack(chunks), group=group)
    me = group_rank(group)
    return [g[me] for g in gathered]


def _all_to_all(x, split_axis: int, concat_axis: int, group):
    n = group_world_size(group)
    # contiguous: a split may be a strided view, and collectives send memory as laid out
    chunks = [c.contiguous() for c in paddle.split(x, n, axis=split_axis)]
    return paddle.concat(_exchange(chunks, group), axis=concat_axis)


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


class AllToAll(PyLayer):
    """Forward :func:`all_to_all`; backward the reverse exchange (axes swapped), its adjoint."""

    @staticmethod
    def forward(ctx, x, split_axis, concat_axis, group):
        ctx.axes = (split_axis, concat_axis)
        ctx.group = group
        return _all_to_all(x, split_axis, concat_axis, group)

    @staticmethod
    def backward(ctx, grad):
        split_axis, concat_axis = ctx.axes
        return _all_to_all(grad, concat_axis, split_axis, ctx.group)


class GatherFromTensorParallel(PyLayer):
    """Forward: the ranks' ``[n, ...]`` shards gathered to ``[n * TP, ...]`` (rank order).
    Backward: every rank uses the whole gathered tensor in computations of its own, so the full
    gradient is the sum of the ranks' gradients (all-reduce), and each rank keeps its shard's
    rows.  The all-reduce is deterministic from run to run for a fixed group (gloo's ring and
    NCCL's ring/tree reduce in an order fixed by world size, message size, topology and NCCL
    version, without atomics) and gives every rank the same bits."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.rows = int(x.shape[0])
        gathered = []
        dist.all_gather(gathered, x.contiguous(), group=group)
        return paddle.concat(gathered, axis=0)

    @staticmethod
    def backward(ctx, grad):
        total = _all_reduce_sum(grad, ctx.group)
        lo = group_rank(ctx.group) * ctx.rows
        return total[lo : lo + ctx.rows]


def all_to_all(x: paddle.Tensor, split_axis: int, concat_axis: int, group=None) -> paddle.Tensor:
    """All-to-all over ``group`` along two axes of ``x`` (differentiable).

    ``x`` is cut along ``split_axis`` into ``TP`` equal chunks, chunk ``j`` goes to rank ``j``,
    and the chunks received are concatenated along ``concat_axis`` in rank order: for
    ``x [B, S, h, D]`` on every rank, ``all_to_all(x, 1, 2)`` gives rank ``r`` the rows
    ``r*S/TP .. (r+1)*S/TP - 1`` of every rank's heads, ``[B, S/TP, h*TP, D]``, and
    ``all_to_all(y, 2, 1)`` undoes it.  The backward is the reverse exchange.  ``dist.alltoall``
    on NCCL (any backend but gloo); on gloo a fallback built from ``dist.all_gather`` (module
    docstring).  No-op on one rank.

    ``x``: any shape, any dtype the backend moves (bf16 and fp32 on NCCL and on the gloo
    fallback), the same shape and dtype on every rank; the result has ``x``'s dtype.

    Raises:
        ValueError: ``x.shape[split_axis]`` not divisible by the group size (from
            ``paddle.split``).
    """
    if group_world_size(group) == 1:
        return x
    return AllToAll.apply(x, split_axis, concat_axis, group)


def gather_from_tensor_parallel(x: paddle.Tensor, group=None) -> paddle.Tensor:
    """``[n, ...]`` per rank -> ``[n * TP, ...]``, rank-ordered, on every rank; the backward sums
    the gradient over ``group`` and returns this rank's ``n`` rows (no-op on one rank).

    ``x``: the same shape and dtype on every rank (the layer passes its fp32 ``attn_sink [h]``
    shard); the result has ``x``'s dtype.  Different shapes on different ranks make the
    collective fail or hang (not checked: that would take a collective of its own)."""
    if group_world_size(group) == 1:
        return x
    return GatherFromTensorParallel.apply(x, group)


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
