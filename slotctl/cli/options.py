"""Options shared by several commands, as ``Annotated`` aliases."""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from typer.core import TyperCommand

from slotctl.format import SUPPORTED_VERSIONS
from slotctl.format.ggml import CACHE_TYPE_NAMES
from slotctl.live import API_KEY_ENV

# -- the help panels options are grouped under (``rich_help_panel``); options without one come last --

#: the GGUFs a command reads (-m, -md, --mmproj)
MODEL_PANEL = "Model"
#: what the command prints and how (--json, --verbose, ...)
OUTPUT_PANEL = "Output"
#: llama-server's own flags, as the server takes them
SERVER_PANEL = "Server flags"

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (docs/json.md); a failure "
                                                     "is one too.", rich_help_panel=OUTPUT_PANEL)]
JsonlOpt = Annotated[bool, typer.Option("--jsonl", help="Print one JSON object per file, one per line, as each is "
                                                       "done, then a summary line (docs/json.md).",
                                        rich_help_panel=OUTPUT_PANEL)]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Show only the files that are not fine, and the "
                                                              "summary.", rich_help_panel=OUTPUT_PANEL)]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Let logs and llama.cpp's own output through to "
                                          "stderr.", rich_help_panel=OUTPUT_PANEL)]
ModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", help="The target model's GGUF.",
                                                  dir_okay=False, rich_help_panel=MODEL_PANEL)]
DraftModelOpt = Annotated[Optional[Path], typer.Option("--draft-model", "-md", "--spec-draft-model", "--model-draft",
                                                       help="The draft model's GGUF.", dir_okay=False,
                                                       rich_help_panel=MODEL_PANEL)]


SlotOpt = Annotated[int, typer.Option("--slot", min=0, help="The slot (sequence id).")]
StoreTimeoutOpt = Annotated[Optional[float], typer.Option("--timeout", min=0.001, metavar="SECONDS",
                                                          help="With s3:// paths: the whole command's time for its "
                                                               "requests to the store; past it, one error, exit 2 "
                                                               "(docs/store.md).")]

#: ls and validate: the state version of the server the files are judged for (default
#: :data:`slotctl.server.flags.SERVER_STATE_VERSION`)
ServerStateVersionOpt = Annotated[int, typer.Option("--state-version", min=min(SUPPORTED_VERSIONS),
                                                    max=max(SUPPORTED_VERSIONS),
                                                    help="The server's state version: its loader accepts no other "
                                                         "(4: llama.cpp b11434 and later).")]
#: save: the state version to write (default :data:`slotctl.server.flags.SERVER_STATE_VERSION`)
SaveStateVersionOpt = Annotated[int, typer.Option("--state-version", help="4: what current llama-server reads; "
                                                  "3: what this llama-cpp-python reads.")]
#: convert: the state version to write (default: the file's own)
ConvertStateVersionOpt = Annotated[Optional[int], typer.Option("--state-version", min=min(SUPPORTED_VERSIONS),
                                                               max=max(SUPPORTED_VERSIONS),
                                                               help="Write this state version (exact, or "
                                                                    "refused).")]


def store_option(help: str) -> Any:
    """``--store``: a directory or an ``s3://`` prefix where slot files are kept (keep, migrate; docs/store.md)."""
    return typer.Option("--store", metavar="DIR|s3://BUCKET/PREFIX/", help=help)


# -- live mode: a running llama-server (docs/live.md); defaults in :mod:`slotctl.live` ----------------------

#: the live commands (slots, erase, keep, migrate): the server is the point
ServerOpt = Annotated[str, typer.Option("--server", metavar="URL",
                                        help="The llama-server's base URL, e.g. http://127.0.0.1:8080.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option("--api-key", envvar=API_KEY_ENV, show_envvar=True,
                                                  help="The server's API key (sent as Authorization: Bearer).")]
#: default :data:`slotctl.live.DEFAULT_TIMEOUT`, or :data:`slotctl.live.SLOT_FILE_TIMEOUT` where a request
#: moves a whole slot file
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.001, metavar="SECONDS",
                                           help="Give up on a request after this many seconds.")]
ServerSlotOpt = Annotated[int, typer.Option("--slot", min=0, help="The slot id (0, 1, ...).")]
#: the model a router URL stands for (slotctl.live.router): slot reads and actions name it as the router routes
RouterModelOpt = Annotated[Optional[str], typer.Option("--router-model", metavar="NAME",
                                                       help="The --server is llama-server's router (router mode): "
                                                            "act on this model of it (its name in the router's GET "
                                                            "/models; never loaded by slotctl; docs/fleet.md).")]
#: keep and slots: a TOML configuration file (slotctl.unattended.config)
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", dir_okay=False, metavar="FILE",
                                                  help="A TOML configuration file (docs/fleet.md); flags given here "
                                                       "override it.")]

# ... and their forms for commands that also work without a server (save, restore, validate, ls)

LiveServerOpt = Annotated[Optional[str], typer.Option("--server", metavar="URL",
                                                      help="Act through a running llama-server at this base URL "
                                                           "(live mode, docs/live.md).")]
#: validate and ls: judge the files for a running server (its model and flags) instead of flags given
JudgeServerOpt = Annotated[Optional[str], typer.Option("--server", metavar="URL",
                                                       help="Judge the files for the running llama-server at this "
                                                            "URL: its model, -c and -np from GET /props and /slots "
                                                            "(flags given here win; docs/live.md).")]
LiveTimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.001, metavar="SECONDS",
                                               help="With --server: give up on a request after this many seconds. "
                                                    "Given with s3:// paths: the whole command's time for its "
                                                    "requests to the store (docs/store.md).")]
LiveApiKeyOpt = Annotated[Optional[str], typer.Option("--api-key", envvar=API_KEY_ENV, show_envvar=True,
                                                      help="With --server: the server's API key (sent as "
                                                           "Authorization: Bearer).")]
LocalModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", dir_okay=False,
                                                       help="The target model's GGUF (llama-server -m); needed "
                                                            "unless --server.")]
ProveOpt = Annotated[bool, typer.Option("--prove", help="With --server: after the restore, send the file's own "
                                        "prompt (nothing generated) and check the server's own counts (timings "
                                        "cache_n, prompt_n) against validate's predicted reuse; needs --slot-dir.")]
SlotDirOpt = Annotated[Optional[Path], typer.Option("--slot-dir", file_okay=False, metavar="DIR",
                                                    help="With --server: the server's --slot-save-path as this "
                                                         "machine sees it (the file is read there: validated "
                                                         "for the server before it is sent; --prove needs it).")]
ForceSendOpt = Annotated[bool, typer.Option("--force", help="With --server --slot-dir: send the file even when "
                                            "validate says the server refuses it or aborts on it.")]
ProveAnywayOpt = Annotated[bool, typer.Option("--prove-anyway", help="With --prove: send the proving request even "
                                              "where it makes the server evaluate the prompt again (recurrent, "
                                              "hybrid, SWA files b11434 keeps no checkpoint of): it spends the "
                                              "restore it proves.")]


# -- the command line as typed ----------------------------------------------------------------------------


class ArgsCommand(TyperCommand):
    """A typer command that also keeps its command line as typed: each parameter's value
    (``ctx.meta["slotctl.raw"]``, see :func:`raw_value`) and the arguments (``ctx.meta["slotctl.args"]``,
    so that a usage error can name a flag as it was written).

    typer turns a ``Path`` argument into a ``pathlib.Path``, which drops a trailing ``/``, a leading ``./``
    and doubled slashes: ``restore --server URL x/`` would send ``x``. Live mode checks the name as typed.

    A command with the server's flags (:func:`with_server_flags`) also takes llama-server's command line as
    it is: see :func:`server_command_line`.
    """

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        _refuse_repeated(self, ctx, args)
        if any(p.name == SERVER_ARGS_PARAM for p in self.params):
            args, ctx.meta["slotctl.ignored_flags"], ctx.meta["slotctl.server_env"] = \
                server_command_line(self, ctx, list(args))
        ctx.meta["slotctl.args"] = list(args)
        try:
            opts, _, _ = self.make_parser(ctx).parse_args(args=list(args))
            ctx.meta["slotctl.raw"] = dict(opts)
        except Exception:  # noqa: BLE001 - the real parse below reports whatever is wrong
            pass
        return super().parse_args(ctx, args)


#: options naming one server: given twice, the first would be dropped silently (click keeps the last)
ONE_SERVER_OPTIONS = ("--server", "--from", "--to")


def _refuse_repeated(command, ctx, args: list[str]) -> None:
    """A usage error when an option naming one server (:data:`ONE_SERVER_OPTIONS`) is given more than once to
    a command that takes one (a command taking several declares the option ``multiple``)."""
    words = args[:args.index("--")] if "--" in args else args
    for p in command.get_params(ctx):
        if p.param_type_name != "option" or getattr(p, "multiple", False):
            continue
        for name in (o for o in p.opts if o in ONE_SERVER_OPTIONS):
            given = [w.partition("=")[2] if "=" in w else None for w in words
                     if w == name or w.startswith(name + "=")]
            if len(given) > 1:
                raise typer.BadParameter(f"{name} given {len(given)} times: this command acts on one server "
                                         f"(the first would be dropped); give {name} once", ctx=ctx)


#: the parameter that takes llama-server's command line as one argument (``--server-args``)
SERVER_ARGS_PARAM = "server_args"
#: parameters that only live mode (``--server URL``) takes; in ``--server-args`` without ``--server`` they
#: are the server's own flags of the same names (``--api-key``, ``--timeout``), ignored
LIVE_ONLY_PARAMS = ("api_key", "timeout", "router_model")


#: the parameters whose options mean what llama-server's flags of the same spellings mean: the server flags
#: (added by :func:`with_server_flags`) and these; in ``--server-args`` only they are read as slotctl's
SAME_AS_SERVER = frozenset({"model", "draft_model", "mmproj", "api_key"})


def _own_options(command, ctx, local: bool, *, pasted: bool = False) -> dict[str, bool]:
    """The command's own option spellings, to whether each takes a value (``pasted``: only those that mean
    what the server's flag of that spelling means)."""
    from slotctl.server.flags import FLAGS

    own = {}
    for p in command.get_params(ctx):
        if p.param_type_name != "option":
            continue
        if pasted and (p.name not in SAME_AS_SERVER and p.name not in FLAGS or local and p.name in LIVE_ONLY_PARAMS):
            continue
        for name in (*p.opts, *p.secondary_opts):
            own[name] = not (p.is_flag or p.count)
    return own


def server_command_line(command, ctx, args: list[str]) -> tuple[list[str], list[str], dict[str, str]]:
    """llama-server's flags pasted among a command's own: ``(args for click, the server flags ignored,
    environment assignments from --server-args)``.

    The command's own options come first (``-m``, ``-c``, ``-np``...: the flags slotctl uses are its own
    options, by every spelling b11434 has; in ``--server-args`` only those meaning what the server's flag
    means, :data:`SAME_AS_SERVER`, so that ``prune --server-args '--keep 256'`` is the server's --keep, not
    prune's). Any other flag llama-server b11434 takes
    (:func:`slotctl.server.flags.server_arg`) is removed here with the values it takes, whatever they look
    like (``-ngl -1``, ``--spec-type ngram-simple``), as the server reads them: always the next
    arguments. What is neither stays, and click refuses it as an unknown option.
    ``--server-args TEXT`` (``@FILE``: read from a file) is a whole command line: see :func:`_split_server_args`;
    so is everything after a word naming the program (``/usr/bin/llama-server -m M -c 4096 ...`` pasted as it
    is). A ``--slot-save-path DIR`` among them is kept in ``ctx.meta["slotctl.slot_save_path"]``
    (:func:`pasted_slot_dir`: ``ls`` and ``prune`` read DIR when given no path).
    """
    from slotctl.server.flags import server_arg

    def UsageError(message: str) -> typer.BadParameter:  # noqa: N802 - raised before the command runs
        return typer.BadParameter(message, ctx=ctx)  # typer's public usage error (help.usage_error_line says it)

    local = "--server" not in args[:args.index("--")] if "--" in args else "--server" not in args
    own_options = {False: _own_options(command, ctx, local), True: _own_options(command, ctx, local, pasted=True)}
    # an option given many times that takes one value: the last wins, as in click, which is told the last only
    # (click looks for close matches of every short option it reads: 1 ms each, 9,000 in 64 KiB cost 15 s)
    single = {name: p.name for p in command.get_params(ctx) if p.param_type_name == "option"
              and not getattr(p, "multiple", False) and not getattr(p, "count", False)
              for name in (*p.opts, *p.secondary_opts)}
    groups: list[tuple[str | None, list[str]]] = []
    ignored: list[str] = []
    env: dict[str, str] = {}

    def walk(words: list[str], *, pasted: bool) -> None:
        own = own_options[pasted]
        i = 0
        while i < len(words):
            word = words[i]
            if word == "--" and not pasted:
                groups.append((None, words[i:]))
                return
            if not pasted and not word.startswith("-") and Path(word).name.startswith("llama-server"):
                # llama-server's own command line pasted as it is, its program first: the rest is the server's
                walk(words[i + 1:], pasted=True)
                return
            name, eq, value = word.partition("=") if word.startswith("--") else (word, "", "")
            norm = name.replace("_", "-") if name.startswith("--") else name
            if norm in ("--server-args",) and not pasted:
                if not eq:
                    if i + 1 >= len(words):
                        raise UsageError("--server-args: expected llama-server's command line (or @FILE)")
                    value, i = words[i + 1], i + 1
                more, assigned = _split_server_args(value, UsageError)
                env.update(assigned)
                walk(more, pasted=True)
                i += 1
                continue
            if norm in own:
                n = 1 if own[norm] and not eq else 0
                groups.append((single.get(norm), [norm + eq + value, *words[i + 1:i + 1 + n]]))
                i += 1 + n
                continue
            arg = server_arg(name) if name.startswith("-") and name != "-" else None
            if arg is not None:
                n = arg.values - (1 if eq else 0)
                if len(words) - i - 1 < n:
                    raise UsageError(f"{name}: expected {'a value' if arg.values == 1 else f'{arg.values} values'}")
                if norm == "--slot-save-path":   # the directory a command of directories reads when given none
                    ctx.meta["slotctl.slot_save_path"] = value if eq else words[i + 1]
                if name not in ignored and norm != "--slot-save-path":
                    ignored.append(name)
                i += 1 + max(n, 0)
                continue
            if pasted:
                what = "is not a flag llama-server b11434 takes" if word.startswith("-") else \
                    "is neither a flag nor the value of one"
                raise UsageError(f"--server-args: {word} {what}")
            groups.append((None, [word]))
            i += 1

    walk(args, pasted=False)
    last = {name: i for i, (name, _) in enumerate(groups) if name is not None}
    out = [w for i, (name, ws) in enumerate(groups) if name is None or last[name] == i for w in ws]
    return out, ignored, env


#: the most bytes ``--server-args`` takes, as text or from ``@FILE`` (a llama-server command line is a few hundred
#: bytes; Linux passes one argument of at most 128 KiB): past it, refused before a byte more is read
SERVER_ARGS_MAX_BYTES = 64 << 10
#: the longest word ``--server-args`` takes: a path (PATH_MAX) is the longest value a server flag has
MAX_WORD = 4096


def _split_server_args(text: str, UsageError) -> tuple[list[str], dict[str, str]]:  # noqa: N803
    """``--server-args`` as a shell reads it: words split and unquoted as ``sh`` does (``shlex``), lines joined
    by a trailing backslash, ``#`` comments dropped. ``@FILE`` reads the text from FILE (a script or a unit
    file's command line). Leading ``NAME=value`` words are the server's environment (``LLAMA_ARG_CTX_SIZE=4096
    llama-server ...``); a first word that is not a flag is the program (``/usr/bin/llama-server``) and is
    skipped. Returns (the words, the environment)."""
    import re
    import shlex

    from slotctl.errors import UsageError as Refused

    if text.startswith("@"):
        from slotctl.paths import read_bounded

        path = Path(text[1:])
        try:
            text = read_bounded(path, SERVER_ARGS_MAX_BYTES, what="--server-args @").decode("utf-8", "replace")
        except Refused as e:
            raise UsageError(str(e)) from None
        except OSError as e:
            raise UsageError(f"--server-args @{path}: {e.strerror or e}") from None
    elif len(text) > SERVER_ARGS_MAX_BYTES:
        raise UsageError(f"--server-args: {len(text):,} characters, more than the {SERVER_ARGS_MAX_BYTES:,} "
                         f"this takes")
    text = text.replace("\\\n", " ")
    try:   # shlex reads a character at a time (16 us each): text without quotes, escapes or comments is split at C speed
        words = re.split(r"[ \t\r\n]+", text.strip(" \t\r\n")) if not re.search(r"['\"\\\\#]", text) else \
            shlex.split(text, comments=True)
    except ValueError as e:
        raise UsageError(f"--server-args: {e} (quote as a shell does)") from None
    words = [w for w in words if w]
    long = next((w for w in words if len(w) > MAX_WORD), None)
    if long is not None:
        raise UsageError(f"--server-args: a word of {len(long):,} characters ({long[:16]}...): longer than any "
                         f"flag or value llama-server takes (a path is at most {MAX_WORD:,})")
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-") and words[0].split("=", 1)[0].isidentifier():
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    program = next((i for i, w in enumerate(words) if w.rpartition("/")[2].startswith("llama-server")), None)
    if program is not None:  # the program and whatever runs it (exec, env, nohup, numactl -N 0, ...)
        del words[:program + 1]
    elif words and not words[0].startswith("-"):
        words.pop(0)
    return words, env


def remote_paths(ctx: typer.Context | None, paths) -> list[str]:
    """``paths`` (typer's ``Path`` values) as strings, each ``s3://`` one as typed: ``Path`` drops the trailing
    ``/`` that makes ``s3://bucket/prefix/`` a prefix (a directory: empty, it holds 0 files)."""
    from slotctl.sources import remote_url

    typed = [remote_url(a) for a in (ctx.meta.get("slotctl.args") or ()) if remote_url(a)] if ctx is not None else []
    out = []
    for p in paths:
        url = remote_url(p)
        if url is None:
            out.append(os.fspath(p))
            continue
        out.append(next((t for t in typed if t.rstrip("/") == url.rstrip("/")), url))
    return out


def pasted_slot_dir(ctx: typer.Context | None) -> str | None:
    """The ``--slot-save-path`` of the server's command line pasted among the arguments, if any."""
    return ctx.meta.get("slotctl.slot_save_path") if ctx is not None else None


def raw_value(ctx: typer.Context | None, name: str, default: Any = None) -> Any:
    """The value of parameter ``name`` as typed on the command line (see :class:`ArgsCommand`)."""
    raw = ctx.meta.get("slotctl.raw") if ctx is not None else None
    if isinstance(raw, dict) and isinstance(raw.get(name), str):
        return raw[name]
    return default


def typed_flag(ctx: typer.Context | None, spellings: tuple[str, ...]) -> str:
    """Which of ``spellings`` the command line used (the last one given wins, as for the value); the
    first spelling when it cannot tell."""
    args = ctx.meta.get("slotctl.args") if ctx is not None else None
    used = spellings[0]
    for arg in args or ():
        if arg == "--":
            break
        name = arg.split("=", 1)[0] if arg.startswith("--") else arg
        if name in spellings:
            used = name
    return used


# -- llama-server's flags (b11434 names), one group shown as a panel: save, restore, validate ---------------


def values_of(field: str) -> Callable[[str], list[str]]:
    """Shell completion for the flag of ``field``: the values it takes
    (:func:`slotctl.server.flags.flag_values`) that begin as typed."""

    def complete(incomplete: str) -> list[str]:
        from slotctl.server.flags import flag_values

        return [v for v in flag_values(field) if v.startswith(incomplete)]

    return complete


_SERVER_OPTIONS: dict[str, tuple[type, dict]] = {
    "ctx_size": (int, dict(min=0, metavar="N", help="Context size in tokens over all slots; 0 = the model's "
                                                     "training context per slot, as the server picks.")),
    "parallel": (int, dict(min=1, max=256, metavar="N", help="Number of slots (n_seq_max).")),
    "kv_unified": (bool, dict(help="One KV cache stream shared by all slots.")),
    "kv_unified_per_slot": (int, dict(min=0, metavar="N", help="Context limit per slot (0 = unset); without -c "
                                                               "the cache holds -np x N.")),
    "cache_type_k": (str, dict(autocompletion=values_of("cache_type_k"), metavar="TYPE",
                               help="K cache type: " + ", ".join(CACHE_TYPE_NAMES) + ".")),
    "cache_type_v": (str, dict(autocompletion=values_of("cache_type_v"), metavar="TYPE",
                               help="V cache type.")),
    "spec_draft_type_k": (str, dict(autocompletion=values_of("spec_draft_type_k"), metavar="TYPE",
                                    help="Draft K cache type (f16 whatever -ctk says).")),
    "spec_draft_type_v": (str, dict(autocompletion=values_of("spec_draft_type_v"), metavar="TYPE",
                                    help="Draft V cache type (f16 whatever -ctv says).")),
    "flash_attn": (str, dict(autocompletion=values_of("flash_attn"), metavar="[on|off|auto]",
                             help="Flash attention (auto is on for the CPU).")),
    "batch_size": (int, dict(min=1, metavar="N", help="Logical batch size.")),
    "ubatch_size": (int, dict(min=1, metavar="N", help="Physical batch size.")),
    "swa_full": (bool, dict(help="Full-size SWA cache (off in the server).")),
    "ctx_checkpoints": (int, dict(min=0, metavar="N", help="Checkpoints the server keeps per slot; the oldest "
                                                           "beyond are dropped.")),
    "checkpoint_min_step": (int, dict(min=0, metavar="N", help="The server's least spacing of the checkpoints it "
                                                               "takes, in tokens.")),
    "spec_draft_n_max": (int, dict(min=0, metavar="N", help="Tokens the draft proposes per step (restore).")),
    "spec_type": (Optional[str], dict(metavar="TYPES", help="Speculative types, comma-separated (draft-simple, "
                                      "draft-eagle3, draft-mtp, ngram-mod, ...; default none). With -md and "
                                      "none of them the server loads the draft model and builds no draft "
                                      "context (only MTP heads, dflash and dspark are inferred from the GGUF).")),
    "threads": (int, dict(min=0, metavar="N", help="CPU threads; 0 = every core. Speed only: nothing saved "
                                                   "depends on it.")),
}


def flag_option(field: str, **opts: Any) -> Any:
    """A typer option spelled as llama-server spells the :class:`~slotctl.server.flags.ServerFlags` field
    ``field`` (every spelling of :data:`~slotctl.server.flags.FLAGS`, the long one shown first): the server
    panel and a command that takes some of the same flags with another meaning (``convert``'s targets)."""
    from slotctl.server.flags import FLAGS, NEGATED_FLAGS

    spellings = FLAGS[field]
    long = spellings[1] if len(spellings) > 1 else spellings[0]
    decls = [long, *[x for x in spellings if x != long]]
    negated = NEGATED_FLAGS.get(field, ())
    if negated:  # each spelling with its negation, as b11434 pairs them (-kvu/-no-kvu), the long one first
        decls = sorted((f"{a}/{b}" for a, b in zip(spellings, negated)), key=lambda d: not d.startswith("--"))
    return typer.Option(*decls, **opts)


def server_flag_params() -> list[inspect.Parameter]:
    """The group's parameters, one per :class:`~slotctl.server.flags.ServerFlags` field, defaulting to
    the server's defaults."""
    from slotctl.server.flags import ServerFlags

    defaults = ServerFlags()
    params = []
    for name, (kind, opts) in _SERVER_OPTIONS.items():
        option = flag_option(name, rich_help_panel=SERVER_PANEL, show_default=True, **opts)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, name),
                                        annotation=Annotated[kind, option]))
    option = typer.Option("--server-args", metavar="'ARGS'|@FILE", rich_help_panel=SERVER_PANEL,
                          help="llama-server's command line as one argument, or @FILE to read it from a file (a "
                               "script, a unit file's command): quoted as a shell quotes, NAME=value words first "
                               "are its environment. Any flag b11434 takes is also accepted directly: the ones "
                               "above are used, the others ignored with one note naming them.")
    params.append(inspect.Parameter(SERVER_ARGS_PARAM, inspect.Parameter.KEYWORD_ONLY, default=None,
                                    annotation=Annotated[Optional[str], option]))
    return params


def with_server_flags(fn: Callable) -> Callable:
    """Give a command the server's flags as options (one panel in ``--help``) and call it with them as one
    :class:`~slotctl.server.flags.ServerFlags`, in its ``flags`` parameter. A value the server refuses is a
    usage error naming the flag as it was typed (``-ctk q8: expected one of f32, f16, ...``). Register the
    command with ``cls=ArgsCommand``, and give it a ``ctx: typer.Context`` parameter, by that name."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "flags"]
    extra = server_flag_params()
    names = [p.name for p in extra]
    visible = sig.replace(parameters=[p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.default is not p.empty
                                      else p for p in own] + extra)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from slotctl.errors import UsageError
        from slotctl.server.flags import FLAGS, FlagError, ServerFlags

        ctx = kwargs.get("ctx")
        kwargs.pop(SERVER_ARGS_PARAM, None)  # spliced into the command line by ArgsCommand
        values = {n: kwargs.pop(n) for n in names if n in kwargs}
        meta = ctx.meta if ctx is not None else {}
        from_env = {}
        if kwargs.get("server") is None:  # live mode learns the running server's flags instead
            from_env = _environment_flags(ctx, values, meta.get("slotctl.server_env", {}))
        try:
            kwargs["flags"] = ServerFlags(**values)
        except FlagError as e:
            flag = e.as_typed(typed_flag(ctx, FLAGS[e.field]))
            raise UsageError(f"{from_env[e.field]}: {flag}" if e.field in from_env else flag) from None
        _note_server_flags(kwargs, meta.get("slotctl.ignored_flags", []), from_env)
        return fn(*args, **kwargs)

    wrapper.__signature__ = visible
    wrapper.__annotations__ = {p.name: p.annotation for p in visible.parameters.values()}
    return wrapper


def _environment_flags(ctx, values: dict, assigned: dict[str, str]) -> dict[str, str]:
    """The server flags not given on the command line that llama-server would take from its environment
    (``LLAMA_ARG_CTX_SIZE``): slotctl's own, plus ``assigned`` (``--server-args 'LLAMA_ARG_...=v ...'``),
    which win. Sets them in ``values``; returns ``{field: "VARIABLE=value"}`` for the note."""
    import os

    from slotctl.server.flags import from_environment

    found = from_environment({**os.environ, **assigned})
    given = {p.name for p in (ctx.command.params if ctx is not None else ())
             if getattr(ctx.get_parameter_source(p.name), "name", "") == "COMMANDLINE"}
    said = {}
    for field, (var, value) in found.items():
        if field in given or field not in values:
            continue
        values[field] = value
        text = ({**os.environ, **assigned}).get(var, "")
        said[field] = f"{var}={text}" if len(text) <= 64 else f"{var} ({len(text):,} characters)"
    return said


def _note_server_flags(kwargs: dict, ignored: list[str], from_env: dict[str, str]) -> None:
    """One note on stderr for the server flags that change nothing here, one for those read from the
    environment."""
    if not ignored and not from_env:
        return
    from slotctl.cli.output import Output
    from slotctl.server.flags import flag_name

    out = Output(json_mode=bool(kwargs.get("json_out")) or bool(kwargs.get("jsonl")))
    if from_env:
        out.note("server flags from the environment, as llama-server reads them: "
                 + ", ".join(f"{v} ({flag_name(f)})" for f, v in from_env.items()))
    if ignored:
        out.note(f"llama-server flag{'s' if len(ignored) > 1 else ''} ignored (nothing a slot file holds depends "
                 f"on {'them' if len(ignored) > 1 else 'it'}): " + " ".join(ignored))


# -- the long-running commands (keep, serve: docs/fleet.md, docs/serve.md) -----------------------------------

#: keep: the server kept; serve: the server served (each, or the configuration file's)
KeepServerOpt = Annotated[Optional[str], typer.Option("--server", metavar="URL",
                                                      help="The llama-server's base URL, e.g. http://127.0.0.1:8080 "
                                                           "(or the configuration's).")]
UpstreamOpt = Annotated[Optional[str], typer.Option("--upstream", metavar="URL",
                                                    help="The llama-server (or llama-swap) to serve, e.g. "
                                                         "http://127.0.0.1:8080 (or the configuration's).")]
KeptSlotDirOpt = Annotated[Optional[Path], typer.Option("--slot-dir", file_okay=False, metavar="DIR",
                                                        help="The server's --slot-save-path as this machine sees "
                                                             "it.")]
KeptStoreOpt = Annotated[Optional[str], store_option("Where the states are kept: a directory or an s3:// prefix "
                                                     "(docs/store.md; default: --slot-dir itself).")]
#: the store's budget (default: the configuration file's max_size)
StoreBudgetOpt = Annotated[Optional[str], typer.Option("--max-size", metavar="SIZE",
                                                       help="Keep the store under SIZE (20G, 500M) by prune's rules, "
                                                            "least recently used first.")]
#: the store's catalog: its verdicts and the stored states' tokens (slotctl.keeping.states)
StoreCatalogOpt = Annotated[bool, typer.Option("--no-cache", help="Do not use the store's catalog (its SQLite index "
                                               "of the stored states' tokens and verdicts): read and judge every "
                                               "stored state again.")]
LeaseOpt = Annotated[Optional[float], typer.Option("--lease", min=1.0, max=86400.0, metavar="SECONDS",
                                                   help="With an s3:// store: seconds the process's lease holds "
                                                        "without a renewal [default: 60].")]
#: default :data:`slotctl.live.SLOT_FILE_TIMEOUT` (a save or restore moves a whole slot file)
KeptTimeoutOpt = Annotated[Optional[float], typer.Option("--timeout", min=0.001, max=86400.0, metavar="SECONDS",
                                                         help="Give up on a request to the server (a save, a "
                                                              "restore) after this many seconds [default: 600].")]
EventsJsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON line per event on stdout (docs/json.md) "
                                             "instead of log lines on stderr.")]
#: the server's flags it does not report, as given (its saves say them and win: slotctl.server.saved)
UnreportedKvuOpt = Annotated[bool, typer.Option("--kv-unified", "-kvu", help="The server runs with -kvu (not "
                                                "reported by the server; learnt from its saves, which win): "
                                                "states are judged, and converted, for it.")]
#: ``UnreportedCtkOpt``, ``UnreportedCtvOpt``: -ctk/-ctv spelled as the server spells them (:func:`flag_option`),
#: made on first use (:func:`__getattr__`: the flag tables are read only by the commands that take them)
_UNREPORTED_TYPES = {"UnreportedCtkOpt": ("cache_type_k", "-ctk"), "UnreportedCtvOpt": ("cache_type_v", "-ctv")}
# keep's own
EveryOpt = Annotated[Optional[float], typer.Option("--every", min=0.05, max=86400.0, metavar="SECONDS",
                                                   help="Seconds between two looks at the server [default: 30].")]
MinTokensOpt = Annotated[Optional[int], typer.Option("--min-tokens", min=1, max=1 << 24, metavar="N",
                                                     help="Save only slots whose last prompt had at least N tokens "
                                                          "[default: 1].")]
KeepNewestOpt = Annotated[Optional[int], typer.Option("--keep-newest", min=1, max=1 << 20, metavar="N",
                                                      help="Keep only the newest N states of each slot and model "
                                                           "(older ones deleted after each new state).")]
ProveRestoresOpt = Annotated[Optional[bool], typer.Option("--prove/--no-prove", help="Prove each restore with the "
                                                          "server's own counts [default: --prove].")]
KeepListenOpt = Annotated[Optional[str], typer.Option("--listen", metavar="HOST:PORT",
                                                      help="Serve /metrics, /livez, /readyz and the slots' page /ui "
                                                           "there (loopback unless a host is given).")]
SaveAllOpt = Annotated[bool, typer.Option("--save-all", help="One pass, then exit: save every idle slot whose state "
                                          "the store does not have (llama-swap's cmdStop).")]
RestoreAllOpt = Annotated[bool, typer.Option("--restore-all", help="One pass, then exit: restore (and prove) every "
                                             "empty slot from the store.")]
ForceRestoreOpt = Annotated[bool, typer.Option("--force", help="Restore a stored state even when validate says the "
                                               "server now running refuses it or aborts on it.")]
AllowLossyOpt = Annotated[bool, typer.Option("--allow-lossy", help="Re-encode a stored state's cache rows when the "
                                             "server's cache types changed (lossy).")]
# serve's own
ServeListenOpt = Annotated[Optional[str], typer.Option("--listen", metavar="HOST:PORT",
                                                       help="Where serve listens (port 0: any free port, said on "
                                                            "the first line) [default: 127.0.0.1:8081].")]
MetricsListenOpt = Annotated[Optional[str], typer.Option("--metrics-listen", metavar="HOST:PORT",
                                                         help="Serve /metrics, /livez and /readyz there, apart from "
                                                              "the proxy (loopback unless a host is given).")]
MinGainOpt = Annotated[Optional[int], typer.Option("--min-gain", min=1, metavar="N",
                                                   help="Restore a stored state only when it keeps at least N "
                                                        "prompt tokens more than the slot holds [default: 16].")]

# -- directories: ls and prune ----------------------------------------------------------------------------

FileCatalogOpt = Annotated[bool, typer.Option("--no-cache", help="Read every file: do not use the catalog (what "
                                              "reading each unchanged file found, kept by ls and prune under the "
                                              "user's cache directory).")]
PruneMaxSizeOpt = Annotated[Optional[str], typer.Option("--max-size", metavar="SIZE",
                                                        help="Delete least recently used files until the directory "
                                                             "holds at most SIZE (20G, 500M, bytes).")]


def __getattr__(name: str) -> Any:
    """The aliases made on first use (:data:`_UNREPORTED_TYPES`)."""
    if name in _UNREPORTED_TYPES:
        field, said = _UNREPORTED_TYPES[name]
        alias = Annotated[Optional[str], flag_option(field, help=f"The server's {said} (not reported; learnt from "
                                                                 f"its saves, which win; default f16).")]
        globals()[name] = alias
        return alias
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
