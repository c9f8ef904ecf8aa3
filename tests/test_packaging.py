"""Packaging and the install story: Paddle is an extra, so a CUDA install keeps its Paddle."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

import setuptools

from helpers import REPO_ROOT


def _setup_kwargs(monkeypatch) -> dict:
    got = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: got.update(kw))
    monkeypatch.chdir(REPO_ROOT)  # setup.py reads README.md from the working directory
    runpy.run_path(str(REPO_ROOT / "setup.py"))
    return got


def test_paddle_is_an_extra_not_a_requirement(monkeypatch):
    """`pip install -e .` on a CUDA machine must not pull the CPU paddlepaddle over an
    installed paddlepaddle-gpu (same `paddle` package, two distributions)."""
    kw = _setup_kwargs(monkeypatch)
    names = [r.split(">")[0].split("=")[0].strip() for r in kw["install_requires"]]
    assert not [n for n in names if n.startswith("paddlepaddle")], kw["install_requires"]
    assert {"tilelang-paddle", "numpy", "tqdm", "psutil"} <= set(names)
    assert kw["extras_require"]["cpu"] == ["paddlepaddle>=3.3"]


def test_readme_and_ci_install_the_cpu_extra():
    readme = (REPO_ROOT / "README.md").read_text()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[cpu,test]"' in readme and 'pip install -e ".[cpu,test]"' in ci
    # the CUDA story: Paddle's GPU build first, then the package without the cpu extra
    gpu = readme.split("## Installing on a CUDA machine", 1)[1].split("\n## ", 1)[0]
    assert "paddlepaddle-gpu" in gpu and 'pip install -e ".[test]"' in gpu
    assert "--index-url https://download.pytorch.org/whl/cpu" in gpu  # torch: the CPU wheel


def test_train_step_without_paddle_says_what_to_install(tmp_path):
    fake = tmp_path / "paddle"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'paddle'\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO_ROOT / "src")]))
    res = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "train_step.py")],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 1
    assert res.stderr.startswith("error: Paddle is not installed"), res.stderr
    assert 'pip install -e ".[cpu]"' in res.stderr and "paddlepaddle-gpu" in res.stderr
    assert "Traceback" not in res.stderr


def test_kernel_compile_tests_skip_without_tilelang():
    """On a machine without TileLang the compile tests skip instead of failing to collect (the
    cubin test's ids once assumed the kernel specialisations were listed, which they are only
    with TileLang: a collection error, found while splitting the GPU suite's CPU tests)."""
    code = "\n".join([
        "import importlib.metadata as md, sys",
        "real = md.version",
        "def version(dist):",
        "    if dist in ('tilelang', 'tilelang-paddle'):",
        "        raise md.PackageNotFoundError(dist)",
        "    return real(dist)",
        "md.version = version",
        "import pytest",
        "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider',",
        "                      'tests/test_kernel_compile.py']))",
    ])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "skipped" in res.stdout and "passed" not in res.stdout, res.stdout[-2000:]
    # -rs lists each skip with its reason: every one is the module's, none another's
    reasons = [line for line in res.stdout.splitlines() if line.startswith("SKIPPED")]
    assert reasons and all(line.endswith(": TileLang is not installed") for line in reasons), (
        res.stdout[-2000:])
