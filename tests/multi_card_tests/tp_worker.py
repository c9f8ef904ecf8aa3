"""Rank process of the tensor-parallel tests (launched by paddle.distributed.launch).

Usage: tp_worker.py OUT_DIR SPEC [SPEC ...]

A SPEC is ``CASE@PARTITION`` (a layer case of tp_case.py run with that attention partition),
``CASE@sequence+alltoall`` (the same through the ``dist.alltoall`` branch, see below),
``exchange`` (the collectives of tp.py on known data, both branches), ``errors`` (inputs
that fail the layer's checks on some ranks only, "sequence" partition) or ``switch`` (one
layer whose partition changes between steps).  Writes
OUT_DIR/<spec>_rank<r>.npz per spec; the pytest process does the comparing, so a mismatch is
reported there with names and errors instead of a crashed rank.

The ``dist.alltoall`` branch: gloo has no all-to-all in Paddle 3.3.1 (tp.py's docstring), so
on CPU tp.py takes its all-gather fallback.  ``+alltoall`` makes tp.py take the branch NCCL
runs, with ``dist.alltoall`` replaced by :func:`_alltoall_by_scatter`, its documented semantics
built from ``dist.scatter`` (which gloo has; a construction independent of the fallback's).
"""

import contextlib
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_case import case_config, case_inputs, run_case  # noqa: E402

from paddlefleet.tilelang_ops.attn import tp  # noqa: E402
from paddlefleet.tilelang_ops.attn.layer import MQALatentAttention  # noqa: E402

#: Calls of the stand-in, counted so a run that never took the branch fails.
_ALLTOALL_CALLS = []


def _alltoall_by_scatter(out_tensor_list, in_tensor_list, group=None, sync_op=True):
    """``dist.alltoall``'s documented semantics: ``out_tensor_list[i]`` (filled when empty)
    receives what rank ``i`` put at this rank's index of its ``in_tensor_list``."""
    _ALLTOALL_CALLS.append(len(in_tensor_list))
    me, n = dist.get_rank(), dist.get_world_size()
    assert len(in_tensor_list) == n
    if not out_tensor_list:
        out_tensor_list += [paddle.empty_like(t) for t in in_tensor_list]
    for src in range(n):  # rank src sends its chunk j to rank j
        dist.scatter(out_tensor_list[src], list(in_tensor_list) if me == src else None,
                     src=src, group=group)


@contextlib.contextmanager
def _alltoall_branch():
    saved = tp.has_all_to_all, dist.alltoall
    tp.has_all_to_all, dist.alltoall = (lambda group=None: True), _alltoall_by_scatter
    try:
        yield
    finally:
        tp.has_all_to_all, dist.alltoall = saved


def coded(shape, rank: int, salt: int) -> np.ndarray:
    """fp32 values that name their rank, salt and position (exact integers)."""
    return (np.arange(np.prod(shape)).reshape(shape) + 1000 * rank + 100000 * salt).astype(
        np.float32)


def exchange_shapes(world: int):
    """``(x, y)``: the shapes before and after ``all_to_all(x, 1, 2)``."""
    return (2, 2 * world, 3, 4), (2, 2, 3 * world, 4)


def _exchange(rank: int, world: int) -> dict:
    """all_to_all both ways and gather_from_tensor_parallel, forward and backward, on coded
    inputs, through both branches; numpy results for the pytest process.  One backward per
    graph (Paddle 3.3.1 crashes on a second backward through a PyLayer, docs/layer.md)."""
    x_shape, y_shape = exchange_shapes(world)
    s = paddle.to_tensor(coded((3,), rank, 0), stop_gradient=False)
    g = tp.gather_from_tensor_parallel(s)  # all_gather / all_reduce: one branch
    (g * paddle.to_tensor(coded((3 * world,), rank, 3))).sum().backward()
    out = {"gathered": g.numpy(), "d_shard": s.grad.numpy()}
    for branch in ("fallback", "alltoall"):
        del _ALLTOALL_CALLS[:]
        with _alltoall_branch() if branch == "alltoall" else contextlib.nullcontext():
            x = paddle.to_tensor(coded(x_shape, rank, 0), stop_gradient=False)
            y = tp.all_to_all(x, 1, 2)  # rows split, heads gathered
            (y * paddle.to_tensor(coded(y_shape, rank, 1))).sum().backward()
            out[f"{branch}.y"], out[f"{branch}.dx"] = y.numpy(), x.grad.numpy()

            x = paddle.to_tensor(coded(x_shape, rank, 0), stop_gradient=False)
            z = tp.all_to_all(tp.all_to_all(x, 1, 2), 2, 1)  # there and back
            (z * paddle.to_tensor(coded(x_shape, rank, 2))).sum().backward()
            out[f"{branch}.z"], out[f"{branch}.dx_round_trip"] = z.numpy(), x.grad.numpy()
        assert len(_ALLTOALL_CALLS) == (6 if branch == "alltoall" else 0), _ALLTOALL_CALLS
    return out


#: ``errors`` cases: name -> what rank 1 (or every rank) gets wrong; see :func:`_errors`.
ERROR_CASES = ("index_on_rank1", "index_on_every_rank", "cu_seqlens_on_rank0",
               "hidden_type_on_rank0", "seq_len_on_rank1")


def _errors(rank: int, world: int) -> dict:
    """The "sequence" layer fed inputs that fail its checks on some ranks only (the inputs must
    be the same on every rank: a caller's bug, but one that must not leave the other ranks
    waiting in the exchange).  Records, per case, what each rank raised (``type: message``),
    then the output of a good call: the group must still be in step after the errors."""
    import paddle

    out = {}
    for case in ERROR_CASES:
        packed = case.startswith("cu_seqlens")
        name = "h64_packed" if packed else "h64_s45"
        full, x, idx, _, cu = case_inputs(name)
        layer = MQALatentAttention(case_config(name, world, "sequence"))
        layer.load_full_weights(full)
        S = x.shape[1]
        x_in = paddle.to_tensor(x)
        if case == "index_on_rank1" and rank == 1:
            idx = idx.copy()
            idx[0, 0, 0] = S  # row 0: one of rank 0's rows; key S is one past the last
        elif case == "index_on_every_rank":
            idx = idx.copy()
            idx[-1, S - 1, 0] = S  # the last row, on the last rank's rows
        elif case == "cu_seqlens_on_rank0" and rank == 0:
            cu = cu.copy()
            cu[-1] -= 1
        elif case == "hidden_type_on_rank0" and rank == 0:
            x_in = x  # numpy, not a paddle.Tensor
        elif case == "seq_len_on_rank1" and rank == 1:
            x_in, idx = x_in[:, :-1], idx[:, :-1]
        try:
            layer(x_in, paddle.to_tensor(idx), cu_seqlens=None if cu is None else paddle.to_tensor(cu))
            out[case] = np.array("no error")
        except Exception as e:  # noqa: BLE001 (recorded for the pytest process)
            out[case] = np.array(f"{type(e).__name__}: {e}")
    full, x, idx, _, _ = case_inputs("h64_s45")
    layer = MQALatentAttention(case_config("h64_s45", world, "sequence"))
    layer.load_full_weights(full)
    out["y"] = layer(paddle.to_tensor(x), paddle.to_tensor(idx)).numpy()
    return out


#: ``switch``: the partitions one layer runs with, step after step.
SWITCH_PARTITIONS = ("sequence", "heads", "sequence")


def _switch(rank: int, world: int) -> dict:
    """One layer, its config's attention_partition replaced between forward/backward steps
    (same weights; gradients cleared in between): every step must equal the single-process
    run.  Keys ``<step>.<result key>``."""
    import paddle

    full, x_np, idx, gy, _ = case_inputs("h64_s45")
    layer = MQALatentAttention(case_config("h64_s45", world, "heads"))
    layer.load_full_weights(full)
    out = {}
    for step, partition in enumerate(SWITCH_PARTITIONS):
        layer.config = layer.config.replace(attention_partition=partition)
        x = paddle.to_tensor(x_np, stop_gradient=False)
        y = layer(x, paddle.to_tensor(idx))
        (y * paddle.to_tensor(gy)).sum().backward()
        out[f"{step}.y"], out[f"{step}.dx"] = y.numpy(), x.grad.numpy()
        for pname, p in layer.named_parameters():
            out[f"{step}.grad.{pname}"] = p.grad.numpy()
        layer.clear_gradients()
    return out


def main():
    out_dir, specs = sys.argv[1], sys.argv[2:]
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    for spec in specs:
        if spec == "exchange":
            result = _exchange(rank, world)
        elif spec == "errors":
            result = _errors(rank, world)
        elif spec == "switch":
            result = _switch(rank, world)
        else:
            name, partition = spec.split("@")
            branch = partition.endswith("+alltoall")
            partition = partition.removesuffix("+alltoall")
            # group=None: the world group, which is the tensor-parallel group here (gloo
            # sub-groups are broken on the CPU wheel; Paddle 3.3.1).
            with _alltoall_branch() if branch else contextlib.nullcontext():
                del _ALLTOALL_CALLS[:]
                result = run_case(name, world, partition=partition)
                # forward: query and output; backward: their reverse exchanges
                assert len(_ALLTOALL_CALLS) == (4 if branch else 0), _ALLTOALL_CALLS
        np.savez(os.path.join(out_dir, f"{spec}_rank{rank}.npz"), **result)
    dist.barrier()


if __name__ == "__main__":
    main()
