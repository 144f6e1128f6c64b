"""The stored states serve can restore: each one's tokens, memory kind and size, for prefix lookups.

A state is found by the longest common token prefix it shares with a request (:meth:`StateIndex.lookup`).
The tokens are read once per stored file (its header and token list: tensor bytes are never read); the
index is filled from the store's listing and from serve's own saves.
"""

from __future__ import annotations

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


class StateIndex:
    """The states of one store for one model (names beginning with ``prefix``), kept in memory."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.states: dict[str, State] = {}

    def add(self, state: State) -> None:
        self.states[state.name] = state

    def forget(self, names) -> None:
        for n in names:
            self.states.pop(n, None)

    def sync(self, names: list[str], read) -> list[str]:
        """Hold exactly the states ``names`` (the store's listing): each new one read by ``read(name)`` (a
        :class:`State`, or None when it does not parse: left out); those gone forgotten. The names read."""
        gone = set(self.states) - set(names)
        self.forget(gone)
        new = [n for n in names if n not in self.states]
        for n in new:
            st = read(n)
            if st is not None:
                self.add(st)
        return new

    def lookup(self, tokens: np.ndarray, limit: int = 4) -> list[tuple[State, int]]:
        """The states sharing the longest common prefix with ``tokens``, longest first (ties: the longer
        state last, so that the one extended most is tried first), with that prefix; none sharing nothing."""
        found = [(s, common_prefix(s.tokens, tokens)) for s in self.states.values()]
        found = [f for f in found if f[1] > 0]
        found.sort(key=lambda f: (-f[1], f[0].n_tokens))
        return found[:limit]
