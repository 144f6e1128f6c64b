"""The progress callback every long step takes: ``progress(done, total)``.

Steps that evaluate tokens (the runtime) or copy bytes (strip-draft, convert) call it as they go; the CLI
turns the calls into a rich progress bar on a terminal and nothing on a pipe. One type, written once.
"""

from __future__ import annotations

from typing import Callable

#: ``progress(done so far, total)``: tokens evaluated or bytes written, in the step's own unit
Progress = Callable[[int, int], None]
