"""serve's view of the server's slots and its choice of a slot for a request: plain code, no HTTP (the proxy,
:mod:`slotctl.serve.proxy`, feeds it ``GET /slots`` and the connections it makes; the cached path,
:mod:`slotctl.serve.completion`, asks it).

What each slot holds is what serve last put there (every request goes through serve: the prompt it sent, the
state it saved or restored). The view is trusted while every connection to the server was made before the
last ``GET /slots`` (:meth:`SlotView.trusted`): a server restarted since has closed them all, and serve's next
request opens a new one (:meth:`SlotView.connected`). A change serve did not make (another client; a restarted
server: no task yet, or task ids counting from 0 again) takes the slot as holding nothing; a slot the server no
longer has (restarted with fewer, ``-np 3`` to ``-np 2``) leaves the view (the server would take its id as
another slot's: ``id % n_slots``).

The choice is the server's own (b11434 ``get_available_slot``, and its deferred tasks): a request is given
an idle slot, else it waits for the first slot that frees (:meth:`SlotView.take`), never for one slot while
another frees. Among the idle slots: the one whose tokens share the longest prefix with the prompt, when it
shares at least ``min_gain`` tokens; else the least recently used (an empty one first: a BOS token in
common is no reason to take another conversation's slot). One exception, where serve itself holds a slot the
server alone would have idle: a slot only being saved after its answer (or probed) that shares more of the
prompt than every idle slot is the conversation's own, and is waited for, for as long as its save takes (an
agent's next turn, sent the moment its answer came, keeps its slot as it would with the server alone).
``id_slot`` given: that slot, waited for while serve holds it. A prompt text that begins with the text serve
last sent into a slot may go there before its tokens are known (:meth:`SlotView.by_text`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from slotctl.serve.index import common_prefix

#: the slots' state as serve last left it is unknown (a request it sent that was not saved)
UNKNOWN = ("unknown",)
EMPTY = np.zeros(0, dtype=np.int32)
#: who holds a slot: a request at work in it, its save after the answer, a save to learn the server's flags
REQUEST, SAVE, PROBE = "request", "save", "probe"


class _Wait:
    """:meth:`SlotView.choose`'s answer when the request is to wait for a slot to free."""

    def __repr__(self) -> str:
        return "WAIT"


WAIT = _Wait()


@dataclass
class Slot:
    """One slot of the server as serve knows it: the tokens it holds (the last prompt, or the state saved or
    restored), the ``/slots`` signature then (a change serve did not make: the tokens are unknown), when it
    was last used, who of serve's holds it (``holder``: :data:`REQUEST`, :data:`SAVE`, :data:`PROBE`, None:
    idle) and whether the server no longer has it (``gone``). ``text`` and ``prompt``: the prompt text serve
    last sent into the slot and the server's tokens of it, while the slot holds what that request left (any
    other change of ``tokens`` forgets them)."""

    id: int
    _tokens: np.ndarray = field(default_factory=lambda: EMPTY)
    sig: tuple | None = None
    used: float = 0.0
    holder: str | None = None
    gone: bool = False
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
        """Held by nothing of serve's."""
        return self.holder is None

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
        #: set (and replaced) at each change a waiting request may take a slot after (:meth:`changed`)
        self._changed = asyncio.Event()

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
        does not hold whose signature is not the one serve noted after its last request holds what serve did
        not put there; a restarted server (task ids counting from 0 again) holds nothing; a slot not shown is
        gone (left out of the view now, or when serve's holder gives it back). True when it shows a restart
        (the server may run other flags)."""
        gen = self.gen      # every connection made until now answers for the server this answer describes
        entries = [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), int)
                   and not isinstance(e.get("id"), bool) and e["id"] >= 0]
        tasks = [e["id_task"] for e in entries if isinstance(e.get("id_task"), int)]
        top = max(tasks, default=-1)
        restarted = top < self.top_task
        if restarted:
            for s in self.slots.values():
                if s.idle:
                    s.tokens, s.sig = EMPTY, UNKNOWN
        self.top_task = top
        shown = {e["id"] for e in entries}
        for i, s in list(self.slots.items()):
            if i not in shown:
                s.gone = True
                if s.idle:
                    del self.slots[i]
        busy = set()
        for entry in entries:
            s = self.slots.get(entry["id"])
            if s is None or s.gone:     # new, or shown again after it was gone (its holder still at work)
                s = self.slots[entry["id"]] = Slot(entry["id"])
            if s.idle and signature(entry) != s.sig:
                s.tokens, s.sig = EMPTY, signature(entry)
            if entry.get("is_processing") and s.idle:
                busy.add(s.id)
        self.busy = busy
        self.view_gen = gen if self.slots else -1
        self._signal()
        return restarted

    def noted(self, slot: Slot, entry: dict | None) -> None:
        """``slot``'s ``GET /slots`` entry as read right after serve's own save of it (None: not there)."""
        slot.sig = signature(entry) if entry is not None else UNKNOWN
        if entry is not None and isinstance(entry.get("id_task"), int):
            self.top_task = max(self.top_task, entry["id_task"])

    def _live(self) -> list[Slot]:
        return [s for s in self.slots.values() if not s.gone]

    def ids(self) -> list[int]:
        """The ids of the slots the server has, as serve last read them (a slot gone is not among them)."""
        return sorted(s.id for s in self._live())

    def free(self) -> list[Slot]:
        """The slots nothing of serve's holds and no other client works in."""
        return [s for s in self._live() if s.idle and s.id not in self.busy]

    def for_probe(self) -> Slot | None:
        """The slot a save to learn the server's flags from takes (held, :data:`PROBE`): of the idle ones no
        other client works in, the one that holds the fewest tokens (a slot that holds nothing saves its
        stream count alone); None when none is."""
        free = self.free()
        if not free:
            return None
        slot = min(free, key=lambda s: (s.holds, s.id))
        self.hold(slot, PROBE)
        return slot

    def choose(self, tokens: np.ndarray, want) -> Slot | _Wait | None:
        """The slot for a request now, as the server chooses (the module docstring), not taken yet: ``want``
        when given (not -1); else an idle slot; :data:`WAIT` when the request is to wait for a slot to free
        (``want`` held by serve; the conversation's own slot being saved; every slot held by serve). None when
        serve knows no slot, or ``want`` is not one of them (the server's answer)."""
        live = self._live()
        if not live:
            return None
        if isinstance(want, int) and want >= 0:
            s = self.slots.get(want)
            if s is None or s.gone:
                return None      # a slot the server does not have: its own answer
            return s if s.idle else WAIT
        free = self.free()
        best = max(free, key=lambda s: (common_prefix(s.tokens, tokens), -s.used), default=None)
        shared = common_prefix(best.tokens, tokens) if best is not None else -1
        # the conversation's own slot, held only by its save (or a probe): a moment, and it is idle
        own = max((s for s in live if s.holder in (SAVE, PROBE)), key=lambda s: common_prefix(s.tokens, tokens),
                  default=None)
        if own is not None and common_prefix(own.tokens, tokens) >= max(self.min_gain, shared + 1):
            return WAIT
        if best is not None:
            if shared >= self.min_gain:
                return best
            # sharing less than --min-gain (a BOS token, a chat template's first line) is no reason to take a
            # conversation's slot: the least recently used (an empty one first) is taken instead
            return min(free, key=lambda s: s.used)
        # none free: an idle slot another client works in is the server's to queue the request on; else the
        # first slot serve gives back
        queued = [s for s in live if s.idle]
        if queued:
            return min(queued, key=lambda s: s.used)
        return WAIT

    async def take(self, tokens: np.ndarray, want) -> Slot | None:
        """The slot for a request (:meth:`choose`), held for it (:data:`REQUEST`), once there is one: waits for
        the first slot that frees (or the one the choice waits for). None: no slot to give (the server's
        answer)."""
        while True:
            got = self.choose(tokens, want)
            if got is not WAIT:
                if got is not None:
                    self.hold(got, REQUEST)
                return got
            await self.changed()

    async def idle_again(self, slot: Slot) -> None:
        """Until serve no longer holds ``slot`` (or it is gone)."""
        while not slot.idle and not slot.gone:
            await self.changed()

    async def changed(self) -> None:
        """Until a slot is given back or the view changes."""
        await self._changed.wait()

    def _signal(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def may_restore(self, slot: Slot, tokens: np.ndarray) -> bool:
        """Whether a stored state could keep ``min_gain`` tokens more of ``tokens`` than ``slot`` holds: not when
        fewer than that are not in the slot (then nothing is looked up)."""
        return len(tokens) - self.held(slot, tokens) >= self.min_gain

    @staticmethod
    def held(slot: Slot, tokens: np.ndarray) -> int:
        """The prompt tokens ``slot`` holds of ``tokens`` (the last one evaluated again, for its logits)."""
        return min(common_prefix(slot.tokens, tokens), len(tokens) - 1)

    def by_text(self, text: str, want) -> Slot | None:
        """The slot whose own prompt text (:attr:`Slot.text`) ``text`` begins with, the longest such (``want``'s
        alone when given), idle or only being saved (or probed): a returning turn's own slot, which the caller
        waits for when it is held (:meth:`idle_again`). Not held here: the proxy asks first whether no stored
        state could beat it."""
        if isinstance(want, int) and want >= 0:
            pool = [self.slots[want]] if want in self.slots else []
        else:
            pool = list(self.slots.values())
        fits = [s for s in pool if s.text is not None and not s.gone and s.holder in (None, SAVE, PROBE)
                and s.id not in self.busy and text.startswith(s.text)]
        return max(fits, key=lambda s: len(s.text), default=None)

    @staticmethod
    def hold(slot: Slot, holder: str) -> None:
        """``slot`` held by ``holder`` (:data:`REQUEST`, :data:`SAVE`, :data:`PROBE`): idle until given back."""
        slot.holder = holder

    def release(self, slot: Slot) -> None:
        """``slot`` given back by the request (or save, or probe) that held it; one the server no longer has
        leaves the view now. The requests waiting for a slot choose again."""
        slot.holder = None
        if slot.gone and self.slots.get(slot.id) is slot:
            del self.slots[slot.id]
        self._signal()
