"""A stored state's bytes brought into the server's slot directory to be restored: copied or downloaded under a
working name of the process's own, or converted for the server, each checked against the checksum its name
says and the identity its verdict was made on (:class:`Placing`, one per
:class:`~slotctl.keeping.states.ServerStates`).

Its one reason to change: how a state gets from the store to the file the server reads (the copy, the
download, the conversion step's streamed rewrite, the checks that nothing else is sent).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable

from slotctl import seal
from slotctl.keeping import names
from slotctl.keeping.store import changed_since, copy_atomic


class ConversionFailed(Exception):
    """A stored state could not be converted for the server (its download or its rewrite failed)."""


class Placing:
    """The states of ``store`` placed into ``slot_dir`` (the server's ``--slot-save-path`` on this machine) under
    the working names of the process of ``role``. ``allow_lossy``: the conversion step may re-encode cache
    rows."""

    def __init__(self, store, slot_dir: Path | None, role: str | None, *, allow_lossy: bool = False):
        self.store, self.slot_dir, self.role, self.allow_lossy = store, slot_dir, role, allow_lossy

    @contextlib.contextmanager
    def placed(self, name: str, slot: int = 0, identity: str | None = None):
        """The stored state ``name`` in the server's slot directory while the block runs, for ``slot``: yields
        its name there. A copy (a directory store: through a temporary file, never a torn file) or a download
        (an ``s3://`` store, whole or absent) under a working name of this process's own (``placed``: no
        client's file of the state's name is ever sent in its place, and a process killed meanwhile leaves
        nothing the next one does not sweep), removed after; the store's own file only when the store is the
        slot directory itself (``--store`` given so). ``identity``: the identity of the bytes a verdict was
        made on (``Judged.identity``): the file the server reads must still have it (a copy: the source opened
        has it before and after the copy; a download: its reads were pinned to that ETag; the store's own file
        in the slot directory: its ``stat``), else nothing is placed
        (:func:`~slotctl.keeping.store.changed_since`). The bytes placed must have the checksum the state's
        name says (:mod:`slotctl.seal`: hashed as they are copied or downloaded, or read once where they are),
        else nothing is placed (:class:`~slotctl.seal.ChecksumMismatch`): a state damaged since it was stored
        is never sent."""
        said = seal.parse_name(name)
        expected = said.checksum if said is not None else None
        if expected is None:
            raise seal.ChecksumMismatch(f"{self.store.where(name)}: its name carries no checksum: never restored")
        if getattr(self.store, "same", False):     # the store is the slot directory: its own file is read
            here = self.slot_dir / name
            if identity is not None and _identity_of(here) != identity:
                raise changed_since(here)       # before its bytes are read
            if _checked_in_place(here, expected) != identity and identity is not None:
                raise changed_since(here)
            yield name
            return
        work = names.work_name(self.role, slot, "placed")
        placed = self.slot_dir / work
        try:
            where = self.store.where(name)
            if where.startswith("s3://"):     # downloaded whole, complete or absent, and checked
                self.store.local(name, self.slot_dir, identity=identity, checksum=expected, as_name=work)
            else:       # not a hard link: that would change the state's ctime, its identity
                copy_atomic(where, placed, identity=identity, checksum=expected)
            yield work
        finally:
            names.discard(placed)

    @contextlib.contextmanager
    def converted(self, name: str, slot: int, setup: Callable[[int], object]):
        """The stored state ``name`` converted for ``slot`` of the server now running, whose setup is
        ``setup(slot)`` (:func:`slotctl.keeping.conversion.convert_for`: streamed into a working file of the slot
        directory, atomic; an ``s3://`` state is downloaded first, into a private directory there, removed once
        converted): yields (its name in the slot directory, the conversion), the file removed after.
        :class:`ConversionFailed` when the download or the conversion fails.

        The state's bytes must have the checksum its name says before they are converted (the download's, or
        the store's file read once, which must not change while it is converted:
        :class:`~slotctl.seal.ChecksumMismatch`, raised as it is); the converted file's checksum is made as it is
        written (``Conversion.checksum``) and checked again before it is restored (:meth:`check_placed`)."""
        from slotctl.keeping.conversion import convert_for

        said = seal.parse_name(name)
        if said is None or said.checksum is None:
            raise seal.ChecksumMismatch(f"{self.store.where(name)}: its name carries no checksum: never restored")
        work = names.work_name(self.role, slot, "converted")
        dest = self.slot_dir / work
        try:
            try:
                where = self.store.where(name)
                with self._staging(slot) as staging:
                    if where.startswith("s3://"):
                        src = self.store.local(name, staging, checksum=said.checksum)
                        before = None
                    else:
                        src, before = Path(where), _checked_in_place(where, said.checksum)
                    conv = convert_for(src, setup(slot), dest, allow_lossy=self.allow_lossy,
                                       lossy_remedy="not allowed")
                    if before is not None and _identity_of(where) != before:
                        raise changed_since(where)
                if not conv.changes:
                    raise ConversionFailed("nothing to convert")
            except (ConversionFailed, seal.ChecksumMismatch):
                raise
            except Exception as e:  # noqa: BLE001 - the caller's to say: the state is not restored
                raise ConversionFailed(f"{name}: not converted for slot {slot}: {e}") from e
            yield work, conv
        finally:
            names.discard(dest)

    @contextlib.contextmanager
    def _staging(self, slot: int):
        """A directory of this process's own in the slot directory (a working name: swept once the process is
        gone), removed after."""
        import shutil

        path = self.slot_dir / names.staging_name(self.role, slot)
        path.mkdir(mode=0o700)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def check_placed(self, placed: str, checksum: str) -> None:
        """The file ``placed`` in the slot directory (a conversion's) still has the bytes it was written with
        (``checksum``), read once: :class:`~slotctl.seal.ChecksumMismatch` else."""
        _checked_in_place(self.slot_dir / placed, checksum)

    def used(self, name: str) -> None:
        """The stored state ``name`` (once restored) read as a reader reads, when the store is a directory: a
        budget prunes the least recently used by the access time, which the copy (``copy_file_range``) does not
        update (an object has none)."""
        where = self.store.where(name)
        if where.startswith("s3://"):
            return
        try:        # its first byte: the filesystem notes the access as its mount keeps access times (relatime:
            with open(where, "rb") as f:    # once after each change, then daily); its ctime, its identity, unchanged
                f.read(1)
        except OSError:
            pass


def _identity_of(path) -> str | None:
    from slotctl.catalog import local_identity

    try:
        return local_identity(os.stat(path))
    except OSError:
        return None


def _checked_in_place(path, expected: str) -> str:
    """The file at ``path`` read once and its bytes checked against ``expected`` (:func:`slotctl.seal.verify`);
    its identity (:func:`slotctl.catalog.local_identity`) as it was read."""
    from slotctl.catalog import local_identity
    from slotctl.paths import open_regular

    with open_regular(path, what="slot file ") as f:
        ident = local_identity(os.fstat(f.fileno()))
        seal.verify(path, expected, seal.checksum(f))
        return ident
