"""Start a script on N local ranks with ``python -m paddle.distributed.launch``, with a timeout.

Used by ``tools/train_step.py --nproc`` and the multi-card tests. A broken gloo rendezvous hangs
instead of failing (Paddle 3.3.1 CPU wheel), so every run has a hard timeout, and on
timeout the ranks must really end: Paddle's launcher starts each rank in a process group of its
own, so killing the launcher's group alone leaves them running. The launcher does stop its ranks
on SIGTERM, so a timeout sends SIGTERM first; if it has not exited after a grace period, the
launcher's group and every rank found under it beforehand get SIGKILL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["LaunchResult", "free_port", "launch_ranks"]

_SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class LaunchResult:
    returncode: int  # the launcher's exit status; 124 on timeout (as coreutils' timeout)
    timed_out: bool
    output: str | None  # launcher stdout+stderr when captured, else None
    log_dir: str  # holds workerlog.N, one per rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(script: str, nproc: int, args=(), *, timeout: float, devices=None,
                 capture: bool = False, log_prefix: str = "paddle_launch_",
                 grace: float = 15.0) -> LaunchResult:
    """Run ``script args`` on ``nproc`` local ranks and wait at most ``timeout`` seconds.

    Args:
        script: path of the Python script each rank runs.
        nproc: number of ranks (>= 1).
        args: extra command-line arguments for the script.
        timeout: seconds before the run is stopped (SIGTERM, then SIGKILL after ``grace``).
        devices: GPU ids for ``--devices`` (None: let Paddle choose; on CPU builds it uses gloo).
        capture: capture the launcher's own output into ``LaunchResult.output``.

    The ranks get ``PYTHONPATH`` with this package's ``src`` folder first, a fresh rendezvous
    port and their own log directory.

    Raises:
        ValueError: ``nproc`` < 1 or ``timeout`` <= 0.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc: expected an int >= 1, got {nproc!r}")
    if not timeout > 0:
        raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
    log_dir = tempfile.mkdtemp(prefix=log_prefix)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
           "--master", f"127.0.0.1:{free_port()}", "--log_dir", log_dir]
    if devices is not None:
        cmd += ["--devices", ",".join(str(d) for d in devices)]
    cmd += [script, *map(str, args)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, env.get("PYTHONPATH")) if p)
    pipe = subprocess.PIPE if capture else None
    # Own session, so that stopping it reaches nothing of the caller's.
    proc = subprocess.Popen(cmd, env=env, stdout=pipe, stderr=subprocess.STDOUT if capture else None,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return LaunchResult(proc.returncode, False, out, log_dir)
    except subprocess.TimeoutExpired:
        pass
    return LaunchResult(124, True, _stop(proc, grace), log_dir)


def _stop(proc: subprocess.Popen, grace: float):
    """End ``proc`` (a session leader) and everything it started; returns its remaining output."""
    ranks = _descendants(proc.pid)  # before the launcher can exit and orphan them
    os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its ranks on SIGTERM
    try:
        out, _ = proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        # A launcher that ignored SIGTERM leaves its ranks (own sessions, maybe holding the
        # output pipe open): end them directly before reading the rest of the output.
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        out, _ = proc.communicate()
    return out


def _descendants(root: int) -> list:
    """Pids of every live descendant of ``root`` (from /proc; empty where there is none)."""
    children: dict = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
