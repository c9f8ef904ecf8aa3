"""Run a script on N local ranks with ``python -m paddle.distributed.launch`` (CPU: gloo).

Each run gets a fresh free port for the rendezvous, its own log directory under the system
temp dir, ``PYTHONPATH`` with the repository's ``src`` prepended, and a hard timeout: a broken
gloo rendezvous hangs instead of failing, so a hung run is killed (its whole process group,
which this module started) and reported with the tail of every rank's log.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(REPO, "src")


class LaunchError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tails(log_dir: str, nchars: int = 3000) -> str:
    parts = []
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
        if name.startswith("workerlog"):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                parts.append(f"--- {name} ---\n{f.read()[-nchars:]}")
    return "\n".join(parts) or "(no worker logs)"


def launch(script: str, nproc: int, args=(), timeout: float = 120.0) -> str:
    """Run ``script args`` on ``nproc`` ranks; returns the log directory.

    Raises:
        LaunchError: non-zero exit or timeout, with the launcher output and worker log tails.
    """
    log_dir = tempfile.mkdtemp(prefix=f"tp_launch_{nproc}_")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable, "-m", "paddle.distributed.launch",
        "--nproc_per_node", str(nproc),
        "--master", f"127.0.0.1:{free_port()}",
        "--log_dir", log_dir,
        script, *map(str, args),
    ]
    # Own session so a hang can be ended by killing exactly this launcher and its ranks.
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise LaunchError(
            f"{nproc}-rank run of {os.path.basename(script)} timed out after {timeout:.0f} s "
            f"(hung rendezvous?)\n{out[-2000:]}\n{_log_tails(log_dir)}"
        ) from None
    if proc.returncode != 0:
        raise LaunchError(
            f"{nproc}-rank run of {os.path.basename(script)} exited with {proc.returncode}\n"
            f"{out[-2000:]}\n{_log_tails(log_dir)}"
        )
    return log_dir
