"""The ``/ui`` page: the fleet view's table (:mod:`slotctl.fleet.view`) as one read-only HTML page, rendered
here on the server's side (docs/fleet.md, "The /ui page").

Plain HTML and an inline style sheet: no script, no external asset (the page's Content-Security-Policy,
:data:`slotctl.unattended.metrics.UI_HEADERS`, forbids both), refreshed by the browser itself (``<meta http-equiv="refresh">``). Every value
shown comes from a server's answers, a store's names or a message about them: untrusted, each goes through
:func:`text`, which escapes it for HTML (``html.escape``: ``<``, ``>``, ``&`` and both quotes) after showing
control characters, bidirectional overrides and bytes that are not UTF-8 as ``\\xNN`` (as the terminal
does, :func:`slotctl.errors.escape_text`), so no value becomes markup or reorders the page.
"""

from __future__ import annotations

import html
import time

from slotctl.errors import escape_text
from slotctl.fleet.view import COLUMNS, rows, summary


_STYLE = """
body { font: 14px/1.4 sans-serif; margin: 1.5em; color: #222; background: #fff; }
h1 { font-size: 1.3em; margin: 0 0 .2em; }
p.meta { color: #666; margin: 0 0 1em; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { border-bottom: 1px solid #ddd; padding: .3em .8em; text-align: left; white-space: nowrap; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.idle { color: #1a7f37; } td.busy { color: #9a6700; } td.error { color: #cf222e; font-weight: bold; }
td.refused, td.aborts, td.unreadable, td.undecided, td.other_model, td.corrupt { color: #cf222e; }
td.restores { color: #1a7f37; } td.restores_with_drops { color: #9a6700; }
ul.errors li { color: #cf222e; }
td.name { font-family: monospace; white-space: normal; word-break: break-all; }
td.why { white-space: normal; min-width: 24em; }
"""


#: the verdicts a cell is coloured for (validate's words: a class name of the style sheet)
_VERDICTS = ("restores", "restores_with_drops", "refused", "aborts", "unreadable", "undecided", "other_model",
             "corrupt")


def text(value) -> str:
    """An untrusted value for the page: control characters escaped as the terminal shows them, then HTML's
    special characters (quotes included: safe in an attribute too)."""
    return html.escape(escape_text("" if value is None else str(value), keep_newlines=False), quote=True)


def _cell(value: str, cls: str | None = None) -> str:
    return f'<td class="{cls}">{text(value)}</td>' if cls else f"<td>{text(value)}</td>"


def page(servers: list[dict], *, refresh: float, title: str = "slotctl slots", source: str | None = None,
         now: float | None = None) -> str:
    """The page of the fleet view's documents ``servers`` (:func:`slotctl.fleet.view.server_doc`), asking
    the browser to load it again after ``refresh`` seconds; ``source``: where the rows come from, in words."""
    now = time.time() if now is None else now
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    refresh_s = max(1, round(refresh))
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           f'<meta http-equiv="refresh" content="{refresh_s}">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{text(title)}</title>", f"<style>{_STYLE}</style>", "</head>", "<body>",
           f"<h1>{text(title)}</h1>",
           f'<p class="meta">{text(summary(servers))} &middot; as of {text(when)}'
           + (f" &middot; {text(source)}" if source else "")
           + f" &middot; refreshed every {refresh_s} s</p>"]
    # the fleet table: the same rows as `slotctl slots`
    out.append('<table id="slots">')
    out.append("<thead><tr>" + "".join(f"<th>{text(c)}</th>" for c in COLUMNS) + "</tr></thead>")
    out.append("<tbody>")
    numeric = {COLUMNS.index(c) for c in ("slot", "tokens", "stored", "best reuse")}
    for row in rows(servers):
        cells = [_cell(v, row[4] if i == 4 else "num" if i in numeric else None) for i, v in enumerate(row)]
        out.append('<tr class="slot">' + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    # every stored state and its predicted reuse
    states = [(d, s, st) for d in servers for s in d["slots"] for st in (s.get("states") or ())]
    if states:
        out.append("<h2>Stored states</h2>")
        out.append('<table id="states"><thead><tr>' + "".join(
            f"<th>{c}</th>" for c in ("server", "slot", "state", "saved", "tokens", "verdict", "predicted reuse",
                                      "why fewer"))
                   + "</tr></thead><tbody>")
        for d, s, st in states:
            best = (s.get("best") or {}).get("name") == st["name"]
            reuse = "-" if st["n_reused"] is None else f"{st['n_reused']:,}"
            out.append(f'<tr class="state{" best" if best else ""}">'
                       + _cell(d["name"] or d["server"]) + _cell(str(s["slot"]), "num")
                       + _cell(st["name"] + (" (best)" if best else ""), "name") + _cell(st["saved"])
                       + _cell("-" if st["n_tokens"] is None else f"{st['n_tokens']:,}", "num")
                       + _cell(st["verdict"], st["verdict"] if st["verdict"] in _VERDICTS else None)
                       + _cell(reuse, "num") + _cell(st["reason"] or "", "why") + "</tr>")
        out.append("</tbody></table>")
    errors = [d for d in servers if d["error"] is not None]
    if errors:
        out.append('<ul class="errors">' + "".join(
            f"<li>{text(d['name'] or d['server'])}: {text(d['error']['message'])}</li>" for d in errors) + "</ul>")
    out += ["</body>", "</html>", ""]
    return "\n".join(out)


def server_page(url: str, facts, up: bool | None, states, *, every: float, title: str) -> str:
    """The page of one server kept by a long-running process (keep; serve can pass its own): ``facts`` as
    its last look read them (``up``: whether that look found the server answering, None before the first),
    ``states`` the process's :class:`~slotctl.keeping.states.ServerStates` (its store, the flags as given or
    learnt from the server's saves, its verdicts), ``every`` seconds between its looks. No request is made to
    the server: a page load never wakes it or makes llama-swap load a model; the store is listed now and each
    new state judged once (:func:`slotctl.fleet.view.stored_states`)."""
    from slotctl.errors import SlotctlError
    from slotctl.fleet.view import Target, server_doc
    from slotctl.live import router

    t = Target(url, store=str(states.store), model=states.router_model or router.model_for(url))
    if facts is None or up is not True:
        why = "not looked at yet" if up is None else "the server did not answer the last look"
        doc = server_doc(t, None, error=SlotctlError(why))
    else:
        doc = server_doc(t, facts, states=states)
    return page([doc], refresh=min(60.0, max(2.0, every)), title=title,
                source=f"the slots as last looked at (every {every:g} s); the store as it is now")


def keeper_page(keeper) -> str:
    """keep's ``/ui`` (:func:`server_page` of the server it keeps, judged by keep's own states)."""
    return server_page(keeper.url, keeper.facts, keeper.up, keeper.states, every=keeper.every, title="slotctl keep")
