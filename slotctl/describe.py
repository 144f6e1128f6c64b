"""Describers: parsed layers as plain dicts with stable keys (the ``--json`` schema in docs/json.md).

Pure functions over :mod:`slotctl.slotfile` objects; rendering for people lives in the CLI.
"""

from __future__ import annotations

from slotctl.format import ggml
from slotctl.format.records import record_size
from slotctl.slotfile import Blob, Memory, SlotFile


def _stream(cell_count: int, cells) -> dict:
    return {"cell_count": cell_count, "pos_min": cells.pos_min, "pos_max": cells.pos_max}


def _kv_layers(data) -> list[dict]:
    layers = []
    v = list(data.v)
    for i, k in enumerate(data.k):
        row = {"k_type": ggml.type_name(k.type), "k_row_size": k.row_size,
               "v_type": None, "v_row_size": None}
        if i < len(v):
            rec = v[i]
            row["v_type"] = ggml.type_name(rec.type)
            if "row_size" in rec:
                row["v_row_size"] = rec.row_size
            else:
                # transposed V: a "row" of one cell is n_embd elements of el_size bytes
                row["v_row_size"] = rec.el_size * rec.n_embd
                row["v_el_size"] = rec.el_size
                row["v_n_embd"] = rec.n_embd
        layers.append(row)
    return layers


def describe_section(sec, span=None) -> dict:
    """One KV or recurrent section."""
    out: dict = {"type": sec.type}
    if span is not None:
        out["offset"], out["size"] = span.offset, span.size
    if sec.type == "kv":
        streams = [_stream(s.cell_count, s.cells) for s in sec.streams]
        datas = [s.data for s in sec.streams if s.data is not None]
        first = datas[0] if datas else None
        layers = _kv_layers(first) if first else []
        out.update({
            "n_stream": sec.n_stream,
            "streams": streams,
            "v_trans": first.v_trans if first else None,
            "n_layer": first.n_layer if first else None,
            "n_rot_k": first.n_rot_k if first else None,
            "n_rot_v": first.n_rot_v if first else None,
            "layers": layers,
            "bytes_per_token": sum((l["k_row_size"] or 0) + (l["v_row_size"] or 0) for l in layers),
            "uniform_streams": all(_kv_shape(d) == _kv_shape(first) for d in datas),
        })
    else:
        r, s = list(sec.r), list(sec.s)
        layers = []
        for i in range(max(len(r), len(s))):
            row = {}
            if i < len(r):
                row.update(r_type=ggml.type_name(r[i].type), r_row_size=r[i].row_size)
            if i < len(s):
                srec = s[i]
                row.update(s_type=ggml.type_name(srec.type),
                           s_row_size=srec.row_size if "row_size" in srec else srec.el_size * srec.n_embd)
            layers.append(row)
        out.update({
            "n_stream": 1,
            "streams": [_stream(sec.cell_count, sec.cells)],
            "s_trans": sec.s_trans,
            "n_layer": sec.n_layer,
            "layers": layers,
            "bytes_per_token": None,
        })
    return out


def _kv_shape(data):
    return (data.v_trans, data.n_layer, data.n_rot_k, data.n_rot_v,
            tuple((k.type, k.row_size) for k in data.k),
            tuple((v.type, v.get("row_size"), v.get("el_size"), v.get("n_embd")) for v in data.v))


def section_layer_ids(info, role: str) -> list[int]:
    """The model's layers a section of role ``role`` holds records for, in record order
    (``info``: a :class:`~slotctl.model.info.ModelInfo`)."""
    if role == "recurrent":
        return list(info.recurrent_layer_ids())
    return list(info.kv_layers(role))


def describe_memory(mem: Memory | None, info=None) -> dict | None:
    """A payload or blob; with ``info`` (the model's :class:`~slotctl.model.info.ModelInfo`) each section
    also names the model layers its records belong to (``layer_ids``; null without a model)."""
    if mem is None:
        return None
    spans = mem.section_spans or [None] * len(mem.sections)
    out = []
    for s, sp, l in zip(mem.sections, spans, mem.layout.sections):
        d = dict(describe_section(s, sp), role=l.role)
        ids = section_layer_ids(info, l.role) if info is not None else None
        d["layer_ids"] = ids if ids is not None and len(ids) == len(d["layers"]) else None
        out.append(d)
    return {"kind": mem.layout.kind, "sections": out}


def tensor_bytes(mem: Memory) -> int:
    """Bytes of tensor data in a payload (the rest is metadata)."""
    total = 0
    for sec in mem.sections:
        if sec.type == "kv":
            for st in sec.streams:
                if st.data is not None:
                    total += sum(record_size(r) for r in st.data.k) + sum(record_size(r) for r in st.data.v)
        else:
            total += sum(record_size(r) for r in sec.r) + sum(record_size(r) for r in sec.s)
    return total


def describe_blob(b: Blob | None, info=None) -> dict | None:
    if b is None:
        return None
    return {
        "offset": b.span.offset,
        "size": b.span.size,
        "seq_id": b.seq_id,
        "memory": describe_memory(b.memory, info),
        "header_only": b.header_only,
        "error": {"code": b.error.error_code, "message": b.error.one_line()} if b.error else None,
    }


def describe_file(sf: SlotFile, *, tokens: bool = False, text: str | None = None, info=None,
                  draft_info=None, findings=()) -> dict:
    """The whole file, as ``slotctl inspect --json`` prints it for each file (docs/schemas/inspect.schema.json).

    ``info`` / ``draft_info``: the target and draft models' :class:`~slotctl.model.info.ModelInfo`, which
    name the layers of each section. ``findings``: what was found (:mod:`slotctl.findings`), as the file's
    ``findings`` list.
    """
    tk = sf.tokens
    prompt = None
    if tk is not None:
        prompt = {"format": tk.format, "n_words": int(len(sf.words)), "n_tokens": tk.n_tokens,
                  "n_media": len(tk.media),
                  "media": [{"start": s, "size": (m.size if hasattr(m, "size") else len(m))} for s, m in tk.media]}
        if tokens:
            prompt["tokens"] = tk.tokens   # the int32 array itself: a list only when written as JSON
        if text is not None:
            prompt["text"] = text
    target = None
    if sf.target is not None:
        target = {"offset": sf.target.offset, "size": sf.target.size, "memory": describe_memory(sf.target, info),
                  "tensor_bytes": tensor_bytes(sf.target)}
    checkpoints = []
    if sf.checkpoints is not None or sf.draft is not None:
        from slotctl.server.speculative import describe_state   # only a file with a draft state or checkpoints
    if sf.checkpoints is not None:
        checkpoints = [{"n_tokens": c.n_tokens, "pos_min": c.pos_min, "pos_max": c.pos_max,
                        "target": describe_blob(c.tgt, info), "draft": describe_blob(c.dft, draft_info),
                        "spec_size": c.spec.size, "speculative": describe_state(c.spec.size, info, draft_info)}
                       for c in sf.checkpoints]
    draft = None
    if sf.draft is not None:
        draft = describe_blob(sf.draft, draft_info)
        draft["spec_size"] = sf.draft_spec.size if sf.draft_spec else 0
        draft["speculative"] = describe_state(draft["spec_size"], info, draft_info)
    return {
        "path": sf.path,
        "size": sf.size,
        "state_version": sf.version,
        "exit_code": 1 if sf.damaged else 0,
        "damaged": sf.damaged,
        "layers": [{"name": n, "offset": o, "size": s} for n, o, s in sf.layers()],
        "prompt": prompt,
        "target": target,
        "target_candidates": [l.describe() for l in sf.target_candidates] if sf.target is None else [],
        "checkpoints": checkpoints,
        "sckp": {"offset": sf.sckp.offset, "size": sf.sckp.size} if sf.sckp else None,
        "draft": draft,
        "sdft": {"offset": sf.sdft.offset, "size": sf.sdft.size} if sf.sdft else None,
        "trailing_bytes": sf.trailing.size if sf.trailing else 0,
        "findings": [f.as_dict() for f in findings],
    }
