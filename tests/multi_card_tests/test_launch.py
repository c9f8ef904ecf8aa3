"""The rank launcher's timeout really ends the ranks (regression: ranks outlived a killed launcher).

Paddle's launcher puts each rank in a process group of its own, so killing the launcher's group
left the ranks running with parent pid 1; a hung gloo rendezvous would then never end.
"""

import os
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("paddle")  # the ranks run Paddle; the torch-only GPU env skips this

from paddlefleet.tilelang_ops.launch import launch_ranks

pytestmark = pytest.mark.multicard

_HANG = """
import sys, time
import paddle.distributed as dist
dist.init_parallel_env()
print("rank up", flush=True)
time.sleep(3600)
"""


def _processes_running(marker: str) -> list:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append((int(pid), cmd))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_timeout_ends_every_rank(tmp_path):
    script = tmp_path / f"hang_{os.getpid()}.py"
    script.write_text(_HANG)
    t0 = time.monotonic()
    res = launch_ranks(str(script), 2, timeout=20, capture=True)
    assert res.timed_out and res.returncode == 124
    assert time.monotonic() - t0 < 60
    # The ranks had started (so there was something to end) ...
    logs = "".join(p.read_text(errors="replace")
                   for p in sorted(Path(res.log_dir).glob("workerlog.*")))
    assert logs.count("rank up") == 2, logs[-2000:]
    # ... and none is left.
    deadline = time.monotonic() + 10
    while _processes_running(script.name) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_running(script.name) == []


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stop_ends_a_launcher_that_ignores_sigterm():
    """The SIGKILL fallback: a 'launcher' that ignores SIGTERM, with a child in a session of its
    own (as Paddle starts its ranks) that ignores it too; both must be gone afterwards."""
    import subprocess

    from paddlefleet.tilelang_ops import launch

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
