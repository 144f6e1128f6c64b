"""The stored states serve can restore: each one's tokens, memory kind and size, for prefix lookups.

A state is found by the longest common token prefix it shares with a request (:meth:`StateIndex.lookup`).
The tokens are read once per stored file (its header and token list: tensor bytes are never read); the
index is filled from the store's listing and from serve's own saves.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class State:
    """One stored state: its name in the store, its tokens, its memory kind (``kv``, ``iswa``, ...), size."""

    name: str
    tokens: np.ndarray
    kind: str | None
    size: int

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    eq = a[:m] == b[:m]
    return m if bool(eq.all()) else int(np.argmin(eq))


def as_tokens(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def _key(tokens: np.ndarray) -> bytes:
    """Tokens as bytes that sort as the token sequences do (big-endian, unsigned: token ids are >= 0)."""
    return np.asarray(tokens, dtype=">u4").tobytes()


def _common_bytes(a: bytes, b: bytes) -> int:
    """The tokens two keys share (whole 4-byte words)."""
    return common_prefix(np.frombuffer(a, dtype=">u4"), np.frombuffer(b, dtype=">u4"))


class StateIndex:
    """The states of one store for one model (``model``: its hash in the states' names,
    :func:`slotctl.keeping.names.of_model`), kept in memory, sorted by their tokens: the states sharing the
    longest prefix with a request sit next to where the request's tokens would be (in a sorted list of
    sequences, the common prefix with a query only shrinks going away from its place), so a lookup compares
    O(log n) keys and then only its neighbours."""

    def __init__(self, model: str):
        self.model = model
        self.states: dict[str, State] = {}
        self._keys: list[bytes] = []
        self._names: list[str] = []
        # the proxy looks up on its event loop while a worker thread adds or forgets: keys and names change together
        self._lock = threading.Lock()

    def add(self, state: State) -> None:
        import bisect

        k = _key(state.tokens)
        with self._lock:
            if state.name in self.states:
                return
            self.states[state.name] = state
            i = bisect.bisect_left(self._keys, k)
            self._keys.insert(i, k)
            self._names.insert(i, state.name)

    def forget(self, names) -> None:
        with self._lock:
            gone = {n for n in names if n in self.states}
            if not gone:
                return
            for n in gone:
                del self.states[n]
            keep = [i for i, n in enumerate(self._names) if n not in gone]
            self._keys = [self._keys[i] for i in keep]
            self._names = [self._names[i] for i in keep]

    def lookup(self, tokens: np.ndarray, limit: int = 4) -> list[tuple[State, int]]:
        """Up to ``limit`` states sharing the longest common prefix with ``tokens``, longest first (ties: the
        shorter state first), with that prefix; none sharing nothing."""
        import bisect

        q = _key(tokens)
        with self._lock:
            return self._lookup(q, bisect.bisect_left(self._keys, q), limit)

    def holding(self, tokens: np.ndarray) -> State | None:
        """A state holding exactly ``tokens`` (saved from any slot), or None."""
        return next((st for st, common in self.lookup(tokens) if common == st.n_tokens == len(tokens)), None)

    def extends(self, prefix: np.ndarray, min_tokens: int, besides: np.ndarray, scan: int = 64) -> bool:
        """Whether a state begins with ``prefix``, holds at least ``min_tokens`` tokens and is not a prefix
        of ``besides`` (what a slot holds: such a state could not keep more of a prompt than the slot does).
        The states beginning with ``prefix`` sit together in the sorted keys, from where ``prefix`` would
        be; past ``scan`` of them the answer is yes (unsure, so the caller asks for the prompt's tokens)."""
        import bisect

        q = _key(prefix)
        with self._lock:
            i = bisect.bisect_left(self._keys, q)
            for j in range(i, len(self._keys)):
                if not self._keys[j].startswith(q) or j - i >= scan:
                    return j - i >= scan
                st = self.states[self._names[j]]
                if st.n_tokens >= min_tokens and common_prefix(st.tokens, besides) < st.n_tokens:
                    return True
        return False

    def _lookup(self, q: bytes, i: int, limit: int) -> list[tuple[State, int]]:
        found: list[tuple[int, int]] = []      # (common, position)
        lo, hi = i - 1, i
        c_lo = _common_bytes(self._keys[lo], q) if lo >= 0 else 0
        c_hi = _common_bytes(self._keys[hi], q) if hi < len(self._keys) else 0
        while len(found) < limit * 4 and (c_lo > 0 or c_hi > 0):
            if c_hi >= c_lo:
                found.append((c_hi, hi))
                hi += 1
                c_hi = _common_bytes(self._keys[hi], q) if hi < len(self._keys) else 0
            else:
                found.append((c_lo, lo))
                lo -= 1
                c_lo = _common_bytes(self._keys[lo], q) if lo >= 0 else 0
        out = [(self.states[self._names[pos]], c) for c, pos in found]
        out.sort(key=lambda f: (-f[1], f[0].n_tokens))
        return out[:limit]
