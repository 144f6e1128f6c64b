"""What the long-running commands (``keep``, ``serve``) share as commands: their flags over their
configuration file's values (:func:`settings`), the server's flags it does not report as given
(:func:`unreported_flags`), and their event lines (:func:`event_line`). The process around their work is
:mod:`slotctl.unattended.shell`'s."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotctl.cli.output import Output
from slotctl.errors import UsageError


@dataclass
class Settings:
    """A long-running command's server, slot directory, store and API key (each given on the command line
    kept over the configuration file's), the file's table for the command (``section``), its budget
    (``max_size``, as given) and its retention and proof policy."""

    url: str | None
    slot_dir: Path | None
    store: str | None
    api_key: str | None
    section: dict
    max_size: str | None
    newest: int | None
    proof: str | None
    #: the configuration file's server entry's router model (None: none, or no file)
    model: str | None = None

    def pick(self, flag: Any, key: str, default: Any) -> Any:
        """A flag's value: given, else the configuration file's ``key``, else ``default``."""
        return flag if flag is not None else self.section.get(key, default)

    def require(self, url_option: str) -> None:
        """UsageError unless a server (``url_option``: how it is given) and a slot directory are known, the
        directory is one and the store a directory or an ``s3://`` prefix."""
        from slotctl.cli.remote import check_slot_dir_and_store

        if self.url is None:
            raise UsageError(f"{url_option}: no URL given (nor a server in --config)")
        if self.slot_dir is None:
            raise UsageError("--slot-dir: no directory given (nor slot_dir in --config)")
        check_slot_dir_and_store(self.slot_dir, self.store)

    def budget(self, max_size: str | None) -> int | None:
        """``--max-size`` as given, else the configuration file's, in bytes (None: no budget)."""
        given = max_size if max_size is not None else self.max_size
        if given is None:
            return None
        from slotctl.prune import parse_size

        return parse_size(given)


def settings(section: str, config: Path | None, url: str | None, slot_dir: Path | None, store: str | None,
             api_key: str | None) -> Settings:
    """The command ``section``'s settings: the configuration file ``config`` read (none: the flags alone), its
    server (``url`` names one, or the section's ``server``, or the only one) filled in where a flag was not
    given (:meth:`slotctl.unattended.config.Config.fill`)."""
    from slotctl.unattended.config import Config, load

    cfg = load(config) if config is not None else Config()
    url, slot_dir, store, api_key, model = cfg.fill(section, url, slot_dir, store, api_key)
    return Settings(url, slot_dir, store, api_key, getattr(cfg, section), cfg.max_size, cfg.newest, cfg.proof, model)


def unreported_flags(ctx, kv_unified: bool, cache_type_k: str | None, cache_type_v: str | None):
    """The server's ``-kvu``, ``-ctk``, ``-ctv`` as given (llama-server's defaults for the rest), and the names
    of those given (a save of the server's says otherwise: :class:`slotctl.server.saved.Learnt`)."""
    from slotctl.cli.remote import given_params
    from slotctl.server.flags import ServerFlags

    given = given_params(ctx) & {"kv_unified", "cache_type_k", "cache_type_v"}
    flags = ServerFlags(kv_unified=kv_unified, cache_type_k=cache_type_k or ServerFlags().cache_type_k,
                        cache_type_v=cache_type_v or ServerFlags().cache_type_v)
    return flags, frozenset(given)


def event_line(out: Output, when: str, event: str, message: str) -> None:
    """One event as a log line on stderr: ``TIME EVENT message`` (the event in its colour of
    :data:`slotctl.cli.output.STYLES`, bold for one not there; the message's control characters escaped)."""
    from rich.text import Text

    from slotctl.cli.output import style_of
    from slotctl.cli.remote import _plain

    line = Text(f"{when} ")
    line.append(event, style=style_of(event, "bold"))
    line.append(f" {_plain(message)}")
    out.err.print(line)
