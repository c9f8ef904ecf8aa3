"""tools/launch.py StopSignals: SIGINT / SIGTERM as exceptions, recorded, and deferrable (no Paddle)."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from launch import StopSignals, Terminated

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")


def _signal_self(sig) -> None:
    os.kill(os.getpid(), sig)  # the Python handler runs before the next bytecode of this thread


@pytest.mark.parametrize("sig, exc", [(signal.SIGINT, KeyboardInterrupt),
                                      (signal.SIGTERM, Terminated)])
def test_signal_raises_and_is_recorded(sig, exc):
    before = signal.getsignal(sig)
    with pytest.raises(exc), StopSignals() as stop:
        _signal_self(sig)
    assert stop.received == [sig]
    assert signal.getsignal(sig) is before  # restored


def test_deferred_block_finishes_before_the_signal_raises():
    """What train_step wraps around loss.backward(): Paddle turns an exception raised inside a
    PyLayer's backward into an OSError and prints a glog warning."""
    finished = []
    with pytest.raises(Terminated), StopSignals() as stop:
        with stop.deferred():
            _signal_self(signal.SIGTERM)
            finished.append("rest of the block")
        finished.append("after the block")  # never: the signal raises as the block ends
    assert finished == ["rest of the block"] and stop.received == [signal.SIGTERM]


def test_a_second_signal_inside_a_deferred_block_raises_at_once():
    finished = []
    with pytest.raises(KeyboardInterrupt), StopSignals() as stop:
        with stop.deferred():
            _signal_self(signal.SIGINT)
            finished.append("after the first")
            _signal_self(signal.SIGINT)
            finished.append("after the second")
    assert finished == ["after the first"]
    assert stop.received == [signal.SIGINT, signal.SIGINT]


def test_on_deferred_is_called_at_once_for_the_first_signal_only():
    """What train_step uses to say at once that a Ctrl-C waits for the backward (issue 42)."""
    events = []
    with pytest.raises(KeyboardInterrupt), StopSignals(on_deferred=events.append) as stop:
        with stop.deferred():
            _signal_self(signal.SIGINT)
            events.append("rest of the block")
            _signal_self(signal.SIGINT)  # raises at once: not announced
    assert events == [signal.SIGINT, "rest of the block"]
    with pytest.raises(KeyboardInterrupt), StopSignals(on_deferred=events.append):
        _signal_self(signal.SIGINT)  # outside a deferred block: raises, nothing to announce
    assert events == [signal.SIGINT, "rest of the block"]
