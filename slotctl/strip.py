"""Removing the draft state from slot files: the SDFT appendix, and optionally the draft and speculative
blobs inside each context checkpoint (``slotctl strip-draft``).

A strip is planned from the parse (:func:`plan_strip`): the new file is a list of pieces, each either a
byte range of the old file or a few bytes written here (the headers of a rebuilt SCKP appendix).

Two ways to write it (docs/strip-draft.md):

* **truncate** — when the new file is a prefix of the old one (the SDFT appendix is the last layer, the
  usual case) and the file is stripped in place: one ``ftruncate`` at the appendix's offset. O(1) in time
  and disk, and atomic in itself: a crash leaves the old length or the new one.
* **copy** — otherwise (``--checkpoints`` rewrites the middle, ``-o`` asks for a copy, bytes follow the
  appendix): every kept byte is copied from the old file in large chunks
  (:func:`~slotctl.atomic.copy_range`) into a new file that replaces the old one atomically
  (:func:`~slotctl.atomic.atomic_writer`). Rewriting only from the first changed byte is not crash-safe
  (a kill mid-write leaves neither file), so the copy is whole, and the free space it needs is checked
  before it starts.

A file without draft state is not rewritten. A file that does not parse cleanly is refused and left as it
was: what a strip keeps is known only from a complete parse. The one exception is damage confined to the
SDFT appendix (truncated, or a blob that does not parse): removing it is the repair, so the file is cut
where the appendix starts, and the result says what was damaged.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable

from slotctl.progress import Progress
from slotctl.atomic import check_destination
from slotctl.errors import ExitStatus, FormatError, SlotctlError, UsageError, error_entry
from slotctl.format import appendix as apx
from slotctl.format.common import Span, coalesce
from slotctl.format.memory import MemoryLayout
from slotctl.paths import DEFAULT_GRACE, being_written, check_readable
from slotctl.rewrite import Piece, SourceChanged, check_unchanged, write_pieces
from slotctl.slotfile import SlotFile, open_slot_file, stat_identity

#: what ``removed`` lists
REMOVED_SDFT = "SDFT"
REMOVED_CKPT_DRAFT = "checkpoint draft blobs"
REMOVED_CKPT_SPEC = "checkpoint speculative state"

#: ``method`` of a write
TRUNCATE = "truncate"
COPY = "copy"
#: free space kept in reserve beyond the new file's size before a copy starts
FREE_SPACE_MARGIN = 1 << 20

class StripStatus(StrEnum):
    """``status`` of a file: what strip-draft did with it. ``refused`` is slotctl's own refusal to change
    the file (it is damaged, or changed under the command), not a server's; ``unreadable``: the file could
    not be read at all (missing, not a regular file, no permission), nothing was done to it."""

    STRIPPED = "stripped"
    UNCHANGED = "unchanged"
    REFUSED = "refused"
    WOULD_STRIP = "would_strip"
    UNREADABLE = "unreadable"


STRIPPED, UNCHANGED, REFUSED, WOULD_STRIP, UNREADABLE = StripStatus

_EMPTY_BLOBS = apx.BlobLength.build(0) * 2    # draft blob length 0, speculative state length 0

#: what a refusal for a file changed since its parse says follows
_LEFT = "left as it is now, run again"


class BeingWritten(SlotctlError):
    """The file was modified within the grace period: a server may still be writing it; it is left alone."""

    exit_status = ExitStatus.FAILED


@dataclass(frozen=True)
class Plan:
    """How to write the stripped file: ``pieces`` in order (a :class:`Span` of the old file or bytes)."""

    path: str
    size_before: int
    removed: tuple[str, ...]
    pieces: tuple[Piece, ...]
    #: the file's identity when it was parsed (:attr:`slotctl.slotfile.SlotFile.identity`)
    identity: tuple
    #: bytes of checkpoint draft and speculative blobs that only ``--checkpoints`` removes (0 with it)
    checkpoint_draft_bytes: int = 0
    #: every byte of draft state in the file: the SDFT appendix and the checkpoints' draft and speculative blobs
    draft_size: int = 0
    #: the error of a damaged SDFT appendix that this strip removes (None for an intact file)
    repaired: str | None = None
    #: the file's names (hard links) when it was parsed; more than 1: cutting it in place changes them all
    links: int = 1
    #: the parsed file the plan was made from: the copy reads its stream, never the name
    parsed: SlotFile | None = field(default=None, compare=False, repr=False)

    @property
    def size_after(self) -> int:
        return sum(p.size if isinstance(p, Span) else len(p) for p in self.pieces)

    @property
    def is_prefix(self) -> bool:
        """Whether the new file is the old file's first ``size_after`` bytes (a truncation writes it)."""
        return len(self.pieces) == 1 and isinstance(self.pieces[0], Span) and self.pieces[0].offset == 0

    @property
    def changes(self) -> bool:
        return bool(self.removed)


def plan_strip(path: str | os.PathLike, *, checkpoints: bool = False, layout: MemoryLayout | None = None,
               draft_layout: MemoryLayout | None = None) -> Plan:
    """Parse ``path`` (with the layouts, when given) and plan its strip.

    Raises :class:`FormatError` when the file is refused: any layer that does not parse, except damage
    confined to the SDFT appendix, which the strip removes (``Plan.repaired`` says what it was).
    """
    path = os.fspath(path)
    sf = open_slot_file(path, layout=layout, draft_layout=draft_layout)
    identity = sf.identity
    damage = _sdft_damage(sf)
    if damage is None and (sf.errors or sf.target is None):
        raise sf.errors[0] if sf.errors else FormatError("target memory", sf.header_end,
                                                         "a memory payload of a known kind")
    return _plan(sf, identity, checkpoints, damage, links=os.stat(path).st_nlink)


def _sdft_damage(sf: SlotFile) -> tuple[int, str] | None:
    """(where the SDFT appendix starts, what is wrong with it) when it is the only damaged layer.

    Three shapes: the appendix does not parse (cut short, a bad version or length); it parses but its
    draft blob does not; the file ends inside its magic (1 to 3 bytes of ``SDFT`` where an appendix may
    start: a server ignores them, and they are what is left of a draft state). Everything before it must
    have parsed cleanly.
    """
    if sf.target is None or sf.sdft is not None and not sf.errors:
        return None
    if sf.sdft is not None:
        if sf.draft is not None and sf.errors == [sf.draft.error]:
            return sf.sdft.offset, str(sf.errors[0])
        return None
    if len(sf.errors) > 1 or sf.trailing is None or not sf.trailing.size:
        return None
    at = sf.trailing.offset
    head = sf.read_at(at, 4)
    magic = apx.SDFT_MAGIC_BYTES
    if not sf.errors:
        if sf.trailing.size < 4 and magic.startswith(head):
            return at, (f"SDFT appendix at 0x{at:x} ({at}): the file ends {len(head)} byte(s) into its magic "
                        f"(a draft state cut short)")
        return None
    err = sf.errors[0]
    if err.layer == "SDFT appendix" and head == magic:
        return at, str(err)
    if err.layer == "appendix" and 0 < len(head) < 4 and magic.startswith(head):
        return at, str(err)
    return None


def _plan(sf: SlotFile, identity: tuple, checkpoints: bool, damage: tuple[int, str] | None = None, *,
          links: int = 1) -> Plan:
    """The pieces of the stripped file: the old file's ranges around what goes, and rebuilt SCKP headers.

    With ``checkpoints`` (and a checkpoint holding draft or speculative bytes), SCKP is rewritten from
    the parse: its header, then per checkpoint the position fields and target blob length, the target
    blob copied as a range, and two zero lengths. With ``damage`` (a damaged SDFT appendix) the file
    ends where the appendix starts: where the damaged bytes end is not known, so none behind it is kept.
    """
    removed: list[str] = []
    pieces: list[Piece] = []
    ckpts = sf.checkpoints or []
    dft_bytes = sum(c.dft.span.size for c in ckpts)
    spec_bytes = sum(c.spec.size for c in ckpts)
    rebuild_sckp = checkpoints and (dft_bytes + spec_bytes) > 0

    pos = 0   # the old file is copied from here up to the next removed part
    if rebuild_sckp:
        pieces.append(Span(0, sf.sckp.offset))
        pieces.append(apx.SckpHead.build(dict(magic=apx.SCKP_MAGIC, version=apx.SCKP_VERSION, count=len(ckpts))))
        for c in ckpts:
            pieces.append(apx.CheckpointHead.build(dict(n_tokens=c.n_tokens, pos_min=c.pos_min, pos_max=c.pos_max))
                          + apx.BlobLength.build(c.tgt.span.size))
            pieces.append(c.tgt.span)
            pieces.append(_EMPTY_BLOBS)
        pos = sf.sckp.end
        if dft_bytes:
            removed.append(REMOVED_CKPT_DRAFT)
        if spec_bytes:
            removed.append(REMOVED_CKPT_SPEC)
    if damage is not None:
        cut = damage[0]
        pieces.append(Span(pos, cut - pos))
        removed.insert(0, REMOVED_SDFT)
        sdft_bytes = sf.size - cut
    else:
        sdft_bytes = 0
        if sf.sdft is not None:
            _check_trailing(sf)
            pieces.append(Span(pos, sf.sdft.offset - pos))
            pos = sf.sdft.end
            removed.insert(0, REMOVED_SDFT)
            sdft_bytes = sf.sdft.size
        pieces.append(Span(pos, sf.size - pos))
    return Plan(sf.path, sf.size, tuple(removed), tuple(coalesce(pieces)), identity,
                0 if checkpoints else dft_bytes + spec_bytes, draft_size=sdft_bytes + dft_bytes + spec_bytes,
                repaired=damage[1] if damage else None, links=links, parsed=sf)


def _check_trailing(sf: SlotFile) -> None:
    """Refuse when bytes behind the SDFT appendix would read as an appendix once it is gone.

    A server stops reading at the SDFT appendix; moved up behind the payload or the checkpoints, bytes
    that start with an appendix magic would be read as checkpoints or draft state.
    """
    t = sf.trailing
    if t is None or t.size < 4:
        return
    (word,) = struct.unpack("<I", sf.read_at(t.offset, 4))
    if word in apx.MAGICS:
        raise FormatError("trailing bytes", t.offset,
                          f"bytes a server ignores; they start with an {apx.MAGICS[word]} magic, which a server "
                          f"would read as an appendix once the SDFT appendix before them is removed")


def write_plan(plan: Plan, dest: str | os.PathLike, *, overwrite: bool, follow_symlinks: bool = False,
               progress: Callable[[int], None] | None = None) -> None:
    """Write the stripped file to ``dest`` atomically, streaming the kept ranges of ``plan.path``.

    ``progress(bytes written)`` follows the copy. Raises :class:`SourceChanged` (nothing is replaced) when
    the file is not the one that was parsed, before or during the copy. ``dest`` is replaced only when it
    is a regular file this process may write, and keeps its mode, owner and group (a root run must not
    leave a server's slot file owned by root; a user who may not write it is refused, as a truncate would
    be): :func:`~slotctl.atomic.atomic_writer`.
    """
    check_unchanged(plan.parsed, _LEFT)
    check_destination(dest, overwrite=overwrite, follow_symlinks=follow_symlinks)
    check_free_space(dest, plan.size_after)
    write_pieces(plan.parsed, plan.pieces, dest, overwrite=overwrite, follow_symlinks=follow_symlinks,
                 progress=progress, changed=_LEFT)


def truncate_in_place(plan: Plan, path: str | os.PathLike, *, all_links: bool = False) -> None:
    """Cut the file at ``path`` (the one ``plan`` was made from) to ``plan.size_after`` bytes, and sync it.

    One ``ftruncate``: O(1), no free space needed, and atomic in itself (a crash leaves the old length or
    the new one). Raises :class:`SourceChanged` (nothing is cut) when the file is not the one parsed, or
    when it has gained other names (hard links) since, unless ``all_links``: a cut changes every name.
    """
    if not plan.is_prefix:
        raise ValueError("truncate_in_place needs a plan whose result is a prefix of the file")
    fd = os.open(os.fspath(path), os.O_WRONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if stat_identity(st) != plan.identity:
            raise SourceChanged(f"{plan.path}: the file changed since it was read; {_LEFT}")
        if st.st_nlink > 1 and not all_links:
            raise SourceChanged(f"{plan.path}: the file was given other names (hard links) since it was read; "
                                f"left as it is now, run again")
        os.ftruncate(fd, plan.size_after)
        os.fsync(fd)
    finally:
        os.close(fd)


def check_free_space(dest: str | os.PathLike, need: int) -> None:
    """A one-line :class:`UsageError` when the directory of ``dest`` has not ``need`` bytes free for a copy."""
    directory = os.path.dirname(os.path.abspath(os.fspath(dest)))
    try:
        st = os.statvfs(directory)
    except OSError:   # no statvfs here: the copy itself reports a full disk
        return
    free = st.f_bavail * st.f_frsize
    if free < need + FREE_SPACE_MARGIN:
        raise UsageError(f"{directory}: the stripped copy needs {need + FREE_SPACE_MARGIN:,} bytes free, "
                         f"{free:,} are; free space first (strip-draft without --checkpoints and without -o "
                         f"cuts the file in place and needs none)")


@dataclass
class FileResult:
    """What happened to one file; :meth:`as_dict` is its JSON form (keys in docs/strip-draft.md)."""

    path: str
    status: str
    size_before: int | None = None
    size_after: int | None = None
    removed: list[str] = field(default_factory=list)
    error: str | None = None
    output: str | None = None
    #: the exit status this file calls for: FAILED when refused, USAGE when it could not be read or written
    exit_status: ExitStatus = ExitStatus.OK
    #: how the file was (or, with ``--dry-run``, would be) written: ``"truncate"``, ``"copy"`` or None
    method: str | None = None
    #: every byte of draft state in the file (SDFT and the checkpoints' draft and speculative blobs)
    draft_size: int | None = None
    #: draft bytes the checkpoints keep without ``--checkpoints``
    checkpoint_draft_size: int = 0
    #: the error of a damaged SDFT appendix that was (or would be) removed
    repaired: str | None = None
    #: what kind of error ``error`` is, for scripts (``damaged``, ``no_such_file``, ...)
    error_code: str | None = None
    #: the file's names besides this one (hard links); in place, such a file is copied unless --all-links
    other_links: int = 0

    @property
    def bytes_freed(self) -> int:
        if self.size_before is None or self.size_after is None:
            return 0
        return self.size_before - self.size_after

    def as_dict(self) -> dict:
        out = {"path": self.path, "status": self.status, "size": self.size_before, "size_after": self.size_after,
               "bytes_freed": self.bytes_freed, "removed": list(self.removed), "output": self.output,
               "method": self.method, "draft_size": self.draft_size,
               "checkpoint_draft_size": self.checkpoint_draft_size, "repaired": self.repaired,
               "other_links": self.other_links, "exit_code": int(self.exit_status)}
        if self.error is not None:
            out["error"] = {"code": self.error_code or "refused", "message": self.error}
        return out


def check_output(output: str | os.PathLike, n_files: int, *, force: bool, follow_symlinks: bool = False) -> str:
    """The file ``-o OUT`` writes (OUT, or its target with ``follow_symlinks``), or a usage error: several
    input files, or what :func:`~slotctl.atomic.check_destination` refuses (a directory, a device, a FIFO,
    a socket, a symbolic link not followed, an existing file without ``force``)."""
    out = os.fspath(output)
    if n_files != 1:
        raise UsageError(f"-o {out}: needs exactly one input file, {n_files} given")
    return check_destination(out, overwrite=force, follow_symlinks=follow_symlinks)


def strip_files(files: list[str], *, output: str | os.PathLike | None = None, checkpoints: bool = False,
                dry_run: bool = False, force: bool = False, progress: Progress | None = None,
                layout: MemoryLayout | None = None, draft_layout: MemoryLayout | None = None,
                grace: float = DEFAULT_GRACE, all_links: bool = False, follow_symlinks: bool = False,
                now: Callable[[], float] = time.time) -> list[FileResult]:
    """Strip each of ``files`` (already expanded, see :func:`slotctl.inputs.expand_slot_paths`); one result per
    file.

    ``layout`` / ``draft_layout``: the target and draft memory layouts, when known from the models.
    In place unless ``output`` is given (one file only; see :func:`check_output`; ``follow_symlinks``
    lets it write through a symbolic link). Every file is parsed first, then the files with draft state
    are written; ``progress(done, total)`` counts bytes written over all files. A refused or unreadable
    file does not stop the others.

    A file modified less than ``grace`` seconds ago is refused (a server may still be writing it: a cut
    under a writer leaves a hole). A file with other names (hard links) is not changed behind them: in
    place it is copied, so only this name gets the stripped file, unless ``all_links`` (then it is cut in
    place, and every name sees the cut; a strip that needs a copy is refused).
    """
    if output is not None:
        dest = check_output(output, len(files), force=force, follow_symlinks=follow_symlinks)
        if os.path.exists(dest) and os.path.samefile(dest, files[0]):
            output = None   # -o naming the file itself (with --force): in place
    results: list[FileResult] = []
    plans: list[tuple[FileResult, Plan, str]] = []
    for path in files:
        res = FileResult(path, REFUSED)
        results.append(res)
        try:
            st = check_readable(path)
            res.size_before = st.st_size
            busy = being_written(st, grace, now())
            if busy:
                raise BeingWritten(f"{path}: {busy}; left as it is: strip it once the writer is done "
                                   f"(or give a shorter --grace)")
            plan = plan_strip(path, checkpoints=checkpoints, layout=layout, draft_layout=draft_layout)
        except FormatError as e:
            res.error, res.error_code, res.exit_status = f"{path}: {e}", e.error_code, ExitStatus.FAILED
            continue
        except BeingWritten as e:
            res.error, res.error_code, res.exit_status = str(e), e.error_code, ExitStatus.FAILED
            continue
        except UsageError as e:
            res.status, res.error, res.error_code, res.exit_status = UNREADABLE, str(e), e.error_code, ExitStatus.USAGE
            continue
        except OSError as e:
            err = error_entry(e, path)
            res.status, res.error, res.error_code, res.exit_status = UNREADABLE, err.message, err.code, err.exit_status
            continue
        res.size_before, res.size_after, res.removed = plan.size_before, plan.size_after, list(plan.removed)
        res.draft_size, res.checkpoint_draft_size, res.repaired = (plan.draft_size, plan.checkpoint_draft_bytes,
                                                                   plan.repaired)
        written_to = path if output is None else os.fspath(output)
        res.other_links = plan.links - 1
        if plan.changes or output is not None:
            res.method = TRUNCATE if output is None and plan.is_prefix and (plan.links == 1 or all_links) else COPY
        if plan.changes and output is None and plan.links > 1 and all_links and res.method == COPY:
            res.error = (f"{path}: --all-links: this strip rewrites the middle of the file (--checkpoints, or bytes "
                         f"after the draft state), which only a copy does, and a copy cannot change the file's "
                         f"{plan.links - 1} other name(s); left as it is")
            res.error_code, res.exit_status, res.removed, res.method = "hard_links", ExitStatus.FAILED, [], None
            res.size_after = None
            continue
        if not plan.changes and output is None:
            res.status = UNCHANGED
        elif dry_run:
            res.status, res.output = (WOULD_STRIP if plan.changes else UNCHANGED), written_to
        else:
            plans.append((res, plan, written_to))
    total = sum(plan.size_after for res, plan, _ in plans if res.method == COPY)
    written = 0
    for res, plan, written_to in plans:
        base = written
        # in place, through a symbolic link: the file it points to is replaced (or cut), not the link
        dest = os.path.realpath(written_to) if output is None else written_to
        try:
            if res.method == TRUNCATE:
                truncate_in_place(plan, dest, all_links=all_links)
            else:
                written = base + plan.size_after
                write_plan(plan, dest, overwrite=force or output is None, follow_symlinks=follow_symlinks,
                           progress=(lambda n, base=base: progress(base + n, total)) if progress else None)
        except SourceChanged as e:
            _refused(res, str(e), e.error_code, ExitStatus.FAILED)
        except (OSError, UsageError) as e:
            err = error_entry(e, dest)
            _refused(res, err.message, err.code, ExitStatus.USAGE)
        else:
            res.status, res.output = (STRIPPED if plan.changes else UNCHANGED), written_to
    return results


def _refused(res: FileResult, error: str, code: str, status: ExitStatus) -> None:
    """``res`` refused at the write: nothing was removed, and no method wrote it."""
    res.status, res.size_after, res.removed, res.method = REFUSED, None, [], None
    res.error, res.error_code, res.exit_status = error, code, status

