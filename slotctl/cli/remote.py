"""Live mode's command-line side, shared by every command that can talk to a running llama-server.

Options (``--server``, ``--api-key``, ``--timeout``), the checks that keep local and live options apart,
``save --server`` and ``restore --server`` (:func:`save_on_server`, :func:`restore_on_server`) and what
``validate --server`` prints (:func:`render_live`; the flags it learns come from
:func:`slotctl.live.learn.learn_flags`). The commands ``slots`` and ``erase`` are in :mod:`slotctl.cli.live`.

Every request goes through :mod:`slotctl.live.http`: bounded by ``--timeout``, the API key from
``--api-key`` or ``LLAMA_API_KEY``; a refusal by the server exits 1, an unreachable server, a wrong key
or a usage error exits 2, always with one line on stderr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from slotctl.live import http as server_api
from slotctl.cli.command_line import raw_value
from slotctl.cli.server_args import LIVE_ONLY_PARAMS
from slotctl.cli.output import Output, escape_text, markup_safe, style_of
from slotctl.errors import UsageError

#: parameters save and restore take in live mode; any other one given is a usage error there
_LIVE_PARAMS = frozenset({"server", "api_key", "timeout", "slot", "json_out", "verbose", "name", "file", "prove",
                          "slot_dir", "router_model"})


# -- the command line as given ------------------------------------------------------------------------------


def _source(ctx: typer.Context | None, name: str) -> str | None:
    """Where parameter ``name`` came from: "COMMANDLINE", "ENVIRONMENT", "DEFAULT", ... (None: no context)."""
    if ctx is None:
        return None
    src = ctx.get_parameter_source(name)
    return getattr(src, "name", None)


def given_params(ctx: typer.Context | None) -> set[str]:
    """The command's parameters given on the command line or by environment variable."""
    if ctx is None:
        return set()
    return {p.name for p in ctx.command.params if _source(ctx, p.name) in ("COMMANDLINE", "ENVIRONMENT")}


def option_name(ctx: typer.Context | None, name: str) -> str:
    """How parameter ``name`` of the command is written: ``-o/--output``, ``--continue``, ``NAME``."""
    param = next((p for p in ctx.command.params if p.name == name), None) if ctx is not None else None
    if param is None:
        return name
    if param.param_type_name == "argument":
        return param.human_readable_name
    long = param.opts[0]
    short = min(param.opts, key=len)
    return f"{short}/{long}" if short != long else long


def refuse_local_options(ctx: typer.Context | None, command: str, why: str, also: frozenset[str] = frozenset()) -> None:
    """UsageError naming every option typed that live mode of ``command`` does not take (``also``: the
    parameters of its own that it takes besides :data:`_LIVE_PARAMS`)."""
    if ctx is None:
        return
    local = [p.name for p in ctx.command.params
             if p.name not in _LIVE_PARAMS | also and _source(ctx, p.name) == "COMMANDLINE"]
    if local:
        names = ", ".join(option_name(ctx, n) for n in local)
        raise UsageError(f"{command} --server: {names} {'is' if len(local) == 1 else 'are'} for a local "
                         f"{command} only ({why})")


def require_local(ctx: typer.Context | None, command: str, *, store: bool = False, **required: Any) -> None:
    """Local mode (no ``--server``): the options it needs are there and no live-only option was typed
    (``store``: an ``s3://`` path is given, and ``--timeout`` is its deadline)."""
    live_only = [n for n in LIVE_ONLY_PARAMS if _source(ctx, n) == "COMMANDLINE" and not (store and n == "timeout")]
    if live_only:
        names = ", ".join(option_name(ctx, n) for n in live_only)
        raise UsageError(f"{names} {'goes' if len(live_only) == 1 else 'go'} with --server URL (live mode)")
    for name, value in required.items():
        if value is None:
            raise UsageError(f"missing option {option_name(ctx, name)} (or act through a running llama-server: "
                             f"{command} --server URL --slot N NAME)")


def server_url(server: str, router_model: str | None = None) -> str:
    """The server's normalized URL; with ``router_model`` (``--router-model``), that URL is a router and every
    request to it names the model as the router routes (:mod:`slotctl.live.router`)."""
    from slotctl.live import router

    url = server_api.normalize_url(server)
    router.use_model(url, router_model)
    return url


def check_slot_dir_and_store(slot_dir: Path, store: str | None) -> None:
    """UsageError unless ``--slot-dir`` is a directory and ``--store`` a directory or an ``s3://`` prefix (keep,
    serve)."""
    if not slot_dir.is_dir():
        raise UsageError(f"--slot-dir {slot_dir}: not a directory")
    if store is not None and "://" in store and not store.startswith("s3://"):
        raise UsageError(f"--store {store}: a directory or an s3://BUCKET/PREFIX/")
    if store is not None and "://" not in store and not Path(store).is_dir():
        raise UsageError(f"--store {store}: not a directory")


def _plain(text: str) -> str:
    """Untrusted text for a rich ``Text`` (which reads no markup): control characters escaped only."""
    return escape_text(text, keep_newlines=False)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    # one table row per value: a newline from a server is shown as \n, not a second row
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else markup_safe(str(v), keep_newlines=False)


# -- save / restore --server ----------------------------------------------------------------------------------

#: what each key of a slot action's answer means (llama-server b11434; ``n_read`` is also what the servers of
#: the checkpoint and draft-state changes answer, where it counts the appendices they read)
_ANSWER_KEYS = {
    "id_slot": "the slot",
    "filename": "the file, in the server's --slot-save-path",
    "n_saved": "tokens saved (the packed token record)",
    "n_written": "bytes written (the whole file)",
    "n_restored": "tokens restored",
    "n_read": "bytes of the file read (b11434, which reads no appendix: to the end of the target payload; "
              "a server that reads appendices counts them too)",
    "n_erased": "cached tokens erased",
    "timings.save_ms": "milliseconds the server took to write",
    "timings.restore_ms": "milliseconds the server took to read",
}


def save_on_server(ctx: typer.Context | None, out: Output, server: str, name: str | None, *, slot: int,
                   api_key: str | None, timeout: float, json_out: bool, router_model: str | None = None) -> None:
    """``slotctl save --server URL --slot N NAME``: the server writes slot N to NAME in its --slot-save-path."""
    refuse_local_options(ctx, "save", "the server saves the slot as it holds it, into its --slot-save-path")
    if name is None:
        raise UsageError("save --server: give the file name, NAME, as in `slotctl save --server URL --slot N "
                         "NAME` (the server writes it into its --slot-save-path)")
    url = server_url(server, router_model)
    answer = server_api.save_slot(url, slot, name, api_key=api_key, timeout=timeout)
    _answer(out, answer, json_out, url, f"slot {slot} saved to {name}", slot=slot, name=name, note=SAVE_NOTE)


#: what ``save --server`` says every time: the server does not ask before replacing a file
SAVE_NOTE = ("the server writes NAME into its --slot-save-path whether a file of that name is there or not: an "
             "existing one is replaced (slotctl cannot see that directory; a local save keeps it unless --force)")


def restore_refused_hint(url: str, name: str, slot_dir: Path | None) -> str:
    """What to run when the server refuses to restore NAME (HTTP 400): validate says why, for that server."""
    where = str(Path(slot_dir) / name) if slot_dir is not None else f"DIR/{name}"
    return (f"ask why: slotctl validate --server {url} {where}"
            + ("" if slot_dir is not None else " (DIR: the server's --slot-save-path as this machine sees it)"))


def restore_on_server(ctx: typer.Context | None, out: Output, server: str, name: str, *, slot: int,
                      api_key: str | None, timeout: float, json_out: bool, prove: bool = False,
                      slot_dir: Path | None = None, force: bool = False, prove_anyway: bool = False,
                      router_model: str | None = None) -> None:
    """``slotctl restore --server URL --slot N NAME [--slot-dir DIR] [--prove]``: the server restores NAME
    from its --slot-save-path. With ``slot_dir`` the file is read there first and judged for that server
    (:func:`slotctl.live.judge.check_sendable`): one it refuses or aborts on is not sent unless ``force``.
    With ``prove``, the proving request (:mod:`slotctl.live.prove`) follows, unless it would spend the
    restore it proves (``prove_anyway`` sends it then too).

    NAME is taken as typed (:func:`raw_value`), not as the ``Path`` typer made of it.
    """
    refuse_local_options(ctx, "restore", "the server restores the file with its own model and flags",
                         also=frozenset({"force", "prove_anyway"}))
    name = raw_value(ctx, "file", name)
    url = server_url(server, router_model)
    local = None
    if prove and slot_dir is None:
        raise UsageError("--prove needs --slot-dir DIR, the server's --slot-save-path as this machine sees it "
                         "(the file's prompt and memory are read there)")
    if prove_anyway and not prove:
        raise UsageError("--prove-anyway goes with --prove")
    note = None
    setup = facts = None
    # a stored state of another model, or whose bytes are not the ones stored, is never sent (--force or not)
    from slotctl.live.identity import check_stored, is_stored

    if is_stored(name):
        if slot_dir is not None:
            server_api.check_filename(name)
            local = Path(slot_dir) / name
        facts = server_api.server_facts(url, slot, api_key=api_key, timeout=timeout)
        check_stored(name, facts.model_path, facts.model_meta, local=local, progress=_hashing(out))
    if slot_dir is not None:
        server_api.check_filename(name)
        local = Path(slot_dir) / name
        from slotctl.paths import check_readable

        check_readable(local, what="slot file ")
        from slotctl.live.judge import check_sendable
        from slotctl.live.prove import local_setup

        facts = facts or server_api.server_facts(url, slot, api_key=api_key, timeout=timeout)
        setup, _notes = local_setup(facts, slot)
        report = check_sendable(local, setup, force=force, remedy="--force")
        if report.refused_or_aborts:
            from slotctl.live.judge import why

            note = f"sent with --force: {why(report)}"
    else:
        note = ("not judged: give --slot-dir DIR (the server's --slot-save-path as this machine sees it) and the "
                "file is validated for this server first, and not sent when it would refuse or abort on it")
    try:
        answer = server_api.restore_slot(url, slot, name, api_key=api_key, timeout=timeout)
    except server_api.ServerRefused as e:
        if e.status != 400:
            raise
        raise server_api.ServerRefused(f"{e}; {restore_refused_hint(url, name, slot_dir)}", status=e.status,
                                       message=e.message, error_type=e.error_type, body=e.body) from None
    except server_api.ServerDropped as e:
        raise server_api.ServerDropped(f"{e}; a file the server aborts on kills it while it restores: "
                                       f"{restore_refused_hint(url, name, slot_dir)}") from None
    proof = None
    if prove:
        from slotctl.live.prove import prove as run_proof

        proof = run_proof(url, slot, local, setup, build_info=facts.build_info, api_key=api_key, timeout=timeout,
                          spend=prove_anyway)
        if proof.verdict == "not_taken":
            proof.notes.append("--prove-anyway sends it")
    _answer(out, answer, json_out, url, f"{name} restored into slot {slot}", slot=slot, name=name, proof=proof,
            note=note)
    if proof is not None and proof.exit_status:
        out.error(f"--prove: {proof.verdict}: {proof.reason}")
        raise typer.Exit(int(proof.exit_status))


def _hashing(out: Output):
    from slotctl.cli.output import hashing_progress

    return hashing_progress(out)


def _answer(out: Output, answer: Any, json_out: bool, url: str, head: str, *, slot: int, name: str,
            proof=None, note: str | None = None) -> None:
    if json_out:   # the server's answer as it came, under "answer" (docs/json.md)
        doc = {"server": url, "slot": slot, "name": name, "answer": answer, "exit_code": 0}
        if note is not None:
            doc["note"] = note
        if proof is not None:
            doc.update(proof=proof.as_dict(), exit_code=int(proof.exit_status))
        out.json(doc)
        return
    out.print(Text.assemble((_plain(url), "bold"), "  ", _plain(head)))
    if note is not None:
        out.print(Text(f"note: {note}", style="dim"))
    if proof is not None:
        render_proof(out, proof.as_dict())
    if not isinstance(answer, dict):
        out.print(markup_safe(str(answer), keep_newlines=False))
        return
    t = Table(show_edge=False)
    for col, just in (("key", "left"), ("value", "right"), ("meaning", "left")):
        t.add_column(col, justify=just)
    for key, value in _flatten(answer):
        t.add_row(markup_safe(key, keep_newlines=False), _cell(value), Text(_ANSWER_KEYS.get(key, ""), style="dim"))
    out.print(t)


def render_proof(out: Output, p: dict, indent: str = "  ") -> None:
    """The lines of a proof (:meth:`slotctl.live.prove.Proof.as_dict`): the server's counts against the
    prediction, and why when they differ."""
    line = Text(indent + "proof ", style="bold")
    line.append(p["verdict"].replace("_", " "), style=style_of(p["verdict"]))
    if p["verdict"] == "not_taken":
        line.append(f": the proving request was not sent (the file's {p['n_prompt']:,} prompt tokens)")
    else:
        line.append(f": of the file's {p['n_prompt']:,} prompt tokens the server reused {p['n_reused']:,} and "
                    f"evaluated {p['n_evaluated']:,} (timings cache_n, prompt_n)")
    if p["predicted_evaluated"] is not None:
        line.append(f"; predicted for {p['rule']}: {p['predicted_reused']:,} reused, "
                    f"{p['predicted_evaluated']:,} evaluated")
    out.print(line)
    if p["reason"]:
        out.print(Text(f"{indent}  {_plain(p['reason'])}", style="dim" if p["verdict"] == "proven" else ""))
    for n in p["notes"]:
        out.print(Text(f"{indent}  note: {_plain(n)}", style="dim"))


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    rows = []
    for k, v in d.items():
        if isinstance(v, dict):
            rows += _flatten(v, f"{prefix}{k}.")
        else:
            rows.append((f"{prefix}{k}", v))
    return rows


# -- validate --server ------------------------------------------------------------------------------------------


def learn_from_server(ctx: typer.Context, out: Output, command: str, server: str | None, *, api_key: str | None,
                      timeout: float, flags, model: Path | None, draft_model: Path | None, slot: int,
                      mmproj: bool, state_version: int, store: bool = False):
    """``--server`` of validate and ls: the running server's model and flags where it says them, flags given
    on the command line winning (:func:`slotctl.live.learn.learn_flags`), its lines printed
    (:func:`render_live`); a :class:`~slotctl.live.learn.LiveValidate`, or None without ``--server``
    (then no live-only option may have been typed)."""
    if server is None:
        require_local(ctx, command, store=store)  # --api-key / --timeout typed without --server
        return None
    from slotctl.live.http import server_facts
    from slotctl.live.learn import learn_flags

    facts = server_facts(server, slot, api_key=api_key, timeout=timeout)
    lv = learn_flags(facts, flags, given=given_params(ctx), model=model, draft_model=draft_model, slot=slot,
                     mmproj=mmproj, state_version=state_version)
    render_live(out, lv)  # warnings on stderr; the rest in human mode only
    return lv


def render_live(out: Output, lv) -> None:
    """The lines ``validate --server`` prints before its verdicts (``lv``: a
    :class:`~slotctl.live.learn.LiveValidate`): the server and the flags used, notes.

    Warnings go to stderr in both modes; with ``--json`` nothing else is printed (it is all in ``server.live``).
    """
    for w in lv.warnings:
        out.warn(w)
    if out.json_mode:
        return
    f = lv.facts
    head = Text.assemble((_plain(f.url), "bold"))
    if f.build_info:
        head.append(f"  ({_plain(f.build_info)})", style="dim")
    out.print(head)
    flags = [f"-m {lv.model}" if lv.model is not None else None,
             f"-md {lv.draft_model}" if lv.draft_model is not None else None,
             f"-c {lv.server_flags.ctx_size}", f"-np {lv.server_flags.parallel}",
             "-kvu" if lv.server_flags.kv_unified else None,
             f"--slot {lv.slot}", "--mmproj (the server has one)" if lv.mmproj else None]
    line = Text("  validating for ")
    line.append(_plain(" ".join(x for x in flags if x)), style="bold")
    learned = [k for k, v in lv.sources.items() if v == "server"]
    if learned:
        line.append(f"  (from the server: {', '.join(learned)})", style="dim")
    out.print(line)
    for n in lv.notes:   # they quote the server (a /slots refusal, its model path): escaped
        out.print(Text(f"  note: {_plain(n)}", style="dim"))
