"""Shared test helpers.

Import them from any test file (``pytest.ini`` puts ``tests/`` on ``sys.path``)::

    from conftest import REPO_ROOT, rel_l2, requires_cuda, cuda_available

* ``REPO_ROOT``: the checkout's root (a ``pathlib.Path``).
* ``rel_l2(x, ref)``: relative L2 error ``||x - ref|| / ||ref||`` of two tensors or arrays (Paddle,
  PyTorch or numpy; compared in float64 on the host).  The guide's error measure.
* ``requires_cuda``: a ``skipif`` marker for tests that need a CUDA device through PyTorch (the
  GPU host); it never fails when torch is not installed (the Paddle CPU CI).
* Tests marked ``@pytest.mark.gpu`` are skipped the same way, with the same reason.
* Fixture ``rng``: a ``numpy.random.Generator`` seeded from the test's node id and
  ``$PFTO_TEST_SEED`` (default 0), so each test gets its own fresh random inputs, reproducible
  run to run; set ``PFTO_TEST_SEED`` to draw different ones.  The seed is printed on failure.
* ``run_until_signalled(script, args, marker, sig)``: run a script in a process group of its own
  and send it ``sig`` (as a terminal's Ctrl-C does) once ``marker`` shows on its stdout.
* ``TILELANG_CACHE_DIR`` defaults to ``<repo>/.tilelang-cache`` (git-ignored) so that tests never
  write to the home directory.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TILELANG_CACHE_DIR", str(REPO_ROOT / ".tilelang-cache"))


def _to_float64(x) -> np.ndarray:
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return np.asarray(x, dtype=np.float64)
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        return x.detach().to("cpu").double().numpy()
    if mod.startswith("paddle"):
        # bf16 has no numpy dtype (.numpy() gives uint16), so widen inside Paddle first.
        return x.detach().astype("float64").numpy()
    return np.asarray(x, dtype=np.float64)


def rel_l2(x, ref) -> float:
    """``||x - ref||_2 / ||ref||_2`` in float64; ``inf`` if any non-finite entries differ.

    ``-inf``/``inf`` entries must sit at the same places with the same sign (they are then
    excluded); NaN anywhere gives ``inf`` so that a NaN result can never pass a tolerance.
    """
    a, b = _to_float64(x), _to_float64(ref)
    if a.shape != b.shape:
        raise ValueError(f"rel_l2: shapes differ, got {a.shape} and reference {b.shape}")
    if np.isnan(a).any() or np.isnan(b).any():
        return float("inf")
    fa, fb = np.isfinite(a), np.isfinite(b)
    if (fa != fb).any() or (a[~fa] != b[~fb]).any():
        return float("inf")
    num = np.linalg.norm(a[fa] - b[fa])
    den = np.linalg.norm(b[fb])
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(num / den)


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """True when PyTorch is installed and sees a CUDA device (never raises)."""
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken torch install means no usable CUDA, not a test error
        return False


_NO_CUDA = "needs a CUDA device through PyTorch (torch missing or no GPU visible)"

requires_cuda = pytest.mark.skipif(not cuda_available(), reason=_NO_CUDA)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=_NO_CUDA)
    for item in items:
        if item.get_closest_marker("gpu") is not None and not cuda_available():
            item.add_marker(skip)


def _base_seed() -> int:
    return int(os.environ.get("PFTO_TEST_SEED", "0"))


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random generator per test, seeded from the node id and ``$PFTO_TEST_SEED``."""
    seed = zlib.crc32(request.node.nodeid.encode()) ^ _base_seed()
    request.node.user_properties.append(("rng_seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "rng_seed":
                report.sections.append(("rng", f"rng seed {value} (PFTO_TEST_SEED={_base_seed()})"))


def run_until_signalled(script, args, marker: str, sig, timeout: float = 120):
    """Start ``python script args`` in a process group of its own and send ``sig`` to the whole
    group (as a terminal's Ctrl-C does) once ``marker`` is on its stdout.

    Returns ``(returncode, stdout, stderr, seconds from the signal to the exit, the processes it
    had started)`` (``psutil.Process`` objects, to check that none outlives it).
    """
    import psutil

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src"))
    proc = subprocess.Popen([sys.executable, str(script), *args], text=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out, err = [], []
    readers = [threading.Thread(target=lambda f=f, acc=acc: acc.extend(f), daemon=True)
               for f, acc in ((proc.stdout, out), (proc.stderr, err))]
    for r in readers:
        r.start()
    try:
        deadline = time.monotonic() + timeout
        while not any(marker in ln for ln in out) and time.monotonic() < deadline:
            assert proc.poll() is None, "".join(out + err)
            time.sleep(0.2)
        assert any(marker in ln for ln in out), "".join(out + err)
        started = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.monotonic()
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    for r in readers:
        r.join(10)
    proc.stdout.close()
    proc.stderr.close()
    return proc.returncode, "".join(out), "".join(err), seconds, started
