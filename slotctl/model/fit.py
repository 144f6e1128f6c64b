"""What in a slot file's memory another model wrote: the facts of its shape that the model given does not
have (``validate``'s and ``inspect``'s "saved with another model", ``identify``'s candidates).

Only what no flag changes: the memory kind, the KV layer count of each section, the elements of a K row
(``n_embd_k_gqa``: heads x head size). Cache types, streams and cells depend on the server's flags and are
``validate``'s to compare.
"""

from __future__ import annotations

from slotctl.errors import FormatError
from slotctl.format.records import row_elements
from slotctl.model.info import ModelInfo


def shape_differences(info: ModelInfo, mem) -> list[str]:
    """The facts of ``mem`` (a parsed :class:`~slotctl.slotfile.Memory`) that ``info``'s model would not
    write, each as "what: X in the file, Y in the model"; empty when its shape is the model's."""
    out = []
    want = info.layout()
    if mem.layout.kind != want.kind:
        out.append(f"memory kind: {mem.layout.kind} in the file, {want.kind} in the model")
        return out
    for sl, sec in zip(mem.layout.sections, mem.sections):
        if sec.type != "kv":
            continue
        layers = info.kv_layers(sl.role)
        kv = "KV" if sl.role == "kv" else f"{sl.role} KV"
        for st in sec.streams:
            if not st.cell_count:
                continue
            if st.data.n_layer != len(layers):
                out.append(f"{kv}: {st.data.n_layer} layers in the file, {len(layers)} in the model")
                break
            for il, rec in zip(layers, st.data.k):
                try:
                    n = row_elements(rec, kv)
                except FormatError as e:
                    out.append(f"{kv}: K rows that are not whole rows of their type ({e.expected})")
                    break
                if n != info.n_embd_k_gqa(il):
                    out.append(f"{kv}: K rows of {n} elements in the file, {info.n_embd_k_gqa(il)} in "
                               "the model")
                    break
            break
    return out
