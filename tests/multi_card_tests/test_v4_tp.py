"""DeepSeekV4Attention split over 2, 4 and 8 local ranks equals one process with the same
weights, for both attention partitions; tools/train_step.py --config deepseek_v4_small on 8
ranks prints what one process prints.

The layer runs are v4_tp_worker.py (one launch per TP degree, every spec in it): output and dx
must be the full single-process tensors on every rank, the replicated weights' gradients (the
q/kv projections and norms, the compressor's) the full gradients, the per-rank ones (``wq_b``,
``attn_sink`` by heads; ``wo_a``, ``wo_b`` by head groups) the rank's slice.  Cases: ratio 4
with picks (S = 24, and S = 21 with pad rows in the sequence partition), ratio 128 (two groups),
window only without a sink, and packed documents.  Run alone with
``pytest tests/multi_card_tests/test_v4_tp.py``.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

pytest.importorskip("paddle")  # the ranks run Paddle; the torch-only GPU env skips this

from helpers import REPO_ROOT, rel_l2

from launcher import launch
from v4_tp_worker import run_case

from paddlefleet.tilelang_ops.attn.v4_layer import shard_of

pytestmark = pytest.mark.multicard

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v4_tp_worker.py")
#: TP degree -> the specs (CASE@PARTITION) of its one launch; every degree runs both partitions.
RUNS = {
    2: ("errors", "c4@heads", "c4@sequence", "c4_packed@heads", "c4_packed@sequence",
        "win_nosink@heads"),
    4: ("c4@heads", "c4_s21@sequence", "c128@heads", "c128@sequence"),
    8: ("c4@heads", "c4@sequence", "c4_s21@sequence", "c128@heads", "win_nosink@sequence",
        "c4_packed@sequence"),
}
#: fp32 with a different summation order (all-reduce of partial sums) only.
TOL = 2e-6


@functools.lru_cache(maxsize=None)
def _ranks_results(tp: int) -> str:
    out_dir = tempfile.mkdtemp(prefix=f"v4_tp_results_{tp}_")
    launch(WORKER, tp, [out_dir, *RUNS[tp]], timeout=400)
    return out_dir


@functools.lru_cache(maxsize=None)
def _single(case: str) -> dict:
    return run_case(case, 1, partition="heads")


@pytest.mark.parametrize(
    "tp,spec", [(tp, spec) for tp, specs in RUNS.items() for spec in specs if "@" in spec],
    ids=str)
def test_v4_tp_matches_single_process(tp, spec):
    case = spec.split("@")[0]
    full = _single(case)
    failures = []
    for rank in range(tp):
        path = os.path.join(_ranks_results(tp), f"{spec}_rank{rank}.npz")
        assert os.path.exists(path), f"rank {rank} wrote no results ({path})"
        got = dict(np.load(path))
        assert set(got) == set(full), f"rank {rank}: keys {sorted(got)} != {sorted(full)}"
        for key, ref in full.items():
            want = shard_of(key[5:], ref, rank, tp) if key.startswith("grad.") else ref
            if got[key].shape != want.shape:
                failures.append(f"rank {rank} {key}: shape {got[key].shape} != {want.shape}")
            elif not rel_l2(got[key], want) <= TOL:
                failures.append(f"rank {rank} {key}: rel L2 {rel_l2(got[key], want):.3e}")
    assert not failures, f"TP={tp} {spec}:\n" + "\n".join(failures)


def test_v4_sequence_partition_errors_raise_on_every_rank():
    """A pick out of range on rank 1 only: rank 1 raises it, rank 0 a ValueError naming rank 1
    (no rank is left waiting in the exchange); on every rank: each raises it; the group is
    still in step for the good call after them."""
    own = "ValueError: compressed_indices: expected -1 or a group number in [0, 6)"
    ranks = [dict(np.load(os.path.join(_ranks_results(2), f"errors_rank{r}.npz")))
             for r in range(2)]
    assert str(ranks[1]["pick_on_rank1"]).startswith(own), ranks[1]["pick_on_rank1"]
    assert str(ranks[0]["pick_on_rank1"]).startswith(
        "ValueError: DeepSeekV4Attention (attention_partition='sequence'): the input checks "
        "failed on rank(s) [1]"), ranks[0]["pick_on_rank1"]
    for r in range(2):
        assert str(ranks[r]["pick_on_every_rank"]).startswith(own)
        assert rel_l2(ranks[r]["y"], _single("c4")["y"]) <= TOL


# --- the main job ---------------------------------------------------------------------------
TRAIN_STEP = REPO_ROOT / "tools" / "train_step.py"
ARGS = ["--config", "deepseek_v4_small", "--steps", "2", "--seq-len", "61", "--no-progress"]
NUMBERS = re.compile(r"(?:loss|grad_norm|wq_a|q_norm_weight|wq_b|wkv|kv_norm_weight|wo_a|wo_b|"
                     r"attn_sink|wkv_c|wgate_c|ape|norm_c) ([-+]?\d+\.\d+(?:e[-+]\d+)?)")


def _train_step(*extra):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src"))
    res = subprocess.run([sys.executable, str(TRAIN_STEP), *ARGS, *extra], capture_output=True,
                         text=True, timeout=500, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("step ", "  grad norms:"))]
    return [float(v) for ln in lines for v in NUMBERS.findall(ln)], res.stdout


@pytest.mark.parametrize("partition", ["heads", "sequence"])
def test_train_step_v4_on_8_ranks_matches_one_process(partition):
    """64 heads, 8 per rank; S = 61 (pad rows in the sequence partition, a trailing token in
    no compressed group)."""
    one, out = _train_step("--attention-partition", partition)
    assert len(one) == 2 * (2 + 12), out  # 2 steps: loss, total, 12 parameters
    assert "heads 64 (all in one process), Dk 512, Dv 512" in out
    eight, out8 = _train_step("--attention-partition", partition, "--nproc", "8",
                              "--timeout", "400")
    split = ("8 per rank x TP 8" if partition == "heads"
             else "all 64 on every rank, query rows split over TP 8")
    assert f"heads 64 ({split})" in out8, out8
    # printed with 4-5 significant digits; TP only changes the summation order
    assert eight == pytest.approx(one, rel=1e-3), out + out8
