"""A stop that a signal handler may ask for: keep's loop waits on it between its looks at the server.

``threading.Event`` cannot be set from a signal handler safely. The handler runs in the main thread, between
two bytecodes of whatever that thread was doing; when that was ``Event.wait`` on the same event (keep's loop
waits on it between two looks), the thread holds the event's lock, and ``Event.set`` in the handler waits for
that lock forever. Measured: a loop waiting on an event that SIGTERM's handler sets hung in 1 of 300 runs; in
CI a ``keep --every 0.2`` did not exit within 60 s of SIGTERM. :class:`StopFlag` takes no lock: a flag, and one
byte written into a pipe that its :meth:`~StopFlag.wait` selects on.
"""

from __future__ import annotations

import os
import select
import weakref


class StopFlag:
    """Set once, from anywhere (a signal handler, another thread); waited for with a timeout. Its pipe is closed
    by ``close()`` or when the flag is collected."""

    def __init__(self) -> None:
        self._set = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.close = weakref.finalize(self, _close, self._r, self._w)

    def set(self) -> None:
        self._set = True
        try:
            os.write(self._w, b"\0")
        except OSError:     # the pipe full (set many times over) or closed: the flag is what counts
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Until set, or ``timeout`` seconds (None: no limit); whether it is set. A signal whose handler sets it
        ends the wait at once (the select is retried after the handler, and finds the byte)."""
        if not self._set:
            try:
                select.select([self._r], [], [], timeout)
            except (OSError, ValueError):   # closed meanwhile
                pass
        return self._set



def _close(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
