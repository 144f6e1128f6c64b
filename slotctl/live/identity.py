"""Which model a running llama-server runs, told by the model's content (:mod:`slotctl.model.content`), and
whether a stored state is that model's (its name's seal: :mod:`slotctl.seal`).

What the server reports (``/props`` ``model_path``, ``/v1/models`` meta) finds the model's file on this machine
and is checked against it (its tensors' parameter count and bytes), never taken for the identity: a model of the
same architecture and shapes reports the same. The draft model no build reports (b11434's and b11669's
``/props`` and ``/slots`` do not name it): its file is given (keep's and serve's ``-md``), else it is not known,
and a state that carries a draft state is then restored by no server (:meth:`ServerModel.refusal`).

Where the model's file cannot be read (the server runs on another machine, in a container with other paths),
the server's model is not identified (:class:`Unidentified`, the reason said): its states are neither stored
nor restored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from slotctl.errors import ExitStatus, SlotctlError, UsageError
from slotctl.model.content import ModelContent, model_content
from slotctl.progress import Progress
from slotctl.seal import UNKNOWN_DRAFT, StateName


class Unidentified(SlotctlError):
    """The server's model cannot be told by its content here: no state is stored for it or restored into it."""

    exit_status = ExitStatus.USAGE
    code = "model_unidentified"


@dataclass(frozen=True)
class ServerModel:
    """A server's model as its content says (``target``), and its draft model's when it is known (``draft``)."""

    target: ModelContent
    draft: ModelContent | None = None

    @property
    def short(self) -> str:
        """The target's short digest: the MODEL of the names of the states this server saves."""
        return self.target.short

    def draft_part(self, carries_draft: bool) -> str | None:
        """The draft part of the name of a state this server saved (None: the state carries no draft state;
        :data:`~slotctl.seal.UNKNOWN_DRAFT` when the draft model is not known)."""
        if not carries_draft:
            return None
        return self.draft.short if self.draft is not None else UNKNOWN_DRAFT

    def refusal(self, said: StateName | None) -> str | None:
        """Why the stored state named ``said`` (:func:`slotctl.seal.parse_name`) is not this server's model's
        state, or None when it is: its name carries the target's content identity and, for a state that carries
        a draft state, the draft's, both this server's."""
        if said is None:
            return "not a stored state's name: which model wrote it is not recorded"
        if not said.sealed:
            return ("stored by an earlier slotctl, whose names record what the server reported of its model, "
                    "not its content: which model wrote it is not known")
        if said.model != self.target.short:
            return f"stored for another model (model {said.model}; this server's is {self.target.short})"
        if said.draft is None:
            return None
        if said.draft == UNKNOWN_DRAFT:
            return "its draft state is of a draft model that was not known when it was stored"
        if self.draft is None:
            return (f"it carries the draft state of draft model {said.draft}, and this server's draft model is not "
                    f"known (give its file: -md)")
        if said.draft != self.draft.short:
            return f"its draft state is of another draft model ({said.draft}; this server's is {self.draft.short})"
        return None

    def as_dict(self) -> dict:
        return {"model": self.target.digest, "draft_model": self.draft.digest if self.draft is not None else None}


def identify(model_path: str | None, meta: dict | None = None, draft_model: str | os.PathLike | None = None, *,
             progress: Progress | None = None) -> ServerModel:
    """The model of a server that reports ``model_path`` (``/props``) and ``meta`` (``/v1/models``), by the
    content of that file on this machine (hashed once per file identity: :func:`~slotctl.model.content.model_content`,
    ``progress(done, total)`` meanwhile), and of ``draft_model`` when given. :class:`Unidentified` when the file
    cannot be read here or is not the model the server describes."""
    if not model_path:
        raise Unidentified("the server does not say which file its model is (GET /props has no model_path): its "
                           "model cannot be told by its content")
    try:
        target = model_content(model_path, progress=progress)
    except UsageError as e:
        raise Unidentified(f"the server's model cannot be read on this machine ({e}; the server runs elsewhere, or "
                           f"sees its files under other paths): its model cannot be told by its content") from None
    why = target.disagrees(meta)
    if why is not None:
        raise Unidentified(f"{model_path} is not the model the server runs ({why}; replaced since the server loaded "
                           f"it?)")
    draft = None
    if draft_model is not None:
        try:
            draft = model_content(draft_model, progress=progress)
        except UsageError as e:
            raise Unidentified(f"the draft model cannot be read ({e})") from None
    return ServerModel(target, draft)


class StateRefused(SlotctlError):
    """A stored state is not the server's model's (another model, an unknown draft model): it is never sent,
    ``--force`` or not (exit 1)."""

    exit_status = ExitStatus.FAILED
    code = "other_model"


def is_stored(name: str | os.PathLike) -> bool:
    """Whether ``name`` (its base name) is a stored state's name that records its model (:mod:`slotctl.seal`)."""
    from slotctl.seal import parse_name

    said = parse_name(os.path.basename(os.fspath(name)))
    return said is not None and said.sealed


def check_stored(name: str, model_path: str | None, meta: dict | None, *, local: str | os.PathLike | None = None,
                 draft_model: str | os.PathLike | None = None, progress: Progress | None = None) -> None:
    """Before an act sends the file ``name`` (its base name) to a server that reports ``model_path`` and
    ``meta``: a stored state's name (:mod:`slotctl.seal`) must carry the server's model's content identity
    (:class:`StateRefused`; :class:`Unidentified` when the server's model cannot be told here) and, when the file
    is read here (``local``), its bytes the checksum in its name (:class:`~slotctl.seal.ChecksumMismatch`). Any
    other name (a save of one's own) records no model: nothing to check (validate judges its shapes)."""
    from slotctl.seal import checksum_file, parse_name, verify

    if not is_stored(name):
        return
    said = parse_name(os.path.basename(os.fspath(name)))
    server = identify(model_path, meta, draft_model, progress=progress)
    why = server.refusal(said)
    if why is not None:
        raise StateRefused(f"{os.fspath(name)}: not sent: {why}")
    if local is not None:
        verify(local, said.checksum, checksum_file(local))
