"""Start a script on N local ranks with ``python -m paddle.distributed.launch``, with a timeout.

Used by ``tools/train_step.py --nproc`` and the multi-card tests (a tool, not part of the
package: import it with ``tools/`` on ``sys.path``, as ``pytest.ini`` and ``train_step.py`` do). A broken gloo rendezvous hangs
instead of failing (Paddle 3.3.1 CPU wheel), so every run has a hard timeout, and on
timeout the ranks must really end: Paddle's launcher starts each rank in a process group of its
own, so killing the launcher's group alone leaves them running. The launcher does stop its ranks
on SIGTERM, so a timeout sends SIGTERM first; if it has not exited after a grace period, the
launcher's group and every rank found under it beforehand get SIGKILL.

The launcher runs in a session of its own, so Ctrl-C in a terminal (SIGINT to the foreground
process group) reaches only the calling process.  :func:`launch_ranks` therefore stops the ranks
itself when SIGINT or SIGTERM interrupts it, the same way as on timeout, and then raises
:class:`LaunchInterrupted`.

With ``console=True`` the terminal shows only what the ranks choose to print: the launcher's own
output (its INFO lines and its copy of rank 0's log, Paddle's warnings included) goes to
``launcher.log`` in the log directory, and whatever a rank writes to the file named by
``$PADDLEFLEET_CONSOLE`` is copied to this process's stdout as it arrives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import psutil

__all__ = [
    "CONSOLE_ENV",
    "LaunchInterrupted",
    "LaunchResult",
    "Terminated",
    "StopSignals",
    "free_port",
    "launch_ranks",
]

# the checkout's src/, put on the ranks' PYTHONPATH (this file is <checkout>/tools/launch.py)
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

#: Environment variable that gives the ranks of a ``console=True`` launch the path of the file
#: whose content the caller copies to its stdout.
CONSOLE_ENV = "PADDLEFLEET_CONSOLE"

# How often the console file is copied while the ranks run (seconds).
_CONSOLE_POLL_S = 0.2


@dataclass
class LaunchResult:
    returncode: int  # the launcher's exit status; 124 on timeout (as coreutils' timeout)
    timed_out: bool
    output: str | None  # launcher stdout+stderr when captured, else None
    log_dir: str  # holds workerlog.N, one per rank (and launcher.log with console=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM turned into an exception by :class:`StopSignals`, so that it unwinds (and cleans
    up) like Ctrl-C; a ``KeyboardInterrupt``, so code that handles Ctrl-C handles it."""


class LaunchInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the caller of :func:`launch_ranks` while its ranks ran; the
    launcher and every rank have been stopped.

    Attributes:
        signum: ``signal.SIGINT`` or ``signal.SIGTERM``.
        log_dir: the run's log directory (``workerlog.N``, one per rank).
    """

    def __init__(self, signum: int, log_dir: str):
        super().__init__(f"interrupted by {signal.Signals(signum).name}; ranks stopped")
        self.signum = signum
        self.log_dir = log_dir


class StopSignals:
    """While active (``with StopSignals() as stop:``), SIGINT raises ``KeyboardInterrupt`` and
    SIGTERM :class:`Terminated` in the main thread, and ``stop.received`` lists the signals
    received, in order.  Elsewhere than in the main thread it does nothing (Python delivers
    signals to the main thread only).

    ``received`` tells that the block was interrupted, and by which signal, even where a library
    caught the exception and raised another one.  Inside ``stop.deferred()`` a first signal is
    only recorded and raised when that block ends (a second one raises at once): for code that
    must not be cut in the middle, such as Paddle's ``loss.backward()``, which turns an exception
    inside a PyLayer's backward into an ``OSError`` and prints a glog warning.

    ``on_deferred(signum)``, when given, is called at once (from the signal handler, in the main
    thread) when a first signal is deferred: to tell the user that the stop waits for the end
    of the block and that a second signal stops at once.
    """

    def __init__(self, on_deferred=None):
        self.received: list = []
        self._on_deferred = on_deferred
        self._previous: dict = {}
        self._depth = 0
        self._pending = None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle)
                              for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    @contextlib.contextmanager
    def deferred(self):
        """A first signal inside the block is raised when the block ends; a second at once."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self._pending is not None:
            signum, self._pending = self._pending, None
            self._raise(signum)

    def _handle(self, signum, frame) -> None:
        signum = signal.Signals(signum)
        self.received.append(signum)
        if self._depth and self._pending is None:
            self._pending = signum
            if self._on_deferred is not None:
                self._on_deferred(signum)
            return
        self._raise(signum)

    @staticmethod
    def _raise(signum) -> None:
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager
def _signals_ignored():
    """SIGINT and SIGTERM ignored (main thread only): a second Ctrl-C must not cut the clean-up
    short and leave ranks behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(script: str, nproc: int, args=(), *, timeout: float, devices=None,
                 capture: bool = False, console: bool = False, log_dir: str | None = None,
                 log_prefix: str = "paddle_launch_", grace: float = 15.0) -> LaunchResult:
    """Run ``script args`` on ``nproc`` local ranks and wait at most ``timeout`` seconds.

    Args:
        script: path of the Python script each rank runs.
        nproc: number of ranks (>= 1).
        args: extra command-line arguments for the script.
        timeout: seconds before the run is stopped (SIGTERM, then SIGKILL after ``grace``).
        devices: GPU ids for ``--devices`` (None: let Paddle choose; on CPU builds it uses gloo).
        capture: capture the launcher's own output into ``LaunchResult.output``.
        console: keep the launcher's output off the terminal (in ``log_dir/launcher.log``
            unless captured) and copy to stdout what the ranks write to the file named by
            ``$PADDLEFLEET_CONSOLE`` (:data:`CONSOLE_ENV`).
        log_dir: directory for the rank logs; default a new ``log_prefix*`` temporary one.

    The ranks get ``PYTHONPATH`` with this package's ``src`` folder first and a fresh
    rendezvous port.

    Raises:
        ValueError: ``nproc`` < 1 or ``timeout`` <= 0.
        LaunchInterrupted: SIGINT (Ctrl-C) or SIGTERM arrived while the ranks ran; they were
            stopped (SIGTERM to the launcher, SIGKILL after ``grace``) before it is raised.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc: expected an int >= 1, got {nproc!r}")
    if not timeout > 0:
        raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
    log_dir = log_dir or tempfile.mkdtemp(prefix=log_prefix)
    os.makedirs(log_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
           "--master", f"127.0.0.1:{free_port()}", "--log_dir", log_dir]
    if devices is not None:
        cmd += ["--devices", ",".join(str(d) for d in devices)]
    cmd += [script, *map(str, args)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, env.get("PYTHONPATH")) if p)
    console_path = None
    with contextlib.ExitStack() as files:
        if capture:
            out = subprocess.PIPE
        elif console:
            out = files.enter_context(open(os.path.join(log_dir, "launcher.log"), "w"))
        else:
            out = None
        if console:
            console_path = os.path.join(log_dir, "console.log")
            open(console_path, "w").close()
            env[CONSOLE_ENV] = console_path
        copier = None
        if console_path:
            copier = _ConsoleCopier(files.enter_context(
                open(console_path, encoding="utf-8", errors="replace", newline="")))
        proc = None
        with StopSignals():
            try:
                # Own session, so that stopping it reaches nothing of the caller's.
                proc = subprocess.Popen(cmd, env=env, stdout=out,
                                        stderr=subprocess.STDOUT if out is not None else None,
                                        text=True, start_new_session=True)
                output = _wait(proc, timeout, copier)
                return LaunchResult(proc.returncode, False, output, log_dir)
            except subprocess.TimeoutExpired:
                interrupted = None
            except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
                if proc is None:  # nothing started yet
                    raise
                interrupted = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        with _signals_ignored():
            output = _stop(proc, grace)
            if copier:
                copier.copy()
        if interrupted is not None:
            raise LaunchInterrupted(interrupted, log_dir) from None
        return LaunchResult(124, True, output, log_dir)


class _ConsoleCopier:
    """Copies what has been appended to a text file (open for reading) since the last call to
    stdout."""

    def __init__(self, file):
        self._file = file

    def copy(self) -> None:
        text = self._file.read()
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()


def _wait(proc: subprocess.Popen, timeout: float, copier: _ConsoleCopier | None):
    """Wait for ``proc`` up to ``timeout`` s, copying the console meanwhile; returns its
    captured output (None when not captured).  Raises ``subprocess.TimeoutExpired``."""
    if copier is None:
        out, _ = proc.communicate(timeout=timeout)
        return out
    deadline = time.monotonic() + timeout
    while True:
        try:
            # communicate() may be called again after a timeout without losing output
            out, _ = proc.communicate(timeout=min(_CONSOLE_POLL_S,
                                                  max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            copier.copy()
            if time.monotonic() >= deadline:
                raise
            continue
        copier.copy()
        return out


def _stop(proc: subprocess.Popen, grace: float):
    """End ``proc`` (a session leader) and everything it started; returns its remaining output."""
    try:  # before the launcher can exit and orphan them
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its ranks on SIGTERM
    try:
        out, _ = proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        # A launcher that ignored SIGTERM leaves its ranks (own sessions, maybe holding the
        # output pipe open): end them directly before reading the rest of the output.
        _kill(ranks)
        out, _ = proc.communicate()
    # The launcher waits for its ranks on SIGTERM, but make sure: none may outlive the call.
    alive = _still_running(ranks, grace)
    _kill(alive)
    _still_running(alive, grace)
    return out


def _kill(processes) -> None:
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.kill()


def _still_running(processes, timeout: float) -> list:
    """The processes still running after waiting up to ``timeout`` s for them to end.  A zombie
    counts as ended (it runs nothing; its parent, not we, reaps it), which ``psutil.wait_procs``
    would wait for until the timeout."""

    def running(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    alive = [p for p in processes if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if running(p)]
    return alive
