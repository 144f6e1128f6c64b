"""Restore or prefill: what each costs, measured, and the prediction serve restores by (plain code, no I/O).

A restore spares the server the prompt tokens the stored state keeps beyond what the slot holds, and costs
what placing the state and the server's read of it take. Which is cheaper depends on the model, the machine
and the store (kv-rosetta measured f16 KV restores slower than prefill at every size on a GPU; a tiny model
evaluates a thousand tokens in milliseconds, where an ``s3://`` download of its state takes tens), so serve
measures all three from what it sees, and predicts both:

* **prefill**: milliseconds per prompt token, from the server's own ``timings`` of the answers it relays
  (``prompt_ms`` over ``prompt_n``, of the answers that evaluated at least :data:`MIN_PREFILL` tokens: a few
  tokens cost the fixed time of a batch, not the model's);
* **the server's restore**: milliseconds per byte from each restore's answer (``timings.restore_ms`` over
  ``n_read``); before the first restore, from the server's saves (``save_ms`` over ``n_written``: the same
  file written rather than read);
* **placing the state**: seconds per byte from each download or copy into the slot directory; before the
  first, from the store's writes of serve's saves (the same bytes the other way).

Each is the ratio of sums over the last :data:`WINDOW` measurements (a slow one weighs by its size, not by
its count). The prediction for a request (:meth:`Costs.predict`): prefill of the tokens the slot does not
hold, against placing and restoring the state and then the prefill of the tokens it does not keep; restored
only when that is predicted faster. What is not measured yet (a serve just started, no answer relayed) makes
no prediction, and the token rule decides alone (``--min-gain``), as before.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

#: measurements kept of each kind (the newest)
WINDOW = 32
#: an answer counts towards the prefill speed when it evaluated at least this many prompt tokens
MIN_PREFILL = 32


@dataclass(frozen=True)
class Prediction:
    """What a restore and prefill are predicted to cost (milliseconds) for one request: ``prefill_ms`` of
    the tokens the slot does not hold; ``restore_ms``: placing and restoring the state, then the prefill of
    the tokens it does not keep (``place_ms`` and ``read_ms`` of it). ``restore``: the choice."""

    prefill_ms: float
    restore_ms: float
    place_ms: float
    read_ms: float

    @property
    def restore(self) -> bool:
        return self.restore_ms < self.prefill_ms

    def as_dict(self) -> dict:
        return {"prefill_ms": round(self.prefill_ms, 3), "restore_ms": round(self.restore_ms, 3),
                "place_ms": round(self.place_ms, 3), "read_ms": round(self.read_ms, 3),
                "chose": "restore" if self.restore else "prefill"}


class _Rate:
    """Units of time per unit of work: the ratio of sums over the last :data:`WINDOW` measurements."""

    def __init__(self):
        self.seen: deque[tuple[float, float]] = deque(maxlen=WINDOW)

    def add(self, work: float, took: float) -> None:
        if work > 0 and took >= 0:
            self.seen.append((float(work), float(took)))

    def per(self) -> float | None:
        work = sum(w for w, _t in self.seen)
        return sum(t for _w, t in self.seen) / work if work > 0 else None

    def fastest(self) -> float | None:
        """The shortest time measured (a fixed cost's bound: the latency of one request)."""
        return min((t for _w, t in self.seen), default=None)


class Costs:
    """The measured costs of one server and store (module docstring); safe from several threads.
    ``placed_free``: the store is the slot directory itself (a state is restored where it lies: nothing to
    place)."""

    def __init__(self, *, placed_free: bool = False):
        self.placed_free = placed_free
        self._lock = threading.Lock()
        self._prefill = _Rate()       # ms per prompt token
        self._read = _Rate()          # the server's restore: ms per byte
        self._written = _Rate()       # the server's save: ms per byte (the read's prior)
        self._place = _Rate()         # into the slot directory: seconds per byte
        self._stored = _Rate()        # into the store: seconds per byte (the placing's prior)

    # -- measurements ----------------------------------------------------------------------------------

    def prefilled(self, timings: dict | None) -> None:
        """An answer's ``timings`` (the server's own)."""
        if not timings:
            return
        n, ms = timings.get("prompt_n"), timings.get("prompt_ms")
        if isinstance(n, (int, float)) and isinstance(ms, (int, float)) and n >= MIN_PREFILL and ms > 0:
            with self._lock:
                self._prefill.add(n, ms)

    def restored(self, answer: dict | None) -> None:
        """A restore's answer (``n_read``, ``timings.restore_ms``)."""
        self._server(self._read, answer, "n_read", "restore_ms")

    def saved(self, answer: dict | None) -> None:
        """A save's answer (``n_written``, ``timings.save_ms``)."""
        self._server(self._written, answer, "n_written", "save_ms")

    def _server(self, rate: _Rate, answer, n_key: str, ms_key: str) -> None:
        if not isinstance(answer, dict):
            return
        n, t = answer.get(n_key), answer.get("timings")
        ms = t.get(ms_key) if isinstance(t, dict) else None
        if isinstance(n, int) and isinstance(ms, (int, float)) and n > 0:
            with self._lock:
                rate.add(n, ms)

    def placed(self, size: int, seconds: float) -> None:
        """A state of ``size`` bytes downloaded or copied into the slot directory in ``seconds``."""
        with self._lock:
            self._place.add(size, seconds)

    def stored(self, size: int, seconds: float) -> None:
        """A state of ``size`` bytes written into the store in ``seconds``."""
        with self._lock:
            self._stored.add(size, seconds)

    # -- predictions -----------------------------------------------------------------------------------

    def prefill_ms(self, n_tokens: int) -> float | None:
        """What evaluating ``n_tokens`` prompt tokens is predicted to take; None before any measurement."""
        with self._lock:
            per = self._prefill.per()
        return None if per is None else per * max(n_tokens, 0)

    def cheaper_than_any_restore(self, n_tokens: int) -> bool:
        """Whether evaluating ``n_tokens`` prompt tokens is predicted faster than the fastest placing of a state
        measured (whatever its size: a restore costs at least that), so that no stored state is worth looking
        up. False before both are measured, and when the store is the slot directory (nothing to place)."""
        with self._lock:
            per_token = self._prefill.per()
            fastest = self._place.fastest() if self._place.seen else self._stored.fastest()
        if per_token is None or fastest is None or self.placed_free:
            return False
        return per_token * n_tokens < fastest * 1000.0

    def predict(self, *, n_request: int, held: int, kept: int, size: int, placed: bool = False) -> Prediction | None:
        """Restore or prefill for a request of ``n_request`` prompt tokens whose slot holds ``held`` of them,
        by a state of ``size`` bytes that keeps ``kept`` (``placed``: it is in the slot directory already, a
        conversion's file). None when a cost is not measured yet."""
        with self._lock:
            per_token = self._prefill.per()
            read = self._read.per()
            if read is None:
                read = self._written.per()
            place = 0.0 if placed or self.placed_free else self._place.per()
            if place is None:
                place = self._stored.per()
        if per_token is None or read is None or place is None:
            return None
        place_ms = place * size * 1000.0
        read_ms = read * size
        prefill = per_token * max(n_request - held, 0)
        restored = place_ms + read_ms + per_token * max(n_request - kept, 0)
        return Prediction(prefill, restored, place_ms, read_ms)

    def known(self) -> dict:
        """What is measured (for the stats): ms per prompt token, the server's restore and save in ms per MB,
        placing and storing in ms per MB; None where nothing is measured yet."""
        with self._lock:
            rates = {"prefill_ms_per_token": self._prefill.per(), "restore_ms_per_mb": self._read.per(),
                     "save_ms_per_mb": self._written.per(), "place_ms_per_mb": self._place.per(),
                     "store_ms_per_mb": self._stored.per()}
        scale = {"restore_ms_per_mb": 1e6, "save_ms_per_mb": 1e6, "place_ms_per_mb": 1e9, "store_ms_per_mb": 1e9}
        return {k: (None if v is None else round(v * scale.get(k, 1.0), 6)) for k, v in rates.items()}
