"""The examples run as documented and print their checks as passed.

``examples/fleet_decoder_block.py`` (docs/layer.md, "From a PaddleFleet model"): one process,
and mp_degree 2 through ``paddle.distributed.launch`` (gloo on CPU), whose loss must equal the
single process's (the same model: the layer's weights do not depend on the TP degree).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("paddle")

from helpers import REPO_ROOT  # noqa: E402
from launch import launch_ranks  # noqa: E402  (tools/launch.py; pytest.ini puts tools/ on sys.path)

EXAMPLE = REPO_ROOT / "examples" / "fleet_decoder_block.py"
CHECKS = ("loss_finite", "recompute_grads_bitwise_equal", "optimizer_step_changed_weights",
          "reload_bitwise_equal")
LOSS = re.compile(r"^rank (\d+): loss (\S+), attention keys", re.M)


def _assert_checks(out: str, where: str) -> float:
    for name in CHECKS:
        lines = re.findall(rf"^check {name}: (\w+)$", out, re.M)
        assert lines == ["True"], f"{where}: check {name}: {lines}\n{out[-3000:]}"
    (_, loss), = LOSS.findall(out)
    assert math.isfinite(float(loss)), out[-3000:]
    return float(loss)


@pytest.fixture(scope="module")
def single_process_loss():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=REPO_ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "tp_rank=0/1" in res.stdout, res.stdout
    return _assert_checks(res.stdout, "one process")


def test_fleet_decoder_block_one_process(single_process_loss):
    assert single_process_loss > 0


@pytest.mark.multicard
def test_fleet_decoder_block_mp2_matches_one_process(single_process_loss, tmp_path):
    res = launch_ranks(str(EXAMPLE), 2, timeout=300, capture=True, log_dir=str(tmp_path))
    logs = {r: (tmp_path / f"workerlog.{r}").read_text(errors="replace") for r in (0, 1)}
    assert not res.timed_out and res.returncode == 0, res.output[-2000:] + logs[0][-3000:]
    for r, out in logs.items():
        assert f"tp_rank={r}/2" in out, out[-3000:]
        loss = _assert_checks(out, f"rank {r}")
        # Only the fp32 summation order differs (heads split over two ranks, one all-reduce).
        assert loss == pytest.approx(single_process_loss, rel=1e-6), (r, loss)
