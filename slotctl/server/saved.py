"""What a slot file the server saved says of the flags it does not report: ``-kvu``, ``-ctk``, ``-ctv``.

b11434 reports none of the three (``/props``, ``/slots``), but every save carries them
(``llama_kv_cache::state_write``, src/llama-kv-cache.cpp): a KV section begins with the cache's stream count,
1 with a unified cache (``-kvu``), else one per sequence (``n_seq_max``: the server's ``-np``; the
``llama_kv_cache`` constructor), and each stream that holds cells gives every layer's K and V type (the
cache's ``type_k``/``type_v``: ``-ctk``/``-ctv``). A stream that holds no cells is its cell count alone: the
save of a slot that holds nothing says the stream count (measured with b11434: 40 bytes for ``-np 2``, 36 with
``-kvu``) and no type. Read from the file's metadata (:func:`slotctl.slotfile.written_flags`), never its
tensor bytes. ``slotctl serve`` learns the server's flags here.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the flags a save says, by their ``ServerFlags`` names, with the spellings serve and keep take them by
SAID = {"kv_unified": "-kvu", "cache_type_k": "-ctk", "cache_type_v": "-ctv"}


@dataclass(frozen=True)
class SavedFlags:
    """What one save says (None: it does not say). ``n_stream``: its KV stream count."""

    n_stream: int | None
    kv_unified: bool | None
    cache_type_k: str | None
    cache_type_v: str | None

    def said(self) -> dict[str, bool | str]:
        """The flags it says, by their ``ServerFlags`` names."""
        return {name: getattr(self, name) for name in SAID if getattr(self, name) is not None}


def kv_unified(n_stream: int | None, parallel: int | None) -> bool | None:
    """Whether a server of ``parallel`` slots (``-np``, ``/props`` ``total_slots``) whose save holds
    ``n_stream`` KV streams runs with ``-kvu``: one stream with several slots, yes; one per slot, no. None when
    it cannot be told: one slot (either way one stream), or a count no such server writes."""
    if n_stream is None or parallel is None or parallel < 2:
        return None
    if n_stream == 1:
        return True
    return False if n_stream == parallel else None


def saved_flags(written: tuple | None, parallel: int | None) -> SavedFlags:
    """What a save says of its server's ``-kvu``/``-ctk``/``-ctv``: ``written`` is
    :func:`slotctl.slotfile.written_flags` of its target memory (None: it did not parse), ``parallel`` the
    server's slot count. A type that is not one of llama-server's cache types (a damaged file) says nothing."""
    from slotctl.format.ggml import CACHE_TYPE_NAMES

    if written is None:
        return SavedFlags(None, None, None, None)
    tk, tv, _fa, n_stream = written
    return SavedFlags(n_stream, kv_unified(n_stream, parallel),
                      tk if tk in CACHE_TYPE_NAMES else None, tv if tv in CACHE_TYPE_NAMES else None)
