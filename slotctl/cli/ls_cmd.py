"""``slotctl ls [DIR|FILE...]``: one row per slot file, and what a server does with each."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Iterable, Optional

import typer
from rich.text import Text

from slotctl.cli import remote
from slotctl.cli.common import handle_errors, store_deadline
from slotctl.cli.command_line import ArgsCommand, remote_paths
from slotctl.cli.options import (
    DraftModelOpt,
    FileCatalogOpt,
    JudgeServerOpt,
    JsonOpt,
    LiveApiKeyOpt,
    LiveTimeoutOpt,
    ModelOpt,
    ServerBuildOpt,
    ServerStateVersionOpt,
    SlotOpt,
    VerboseOpt,
)
from slotctl.cli.server_panel import with_server_flags
from rich.cells import cell_len

from slotctl.cli.output import FOLD_WIDTH, Output, escape_text, human_bytes, style_of
from slotctl.server.builds import NEWEST as NEWEST_BUILD
from slotctl.server.flags import SERVER_STATE_VERSION, ServerFlags
from slotctl.live import DEFAULT_TIMEOUT
from slotctl.errors import UsageError, worst

SORT_KEYS = ("name", "size", "age", "tokens")


def register(app: typer.Typer) -> None:
    app.command("ls", cls=ArgsCommand)(ls)


@handle_errors
@with_server_flags
def ls(
    ctx: typer.Context,
    paths: Annotated[Optional[list[Path]], typer.Argument(help="Slot files or directories (such as a server's "
                                                          "--slot-save-path); default: the current directory.")
                     ] = None,
    sort: Annotated[str, typer.Option("--sort", metavar="KEY", help="name, size (largest first), age (oldest "
                                      "first) or tokens (most first).")] = "name",
    reverse: Annotated[bool, typer.Option("--reverse", "-r", help="Reverse the order.")] = False,
    broken: Annotated[bool, typer.Option("--broken", help="Only files the server refuses or aborts on whatever "
                                         "its flags (damage in the file itself), and those it may: undecided "
                                         "without -m (give -m to decide them).")] = False,
    mismatched: Annotated[bool, typer.Option("--mismatched", help="Only files refused only by the flags or model "
                                             "given: they restore in a server started as they were saved (the "
                                             "remedy: convert, or the flag).")] = False,
    useless: Annotated[bool, typer.Option("--useless", help="Only files the server restores but reuses none of.")
                       ] = False,
    fail_useless: Annotated[bool, typer.Option("--fail-useless", help="Exit 1 when a listed file is useless (the "
                                               "server restores it but reuses none of it); for scripts.")] = False,
    has_draft: Annotated[bool, typer.Option("--has-draft", help="Only files holding draft state (SDFT or "
                                            "checkpoint draft blobs).")] = False,
    verdict: Annotated[Optional[list[str]], typer.Option("--verdict", metavar="V", help="Only files with this "
                                                         "verdict (repeatable): restores, restores_with_drops, "
                                                         "other_model, corrupt, aborts, refused, unreadable.")] = None,
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    slot: SlotOpt = 0,
    state_version: ServerStateVersionOpt = SERVER_STATE_VERSION,
    server_build: ServerBuildOpt = NEWEST_BUILD,
    load: Annotated[bool, typer.Option("--load", help="With -m: also load every layer of every file into real "
                                       "contexts (validate's real check; slow).")] = False,
    server: JudgeServerOpt = None,
    api_key: LiveApiKeyOpt = None,
    timeout: LiveTimeoutOpt = DEFAULT_TIMEOUT,
    jobs: Annotated[Optional[int], typer.Option("--jobs", "-j", min=1, help="Worker processes (default: the "
                                                "CPUs, for more than a few dozen files).")] = None,
    no_cache: FileCatalogOpt = False,
    json_out: JsonOpt = False,
    jsonl: Annotated[bool, typer.Option("--jsonl", help="One JSON object per file and line, then a summary line.")
                     ] = False,
    verbose: VerboseOpt = False,
    flags: ServerFlags = ServerFlags(),
) -> None:
    """List slot files: size, age, state version, tokens, memory kind, checkpoints, draft-state bytes, and
    the verdict of validate for each (what a server does with it).

    Reads metadata only, never tensor bytes, spread over the CPUs. Without -m the verdict comes from the
    structure and the server's own rules; with -m (and -md) and the server's flags it adds validate's
    prediction, and --load its real check. In a directory, the slot files are the files that begin with
    the state magic and the files named *.bin (an empty or overwritten one is listed as refused); the
    others are left out and counted. A file named that cannot be read is a row of its own. Totals at the
    bottom. Details: docs/directories.md.

    Exit codes: 0 every listed file restores completely; 1 a listed file is damaged, refused, makes the
    server abort or loses a layer; 2 usage or I/O error (a file that cannot be read); 3 without -m, a
    listed file is undecided and none failed. A run reports the worst: 2, then 1, then 3.
    """
    from slotctl.catalog import Known, Request, catalog, is_broken, is_mismatched, is_undecided, is_useless
    from slotctl.validate.words import VERDICTS as VERDICT_NAMES

    store = store_deadline(timeout if remote._source(ctx, "timeout") == "COMMANDLINE" else None, paths or [])
    out = Output(json_mode=json_out or jsonl, verbose=verbose)
    if sort not in SORT_KEYS:
        raise UsageError(f"--sort {sort}: expected one of {', '.join(SORT_KEYS)}")
    for v in verdict or ():
        if v not in VERDICT_NAMES:
            raise UsageError(f"--verdict {v}: expected one of {', '.join(VERDICT_NAMES)}")
    if json_out and jsonl:
        raise UsageError("give --json or --jsonl, not both")
    if load and model is None:
        raise UsageError("--load needs -m (the model to load the files with)")
    lv = remote.learn_from_server(ctx, out, "ls", server, api_key=api_key, timeout=timeout, flags=flags,
                                  model=model, draft_model=draft_model, slot=slot, mmproj=False,
                                  state_version=state_version, store=store)
    from slotctl.server.builds import from_build_info, get as get_build

    try:
        server_build = get_build(server_build).name
    except ValueError as e:
        raise UsageError(f"--server-build: {e}") from None
    if lv is not None:
        model, draft_model, flags, slot = lv.model, lv.draft_model, lv.server_flags, lv.slot
        server_build = from_build_info(lv.facts.build_info)[0]
    setup = None
    if model is not None or state_version != 4 or slot or flags != ServerFlags() or server_build != NEWEST_BUILD:
        from slotctl.server.flags import attn_rot_disable
        from slotctl.validate import ServerSetup

        setup = ServerSetup.from_flags(flags, target=model, draft=draft_model, slot=slot,
                                       mmproj=lv.mmproj if lv is not None else False,
                                       state_version=state_version, attn_rot_disable=attn_rot_disable(),
                                       build=server_build)
        if model is not None:
            from slotctl.validate import Models

            Models(setup)   # unreadable models and settings llama.cpp refuses: usage errors before any file

    from slotctl.inputs import expand_slot_paths

    if not paths:     # none given: the --slot-save-path of a pasted server command line, else here
        from slotctl.cli.command_line import pasted_slot_dir

        paths = [Path(pasted_slot_dir(ctx) or ".")]
    request = Request(setup=setup, real_check=load, verbose=verbose)
    # the catalog: a file whose identity has not changed is neither opened nor parsed (--no-cache: every one is)
    known = None if no_cache else Known(request, log=out.log if verbose else None)
    given = remote_paths(ctx, paths)
    expansion = expand_slot_paths(given, follow_symlinks=True, known=known)
    files, not_slot = expansion.files, len(expansion.skipped)
    # the files named as such (not found in a directory or prefix): one that is missing is an error (exit 2);
    # one a directory's listing named that is gone when read was deleted meanwhile: skipped, and said
    named = {str(p) for p in given} - {str(c) for c in expansion.containers}
    prefixes = expansion.prefixes
    want = set(verdict or ())

    def keep(row: dict) -> bool:
        if fail_useless and is_useless(row):
            row["exit_code"] = int(worst([row["exit_code"], 1]))    # the opt-in exit code (docs/exit-codes.md)
        chosen = [f for f, on in ((lambda r: is_broken(r) or is_undecided(r), broken), (is_mismatched, mismatched),
                                  (is_useless, useless)) if on]
        if chosen and not any(f(row) for f in chosen):
            return False
        if has_draft and not row["draft_size"]:
            return False
        return not want or row["verdict"] in want

    totals = _Totals(not_slot, prefixes)
    names = len(paths) == 1 and bool(expansion.containers)   # a directory or prefix, listed once
    human = _Cells(show_reuse=model is not None, names=names) if not (json_out or jsonl) else None
    with out.progress("reading", total=len(files)) as update:
        def rows() -> Iterable[dict]:
            for i, row in enumerate(catalog(files, request, processes=jobs, index=not no_cache, known=known), 1):
                update(i)
                if (row.get("error") or {}).get("code") == "no_such_file" and row["path"] not in named:
                    totals.vanished += 1
                    if human is not None:
                        out.note(f"{row['path']}: gone since it was listed (deleted meanwhile): skipped")
                    continue
                totals.seen(row)
                if human is not None and row.get("error") and row.get("exit_code") == 2:
                    # a file that cannot be read: its row, and its line on stderr, as inspect and validate (a
                    # damaged one is a row with its verdict only)
                    out.error(row["error"]["message"])
                if keep(row):
                    totals.add(row)
                    yield row

        if sort == "name" and not reverse and not json_out:
            listed: Iterable[dict] = rows()        # streamed (--jsonl): memory stays flat in the number of files
        else:
            listed = sorted(rows(), key=_SORTS[sort], reverse=reverse)
        if jsonl:
            for row in listed:
                out.json_line(row)
            out.json_line({"summary": totals.summary(), "exit_code": totals.exit_code})
        elif json_out:
            rows_list = list(listed)
            summary = totals.summary()
            if lv is not None:
                summary["server"] = lv.as_dict()
            out.json({"files": rows_list, "summary": summary, "exit_code": totals.exit_code})
        else:
            for row in listed:
                human.add(row)     # a few short strings per file, laid out once every width is known
    if human is not None:          # printed once the progress bar is gone (it is never left on screen)
        human.render(out, totals, broken=broken)
    if totals.exit_code:
        raise typer.Exit(totals.exit_code)


_SORTS = {
    "name": lambda r: r["name"],
    "size": lambda r: -(r["size"] or 0),
    "age": lambda r: -(r["age_seconds"] or 0),
    "tokens": lambda r: -(r["n_tokens"] or 0),
}


class _Totals:
    def __init__(self, not_slot: int, prefixes: list[str] = ()):
        self.not_slot = not_slot
        self.prefixes = list(prefixes)
        #: files a listing named that were gone when read (deleted meanwhile): skipped
        self.vanished = 0
        self.files = self.size = self.tokens = self.draft = self.checkpoints = 0
        self.read = 0
        self.verdicts: dict[str, int] = {}
        self.classes: dict[str, int] = {}
        self.codes: set[int] = set()

    def seen(self, row: dict) -> None:
        self.read += 1

    def add(self, row: dict) -> None:
        self.files += 1
        self.size += row["size"] or 0
        self.tokens += row["n_tokens"] or 0
        self.draft += row["draft_size"]
        self.checkpoints += len(row["checkpoints"])
        self.verdicts[row["verdict"]] = self.verdicts.get(row["verdict"], 0) + 1
        if row.get("class"):
            self.classes[row["class"]] = self.classes.get(row["class"], 0) + 1
        self.codes.add(row["exit_code"])

    @property
    def exit_code(self) -> int:
        return int(worst(self.codes))

    def summary(self) -> dict:
        from slotctl.validate.words import VERDICTS as VERDICT_NAMES

        return {"files": self.files, "read": self.read, "skipped": self.not_slot, "vanished": self.vanished,
                "size": self.size,
                "n_tokens": self.tokens, "draft_size": self.draft, "n_checkpoints": self.checkpoints,
                "verdicts": {v: self.verdicts.get(v, 0) for v in VERDICT_NAMES},
                "classes": {c: self.classes.get(c, 0) for c in ("ok", "broken", "mismatch", "useless", "undecided")},
                "prefixes": list(self.prefixes)}


def human_age(seconds: int | None) -> str:
    if seconds is None:
        return "-"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds // n}{unit}"
    return f"{seconds}s"


#: the columns before the name, and whether each is aligned left (the others right)
_COLUMNS = (("size", False), ("age", False), ("ver", False), ("tokens", False), ("kind", True), ("ckpt", False),
            ("draft", False), ("verdict", True), ("class", True))
class _Cells:
    """The human listing: each row's cells as short strings, laid out when every width is known.

    As a table when it fits the output's width: the columns as wide as their widest cell, the name last
    (folded onto lines of its own below its column when it is longer than the room left, never cut).
    When even a name column of :data:`~slotctl.cli.output.FOLD_WIDTH` does not fit, each file is its name
    on a line, then its ``column: value`` items packed into lines (as inspect and validate show a table
    that does not fit)."""

    def __init__(self, *, show_reuse: bool, names: bool):
        self.names = names
        self.columns = list(_COLUMNS) + ([("reuse", False)] if show_reuse else [])
        self.rows: list[tuple[list[str], str, str | None]] = []

    def add(self, r: dict) -> None:
        cells = [human_bytes(r["size"]), human_age(r["age_seconds"]), str(r["state_version"] or "-"),
                 f"{r['n_tokens']:,}" if r["n_tokens"] is not None else "-", r["memory_kind"] or "-",
                 str(len(r["checkpoints"])), human_bytes(r["draft_size"]) if r["draft_size"] else "-",
                 r["verdict"], r.get("class") or "-"]
        if len(self.columns) > len(_COLUMNS):
            cells.append(_reuse_text(r.get("reuse")))
        error = r["error"]["message"] if r.get("error") else None
        if r.get("remedy") and r.get("class") in ("mismatch", "useless"):
            what = "refused only by the flags given" if r["class"] == "mismatch" else "reuses nothing"
            error = (f"{what}: {r['remedy']}" if error is None or error == r["remedy"]
                     else f"{error} ({what}: {r['remedy']})")
        if r.get("uncertain"):     # the verdict rests on undefined behaviour or on a reading: said in words too
            doubt = "not certain: " + "; ".join(r["uncertain"])
            error = doubt if error is None else f"{error} ({doubt})"
        self.rows.append((cells, escape_text(r["name" if self.names else "path"], keep_newlines=False),
                          None if error is None else escape_text(error, keep_newlines=False)))

    def _drop_column(self, title: str) -> None:
        i = [t for t, _ in self.columns].index(title)
        del self.columns[i]
        self.rows = [(cells[:i] + cells[i + 1:], name, error) for cells, name, error in self.rows]

    def render(self, out: Output, totals: _Totals, *, broken: bool) -> None:
        if not any(c in ("mismatch", "useless") for c in totals.classes):
            # the class says no more than the verdict (ok: restores, broken: refused or aborts): not shown
            self._drop_column("class")
        width = out.console.width
        heads = [title for title, _ in self.columns]
        widths = [max([cell_len(h)] + [cell_len(cells[i]) for cells, _, _ in self.rows])
                  for i, h in enumerate(heads)]
        name_head = "name" if self.names else "path"
        longest = max([cell_len(name_head)] + [cell_len(n) for _, n, _ in self.rows])
        # two spaces between columns when every name fits that way, else one; else the names fold
        gap = next((g for g in (2, 1) if sum(widths) + g * len(widths) + longest <= width), 1)
        room = width - sum(widths) - gap * len(widths)
        if room >= min(FOLD_WIDTH, longest) and out.plain:
            # no styles to draw (a pipe): the same lines as plain text, without rich's work per line (10,000
            # rows: 0.1 s instead of 7 s); an error said of many files is wrapped once
            wrapped: dict[str, list[str]] = {}

            def lines() -> Iterable[str]:
                yield self._plain(heads, widths, gap, name_head, room)
                for cells, name, error in self.rows:
                    yield self._plain(cells, widths, gap, name, room)
                    if error is not None:
                        got = wrapped.get(error)
                        if got is None:
                            got = wrapped[error] = out.wrapped(error, 4)
                        yield from got

            out.lines(lines())
        elif room >= min(FOLD_WIDTH, longest):
            out.print(self._line(heads, widths, gap, name_head, room, head=True))
            for cells, name, error in self.rows:
                out.print(self._line(cells, widths, gap, name, room))
                if error is not None:
                    out.indented(Text(error, style="dim"), 4)
        else:
            for cells, name, error in self.rows:
                verdict = cells[heads.index("verdict")]
                out.print(Text.assemble((name, "bold"), "  ", self._cell("verdict", verdict), overflow="fold"))
                out.record([(h, self._cell(h, c)) for h, c in zip(heads, cells) if h != "verdict"], indent=2, hang=0)
                if error is not None:
                    out.indented(Text(error, style="dim"), 4)
        out.print(_tail(totals, broken=broken))

    def _cell(self, title: str, value: str) -> Text:
        if title == "class":
            return Text(value, style=style_of(f"class.{value}", style_of(value)))
        return Text(value, style=style_of(value) if title == "verdict" else "")

    def _line(self, cells: list[str], widths: list[int], gap: int, name: str, room: int, *,
              head: bool = False) -> Text:
        t = Text(style="bold" if head else "")
        for (title, left), w, c in zip(self.columns, widths, cells):
            pad = " " * (w - cell_len(c))
            cell = Text(c) if head else self._cell(title, c)
            if left:
                t.append_text(cell)
                t.append(pad)
            else:
                t.append(pad)
                t.append_text(cell)
            t.append(" " * gap)
        indent = Text(" " * cell_len(t.plain))
        pieces = _fold(name, room)
        t.append(pieces[0])
        for piece in pieces[1:]:
            t.append("\n")
            t.append_text(indent)
            t.append(piece)
        return t


    def _plain(self, cells: list[str], widths: list[int], gap: int, name: str, room: int) -> str:
        """:meth:`_line`'s text, plain."""
        parts = []
        for (_, left), w, c in zip(self.columns, widths, cells):
            pad = " " * (w - _width(c))
            parts.append(c + pad if left else pad + c)
        spaces = " " * gap
        head = spaces.join(parts) + spaces
        pieces = _fold(name, room)
        if len(pieces) == 1:
            return head + pieces[0]
        return head + pieces[0] + "".join("\n" + " " * cell_len(head) + piece for piece in pieces[1:])


def _width(text: str) -> int:
    """The terminal cells of ``text``: its length when it is printable ASCII (one cell each), else rich's."""
    return len(text) if text.isascii() and text.isprintable() else cell_len(text)


def _fold(text: str, width: int) -> list[str]:
    """``text`` in pieces of at most ``width`` terminal cells (all of it: nothing is cut)."""
    if text.isascii() and text.isprintable():      # one cell a character: pieces of ``width`` characters
        return [text[i:i + width] for i in range(0, len(text), width)] or [""]
    pieces, piece = [], ""
    for ch in text:
        if piece and cell_len(piece + ch) > width:
            pieces.append(piece)
            piece = ""
        piece += ch
    return pieces + [piece]


def _tail(totals: _Totals, *, broken: bool) -> Text:
    s = totals.summary()
    verdicts = ", ".join(f"{n} {v}" for v, n in s["verdicts"].items() if n)
    tail = (f"total: {s['files']:,} file(s), {human_bytes(s['size'])}, {s['n_tokens']:,} tokens, "
            f"{s['n_checkpoints']:,} checkpoint(s), draft state {human_bytes(s['draft_size'])}"
            + (f"; {verdicts}" if verdicts else ""))
    if s["read"] != s["files"]:
        tail += f" ({s['read'] - s['files']:,} filtered out)"
    if s["skipped"]:
        tail += f"; {s['skipped']:,} file(s) that are not slot files left out"
    if s["vanished"]:
        tail += f"; {s['vanished']:,} file(s) gone since they were listed, skipped"
    if s["prefixes"]:
        tail += f"; sub-prefixes (not read, as subdirectories): {', '.join(escape_text(p) for p in s['prefixes'])}"
    if s["verdicts"]["undecided"]:
        tail += ("; undecided: the server may restore, refuse or abort on "
                 f"{'them (listed with --broken)' if broken else 'them'}: give -m with the server's model and "
                 "flags to decide")
    return Text(tail, style="bold")


def _reuse_text(value) -> str:
    """Tokens a restored slot keeps for the next request, of those saved (``n_reused/n_tokens``)."""
    if not isinstance(value, dict) or not isinstance(value.get("n_reused"), int):
        return "-"
    return f"{value['n_reused']:,}/{value.get('n_tokens', 0):,}"
