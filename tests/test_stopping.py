"""A stop asked for by a signal handler (keep's SIGTERM): :class:`slotctl.unattended.stopping.StopFlag` ends the
loop that waits on it wherever in its wait the signal comes, where a ``threading.Event`` deadlocks."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: a loop waiting on a flag that SIGUSR1's handler sets; the signal sent at each line the wait runs in turn (a
#: trace function counts the lines of threading.py and stopping.py): the child prints "done" when every one of
#: those loops ended
CHILD = r"""
import os, signal, sys, threading
from slotctl.unattended import stopping

kind, most = sys.argv[1], int(sys.argv[2])
files = (threading.__file__, stopping.__file__)
for at in range(most):
    flag = stopping.StopFlag() if kind == "flag" else threading.Event()
    signal.signal(signal.SIGUSR1, lambda *a: flag.set())
    count = [0]

    def tracer(frame, event, arg):
        if frame.f_code.co_filename not in files:
            return None
        if event == "line":
            if count[0] == at:
                os.kill(os.getpid(), signal.SIGUSR1)
            count[0] += 1
        return tracer

    sys.settrace(tracer)
    while not flag.is_set():
        flag.wait(0.05)
    sys.settrace(None)
    print(at, count[0], flush=True)
print("done", flush=True)
"""


def run(kind: str, most: int = 40) -> tuple[bool, list[str]]:
    """Whether the child ended every loop within 15 s (about 1 s here), and its lines."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, kind, str(most)], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=15)
        return True, out.splitlines()
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return False, out.splitlines()


def test_a_stop_flag_set_by_a_signal_ends_the_wait_wherever_the_signal_comes():
    ended, lines = run("flag")
    assert ended and lines[-1] == "done", lines
    # each loop ended: the signal came at each of the first 40 lines run (past a whole wait of the flag's)
    assert [int(line.split()[0]) for line in lines[:-1]] == list(range(40)), lines


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="the deadlock is CPython's up to 3.13 at least")
def test_the_probe_finds_the_deadlock_of_a_threading_event():
    """The same loop on a threading.Event hangs: the handler's set() waits for the lock the interrupted wait
    holds (why keep's loop waits on a StopFlag)."""
    ended, lines = run("event")
    assert not ended, lines
    assert len(lines) < 40, lines       # it hung at a line of the wait, not at the end
