"""``strip-draft`` of an object in a store: the draft state (the SDFT appendix, the end of the file) removed
by a server-side rewrite of the object to the bytes before it (:func:`slotctl.store.s3copy.rewrite_prefix`):
nothing is downloaded but the metadata, nothing uploaded.

What a local file allows and an object does not is refused with the reason: ``--checkpoints`` (the draft
blobs inside checkpoints are in the middle of the file: a rewrite would upload new bytes between copied
ranges, and S3's parts are at least 5 MiB), ``-o``, and a file whose SDFT appendix is damaged or is not
the end of the file (trailing bytes).
"""

from __future__ import annotations

from slotctl.errors import ExitStatus, SlotctlError, StoreDown, error_entry
from slotctl.strip import REFUSED, REMOVED_SDFT, STRIPPED, UNCHANGED, UNREADABLE, WOULD_STRIP, FileResult

#: ``method`` of an object rewritten server-side
SERVER_COPY = "server_copy"


def strip_object(url: str, *, dry_run: bool = False, checkpoints: bool = False, layout=None,
                 draft_layout=None) -> FileResult:
    """Strip the draft state of the object at ``url`` (see the module docstring)."""
    from slotctl.store.s3copy import rewrite_prefix
    from slotctl.store.s3 import S3_STORE, call
    from slotctl.slotfile import open_slot_file

    res = FileResult(url, UNREADABLE)
    try:
        with open_slot_file(url, layout=layout, draft_layout=draft_layout) as sf:
            etag = sf.stream.etag
            res.size_before = sf.size
            ckpt_draft = sum(c.dft.span.size + c.spec.size for c in sf.checkpoints or ())
            res.checkpoint_draft_size = ckpt_draft
            res.draft_size = (sf.sdft.size if sf.sdft is not None else 0) + ckpt_draft
            if sf.damaged or sf.target is None:
                return _refuse(res, f"{url}: {sf.errors[0].one_line() if sf.errors else 'no payload located'} "
                                    "(an object is stripped only when every layer parses: cp it down, strip-draft, "
                                    "cp --overwrite it back)", "damaged")
            if checkpoints and ckpt_draft:
                return _refuse(res, f"{url}: --checkpoints rewrites the middle of the file, which an object store "
                                    "cannot do server-side: cp it down, strip-draft --checkpoints, cp --overwrite "
                                    "it back", "not_server_side")
            if sf.sdft is None:
                res.status, res.size_after = UNCHANGED, sf.size
                return res
            if sf.sdft.end != sf.size:
                return _refuse(res, f"{url}: bytes follow the SDFT appendix; not stripped server-side", "damaged")
            keep = sf.sdft.offset
    except StoreDown:       # the store stopped answering (or --timeout passed): the run stops, not object after object
        raise
    except (SlotctlError, OSError) as e:
        err = error_entry(e, url)
        res.error, res.error_code, res.exit_status = err.message, err.code, err.exit_status
        return res
    res.removed, res.method, res.size_after = [REMOVED_SDFT], SERVER_COPY, keep
    if dry_run:
        res.status = WOULD_STRIP
        return res
    try:    # within the command's deadline (--timeout); until it completes the object is the old one
        call(url, "COPY", rewrite_prefix, S3_STORE.config, url, etag, keep)
    except StoreDown:
        raise
    except SlotctlError as e:
        res.status, res.size_after = REFUSED if e.error_code == "object_changed" else UNREADABLE, None
        res.error, res.error_code, res.exit_status = str(e), e.error_code, e.exit_status
        return res
    res.status = STRIPPED
    return res


def _refuse(res: FileResult, message: str, code: str) -> FileResult:
    res.status, res.error, res.error_code, res.exit_status = REFUSED, message, code, ExitStatus.FAILED
    return res
