"""``convert`` of one slot file or of every slot file of a directory or ``s3://`` prefix, local files and
objects alike: the command's library side (:mod:`slotctl.cli.convert_cmd` only adapts).

The rewrite itself is :mod:`slotctl.convert`'s (a plan, then the atomic write); here, the paths around it: an
object is downloaded to a temporary file first and the result uploaded after (convert rewrites every byte:
docs/store.md), so this sits in the store's room, above :mod:`slotctl.convert`. Of many files, each is
converted into ``OUT/NAME`` and a failure is that file's entry (:func:`slotctl.errors.error_entry`); the
others go on.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator

from slotctl.atomic import check_destination
from slotctl.errors import ExitStatus, FormatError, SlotctlError, StoreDown, UsageError, error_entry
from slotctl.progress import Progress
from slotctl.sources import is_remote, remote_url, shown

#: a progress bar for one file's write: a context manager yielding its ``progress(done, total)``
Bar = Callable[[], ContextManager[Progress | None]]


def _no_bar() -> ContextManager[None]:
    return contextlib.nullcontext(None)


@contextlib.contextmanager
def local_input(path) -> Iterator[str]:
    """A local path to read for ``path``: the path itself, or an ``s3://`` object downloaded to a temporary
    file for the block (for a command that reads every byte anyway: docs/store.md)."""
    url = remote_url(path)
    if url is None:
        yield os.fspath(path)
        return
    from slotctl.store.s3 import local_copy

    with local_copy(url) as tmp:
        yield tmp


@contextlib.contextmanager
def local_output(path, *, overwrite: bool) -> Iterator[str]:
    """A local path to write for ``path``: the path itself, or for an ``s3://`` destination a temporary file
    uploaded when the block ends (if it was written), as ``cp`` uploads: created only if no object is there
    unless ``overwrite``."""
    url = remote_url(path)
    if url is None:
        yield os.fspath(path)
        return
    import tempfile

    from slotctl.store.s3 import upload_file

    with tempfile.TemporaryDirectory(prefix="slotctl-s3-") as tmp:
        local = os.path.join(tmp, url.rpartition("/")[2] or "object")
        yield local
        if os.path.exists(local):
            upload_file(local, url, overwrite=overwrite)


def check_output(output, *, force: bool, follow_symlinks: bool, dry_run: bool) -> None:
    """Refuse ``output`` before any work: a device, FIFO, socket or unfollowed symbolic link, or an existing
    file or object without ``force`` (nothing is refused with ``dry_run``)."""
    if dry_run:
        return
    if not is_remote(output):   # a device, FIFO, socket or unfollowed symbolic link is refused first
        check_destination(output, overwrite=force, follow_symlinks=follow_symlinks)
    elif not force:   # an object: refused at once when one is there (and at the upload)
        from slotctl.store.s3 import S3_STORE

        if S3_STORE.stat(shown(output)) is not None:
            raise UsageError(f"{shown(output)}: exists (use --force to overwrite)", code="exists")


def convert_file(file, output, req, layouts: dict, *, force: bool, follow_symlinks: bool, dry_run: bool,
                 bar: Bar = _no_bar):
    """Plan and (unless ``dry_run``) write one conversion of ``file`` (a path or an ``s3://`` object) into
    ``output``; (plan, re-encoding errors). ``layouts``: ``layout`` and ``draft_layout`` for
    :func:`slotctl.convert.plan_convert`. FormatError when the file is damaged or cannot be converted as asked."""
    from slotctl import convert as conv

    remote_out = is_remote(output)
    # s3://: the object downloaded first, OUT uploaded after (convert rewrites every byte: docs/store.md)
    with local_input(file) as real, local_output(output, overwrite=force) as real_out:
        plan = conv.plan_convert(real, req, **layouts)
        errors = []
        if not dry_run:
            with bar() as update:
                errors = conv.write_converted(plan, real_out, overwrite=force and not remote_out,
                                              follow_symlinks=follow_symlinks, progress=update, **layouts)
    return plan, errors


def file_doc(file, output, plan, errors, dry_run: bool) -> dict:
    """One converted file's JSON object (docs/json.md)."""
    worst = max((e.max_abs_error for e in errors), default=None)
    return {"path": shown(file), "output": shown(output), "size": plan.size, "output_size": plan.output_size,
            "source_state_version": plan.version_in, "state_version": plan.version_out,
            "changes": [c.as_dict() for c in plan.changes], "layers": [e.as_dict() for e in errors],
            "max_abs_error": worst, "dry_run": dry_run, "exit_code": 0}


def failure_code(e: FormatError) -> str:
    """A file convert could not convert: ``refused`` (it cannot be converted as asked) or ``damaged``."""
    from slotctl import convert as conv

    return "refused" if isinstance(e, conv.ConversionRefused) else "damaged"


@dataclass
class Many:
    """A directory or prefix converted: one entry per slot file (:func:`file_doc`, or ``path``, ``output``,
    ``error`` and ``exit_code``), the counts, the files passed over as not slot files, the worst exit code."""

    files: list[dict] = field(default_factory=list)
    counts: dict = field(default_factory=lambda: {"converted": 0, "refused": 0, "failed": 0})
    skipped: int = 0

    @property
    def exit_code(self) -> int:
        return max((d["exit_code"] for d in self.files), default=0)

    @property
    def summary(self) -> dict:
        return {"files": len(self.files), **self.counts, "skipped": self.skipped}


def convert_files(src, dest, req, layouts: dict, *, force: bool, follow_symlinks: bool, dry_run: bool,
                  bar: Bar = _no_bar, on_file: Callable[[dict], None] | None = None) -> Many:
    """Every slot file of the directory or prefix ``src`` converted into the directory or prefix ``dest``
    (same names); the others still converted when one fails. ``on_file(entry)`` is called as each file is
    done. UsageError when ``dest`` is neither an existing directory nor an ``s3://`` prefix."""
    from slotctl.inputs import expand_slot_paths

    if not is_remote(dest) and not os.path.isdir(dest):
        raise UsageError(f"-o {dest}: converting a directory or prefix needs an existing directory or an "
                         "s3:// prefix", code="no_such_file")
    opts = dict(force=force, follow_symlinks=follow_symlinks, dry_run=dry_run)
    expansion = expand_slot_paths([src], follow_symlinks=False)
    many = Many(skipped=len(expansion.skipped))
    for p in expansion.files:
        name = p.rstrip("/").rpartition("/")[2]
        target = (shown(dest).rstrip("/") + "/" + name) if is_remote(dest) else os.path.join(dest, name)
        try:
            check_output(target, **opts)
            plan, errors = convert_file(p, target, req, layouts, bar=bar, **opts)
            doc = file_doc(p, target, plan, errors, dry_run)
            many.counts["converted"] += 1
        except FormatError as e:
            doc = {"path": shown(p), "output": target,
                   "error": {"code": failure_code(e), "message": f"{shown(p)}: {e}"},
                   "exit_code": int(ExitStatus.FAILED)}
            many.counts["refused"] += 1
        except StoreDown:   # the store stopped answering (or --timeout passed): the run stops, not file after file
            raise
        except (SlotctlError, OSError) as e:
            doc = {"path": shown(p), "output": target, "error": error_entry(e, shown(p)).as_dict(),
                   "exit_code": int(ExitStatus.USAGE)}
            many.counts["failed"] += 1
        many.files.append(doc)
        if on_file is not None:
            on_file(doc)
    return many
