"""llama-server's command line among a command's own options (``save -m M -c 4096 -ngl 99 ...``, ``--server-args
'...'`` or ``@FILE``, a whole command line pasted as it is): the flags slotctl uses taken as its own options, the
other flags b11434 takes removed with their values (:func:`server_command_line`)."""

from __future__ import annotations

from pathlib import Path

import typer

#: the parameter that takes llama-server's command line as one argument (``--server-args``)
SERVER_ARGS_PARAM = "server_args"
#: parameters that only live mode (``--server URL``) takes; in ``--server-args`` without ``--server`` they
#: are the server's own flags of the same names (``--api-key``, ``--timeout``), ignored
LIVE_ONLY_PARAMS = ("api_key", "timeout", "router_model")


#: the parameters whose options mean what llama-server's flags of the same spellings mean: the server flags
#: (added by :func:`slotctl.cli.server_panel.with_server_flags`) and these; in ``--server-args`` only they are
#: read as slotctl's
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
    (:func:`slotctl.cli.command_line.pasted_slot_dir`: ``ls`` and ``prune`` read DIR when given no path).
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
