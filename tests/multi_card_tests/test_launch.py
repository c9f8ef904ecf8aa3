"""The rank launcher's timeout, and Ctrl-C / SIGTERM to its caller, really end the ranks.

Regressions: Paddle's launcher puts each rank in a process group of its own, so killing the
launcher's group left the ranks running with parent pid 1 (a hung gloo rendezvous would then
never end); and the launcher runs in a session of its own, so a Ctrl-C that ended the caller
left the launcher and its ranks running.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("paddle")  # the ranks run Paddle; the torch-only GPU env skips this

from helpers import REPO_ROOT  # noqa: E402
from launch import CONSOLE_ENV, launch_ranks  # noqa: E402  (tools/launch.py)

pytestmark = pytest.mark.multicard

_HANG = """
import sys, time
import paddle.distributed as dist
dist.init_parallel_env()
print("rank up", flush=True)
time.sleep(3600)
"""


def _processes_running(marker: str) -> list:
    """``(pid, command line)`` of every live process whose command line contains ``marker``."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if marker in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append((p.info["pid"], cmd))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, signals")
def test_timeout_ends_every_rank(tmp_path):
    """The timeout ends ranks that are up (past the gloo rendezvous, hanging).  On a busy
    machine two ranks may not be up within a short timeout (seen at load ~13 with 20 s): then
    that attempt proves nothing about ending them, and the test tries again with twice the
    timeout, so its assertions hold for what happened, whatever the load.  Every attempt must
    end within its timeout plus the launcher's SIGTERM grace and leave no rank behind."""
    script = tmp_path / f"hang_{os.getpid()}.py"
    script.write_text(_HANG)
    grace = 15.0
    for timeout in (20, 40, 80, 160):
        t0 = time.monotonic()
        res = launch_ranks(str(script), 2, timeout=timeout, capture=True, grace=grace)
        elapsed = time.monotonic() - t0
        assert res.timed_out and res.returncode == 124
        # SIGTERM at the timeout; the launcher's _stop waits at most three graces (the
        # launcher, its ranks, their SIGKILL); slack for a loaded machine
        assert elapsed < timeout + 3 * grace + 15, elapsed
        # none is left, whether or not the ranks were up ...
        deadline = time.monotonic() + 10
        while _processes_running(script.name) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _processes_running(script.name) == []
        logs = "".join(p.read_text(errors="replace")
                       for p in sorted(Path(res.log_dir).glob("workerlog.*")))
        if logs.count("rank up") == 2:
            break  # ... and this time the ranks had started (there was something to end)
    assert logs.count("rank up") == 2, (
        f"the 2 ranks were not up within a {timeout} s timeout: {logs[-2000:]}")


def test_exit_status_is_the_launchers(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    res = launch_ranks(str(script), 2, timeout=60, capture=True)
    assert not res.timed_out and res.returncode != 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(nproc=0, timeout=1), "nproc"),
    (dict(nproc=2, timeout=0), "timeout"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch_ranks("x.py", kwargs["nproc"], timeout=kwargs["timeout"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, signals")
def test_stop_ends_a_launcher_that_ignores_sigterm():
    """The SIGKILL fallback: a 'launcher' that ignores SIGTERM, with a child in a session of its
    own (as Paddle starts its ranks) that ignores it too; both must be gone afterwards."""
    import subprocess

    import launch

    marker = f"{3000 + os.getpid() % 1000}"  # unique sleep length to find the children by

    def sleepers():
        return [p for p in _processes_running(f"sleep {marker}") if p[1].startswith("sleep")]

    proc = subprocess.Popen(
        ["bash", "-c", f"trap '' TERM; setsid sleep {marker} & sleep {marker}; wait"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while len(sleepers()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(sleepers()) == 2
    launch._stop(proc, grace=1.0)
    assert proc.returncode is not None
    deadline = time.monotonic() + 10
    while sleepers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sleepers() == []


# A rank that says it is up on the launch console, then waits to be stopped.
_UP_AND_WAIT = f"""
import os, time
with open(os.environ["{CONSOLE_ENV}"], "a") as f:
    f.write("rank up " + os.environ["PADDLE_TRAINER_ID"] + "\\n")
time.sleep(3600)
"""

# The caller: launches two ranks with the console, reports how the launch ended.
_CALLER = """
import sys
from launch import LaunchInterrupted, launch_ranks
try:
    launch_ranks(sys.argv[1], 2, timeout=300, console=True)
except LaunchInterrupted as e:
    print("interrupted by", e.signum.name, "logs", e.log_dir, flush=True)
    sys.exit(3)
print("not interrupted", flush=True)
"""


class _Output:
    """Collects a process's stdout in a thread (the test waits for lines while it runs)."""

    def __init__(self, proc):
        self.lines = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True)
        self._thread.start()

    def wait_for(self, *texts, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(any(t in ln for ln in self.lines) for t in texts):
                return True
            time.sleep(0.2)
        return False

    def text(self, timeout: float = 30) -> str:
        self._thread.join(timeout)
        return "".join(self.lines)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, signals")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_caller_ends_every_rank(tmp_path, sig):
    """Ctrl-C (SIGINT) or SIGTERM to the launching process: the launcher lives in a session of
    its own and never sees the terminal's SIGINT, so the caller must stop it and its ranks
    (regression: they kept running, and printing, after the caller died of the
    KeyboardInterrupt).  What the ranks write to the console reaches the caller's stdout."""
    script = tmp_path / f"up_{os.getpid()}_{int(sig)}.py"
    script.write_text(_UP_AND_WAIT)
    proc = subprocess.Popen([sys.executable, "-c", _CALLER, str(script)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                str(REPO_ROOT / d) for d in ("src", "tools"))))
    output = _Output(proc)
    try:
        # The ranks' console lines reach the caller's stdout while they run.
        assert output.wait_for("rank up 0", "rank up 1", timeout=120), output.lines
        started = psutil.Process(proc.pid).children(recursive=True)
        assert len(started) == 3, started  # the launcher and two ranks
        t0 = time.monotonic()
        os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C: the caller's whole process group
        proc.wait(timeout=60)
        assert time.monotonic() - t0 < 20
    finally:
        if proc.poll() is None:
            proc.kill()
    out = output.text()
    proc.stdout.close()
    assert proc.returncode == 3, out
    assert f"interrupted by {sig.name} logs " in out, out
    log_dir = out.split(" logs ", 1)[1].split()[0]
    assert "LAUNCH INFO" in Path(log_dir, "launcher.log").read_text()  # not on the terminal
    assert "LAUNCH" not in out
    assert _processes_running(script.name) == []
    assert not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
