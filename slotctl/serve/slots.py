"""serve's view of the server's slots and its choice of a slot for a request: plain code, no HTTP (the proxy,
:mod:`slotctl.serve.proxy`, feeds it ``GET /slots`` and the connections it makes, and asks it).

What each slot holds is what serve last put there (every request goes through serve: the prompt it sent, the
state it saved or restored). The view is trusted while every connection to the server was made before the
last ``GET /slots`` (:meth:`SlotView.trusted`): a server restarted since has closed them all, and serve's next
request opens a new one (:meth:`SlotView.connected`). A change serve did not make (another client; a restarted
server: no task yet, or task ids counting from 0 again) takes the slot as holding nothing.

The choice (:meth:`SlotView.choose`): a request's ``id_slot`` when it gives one; else the idle slot whose
tokens share the longest prefix with the prompt, when it shares at least ``min_gain`` tokens; else the least
recently used (an empty one first: a BOS token in common is no reason to take another conversation's slot).
A prompt text that begins with the text serve last sent into an idle slot may go there before its tokens are
known (:meth:`SlotView.by_text`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from slotctl.serve.index import common_prefix

#: the slots' state as serve last left it is unknown (a request it sent that was not saved)
UNKNOWN = ("unknown",)
EMPTY = np.zeros(0, dtype=np.int32)


@dataclass
class Slot:
    """One slot of the server as serve knows it: the tokens it holds (the last prompt, or the state saved or
    restored), the ``/slots`` signature then (a change serve did not make: the tokens are unknown), when it
    was last used, and the requests holding or waiting for it (``pending``; ``lock``: held by the one at
    work). ``text`` and ``prompt``: the prompt text serve last sent into the slot and the server's tokens of
    it, while the slot holds what that request left (any other change of ``tokens`` forgets them)."""

    id: int
    _tokens: np.ndarray = field(default_factory=lambda: EMPTY)
    sig: tuple | None = None
    used: float = 0.0
    pending: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    text: str | None = None
    prompt: np.ndarray = field(default_factory=lambda: EMPTY)

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens

    @tokens.setter
    def tokens(self, tokens: np.ndarray) -> None:
        self._tokens, self.text, self.prompt = tokens, None, EMPTY

    def sent(self, tokens: np.ndarray, text: str | None, prompt: np.ndarray) -> None:
        """The slot holds ``tokens`` after serve sent it the prompt ``text`` (whose tokens are ``prompt``)."""
        self._tokens, self.text, self.prompt = tokens, text, prompt

    def forget(self) -> None:
        """What the slot holds is not known (a broken answer, a view lost)."""
        self.tokens, self.sig = EMPTY, UNKNOWN

    @property
    def idle(self) -> bool:
        """Neither held nor waited for by a request of serve's."""
        return not self.lock.locked() and self.pending == 0

    @property
    def holds(self) -> int:
        """The tokens the slot holds as far as serve knows: ``GET /slots``' count (none for a slot that has run
        no task), else what serve put there."""
        if self.sig is None:
            return 0
        if len(self.sig) == 2 and isinstance(self.sig[1], int):
            return self.sig[1]
        return len(self.tokens)


def signature(entry: dict) -> tuple | None:
    """A slot's state as ``GET /slots`` shows it (its last task and its prompt's length); None for a slot
    that has run no task since the server started."""
    if "id_task" not in entry:
        return None
    return entry.get("id_task"), entry.get("n_prompt_tokens")


class SlotView:
    """The server's slots as serve knows them (see the module docstring). ``min_gain``: a slot is taken for
    its tokens only when it shares at least this many with the prompt; a stored state is looked up only when
    it could keep this many more than the slot."""

    def __init__(self, min_gain: int = 16):
        self.min_gain = min_gain
        self.slots: dict[int, Slot] = {}
        #: connections made to the server (:meth:`connected`), and how many were made when ``GET /slots`` was
        #: last read (-1: the view is lost)
        self.gen = 0
        self.view_gen = -1
        #: slots the last ``GET /slots`` saw at work for another client
        self.busy: set[int] = set()
        #: the highest task id ``GET /slots`` showed: lower later, a new server
        self.top_task = -1

    def connected(self) -> None:
        """A connection to the server was made: it may be a restarted server's."""
        self.gen += 1

    @property
    def trusted(self) -> bool:
        """Whether every connection to the server was made before the last ``GET /slots``."""
        return self.view_gen == self.gen

    def distrust(self) -> None:
        """The next request reads ``GET /slots`` first (the server did not answer as it did)."""
        self.view_gen = -1

    def lose(self) -> None:
        """``GET /slots`` cannot be read: every slot taken as holding nothing."""
        self.view_gen = -1
        for s in self.slots.values():
            s.forget()

    def apply(self, entries: list) -> bool:
        """What ``GET /slots`` shows (``entries``, as answered: anything not a slot is left out): a slot serve
        neither holds nor waits for whose signature is not the one serve noted after its last request holds
        what serve did not put there; a restarted server (task ids counting from 0 again) holds nothing. True
        when it shows a restart (the server may run other flags)."""
        gen = self.gen      # every connection made until now answers for the server this answer describes
        entries = [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), int)
                   and not isinstance(e.get("id"), bool)]
        tasks = [e["id_task"] for e in entries if isinstance(e.get("id_task"), int)]
        top = max(tasks, default=-1)
        restarted = top < self.top_task
        if restarted:
            for s in self.slots.values():
                if s.idle:
                    s.tokens, s.sig = EMPTY, UNKNOWN
        self.top_task = top
        busy = set()
        for entry in entries:
            s = self.slots.setdefault(entry["id"], Slot(entry["id"]))
            if s.idle and signature(entry) != s.sig:
                s.tokens, s.sig = EMPTY, signature(entry)
            if entry.get("is_processing") and not s.lock.locked():
                busy.add(s.id)
        self.busy = busy
        self.view_gen = gen if self.slots else -1
        return restarted

    def noted(self, slot: Slot, entry: dict | None) -> None:
        """``slot``'s ``GET /slots`` entry as read right after serve's own save of it (None: not there)."""
        slot.sig = signature(entry) if entry is not None else UNKNOWN
        if entry is not None and isinstance(entry.get("id_task"), int):
            self.top_task = max(self.top_task, entry["id_task"])

    def free(self) -> list[Slot]:
        """The slots no request of serve's holds or waits for and no other client works in."""
        return [s for s in self.slots.values() if s.pending == 0 and s.id not in self.busy]

    def for_probe(self) -> Slot | None:
        """The slot a save to learn the server's flags from takes (its ``pending`` counted): of the idle ones
        no other client works in, the one that holds the fewest tokens (a slot that holds nothing saves its
        stream count alone); None when none is."""
        free = [s for s in self.slots.values() if s.idle and s.id not in self.busy]
        if not free:
            return None
        slot = min(free, key=lambda s: (s.holds, s.id))
        slot.pending += 1
        return slot

    def choose(self, tokens: np.ndarray, want) -> Slot | None:
        """The slot for a request (its ``pending`` counted): ``want`` when given (not -1); else the idle slot whose
        tokens share the longest prefix with ``tokens``, else the least recently used (also when the longest
        shares fewer than ``min_gain`` tokens). None when serve knows no slot, or ``want`` is not one of them
        (the server's answer)."""
        if not self.slots:
            return None
        if isinstance(want, int) and want >= 0:
            s = self.slots.get(want)
            if s is None:
                return None      # a slot the server does not have: its own answer
        else:
            pool = self.free() or list(self.slots.values())
            best = max(pool, key=lambda s: (common_prefix(s.tokens, tokens), -s.used))
            if common_prefix(best.tokens, tokens) < self.min_gain:
                # sharing less than --min-gain (a BOS token, a chat template's first line) is no reason to
                # take a conversation's slot: the least recently used (an empty one first) is taken instead
                best = min(pool, key=lambda s: (s.pending, s.used))
            s = best
        s.pending += 1
        return s

    def may_restore(self, slot: Slot, tokens: np.ndarray) -> bool:
        """Whether a stored state could keep ``min_gain`` tokens more of ``tokens`` than ``slot`` holds: not when
        fewer than that are not in the slot (then nothing is looked up)."""
        return len(tokens) - self.held(slot, tokens) >= self.min_gain

    @staticmethod
    def held(slot: Slot, tokens: np.ndarray) -> int:
        """The prompt tokens ``slot`` holds of ``tokens`` (the last one evaluated again, for its logits)."""
        return min(common_prefix(slot.tokens, tokens), len(tokens) - 1)

    def by_text(self, text: str, want) -> Slot | None:
        """The idle slot whose own prompt text (:attr:`Slot.text`) ``text`` begins with, the longest such
        (``want``'s alone when given); its ``pending`` not counted: the proxy asks first whether no stored
        state could beat it."""
        if isinstance(want, int) and want >= 0:
            pool = [self.slots[want]] if want in self.slots else []
        else:
            pool = list(self.slots.values())
        fits = [s for s in pool if s.text is not None and s.pending == 0 and s.id not in self.busy
                and text.startswith(s.text)]
        return max(fits, key=lambda s: len(s.text), default=None)

    @staticmethod
    def release(slot: Slot) -> None:
        """``slot`` given back by the request (or save, or probe) that held it."""
        slot.pending -= 1
        slot.lock.release()
