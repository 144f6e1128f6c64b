"""The human view of a slot file's layers (``inspect``; ``save`` shows the file it wrote the same way).

Built of :mod:`slotctl.cli.layout`'s renderables: on a pipe their plain lines are written without importing
rich (the same bytes rich prints; ``inspect FILE | cat`` starts faster), on a terminal rich draws them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slotctl.cli.layout import Group, Panel, Table, Text
from slotctl.cli.output import Output, elide, human_bytes, markup_safe

if TYPE_CHECKING:
    from slotctl.cli.common import NoteCounter


def render(out: Output, d: dict, notes: "NoteCounter | None" = None) -> None:
    """The human view of ``describe_file``'s dict; with ``notes``, notes met in other files are counted there
    and shown once at the end of the run instead."""
    head = [(markup_safe(d["path"], keep_newlines=False), "bold"), f"  {d['size']:,} bytes"]
    if d["state_version"] is not None:
        head.append(f"  state version {d['state_version']}")
    out.show(Text(*head))
    if d["layers"]:
        out.show(_byte_map(d))
    if d["prompt"]:
        out.show(_prompt(d["prompt"]))
        if d["prompt"].get("tokens") is not None:     # --tokens: every id, below the panel, as plain lines
            out.show(Text(f"tokens ({len(d['prompt']['tokens']):,}):", style="dim"))
            out.words(d["prompt"]["tokens"], indent=2)
    if d["target"]:
        out.show(_memory_panel("target memory", d["target"]["memory"], d["target"]["size"]))
    elif d["state_version"] is not None:
        cands = d["target_candidates"]
        out.show(Text(f"target memory: layout not determined ({len(cands)} candidate(s) fit"
                      + (": " + "; ".join(cands) if cands else "") + ")", style="yellow"))
    if d["sckp"] is not None:
        kind = d["target"]["memory"]["kind"] if d["target"] else None
        out.show(_checkpoints(d["checkpoints"], kind))
    if d["draft"] is not None:
        dr = d["draft"]
        title = f"draft state (SDFT), seq {dr['seq_id']}, speculative state {human_bytes(dr['spec_size'])}"
        if dr["memory"]:
            out.show(_memory_panel(title, dr["memory"], dr["size"]))
        else:
            out.show(Text(f"{title}: {dr['size']:,} bytes, layout not determined"
                          + (f" ({dr['error']['message']})" if dr["error"] else ""), style="yellow"))
    elif d["sdft"] is None and not d["damaged"]:
        out.show(Text("draft state: none (a restored slot drafts from an empty draft context)", style="dim"))
    if d["trailing_bytes"]:
        out.show(Text(f"trailing bytes: {d['trailing_bytes']:,}", style="yellow"))
    for f in d["findings"]:   # on stderr, each naming its file (inspect a b 2>log keeps which broke)
        if f["severity"] == "error":
            out.error(f"{d['path']}: {f['message']}")
        elif notes is None or not notes.add(f, d["path"]):
            out.warn(f"{d['path']}: {f['message']}")


def _byte_map(d: dict) -> Table:
    t = Table(("layer", "offset", "bytes", "share"), right=("offset", "bytes", "share"), title="byte map",
              keep=("layer", "offset", "bytes", "share"))
    size = d["size"] or 1
    for layer in d["layers"]:
        t.add_row(layer["name"], f"0x{layer['offset']:x}", f"{layer['size']:,}", f"{100 * layer['size'] / size:.1f}%")
    return t


def _prompt(p: dict) -> Panel:
    lines = [f"format: {p['format']} ({p['n_words']:,} words)", f"tokens: {p['n_tokens']:,}"]
    if p["n_media"]:
        lines.append(f"media chunks: {p['n_media']} (at token " + ", ".join(str(m["start"]) for m in p["media"]) + ")")
    body = [Text("\n".join(lines))]
    if p.get("text") is not None:
        body.append(Text(markup_safe(elide(p["text"])), style="italic"))
    return Panel("prompt", *body)


def _memory_panel(title: str, mem: dict, size: int) -> Panel:
    parts = [Text(f"kind: {mem['kind']}, {len(mem['sections'])} section(s), {size:,} bytes")]
    for sec in mem["sections"]:
        parts.append(_section(sec))
    return Panel(title, *parts)


_ROLE_WORDS = {
    "base": "full-attention",
    "swa": "sliding-window",
    "attention": "attention",
    "recurrent": "recurrent",
}


def _section(sec: dict) -> Group:
    kind = 'KV' if sec['type'] == 'kv' else 'recurrent'
    desc = f"{sec['role']} {kind} section" if sec['role'] != sec['type'] else f"{kind} section"
    if "size" in sec:
        desc += f" at 0x{sec['offset']:x}, {sec['size']:,} bytes"
    ids = sec.get("layer_ids")
    if ids is not None and sec["role"] in _ROLE_WORDS:
        words = _ROLE_WORDS[sec["role"]]
        desc += (f" ({words} {_ids_text(ids)})" if ids else f" (no {words} layers: it lists its cells only)")
    items = [Text(desc, style="bold")]
    streams = Table(("stream", "cells", "positions"), right=("cells",), boxed=False)   # every column kept whole
    for i, s in enumerate(sec["streams"]):
        rng = f"{s['pos_min']}..{s['pos_max']}" if s["pos_min"] is not None else "-"
        streams.add_row(str(i), f"{s['cell_count']:,}", rng)
    items.append(streams)
    facts = []
    if sec["type"] == "kv":
        facts.append(f"n_stream {sec['n_stream']}")
        if sec["v_trans"] is not None:
            facts.append(f"v_trans {sec['v_trans']} ({'flash attention off' if sec['v_trans'] else 'flash attention on'})")
        if sec["n_rot_k"] is not None:
            facts.append(f"rotation K {sec['n_rot_k']} / V {sec['n_rot_v']}")
        if sec["bytes_per_token"]:
            facts.append(f"{sec['bytes_per_token']:,} bytes per token")
    else:
        facts.append(f"s_trans {sec['s_trans']}")
    if sec["n_layer"] is not None:
        facts.append(f"n_layer {sec['n_layer']}")
    items.append(Text(", ".join(facts)))
    if sec["layers"]:
        items.append(_layers(sec))
    return Group(*items)


def _ids_text(ids: list[int]) -> str:
    return ("layer " if len(ids) == 1 else "layers ") + ", ".join(map(str, ids))


def _layers(sec: dict) -> Table:
    """Per-layer types and row sizes, one row for all layers when they agree. The rows are named by
    the model's layer ids when a model says them, else by record index."""
    rows = sec["layers"]
    ids = sec.get("layer_ids")
    keys = [k for k in rows[0] if not k.startswith("v_el") and k != "v_n_embd"]
    t = Table(["layers", *keys], right=keys, boxed=False, keep=keys)
    if all(r == rows[0] for r in rows):
        label = ", ".join(map(str, ids)) if ids and len(rows) > 1 else f"all {len(rows)}"
        t.add_row(label, *[_cell(rows[0][k]) for k in keys])
    else:
        for i, r in enumerate(rows):
            t.add_row(str(ids[i]) if ids else str(i), *[_cell(r.get(k)) for k in keys])
    return t


def _cell(v) -> str:
    if v is None:
        return "-"
    return f"{v:,}" if isinstance(v, int) else str(v)


#: what a PARTIAL_ONLY blob of each memory kind holds
_PARTIAL_WORDS = {
    "iswa": "only the SWA part (the base KV is rolled back by removing positions)",
    "hybrid": "only the recurrent part (the attention KV is rolled back by removing positions)",
    "hybrid_iswa": "only the SWA and recurrent parts (the base KV is rolled back by removing positions)",
    "recurrent": "the whole recurrent state",
    "kv": "the whole KV cache (a plain KV cache needs no checkpoints)",
}


_CHECKPOINT_COLUMNS = ("#", "n_tokens", "positions", "target blob", "draft blob", "spec")


def _checkpoints(cps: list[dict], kind: str | None = None) -> Table:
    title = f"context checkpoints (SCKP): {len(cps)}"
    if kind in _PARTIAL_WORDS:
        title += f"; each target blob holds {_PARTIAL_WORDS[kind]}"
    t = Table(_CHECKPOINT_COLUMNS, right=[c for c in _CHECKPOINT_COLUMNS if c != "positions"], title=title,
              keep=_CHECKPOINT_COLUMNS)
    for i, c in enumerate(cps):
        t.add_row(str(i), f"{c['n_tokens']:,}", f"{c['pos_min']}..{c['pos_max']}",
                  _blob_cell(c["target"]), _blob_cell(c["draft"]), human_bytes(c["spec_size"]))
    return t


def _blob_cell(b: dict | None) -> str:
    if b is None or b["size"] == 0:
        return "-"
    desc = human_bytes(b["size"])
    mem = b.get("memory")
    if mem:
        parts = []
        for sec in mem["sections"]:
            cells = sum(s["cell_count"] for s in sec["streams"])
            parts.append(f"{sec['role']} {cells} cell{'' if cells == 1 else 's'}")
        desc += f"\n{' + '.join(parts)}"
    elif b.get("header_only"):     # a plain KV cache's PARTIAL_ONLY state as b11669 writes it
        desc += "\nheader only"
    elif b.get("error"):
        desc += " (damaged)"
    return desc
