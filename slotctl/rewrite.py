"""A slot file rewritten from its parse (strip-draft, convert): a plan of pieces written atomically.

A piece is a :class:`~slotctl.format.common.Span` of the file as it was parsed (copied from the parse's own
stream, never reopened by name), new bytes, or a piece the caller writes itself (convert's re-encoded rows).
The file must still be the one that was parsed (:meth:`slotctl.slotfile.SlotFile.changed`) before the copy
and after it, before anything is replaced: else :class:`SourceChanged`, and nothing is written
(docs/design.md, "Races with writers").
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Union

from slotctl.atomic import atomic_writer, copy_range
from slotctl.errors import ExitStatus, SlotctlError
from slotctl.format.common import Span
from slotctl.progress import Progress
from slotctl.slotfile import SlotFile

Piece = Union[Span, bytes]


class SourceChanged(SlotctlError):
    """The file changed between the parse and the end of the copy; it is left as it now is."""

    exit_status = ExitStatus.FAILED


def check_unchanged(sf: SlotFile, after: str) -> None:
    """:class:`SourceChanged` when ``sf`` is no longer the file that was parsed; ``after``: what the message
    says follows (``nothing was written``)."""
    why = sf.changed()
    if why is not None:
        raise SourceChanged(f"{sf.path}: the file changed since it was read ({why}); {after}")


def piece_size(p: Any) -> int:
    """The bytes a piece writes: new bytes' length, else its ``size`` (a span, convert's re-encoded rows)."""
    return len(p) if isinstance(p, (bytes, bytearray)) else p.size


def write_pieces(sf: SlotFile, pieces: Iterable[Any], dest: str | os.PathLike, *, overwrite: bool,
                 follow_symlinks: bool = False, progress: Progress | None = None,
                 write_other: Callable[[Any, Any, Any, Callable[[int], None]], None] | None = None,
                 before_replace: Callable[[Any], None] | None = None, changed: str = "nothing was written") -> None:
    """Write ``pieces`` in order to ``dest`` atomically (:func:`~slotctl.atomic.atomic_writer`), reading spans
    from ``sf``'s stream. ``write_other(src, dst, piece, tick)`` writes a piece that is neither a span nor
    bytes; ``before_replace(dst)`` checks the written temporary file last. ``progress(bytes written, 0)``
    follows the copy. :class:`SourceChanged` (``changed``: the words after it) when the file is not the one
    parsed, before or after the copy: nothing is replaced."""
    src = sf.stream
    check_unchanged(sf, changed)
    done = 0

    def tick(n: int) -> None:
        if progress:
            progress(done + n)

    with atomic_writer(dest, overwrite=overwrite, follow_symlinks=follow_symlinks) as dst:
        for p in pieces:
            if isinstance(p, Span):
                copy_range(src, dst, p.offset, p.size, progress=tick)
            elif isinstance(p, (bytes, bytearray)):
                dst.write(p)
            else:
                write_other(src, dst, p, tick)
            done += piece_size(p)
            tick(0)
        check_unchanged(sf, changed)
        if before_replace is not None:
            before_replace(dst)
