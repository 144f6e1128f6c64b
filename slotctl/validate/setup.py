"""The llama-server a file is validated against (:class:`ServerSetup`: models and flags), and what its
models predict (:class:`Models`)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from slotctl.errors import UsageError
from slotctl.model.info import ModelInfo, read_model_info
from slotctl.model.predict import Prediction, predict, requested_n_ctx
from slotctl.model.settings import DRAFT_CACHE_TYPE_DEFAULT, ContextSettings
from slotctl.server import builds
from slotctl.server.flags import DEFAULT_CTX_CHECKPOINTS, SERVER_STATE_VERSION, ServerFlags, cache_type, check_slot
from slotctl.server.speculative import draft_context


# -- what the server is --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSetup:
    """The llama-server a file is validated against: models and flags.

    ``target`` / ``draft``: ``-m`` / ``-md`` (both None: structure only). ``settings``: the target
    context's flags; the draft context is derived from them as the server derives it
    (:meth:`ContextSettings.for_draft` with ``draft_type_k`` / ``draft_type_v``, ``-ctkd`` / ``-ctvd``).
    ``slot``: the slot restored into. ``mmproj``: the server has a multimodal projector (``--mmproj``).
    ``n_ctx_checkpoints``: ``--ctx-checkpoints``. ``state_version``: the state version of the server
    (its loader accepts no other). ``attn_rot_disable``: the server runs with ``LLAMA_ATTN_ROT_DISABLE``.
    ``spec_type``: ``--spec-type`` (None: not given), which decides with ``draft`` whether the server has a
    draft context (:func:`slotctl.server.speculative.draft_context`: ``-md`` alone builds none). ``build``:
    the llama-server build whose rules apply (:mod:`slotctl.server.builds`; live mode: the server's own).
    """

    target: Path | None = None
    draft: Path | None = None
    settings: ContextSettings = ContextSettings()
    draft_type_k: str = DRAFT_CACHE_TYPE_DEFAULT
    draft_type_v: str = DRAFT_CACHE_TYPE_DEFAULT
    slot: int = 0
    mmproj: bool = False
    n_ctx_checkpoints: int = DEFAULT_CTX_CHECKPOINTS
    state_version: int = SERVER_STATE_VERSION
    attn_rot_disable: bool = False
    spec_type: str | None = None
    build: str = builds.NEWEST

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "build", builds.get(self.build).name)
        except ValueError as e:
            raise UsageError(f"--server-build: {e}") from None
        if self.draft is not None and self.target is None:
            raise UsageError("a draft model (-md) needs a target model (-m)")
        check_slot(self.slot, self.settings.n_parallel)
        object.__setattr__(self, "draft_type_k", cache_type(self.draft_type_k.lower(), "spec_draft_type_k"))
        object.__setattr__(self, "draft_type_v", cache_type(self.draft_type_v.lower(), "spec_draft_type_v"))
        if self.n_ctx_checkpoints < 0:
            raise UsageError("--ctx-checkpoints must not be negative")

    @classmethod
    def from_flags(cls, flags: ServerFlags, **more) -> ServerSetup:
        """The setup of a server started with ``flags`` (``more``: models, slot, mmproj, state version, ...)."""
        return cls(settings=flags.context_settings(), draft_type_k=flags.spec_draft_type_k,
                   draft_type_v=flags.spec_draft_type_v, n_ctx_checkpoints=flags.ctx_checkpoints,
                   spec_type=flags.spec_type, **more)

    @property
    def flags(self) -> ServerFlags:
        """The setup's server flags."""
        return ServerFlags.from_settings(self.settings, spec_draft_type_k=self.draft_type_k,
                                         spec_draft_type_v=self.draft_type_v,
                                         ctx_checkpoints=self.n_ctx_checkpoints, spec_type=self.spec_type)

    @property
    def draft_settings_types(self) -> tuple[str, str]:
        return self.draft_type_k.lower(), self.draft_type_v.lower()

    def as_dict(self) -> dict:
        return {
            "model": os.fspath(self.target) if self.target else None,
            "draft_model": os.fspath(self.draft) if self.draft else None,
            "settings": dataclasses.asdict(self.settings),
            "draft_type_k": self.draft_type_k.lower(),
            "draft_type_v": self.draft_type_v.lower(),
            "slot": self.slot,
            "mmproj": self.mmproj,
            "ctx_checkpoints": self.n_ctx_checkpoints,
            "state_version": self.state_version,
            "attn_rot_disable": self.attn_rot_disable,
            "spec_type": self.spec_type,
            "build": self.build,
        }


class Models:
    """The setup's model infos and predictions (one per state version, made when first asked for).

    Construction reads the GGUF headers and predicts for the server's own state version, so that
    settings llama.cpp refuses and models slotctl cannot predict are usage errors before any file is read.
    """

    def __init__(self, setup: ServerSetup):
        self.setup = setup
        self.target: ModelInfo | None = read_model_info(setup.target) if setup.target else None
        #: the draft model given (``-md``), whether or not the server builds a context of it
        self.draft_model: ModelInfo | None = read_model_info(setup.draft) if setup.draft else None
        #: the draft context the server builds (:func:`slotctl.server.speculative.draft_context`)
        self.draft_context = draft_context(setup.spec_type, self.draft_model, self.target)
        #: what the draft context is of: the draft model, its MTP context, the target's MTP context, or None
        #: when the server builds none (``-md`` without a drafter: the file's draft state is dropped)
        self.draft: ModelInfo | None = None
        if self.target is not None and self.draft_context.built:
            model = self.draft_model if self.draft_model is not None else self.target
            self.draft = model.mtp_context() if self.draft_context.mtp else model
        self._cache: dict[int, tuple[Prediction | None, Prediction | None]] = {}
        if self.target is not None:
            self.predictions(setup.state_version)

    def predictions(self, version: int) -> tuple[Prediction | None, Prediction | None]:
        """(target, draft) predictions for files of state ``version``."""
        if version not in self._cache:
            s = self.setup
            tp = dp = None
            if self.target is not None:
                tp = predict(self.target, s.settings, version, attn_rot_disable=s.attn_rot_disable)
                if self.draft is not None:
                    dsettings = s.settings.for_draft(tp.n_ctx, *s.draft_settings_types)
                    dp = predict(self.draft, dsettings, version, attn_rot_disable=s.attn_rot_disable)
            self._cache[version] = (tp, dp)
        return self._cache[version]

    def describe(self) -> dict:
        tp, dp = self.predictions(self.setup.state_version) if self.target else (None, None)
        out: dict = {"target_context": None, "draft_context": None, "n_ctx_slot": None}
        for key, p, info in (("target_context", tp, self.target), ("draft_context", dp, self.draft)):
            if p is not None:
                out[key] = {"arch": info.arch, "layout": info.layout().describe(),
                            "n_ctx_requested": requested_n_ctx(info, p.settings), "n_ctx": p.n_ctx,
                            "n_ctx_seq": p.n_ctx_seq, "n_stream": p.n_stream, "flash_attn": p.flash_attn,
                            "type_k": p.settings.type_k, "type_v": p.settings.type_v}
        if tp is not None:
            out["n_ctx_slot"] = tp.n_ctx_slot
        return out


