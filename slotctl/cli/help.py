"""Help and usage errors, for terminals, pipes and docs/cli.md alike.

Help is plain text laid out by click's formatter: option names are never cut (a long one puts its
help on the next line), flags show no metavar, options are grouped under their ``rich_help_panel``
heading (model, output, server flags, ...). :func:`markdown` renders the same rows for docs/cli.md.
A usage error is one line that names the flag as it was typed.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

import typer

#: what typer builds, named for the annotations only (typer's click is not public: its objects are used
#: through their public attributes and methods)
Command = Parameter = HelpFormatter = Any

#: the heading of options without a panel
OPTIONS = "Options"


class _Light:
    def get_help_option(self, ctx: typer.Context):
        from slotctl.cli.params import lighten_param

        opt = super().get_help_option(ctx)
        return opt if opt is None else lighten_param(opt)


class HelpCommand(_Light):
    """Mixed into a command class: slotctl's help layout instead of typer's boxes."""

    def format_help(self, ctx: typer.Context, formatter: HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, usage_pieces(self, ctx))
        _write_help_text(self, formatter)
        for title, rows in param_sections(self, ctx):
            with formatter.section(title):
                formatter.write_dl(rows, col_max=32)


class HelpGroup(_Light):
    """Mixed into the command group: lists its commands from summaries (no command module imported)."""

    summaries_only = False

    @contextlib.contextmanager
    def summaries(self) -> Iterator[None]:
        self.summaries_only = True
        try:
            yield
        finally:
            self.summaries_only = False

    def format_help(self, ctx: typer.Context, formatter: HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, "[OPTIONS] COMMAND [ARGS]...")
        _write_help_text(self, formatter)
        for title, rows in command_sections(self, ctx):
            with formatter.section(title):
                formatter.write_dl(rows, col_max=32)
        for title, rows in param_sections(self, ctx):
            with formatter.section(title):
                formatter.write_dl(rows, col_max=32)

    def shell_complete(self, ctx, incomplete):
        with self.summaries():
            return super().shell_complete(ctx, incomplete)


def _write_help_text(cmd: Command, formatter: HelpFormatter) -> None:
    if cmd.help:
        formatter.write_paragraph()
        with formatter.indentation():
            formatter.write_text(cmd.help)


def command_sections(group, ctx: typer.Context) -> list[tuple[str, list[tuple[str, str]]]]:
    """The group's commands as (heading, [(name, summary)]), headings in order of first appearance."""
    sections: dict[str, list[tuple[str, str]]] = {}
    with group.summaries():
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            if cmd is None or cmd.hidden:
                continue
            title = getattr(cmd, "rich_help_panel", None) or "Commands"
            sections.setdefault(title, []).append((name, cmd.help or ""))
    return list(sections.items())


def usage_pieces(cmd: Command, ctx: typer.Context) -> str:
    pieces = ["[OPTIONS]"]
    for p in cmd.get_params(ctx):
        if _is_argument(p):
            name = _arg_name(p)
            pieces.append(name if p.required else f"[{name}]")
    return " ".join(pieces)


def param_sections(cmd: Command, ctx: typer.Context) -> list[tuple[str, list[tuple[str, str]]]]:
    """The command's parameters as (heading, [(names, help)]): arguments first, then each option panel in
    order of first appearance, the options without a panel (help, completion) last."""
    sections: dict[str, list[tuple[str, str]]] = {}
    for p in cmd.get_params(ctx):
        if getattr(p, "hidden", False):
            continue
        if _is_argument(p):
            sections.setdefault("Arguments", []).append((_arg_name(p), _param_help(p)))
        else:
            title = getattr(p, "rich_help_panel", None) or OPTIONS
            sections.setdefault(title, []).append((option_names(p), _param_help(p)))
    ordered = [t for t in sections if t not in ("Arguments", OPTIONS)]
    ordered = (["Arguments"] if "Arguments" in sections else []) + ordered + ([OPTIONS] if OPTIONS in sections else [])
    return [(t, sections[t]) for t in ordered]


def _is_argument(p: Parameter) -> bool:
    return getattr(p, "param_type_name", "") == "argument"


def _arg_name(p: Parameter) -> str:
    name = p.metavar or (p.name or "").upper()
    return f"{name}..." if p.nargs == -1 else name


def option_names(p: Parameter) -> str:
    """``-m, --model FILE``: short names first, then long ones, then the metavar (none for a flag)."""
    opts = sorted(p.opts, key=lambda o: (o.startswith("--"),))  # stable: the declared order within each kind
    names = ", ".join(opts)
    if getattr(p, "secondary_opts", None):
        names += " / " + ", ".join(p.secondary_opts)
    mv = metavar(p)
    return f"{names} {mv}" if mv else names


def metavar(p: Parameter) -> str:
    """What follows the option: its declared metavar, or a word for its type; nothing for flags."""
    from slotctl.cli.params import path_kind, plain

    if getattr(p, "is_flag", False) or getattr(p, "count", False):
        return ""
    if p.metavar:
        return p.metavar
    spec = plain(p)
    if spec is None:
        return "VALUE"
    if spec.leaf not in (str, int, float, bool):
        return {"file": "FILE", "dir": "DIR"}.get(path_kind(spec.info), "PATH")
    return {int: "N", float: "X", str: "TEXT"}.get(spec.leaf, "VALUE")


def _param_help(p: Parameter) -> str:
    text = " ".join((getattr(p, "help", None) or "").split())
    extra = []
    lo, hi = getattr(p, "min", None), getattr(p, "max", None)
    if lo is not None and hi is not None:
        extra.append(f"{lo} to {hi}")
    elif lo is not None and lo != 0:
        extra.append(f"at least {lo}")
    default = _default_text(p)
    if default:
        extra.append(f"default: {default}")
    if p.required:
        extra.append("required")
    if extra:
        text = f"{text} [{'; '.join(extra)}]".strip()
    return text


def _default_text(p: Parameter) -> str:
    if getattr(p, "show_default", True) is False or _is_argument(p):
        return ""
    d = p.default
    if callable(d) or d is None or d == () or d == [] or d == "":
        return ""
    if getattr(p, "is_flag", False):
        if getattr(p, "secondary_opts", None):
            return p.opts[-1] if d else p.secondary_opts[-1]
        return ""
    return str(getattr(d, "value", d))


# -- usage errors ---------------------------------------------------------------------------------------


#: a value typed longer than this is named by its length in a usage error, not echoed (a 5,000,000-digit
#: number is one line either way, but not one a person reads)
MAX_ECHO = 256


def usage_error_line(e: typer.TyperException, argv: list[str]) -> str:
    """One line for a usage error, naming the flag as it was typed and pointing at the command's help."""
    from slotctl.cli.params import MissingValue

    param = getattr(e, "param", None)
    if isinstance(e, MissingValue) and param is not None:
        if _is_argument(param):
            msg = f"missing argument {_arg_name(param)}"
        else:
            msg = f"missing option {option_names(param)}"
    elif isinstance(e, typer.BadParameter) and param is not None:
        if _is_argument(param):
            where = _arg_name(param)
        else:
            where = typed_name(param, argv)
            value = typed_value(where, argv)
            if value is not None:
                where += f" {value}" if len(value) <= MAX_ECHO else f" ({len(value):,} characters)"
        msg = f"{where}: {_plain(e.message)}"
    elif isinstance(e, typer.BadParameter):  # raised by slotctl with the whole message (no parameter)
        msg = _plain(e.message)
    else:
        msg = _sentence(e.format_message())
    msg = " ".join(msg.split())
    ctx = getattr(e, "ctx", None)
    if ctx is not None:
        msg += f" (see: {ctx.command_path} --help)"
    return msg


def typed_name(param: Parameter, argv: list[str]) -> str:
    """The name of ``param`` as the user typed it (the last one given wins, as for the value)."""
    names = [*param.opts, *getattr(param, "secondary_opts", [])]
    typed = None
    for a in argv:
        if a == "--":
            break
        for n in names:
            if a == n or (a.startswith(n + "=") and n.startswith("--")):
                typed = n
    return typed or max(names, key=len)


def typed_value(name: str, argv: list[str]) -> str | None:
    """The value given to the option typed as ``name`` (its last occurrence), or None."""
    value = None
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif name.startswith("--") and a.startswith(name + "="):
            value = a[len(name) + 1:]
    return value


#: the type checker's wording, said as slotctl says it
_PLAIN = (
    (re.compile(r"Input should be a valid integer.*"), "expected a whole number"),
    (re.compile(r"Input should be a valid number.*"), "expected a number"),
    (re.compile(r"Input should be greater than or equal to (\S+)"), r"expected \1 or more"),
    (re.compile(r"Input should be greater than (\S+)"), r"expected more than \1"),
    (re.compile(r"Input should be less than or equal to (\S+)"), r"expected \1 or less"),
    (re.compile(r"Input should be less than (\S+)"), r"expected less than \1"),
)


def _plain(message: str) -> str:
    message = _sentence(message)
    for pattern, words in _PLAIN:
        if pattern.fullmatch(message):
            return pattern.sub(words, message)
    return message


def _sentence(text: str) -> str:
    text = text.strip()
    return text[:-1] if text.endswith(".") and not text.endswith("..") else text


# -- docs/cli.md ----------------------------------------------------------------------------------------


def markdown(group, ctx: typer.Context, commands: list[tuple[str, Command, typer.Context]]) -> str:
    """The command reference in markdown: the group, then each command (usage, help, one table per panel)."""
    out = ["# Command reference", "",
           "Generated from the commands themselves by `scripts/gen_cli_docs.py`; do not edit by hand. "
           "`slotctl COMMAND --help` shows the same.", ""]
    out += [f"## {ctx.command_path}", "", "```", f"{ctx.command_path} [OPTIONS] COMMAND [ARGS]...", "```", "",
            _md_text(group.help), ""]
    for title, rows in command_sections(group, ctx):
        out += [f"**{title}**", "", "| command | what it does |", "|---|---|"]
        out += [f"| [`{name}`](#{_anchor(ctx.command_path + ' ' + name)}) | {_md_cell(text)} |" for name, text in rows]
        out.append("")
    out += _md_params(group, ctx)
    for name, cmd, sub in commands:
        out += [f"## {sub.command_path}", "", "```", f"{sub.command_path} {usage_pieces(cmd, sub)}", "```", "",
                _md_text(cmd.help), ""]
        out += _md_params(cmd, sub)
    return "\n".join(line.rstrip() for line in out).rstrip() + "\n"


def _md_params(cmd, ctx) -> list[str]:
    out = []
    for title, rows in param_sections(cmd, ctx):
        out += [f"**{title}**", "", "| option | meaning |" if title != "Arguments" else "| argument | meaning |",
                "|---|---|"]
        out += [f"| `{names}` | {_md_cell(text)} |" for names, text in rows]
        out.append("")
    return out


def _md_text(text: str | None) -> str:
    """Docstring paragraphs as markdown paragraphs (each joined into one line)."""
    paras = [" ".join(p.split()) for p in (text or "").replace("\b", "").split("\n\n")]
    return "\n\n".join(p for p in paras if p)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def _anchor(title: str) -> str:
    return "".join(ch for ch in title.lower().replace(" ", "-") if ch.isalnum() or ch in "-_")
