"""tools/train_step.py --nproc N prints the same losses and gradient norms as one process
(the script re-launches itself with paddle.distributed.launch; shard norms are combined)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("paddle")  # the ranks run Paddle; the torch-only GPU env skips this

from conftest import REPO_ROOT

pytestmark = pytest.mark.multicard

ARGS = ["--config", "deepseek_v32_small", "--steps", "2", "--seq-len", "128", "--no-progress"]
LINES = re.compile(r"(step \d+: loss \S+\s+grad_norm \S+|  grad norms: .*)")
FLOAT = re.compile(r"[-+]?\d+\.\d+(?:e[-+]\d+)?|nan|inf")


def _run(*extra):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src"))
    # train_step.py kills its own launcher after --timeout; the outer timeout is a backstop.
    res = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "train_step.py"), *ARGS, *extra],
        capture_output=True, text=True, timeout=150, env=env,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = LINES.findall(res.stdout)
    # Printed with 5 significant digits; TP only changes the summation order (~1e-7).
    return lines, [float(v) for line in lines for v in FLOAT.findall(line)]


@pytest.mark.parametrize(
    "extra,nproc",
    [((), 4), (("--doc-lens", "30,2,0,96"), 2)],  # packed documents: cu_seqlens through TP
    ids=["unpacked-tp4", "packed-tp2"],
)
def test_train_step_tensor_parallel_matches_single_process(extra, nproc):
    lines, single = _run(*extra)
    assert len(lines) == 4 and len(single) == 2 * (2 + 9), lines  # 2 steps: loss, total, 9 params
    tp_lines, tp = _run(*extra, "--nproc", str(nproc), "--timeout", "120")
    assert len(tp) == len(single), tp_lines
    assert tp == pytest.approx(single, rel=1e-3), "\n".join(tp_lines + lines)
