"""Run a test script on N local ranks (CPU: gloo) and turn failures into clear errors.

Launching itself is ``launch_ranks`` of ``tools/launch.py`` (fresh port, own log
directory, ``src`` on ``PYTHONPATH``, hard timeout that really ends the ranks); this module adds
the tail of every rank's log to the error, so a failing or hung run explains itself.
"""

from __future__ import annotations

import os

from launch import launch_ranks


class LaunchError(RuntimeError):
    pass


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
    res = launch_ranks(script, nproc, args, timeout=timeout, capture=True,
                       log_prefix=f"tp_launch_{nproc}_")
    name = os.path.basename(script)
    if res.timed_out:
        raise LaunchError(f"{nproc}-rank run of {name} timed out after {timeout:.0f} s "
                          f"(hung rendezvous?)\n{res.output[-2000:]}\n{_log_tails(res.log_dir)}")
    if res.returncode != 0:
        raise LaunchError(f"{nproc}-rank run of {name} exited with {res.returncode}\n"
                          f"{res.output[-2000:]}\n{_log_tails(res.log_dir)}")
    return res.log_dir
