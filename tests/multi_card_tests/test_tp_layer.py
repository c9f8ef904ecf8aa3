"""MQALatentAttention split over N local ranks equals one process with the same weights.

Each launch runs tp_worker.py on N ranks (CPU: gloo, the world group is the tensor-parallel
group); every rank loads its slice of the same full weights and writes its output, input
gradient and parameter gradients to an npz.  Here they are compared with a single-process run:
output and dx must be the full single-process tensors on every rank, replicated-weight
gradients the full gradients, per-rank gradients (wq_b, w_uk, w_uv, wo, attn_sink) the rank's
slice of the full gradients.  The ``*_packed`` cases pack documents of very different lengths
into one row (B = 1, ``cu_seqlens``; tests/test_layer.py shows the single-process packed run
equals each document alone).  Run alone with ``pytest tests/multi_card_tests``.
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
from tp_case import run_case

from paddlefleet.tilelang_ops.attn.layer import shard_of

pytestmark = pytest.mark.multicard

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")
#: (TP degree, cases run in that one launch); 64 heads at TP 2/4/8, 48 heads (6 per rank) at 8;
#: packed documents (B = 1, cu_seqlens) at TP 2 and 8.
RUNS = {2: ("h64", "h64_nosink", "h64_packed"), 4: ("h64",), 8: ("h64", "h48", "h48_packed")}
#: fp32 with a different summation order (all-reduce of partial sums) only.
TOL = 2e-6


@functools.lru_cache(maxsize=None)
def _ranks_results(tp: int) -> str:
    """One launch per TP degree for all its cases (the launches dominate the test time)."""
    out_dir = tempfile.mkdtemp(prefix=f"tp_results_{tp}_")
    launch(WORKER, tp, [out_dir, *RUNS[tp]], timeout=120)
    return out_dir


@functools.lru_cache(maxsize=None)
def _single(case: str) -> dict:
    return run_case(case, 1)


@pytest.mark.parametrize(
    "tp,case", [(tp, case) for tp, cases in RUNS.items() for case in cases],
    ids=lambda v: str(v),
)
def test_tp_matches_single_process(tp, case):
    out_dir = _ranks_results(tp)
    full = _single(case)
    failures = []
    for rank in range(tp):
        path = os.path.join(out_dir, f"{case}_rank{rank}.npz")
        assert os.path.exists(path), f"rank {rank} wrote no results ({path})"
        got = dict(np.load(path))
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
    assert not failures, f"TP={tp} case {case}:\n" + "\n".join(failures)


def test_single_process_gradients_are_not_trivial():
    # Guards the comparison above against passing on zeros: every gradient carries signal.
    for case in ("h64", "h48", "h64_packed", "h48_packed"):
        for key, value in _single(case).items():
            assert np.isfinite(value).all() and np.abs(value).max() > 0, f"{case} {key}"
