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


def said(name: str, value: bool | str) -> str:
    """A flag as a server's command line says it: ``-kvu`` or ``no -kvu``, ``-ctk q8_0``."""
    if isinstance(value, bool):
        return SAID[name] if value else f"no {SAID[name]}"
    return f"{SAID[name]} {value}"


class Learnt:
    """The flags a server does not report, as a process that watches it knows them (serve, keep): the ones
    given (``flags``: a ``ServerFlags``; ``given``: the names given on the command line), with what its saves
    said over them (:meth:`take`). Not thread-safe: the caller holds its own lock."""

    def __init__(self, flags, given: frozenset[str] = frozenset()):
        self.given_flags, self.given_names = flags, frozenset(given)
        self.flags, self.given = flags, frozenset(given)
        self.said: dict[str, bool | str] = {}
        self._warned: set[tuple[str, bool | str]] = set()

    def forget(self) -> None:
        """Back to the flags given: another model's server (another command line) runs now."""
        self.flags, self.given, self.said = self.given_flags, self.given_names, {}

    def take(self, saved: SavedFlags, *, slot: int, total_slots: int | None,
             source: str) -> tuple[list[tuple[str, str, dict]], bool]:
        """What ``saved`` (a save of ``slot`` of a server of ``total_slots`` slots; ``source``: "probe", a save
        made to learn them, or "save") says that was not known, taken over: it wins over a flag given. The
        events to say, as ``(event, message, details)``: a ``warning`` for each flag given it contradicts, once
        per flag and value, and a ``learned`` one for what is new (none when nothing is); and whether the flags
        judged with changed (the verdicts made before are then stale)."""
        new = {k: v for k, v in saved.said().items() if self.said.get(k) != v}
        if not new:
            return [], False
        self.said.update(new)
        streams = f" ({saved.n_stream} KV stream(s) for {total_slots} slot(s))" if total_slots else ""
        events = []
        for k, v in new.items():
            given = getattr(self.given_flags, k)
            if k in self.given_names and given != v and (k, v) not in self._warned:
                self._warned.add((k, v))
                events.append(("warning", f"{said(k, given)} was given, but the server's own save of slot {slot} "
                                          f"says {said(k, v)}{streams if k == 'kv_unified' else ''}: states are "
                                          f"judged and converted for the server's",
                               {"flag": SAID[k], "given": given, "server": v}))
        changed = any(getattr(self.flags, k) != v for k, v in new.items())
        self.flags = self.flags.replace(**new)
        self.given = self.given | set(new)
        events.append(("learned", f"the server's save of slot {slot} says "
                                  f"{', '.join(said(k, v) for k, v in new.items())}{streams}: states are judged "
                                  f"and converted for it",
                       {"source": source, "n_stream": saved.n_stream, **self.as_details()}))
        return events, changed

    def as_details(self) -> dict[str, bool | str | None]:
        """What the saves said so far, by name (None: not said yet): a ``learned`` event's details."""
        return {k: self.said.get(k) for k in SAID}
