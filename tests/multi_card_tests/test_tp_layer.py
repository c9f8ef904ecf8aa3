"""MQALatentAttention split over N local ranks equals one process with the same weights.

Each launch runs tp_worker.py on N ranks (CPU: gloo, the world group is the tensor-parallel
group); every rank loads its slice of the same full weights and writes its output, input
gradient and parameter gradients to an npz.  Here they are compared with a single-process run
(one rank, ``attention_partition="heads"``: the plain layer): output and dx must be the full
single-process tensors on every rank, replicated-weight gradients the full gradients, per-rank
gradients (wq_b, w_uk, w_uv, wo, attn_sink) the rank's slice of the full gradients.  Both
attention partitions are compared with the same single-process run:

* ``@heads``: each rank runs its heads on every row (the default);
* ``@sequence``: each rank runs all heads on ``ceil(S/TP)`` rows, after an all-to-all (on gloo
  the all-gather fallback of tp.py); ``@sequence+alltoall`` goes through the ``dist.alltoall``
  branch instead (NCCL's; here with a scatter-built stand-in, see tp_worker.py).

The ``*_packed`` cases pack documents of very different lengths into one row (B = 1,
``cu_seqlens``; tests/test_layer.py shows the single-process packed run equals each document
alone); the ``*_s45`` / ``*_s3`` cases have S not divisible by TP (pad rows in the sequence
partition).  ``exchange`` checks the collectives themselves on coded values, exactly.  Run
alone with ``pytest tests/multi_card_tests``.
"""

from __future__ import annotations

import functools
import os
import tempfile

import numpy as np
import pytest

pytest.importorskip("paddle")  # the ranks run Paddle; the torch-only GPU env skips this

from helpers import rel_l2

from launcher import launch
from tp_case import PARTITIONS, run_case
from tp_worker import SWITCH_PARTITIONS, coded, exchange_shapes

from paddlefleet.tilelang_ops.attn.layer import shard_of

pytestmark = pytest.mark.multicard

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")
#: TP degree -> the specs (CASE@PARTITION) run in that one launch.  64 heads at TP 2/4/8, 48
#: heads (6 per rank) at 4 and 8; S = 48 (divisible by TP) and 45 / 3 (not); packed documents
#: at TP 2 and 8; every TP degree runs both partitions.
RUNS = {
    2: ("errors", "switch", "h64@heads", "h64_nosink@heads", "h64_packed@heads",
        "h64@sequence", "h64_s45@sequence", "h64_nosink@sequence", "h64_packed@sequence",
        "h64_s45@sequence+alltoall", "exchange"),
    4: ("h64@heads", "h64_s45@heads",
        "h64@sequence", "h64_s45@sequence", "h48_s45@sequence", "exchange"),
    8: ("h64@heads", "h48@heads", "h48_packed@heads", "h48_s45@heads",
        "h64@sequence", "h48@sequence", "h64_s45@sequence", "h48_s45@sequence",
        "h48_packed@sequence", "h48_packed_s45@sequence", "h48_s3@sequence",
        "h48_s45@sequence+alltoall", "exchange"),
}
#: fp32 with a different summation order (all-reduce of partial sums) only.
TOL = 2e-6


@functools.lru_cache(maxsize=None)
def _ranks_results(tp: int) -> str:
    """One launch per TP degree for all its specs (the launches dominate the test time)."""
    out_dir = tempfile.mkdtemp(prefix=f"tp_results_{tp}_")
    launch(WORKER, tp, [out_dir, *RUNS[tp]], timeout=300)
    return out_dir


def _rank_result(tp: int, spec: str, rank: int) -> dict:
    path = os.path.join(_ranks_results(tp), f"{spec}_rank{rank}.npz")
    assert os.path.exists(path), f"rank {rank} wrote no results ({path})"
    return dict(np.load(path))


@functools.lru_cache(maxsize=None)
def _single(case: str) -> dict:
    return run_case(case, 1, partition="heads")


@pytest.mark.parametrize(
    "tp,spec", [(tp, spec) for tp, specs in RUNS.items() for spec in specs if "@" in spec],
    ids=lambda v: str(v),
)
def test_tp_matches_single_process(tp, spec):
    case, partition = spec.split("@")
    assert partition.removesuffix("+alltoall") in PARTITIONS
    full = _single(case)
    failures = []
    for rank in range(tp):
        got = _rank_result(tp, spec, rank)
        assert set(got) == set(full), f"rank {rank}: keys {sorted(got)} != {sorted(full)}"
        for key, ref in full.items():
            name = key.split(".", 1)[1] if key.startswith("grad.") else key
            want = shard_of(name, ref, rank, tp) if key.startswith("grad.") else ref
            if got[key].shape != want.shape:
                failures.append(f"rank {rank} {key}: shape {got[key].shape} != {want.shape}")
                continue
            err = rel_l2(got[key], want)
            if not err <= TOL:
                failures.append(f"rank {rank} {key}: rel L2 {err:.3e} > {TOL}")
    assert not failures, f"TP={tp} {spec}:\n" + "\n".join(failures)


@pytest.mark.parametrize("tp", [tp for tp, specs in RUNS.items() if "exchange" in specs])
def test_exchange_collectives_move_exactly_the_right_values(tp):
    """all_to_all (both branches) and gather_from_tensor_parallel against numpy, bit for bit:
    they only move data, except the sink gradient's sum of small integers (exact in fp32)."""
    x_shape, y_shape = exchange_shapes(tp)
    rows, heads = x_shape[1] // tp, x_shape[2]
    xs = [coded(x_shape, r, 0) for r in range(tp)]
    gys = [coded(y_shape, r, 1) for r in range(tp)]
    for rank in range(tp):
        got = _rank_result(tp, "exchange", rank)
        # rank r gets rows r*rows.. of every rank's heads, heads in rank order
        y = np.concatenate([x[:, rank * rows:(rank + 1) * rows] for x in xs], axis=2)
        # the gradient of x_r's row block k comes from rank k's heads block r
        dx = np.concatenate([g[:, :, rank * heads:(rank + 1) * heads] for g in gys], axis=1)
        for branch in ("fallback", "alltoall"):
            np.testing.assert_array_equal(got[f"{branch}.y"], y, err_msg=f"{branch} rank {rank}")
            np.testing.assert_array_equal(got[f"{branch}.dx"], dx, err_msg=f"{branch} rank {rank}")
            np.testing.assert_array_equal(got[f"{branch}.z"], xs[rank])  # round trip
            np.testing.assert_array_equal(got[f"{branch}.dx_round_trip"],
                                          coded(x_shape, rank, 2))
        np.testing.assert_array_equal(
            got["gathered"], np.concatenate([coded((3,), r, 0) for r in range(tp)]))
        d_shard = sum(coded((3 * tp,), r, 3) for r in range(tp))[rank * 3:(rank + 1) * 3]
        np.testing.assert_array_equal(got["d_shard"], d_shard)


def test_sequence_inputs_bad_on_some_ranks_raise_on_every_rank():
    """Inputs that fail the checks on some ranks only (they must be the same on every rank)
    make every rank raise a ValueError/TypeError before the first exchange, and the group stays
    in step: a good call afterwards gives the single-process output.  (Regression: the ranks
    whose inputs passed waited in the all-to-all until gloo's own timeout, ~30 s, and then
    failed with gloo's opaque "TIMEOUT self_rank = -1"; NCCL would wait on.)"""
    tp = 2
    got = [_rank_result(tp, "errors", rank) for rank in range(tp)]
    others = ("ValueError: MQALatentAttention (attention_partition='sequence'): the input checks "
              "failed on rank(s) [{}] of the tensor-parallel group (the error is raised there); "
              "hidden_states, token_indices and cu_seqlens must be the same on every rank")
    index = ("ValueError: token_indices: expected values -1 (empty slot) or in [0, S_kv=45), "
             "got values in [-1, 45]")
    want = {
        "index_on_rank1": [others.format(1), index],
        "index_on_every_rank": [index, index],
        "cu_seqlens_on_rank0": ["ValueError: cu_seqlens: expected cu_seqlens[-1] == S=48 (the "
                                "packed rows), got 47", others.format(0)],
        "hidden_type_on_rank0": ["TypeError: hidden_states: expected a paddle.Tensor, got "
                                 "numpy.ndarray", others.format(0)],
    }
    for case, messages in want.items():
        for rank, message in enumerate(messages):
            assert str(got[rank][case]).startswith(message), (case, rank, str(got[rank][case]))
    shapes = ("ValueError: hidden_states, token_indices: expected the same [B, S, L] on every "
              "rank of the tensor-parallel group (attention_partition='sequence' exchanges rows "
              "between them), got rank 0: [2, 45, 32], rank 1: [2, 44, 32]")
    assert [str(g["seq_len_on_rank1"]) for g in got] == [shapes, shapes]
    y = _single("h64_s45")["y"]
    for rank in range(tp):
        assert rel_l2(got[rank]["y"], y) <= TOL, rank


def test_partition_switched_between_steps_on_one_layer():
    """The same layer run with "sequence", "heads", "sequence" in turn (its config replaced):
    every step equals the single-process run (the partition holds no state of its own)."""
    tp = 2
    full = _single("h64_s45")
    failures = []
    for rank in range(tp):
        got = _rank_result(tp, "switch", rank)
        for step, partition in enumerate(SWITCH_PARTITIONS):
            for key, ref in full.items():
                name = key.split(".", 1)[1] if key.startswith("grad.") else key
                want = shard_of(name, ref, rank, tp) if key.startswith("grad.") else ref
                err = rel_l2(got[f"{step}.{key}"], want)
                if not err <= TOL:
                    failures.append(f"rank {rank} step {step} ({partition}) {key}: {err:.3e}")
    assert not failures, "\n".join(failures)


def test_single_process_gradients_are_not_trivial():
    # Guards the comparison above against passing on zeros: every gradient carries signal.
    for case in ("h64", "h48", "h64_packed", "h48_packed", "h48_s45", "h48_packed_s45", "h48_s3"):
        for key, value in _single(case).items():
            assert np.isfinite(value).all() and np.abs(value).max() > 0, f"{case} {key}"
