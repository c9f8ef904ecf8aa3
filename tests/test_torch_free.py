"""torch is optional (README): tests whose subject needs no torch must pass without it.

The CI venv has torch installed for the PyTorch-path tests, so this runs test modules in a
subprocess in which ``import torch`` fails as if it were not installed (``sys.modules["torch"]
= None``: ``import torch`` raises ``ImportError`` and ``importlib.util.find_spec`` returns
``None``, what ``pytest.importorskip`` and ``helpers.FRAMEWORKS`` see).  ``.ci/run`` also
collects the whole suite before torch is installed, which catches module-level imports.
"""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import REPO_ROOT

#: Modules with tests of tools that import torch for their GPU work only (kernel_trial's
#: provider order was imported with a module-level ``import torch``, issue 41).
TORCH_FREE_MODULES = ("tests/test_bench_tools.py",)

_RUN_WITHOUT_TORCH = (
    "import sys; sys.modules['torch'] = None; import pytest; sys.exit(pytest.main(sys.argv[1:]))"
)


def test_modules_pass_without_torch():
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src"))
    res = subprocess.run(
        [sys.executable, "-c", _RUN_WITHOUT_TORCH, "-q", "-rs", "-p", "no:cacheprovider",
         *TORCH_FREE_MODULES],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    # torch really was missing there: its tests were skipped, not run
    assert "could not import 'torch'" in out, out[-4000:]
