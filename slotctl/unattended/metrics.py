"""Metrics and health of a long-running slotctl: counters, gauges and histograms exposed through
prometheus_client (its registry, its typed metric families and its text format: version 0.0.4, whose
counters' ``# TYPE`` lines carry the ``_total`` of their samples), served with ``/livez`` and ``/readyz`` by a
small standard-library HTTP server thread (docs/fleet.md, "Metrics and health").

Names follow Prometheus's practice: ``slotctl_`` first, base units, ``_total`` for counters, ``_bytes`` and
``_seconds`` for sizes and times; ``slotctl_build_info`` (a gauge of 1) names the version running.
:class:`KeepMetrics` turns keep's events (``slotctl.fleet.keep.Event``, as ``as_dict()``) into them, so what
is counted is what keep reported, one event at a time; :class:`ServeMetrics` reads serve's counters at each
scrape and its events as they come.

prometheus_client (a core dependency: keep runs on the core install) is imported when metrics are served,
never by a command that serves none (tests/test_startup.py).

Answering never makes a request to the server: ``/readyz`` reads what the keeper (or serve) last saw of it
(its last look, and how long ago), so a scrape never wakes a sleeping server and never makes llama-swap
load a model. The store is asked (:class:`StoreProbe`: one ``HEAD`` of an object that need not exist, or a
look at the directory), at most every :data:`PROBE_EVERY` seconds whatever the scrapes, within
:data:`PROBE_TIMEOUT` seconds: a process that does not write for hours still knows whether its store
answers.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from typing import Callable

from slotctl.errors import UsageError

#: the text format prometheus_client's ``generate_latest`` writes (what its own handler answers a scraper
#: that asks for nothing else)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: seconds between two probes of the store (``/readyz`` answers the last one meanwhile)
PROBE_EVERY = 5.0
#: seconds a probe of the store may take before it says the store does not answer
PROBE_TIMEOUT = 5.0
#: the upper bounds (seconds) of the buckets of a histogram of durations: a restore or a save of a few
#: milliseconds (a small state, a local store) to minutes (gigabytes over S3)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Family:
    """One metric: a name, its type (counter or gauge), its help, its label names, a value per label set."""

    def __init__(self, name: str, kind: str, help_: str, labels: tuple[str, ...]):
        self.name, self.kind, self.help, self.labels = name, kind, help_, labels
        self.values: dict[tuple[str, ...], float] = {}

    def _key(self, labels: dict) -> tuple[str, ...]:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name}: labels {sorted(labels)}, expected {list(self.labels)}")
        return tuple("" if labels[k] is None else str(labels[k]) for k in self.labels)

    def inc(self, amount: float = 1, **labels) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up")
        k = self._key(labels)
        self.values[k] = self.values.get(k, 0) + amount

    def set(self, value: float, **labels) -> None:
        self.values[self._key(labels)] = value

    def get(self, **labels) -> float:
        return self.values.get(self._key(labels), 0)

    def family(self):
        """The family as prometheus_client's typed metric family (its samples sorted by label values)."""
        from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        fam = cls(self.name, self.help, labels=self.labels)
        for key in sorted(self.values):
            fam.add_metric(list(key), self.values[key])
        return fam


class Histogram(Family):
    """A histogram: per label set, how many observations fell at or under each bucket's bound, their count
    and their sum (prometheus_client's histogram family: ``_bucket{le}``, ``_count``, ``_sum``)."""

    def __init__(self, name: str, help_: str, labels: tuple[str, ...], buckets: tuple[float, ...]):
        super().__init__(name, "histogram", help_, labels)
        if list(buckets) != sorted(set(buckets)) or not buckets or math.isinf(buckets[-1]):
            raise ValueError(f"{name}: buckets must be finite and increasing")
        self.buckets = tuple(float(b) for b in buckets)
        #: label values -> (the observations in each bucket (not cumulated) and above the last, their sum)
        self.observed: dict[tuple[str, ...], tuple[list[int], float]] = {}

    def observe(self, value: float, **labels) -> None:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{self.name}: an observation must be a finite duration or size, got {value!r}")
        counts, total = self.observed.get(self._key(labels), ([0] * (len(self.buckets) + 1), 0.0))
        counts[next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))] += 1
        self.observed[self._key(labels)] = (counts, total + value)

    def touch(self, **labels) -> None:
        """The series of ``labels`` shown with no observation yet (a rate has its start)."""
        self.observed.setdefault(self._key(labels), ([0] * (len(self.buckets) + 1), 0.0))

    def count(self, **labels) -> int:
        got = self.observed.get(self._key(labels))
        return sum(got[0]) if got else 0

    def inc(self, amount: float = 1, **labels) -> None:
        raise TypeError(f"{self.name}: a histogram is observed, not incremented")

    def set(self, value: float, **labels) -> None:
        raise TypeError(f"{self.name}: a histogram is observed, not set")

    def family(self):
        from prometheus_client.metrics_core import HistogramMetricFamily

        fam = HistogramMetricFamily(self.name, self.help, labels=self.labels)
        for key in sorted(self.observed):
            counts, total = self.observed[key]
            running, buckets = 0, []
            for bound, n in zip(self.buckets + (math.inf,), counts):
                running += n
                buckets.append(("+Inf" if math.isinf(bound) else repr(bound), running))
            fam.add_metric(list(key), buckets, total)
        return fam


class Registry:
    """The families of one process (``role``: ``keep`` or ``serve``), ``slotctl_build_info`` first, exposed
    through a prometheus_client ``CollectorRegistry`` of which this is the one collector."""

    def __init__(self, role: str = ""):
        try:
            from prometheus_client.registry import CollectorRegistry
        except ImportError:     # a core dependency: missing only from an install made without its dependencies
            raise UsageError("metrics need prometheus_client, a dependency of slotctl: pip install "
                             "prometheus_client", code="missing_extra") from None
        self.families: dict[str, Family] = {}
        self.lock = threading.Lock()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)
        if role:
            import platform

            from slotctl import __version__

            self.gauge("slotctl_build_info", "The slotctl running (1): its version, Python's and its role "
                       "(keep, serve).", ("version", "python", "role")).set(
                1, version=__version__, python=platform.python_version(), role=role)

    def counter(self, name: str, help_: str, labels: tuple[str, ...] = ()) -> Family:
        assert name.endswith("_total"), name
        return self._add(Family(name, "counter", help_, labels))

    def gauge(self, name: str, help_: str, labels: tuple[str, ...] = ()) -> Family:
        return self._add(Family(name, "gauge", help_, labels))

    def histogram(self, name: str, help_: str, labels: tuple[str, ...] = (),
                  buckets: tuple[float, ...] = SECONDS_BUCKETS) -> Histogram:
        got = Histogram(name, help_, labels, buckets)
        self._add(got)
        return got

    def _add(self, f: Family) -> Family:
        if f.name in self.families:
            raise ValueError(f"{f.name}: defined twice")
        self.families[f.name] = f
        return f

    def collect(self):
        """prometheus_client's collector protocol: every family, typed, as it is now."""
        with self.lock:
            return [f.family() for f in self.families.values()]

    def exposition(self) -> str:
        """The families in prometheus_client's text format (version 0.0.4: :data:`CONTENT_TYPE`)."""
        from prometheus_client.exposition import generate_latest

        return generate_latest(self._registry).decode()


class KeepMetrics:
    """keep's metrics, counted from its events; ``server`` is the label of the server kept."""

    def __init__(self, server: str):
        self.server = server
        r = self.registry = Registry("keep")
        s, ss = ("server",), ("server", "slot")
        self.looks = r.counter("slotctl_keep_looks_total", "Looks at the server (GET /health), by outcome (up, down).",
                               ("server", "outcome"))
        self.up = r.gauge("slotctl_keep_server_up", "1 when the last look found the server answering, else 0.", s)
        self.saves = r.counter("slotctl_keep_saves_total", "Slot saves, by outcome (stored: a new state in the "
                               "store; unchanged: the store had it; skipped: the file did not check).",
                               ss + ("outcome",))
        self.saved_bytes = r.counter("slotctl_keep_stored_bytes_total", "Bytes of the states stored.", ss)
        self.restores = r.counter("slotctl_keep_restores_total", "Restores into slots, by outcome (restored; "
                                  "refused: validate's verdict refused a state, which was not sent).",
                                  ss + ("outcome",))
        self.proofs = r.counter("slotctl_keep_proofs_total", "Restores proven by the server's own counts, by "
                                "verdict (proven, reevaluated, undecided).", ss + ("verdict",))
        self.reused = r.counter("slotctl_keep_prompt_tokens_reused_total", "Prompt tokens of the proving "
                                "requests the server reused, measured (timings) and predicted.",
                                ss + ("source",))
        self.evaluated = r.counter("slotctl_keep_prompt_tokens_evaluated_total", "Prompt tokens of the proving "
                                   "requests the server evaluated, measured (timings) and predicted.",
                                   ss + ("source",))
        self.pruned = r.counter("slotctl_keep_pruned_total", "States deleted from the store (budget, retention).", s)
        self.pruned_bytes = r.counter("slotctl_keep_pruned_bytes_total", "Bytes of the states deleted.", s)
        self.errors = r.counter("slotctl_keep_errors_total", "Errors, by code (docs/exit-codes.md).", ("server", "code"))
        self.objects = r.gauge("slotctl_keep_store_objects", "States in the store (at the last count).", s)
        self.bytes = r.gauge("slotctl_keep_store_bytes", "Bytes of the states in the store (at the last count).", s)
        self.last = r.gauge("slotctl_keep_last_success_timestamp_seconds", "When each action last succeeded "
                            "(Unix time): look, save, restore, proof.", ("server", "action"))
        self.started = r.gauge("slotctl_keep_start_timestamp_seconds", "When this keep started (Unix time).", s)
        self.started.set(time.time(), server=server)
        #: what /readyz reads: the last look at the store (the keeper's own state says the server's)
        self.store_ok: tuple[bool, float, str] | None = None

    def observe(self, ev: dict) -> None:
        """Count one of keep's events (``Event.as_dict()``)."""
        with self.registry.lock:
            self._observe(ev)

    def _observe(self, ev: dict) -> None:
        e, slot, d, now = ev["event"], ev.get("slot"), ev.get("details") or {}, time.time()
        srv = self.server
        if e in ("up", "restart"):
            self.up.set(1, server=srv)
        elif e == "down":
            self.up.set(0, server=srv)
        elif e in ("stored", "unchanged"):
            self.saves.inc(server=srv, slot=slot, outcome=e)
            if e == "stored":
                self.saved_bytes.inc(d.get("size") or 0, server=srv, slot=slot)
            self.last.set(now, server=srv, action="save")
            self.store_ok = (True, time.monotonic(), "")
        elif e == "skipped" and slot is not None and "verdict" in d:
            self.restores.inc(server=srv, slot=slot, outcome="refused")
        elif e == "skipped" and slot is not None and "answer" not in d and "name" not in d \
                and "not stored" in ev.get("message", ""):
            self.saves.inc(server=srv, slot=slot, outcome="skipped")
        elif e == "restored":
            self.restores.inc(server=srv, slot=slot, outcome="restored")
            self.last.set(now, server=srv, action="restore")
        elif e == "proof":
            p = d.get("proof") or {}
            self.proofs.inc(server=srv, slot=slot, verdict=p.get("verdict"))
            for fam, measured, predicted in ((self.reused, "n_reused", "predicted_reused"),
                                            (self.evaluated, "n_evaluated", "predicted_evaluated")):
                for source, key in (("measured", measured), ("predicted", predicted)):
                    v = p.get(key)
                    if isinstance(v, int) and not isinstance(v, bool):
                        fam.inc(v, server=srv, slot=slot, source=source)
            if p.get("verdict") == "proven":
                self.last.set(now, server=srv, action="proof")
        elif e == "pruned":
            self.pruned.inc(server=srv)
            self.pruned_bytes.inc(d.get("size") or 0, server=srv)
        elif e == "error":
            code = (d.get("error") or {}).get("code") or "error"
            self.errors.inc(server=srv, code=code)
            if code.startswith(("store", "no_such_bucket", "bad_credentials")):
                self.store_ok = (False, time.monotonic(), ev.get("message", ""))

    def store_usage(self, objects: int, size: int) -> None:
        with self.registry.lock:
            self.objects.set(objects, server=self.server)
            self.bytes.set(size, server=self.server)
            self.store_ok = (True, time.monotonic(), "")

    def store_failed(self, message: str) -> None:
        with self.registry.lock:
            self.store_ok = (False, time.monotonic(), message)

    def look(self, up: bool) -> None:
        """One look at the server (``GET /health``) and what it found."""
        with self.registry.lock:
            self.looks.inc(server=self.server, outcome="up" if up else "down")
            self.up.set(1 if up else 0, server=self.server)
            if up:
                self.last.set(time.time(), server=self.server, action="look")
            self.server_ok = (up, time.monotonic())

    server_ok: tuple[bool, float] | None = None

    def ready(self, max_age: float, probe: "StoreProbe | None" = None) -> tuple[bool, list[str]]:
        """Ready when the last look, within ``max_age`` seconds, found the server up (as the keeper last saw
        it: no request made), and the store answers: ``probe``'s answer when given, else the store's answer to
        the keeper's last request."""
        if probe is not None:
            ok, why = probe()
            with self.registry.lock:
                self.store_ok = (ok, time.monotonic(), why)
        now = time.monotonic()
        why = []
        if self.server_ok is None:
            why.append("server: not looked at yet")
        elif not self.server_ok[0]:
            why.append("server: down at the last look")
        elif now - self.server_ok[1] > max_age:
            why.append(f"server: last looked at {now - self.server_ok[1]:.0f} s ago")
        else:
            why.append("server: up")
        if self.store_ok is None:
            why.append("store: not reached yet")
        elif not self.store_ok[0]:
            why.append(f"store: failed ({self.store_ok[2]})")
        else:
            why.append("store: reachable")

        ok = (self.server_ok is not None and self.server_ok[0] and now - self.server_ok[1] <= max_age
              and self.store_ok is not None and self.store_ok[0])
        return ok, why


class StoreProbe:
    """Whether the store ``store`` (a directory or an ``s3://`` prefix) answers: ``(ok, why)``. Asked at most
    every ``every`` seconds (the last answer given meanwhile), each time within ``timeout`` seconds (a store
    that does not answer by then: not ready, and the request is left to itself in a daemon thread). An
    ``s3://`` store is asked one ``HEAD`` of an object that need not exist (absent is an answer); a store that
    answers again is tried again by the process's own requests (:func:`slotctl.store.s3.forget_down`)."""

    def __init__(self, store: str, *, every: float = PROBE_EVERY, timeout: float = PROBE_TIMEOUT):
        self.store = store
        self.every, self.timeout = every, timeout
        self._last: tuple[float, bool, str] | None = None
        self._lock = threading.Lock()
        self._running: threading.Thread | None = None

    def _ask(self) -> tuple[bool, str]:
        import os

        if not self.store.startswith("s3://"):
            try:
                os.stat(self.store)
                os.listdir(self.store)
                if not os.access(self.store, os.W_OK | os.X_OK):
                    return False, f"{self.store}: not writable"
            except OSError as e:
                return False, f"{self.store}: {e.strerror}"
            return True, f"{self.store}: reachable"
        import obstore
        from obstore import exceptions as obx

        from slotctl.store.s3 import S3_STORE, forget_down

        url = self.store.rstrip("/") + "/.slotctl-readyz"
        try:
            client, key = S3_STORE.bucket(url)
            obstore.head(client, key)
        except (obx.NotFoundError, FileNotFoundError):
            pass
        except Exception as e:  # noqa: BLE001 - every failure is a reason not to be ready
            err = S3_STORE.error(url, e, "HEAD") if not isinstance(e, UsageError) else e
            return False, str(err)
        forget_down()
        return True, f"{self.store}: reachable"

    def __call__(self) -> tuple[bool, str]:
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last[0] < self.every:
                return self._last[1], self._last[2]
            box: dict = {}
            t = threading.Thread(target=lambda: box.update(answer=self._ask()), name="slotctl-store-probe",
                                 daemon=True)
            t.start()
            t.join(self.timeout)
            ok, why = box.get("answer", (False, f"{self.store}: no answer within {self.timeout:g} s"))
            self._last = (time.monotonic(), ok, why)
            return ok, why


class ServeMetrics:
    """serve's metrics: its counters (:class:`slotctl.serve.cache.Counters`, read at each scrape) and its
    events (``emit(event, message, details)``); ``server`` is the label of the upstream."""

    #: serve's counters of failures, as ``slotctl_serve_errors_total``'s codes
    ERRORS = {"lookup_failures": "lookup_failed", "restore_failures": "restore_failed",
              "save_failures": "save_failed", "upstream_errors": "upstream_unreachable",
              "client_disconnects": "client_disconnected"}

    #: what happened to each completion request's prompt (slotctl.serve.cache.OUTCOMES)
    OUTCOMES = ("slot_hit", "restored", "prefill", "cold", "uncached", "passed_through")
    #: the upper bounds of the buckets of a prediction's measured time over its predicted time
    RATIO_BUCKETS = (0.25, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0, 8.0)

    def __init__(self, server: str, counters, cache_off: Callable[[], str | None] | None = None):
        self.server, self.counters = server, counters
        #: why serve's cache is off now (its store not used: no lease, the store down or stalled), or None
        self.cache_off = cache_off or (lambda: None)
        r = self.registry = Registry("serve")
        s = ("server",)
        self.requests = r.counter("slotctl_serve_requests_total", "Requests, by outcome (cached: given a slot "
                                  "and a lookup; passed_through: sent on untouched).", ("server", "outcome"))
        self.restores = r.counter("slotctl_serve_restores_total", "Restores of stored states into slots, by "
                                  "outcome (restored; refused: validate's verdict, not sent; failed).",
                                  ("server", "outcome"))
        self.saves = r.counter("slotctl_serve_saves_total", "Saves after an answer, by outcome (stored: a new "
                               "state; deduplicated: the store had it; failed).", ("server", "outcome"))
        self.conversions = r.counter("slotctl_serve_conversions_total", "Stored states converted for this "
                                     "server's -np/-kvu before a restore, by outcome (converted, failed).",
                                     ("server", "outcome"))
        self.stored_bytes = r.counter("slotctl_serve_stored_bytes_total", "Bytes of the states stored.", s)
        self.pruned = r.counter("slotctl_serve_pruned_total", "States deleted from the store (--max-size).", s)
        self.reused = r.counter("slotctl_serve_prompt_tokens_reused_total", "Prompt tokens of the requests given "
                                "a slot that the server keeps from its cache (predicted by validate's rules: "
                                "the slot's own prefix, or the restored state's).", ("server", "source"))
        self.evaluated = r.counter("slotctl_serve_prompt_tokens_evaluated_total", "Prompt tokens of the requests "
                                   "given a slot that the server evaluates (predicted).", ("server", "source"))
        self.errors = r.counter("slotctl_serve_errors_total", "Failures of the cache (the request went on "
                                "uncached) and of the upstream, by code.", ("server", "code"))
        self.up = r.gauge("slotctl_serve_server_up", "1 when the server's facts were last read, 0 when they "
                          "could not be.", s)
        self.objects = r.gauge("slotctl_serve_store_objects", "States in the store (at the last count).", s)
        self.bytes = r.gauge("slotctl_serve_store_bytes", "Bytes of the states in the store (at the last count).", s)
        self.last = r.gauge("slotctl_serve_last_success_timestamp_seconds", "When each action last succeeded "
                            "(Unix time): facts (the server read), restore, save.", ("server", "action"))
        self.started = r.gauge("slotctl_serve_start_timestamp_seconds", "When this serve started (Unix time).", s)
        self.ready_ = r.gauge("slotctl_serve_ready", "1 when /readyz last said ready.", s)
        self.restore_seconds = r.histogram("slotctl_serve_restore_seconds", "Seconds each restore of a stored "
                                           "state took, from the request for it to the server's answer (the "
                                           "state fetched from the store, placed, read by the server).", s)
        self.save_seconds = r.histogram("slotctl_serve_save_seconds", "Seconds each save after an answer took "
                                        "(the server's write, the file checked, the state stored).", s)
        self.added_ttft_seconds = r.histogram("slotctl_serve_added_time_to_first_token_seconds", "Seconds serve "
                                              "added before a request's first token, beside the server's own "
                                              "(the lookup, a restore).", s)
        self.outcomes = r.counter("slotctl_serve_request_outcomes_total", "Completion requests, by what happened "
                                  "to their prompt: slot_hit (its slot held --min-gain tokens of it), restored (a "
                                  "stored state), prefill (a restore was predicted slower than the prefill it "
                                  "spares), cold (nothing held, nothing restored), uncached (the cache could not "
                                  "be used: the store down or stalled, no lease, a failure), passed_through (not "
                                  "given a slot).", ("server", "outcome"))
        self.choices = r.counter("slotctl_serve_choices_total", "Restore-or-prefill choices made by prediction "
                                 "(restore, prefill), counted once the answer's timings measured them.",
                                 ("server", "choice"))
        self.prediction_ratio = r.histogram("slotctl_serve_prediction_ratio", "Each restore-or-prefill choice's "
                                            "measured time (the restore and the server's prompt time) over its "
                                            "predicted time.", ("server", "choice"), buckets=self.RATIO_BUCKETS)
        self.cache_on = r.gauge("slotctl_serve_cache_available", "1 while serve uses its store (restores, saves), "
                                "0 while requests go uncached (the store down or stalled, no lease held).", s)
        self.started.set(time.time(), server=server)
        for h in (self.restore_seconds, self.save_seconds, self.added_ttft_seconds):
            h.touch(server=server)
        for outcome in self.OUTCOMES:
            self.outcomes.inc(0, server=server, outcome=outcome)
        for choice in ("restore", "prefill"):
            self.choices.inc(0, server=server, choice=choice)
            self.prediction_ratio.touch(server=server, choice=choice)
        #: the last facts event: (server answered, monotonic time)
        self.server_ok: tuple[bool, float] | None = None

    def observe(self, event: str, details: dict) -> None:
        """Count one of serve's events."""
        with self.registry.lock:
            srv, now = self.server, time.time()
            if event == "up":
                self.up.set(1, server=srv)
                self.last.set(now, server=srv, action="facts")
                self.server_ok = (True, time.monotonic())
            elif event == "down":
                self.up.set(0, server=srv)
                self.server_ok = (False, time.monotonic())
            elif event == "restored":
                self.last.set(now, server=srv, action="restore")
                self._took(self.restore_seconds, details)
            elif event == "stored":
                self.stored_bytes.inc(details.get("size") or 0, server=srv)
                self.last.set(now, server=srv, action="save")

    def _took(self, histogram: Histogram, details: dict) -> None:
        """An event's ``seconds`` (what it took) observed, when the event says it."""
        took = details.get("seconds")
        if isinstance(took, (int, float)) and not isinstance(took, bool) and math.isfinite(took) and took >= 0:
            histogram.observe(took, server=self.server)

    def restore_took(self, seconds: float) -> None:
        """One restore and what it took (seconds), as the ``restored`` event's ``seconds`` counts it."""
        with self.registry.lock:
            self.restore_seconds.observe(seconds, server=self.server)

    def save_took(self, seconds: float) -> None:
        """One save after an answer and what it took (seconds)."""
        with self.registry.lock:
            self.save_seconds.observe(seconds, server=self.server)

    def added_time_to_first_token(self, seconds: float) -> None:
        """What serve added (seconds) before one request's first token, beside the server's own time."""
        with self.registry.lock:
            self.added_ttft_seconds.observe(seconds, server=self.server)

    def outcome(self, outcome: str) -> None:
        """One completion request and what happened to its prompt (:data:`OUTCOMES`)."""
        with self.registry.lock:
            self.outcomes.inc(server=self.server, outcome=outcome)

    def predicted(self, choice: str, predicted: float, measured: float) -> None:
        """One restore-or-prefill ``choice`` (``restore``, ``prefill``) made by a prediction of ``predicted``
        seconds, measured ``measured`` seconds."""
        with self.registry.lock:
            self.choices.inc(server=self.server, choice=choice)
            if predicted > 0:
                self.prediction_ratio.observe(measured / predicted, server=self.server, choice=choice)

    def prompt(self, reused: int, evaluated: int) -> None:
        """One request given a slot: the prompt tokens predicted to be reused and evaluated."""
        with self.registry.lock:
            self.reused.inc(reused, server=self.server, source="predicted")
            self.evaluated.inc(evaluated, server=self.server, source="predicted")

    def store_usage(self, objects: int, size: int) -> None:
        with self.registry.lock:
            self.objects.set(objects, server=self.server)
            self.bytes.set(size, server=self.server)

    def exposition(self) -> str:
        c, srv = self.counters.as_dict(), self.server
        with self.registry.lock:
            for outcome, key in (("cached", "cached"), ("passed_through", "passed_through")):
                self.requests.set(c[key], server=srv, outcome=outcome)
            for outcome, key in (("restored", "restores"), ("refused", "restores_refused_by_verdict"),
                                 ("failed", "restore_failures")):
                self.restores.set(c[key], server=srv, outcome=outcome)
            for outcome, key in (("stored", "saves"), ("deduplicated", "saves_deduplicated"),
                                 ("failed", "save_failures")):
                self.saves.set(c[key], server=srv, outcome=outcome)
            for outcome, key in (("converted", "conversions"), ("failed", "conversion_failures")):
                if key in c:
                    self.conversions.set(c[key], server=srv, outcome=outcome)
            self.pruned.set(c["pruned"], server=srv)
            self.cache_on.set(0 if self.cache_off() else 1, server=srv)
            for key, code in self.ERRORS.items():
                if c[key]:
                    self.errors.set(c[key], server=srv, code=code)
        return self.registry.exposition()

    def ready(self, probe: StoreProbe | None) -> tuple[bool, list[str]]:
        """Ready when serve last read the server's facts (no request made here: a sleeping server is not
        woken) and the store answers ``probe``."""
        why = []
        ok_server = self.server_ok is not None and self.server_ok[0]
        if self.server_ok is None:
            why.append("server: not read yet")
        elif not ok_server:
            why.append("server: its facts could not be read at the last try")
        else:
            why.append("server: up")
        ok_store, said = probe() if probe is not None else (True, "")
        why.append(f"store: reachable" if ok_store else f"store: failed ({said})")
        off = self.cache_off()
        why.append("cache: on" if off is None else f"cache: off ({off}): requests go uncached")
        ok = ok_server and ok_store and off is None
        with self.registry.lock:
            self.ready_.set(1 if ok else 0, server=self.server)
        return ok, why


# -- the HTTP endpoint ------------------------------------------------------------------------------------


def parse_listen(text: str, option: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6; ``:PORT`` or ``PORT`` alone: 127.0.0.1); ``option`` names it in
    the error."""
    t = text.strip()
    host, sep, port = t.rpartition(":")
    if not sep:
        host, port = "", t
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or len(port) > 5 or not 0 <= int(port) <= 65535:
        raise UsageError(f"{option} {text!r}: expected HOST:PORT (a port from 0 to 65535)")
    return host, int(port)


#: the ``/ui`` page's headers: nothing loaded from anywhere, no script (the page's own inline style only)
UI_HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; "
                                         "form-action 'none'; frame-ancestors 'none'",
              "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}


#: connections the endpoint serves at once, and seconds one may send nothing before it is closed
MAX_CONNECTIONS = 32
CONNECTION_TIMEOUT = 10.0


class Endpoint:
    """``GET /metrics``, ``/livez`` and ``/readyz`` on ``HOST:PORT``, answered by a daemon thread; ``/ui``
    too when ``ui`` is given (it returns the page's HTML: :mod:`slotctl.fleet.ui`)."""

    def __init__(self, listen: str, metrics: Callable[[], str], ready: Callable[[], tuple[bool, list[str]]],
                 alive: Callable[[], tuple[bool, str]], ui: Callable[[], str] | None = None,
                 option: str = "--listen"):
        import http.server

        host, port = parse_listen(listen, option)
        paths = "/metrics, /livez, /readyz" + (", /ui" if ui is not None else "")

        class Handler(http.server.BaseHTTPRequestHandler):
            server_version = "slotctl"
            timeout = CONNECTION_TIMEOUT    # a connection that sends nothing is closed

            def do_GET(self):  # noqa: N802 - the standard library's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, metrics().encode(), CONTENT_TYPE)
                elif path == "/livez":
                    ok, why = alive()
                    self._send(200 if ok else 503, (why + "\n").encode())
                elif path == "/readyz":
                    ok, why = ready()
                    self._send(200 if ok else 503, ("\n".join(why) + "\n").encode())
                elif path == "/ui" and ui is not None:
                    try:
                        body = ui().encode()
                    except Exception as e:  # noqa: BLE001 - the page failed: a line saying why, not a dropped connection
                        self._send(500, f"error: the page could not be made: {type(e).__name__}\n".encode())
                        return
                    self._send(200, body, "text/html; charset=utf-8", UI_HEADERS)
                else:
                    self._send(404, f"not found: {paths}\n".encode())

            def _send(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8",
                      headers: dict | None = None):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):   # no line per scrape on stderr
                pass

        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        class Server(http.server.ThreadingHTTPServer):
            """A thread per connection, at most :data:`MAX_CONNECTIONS` at once (beyond, a new one is closed at
            once): idle connections cannot take the process's descriptors."""

            address_family = family
            daemon_threads = True

            def process_request(self, request, client_address):
                if not slots.acquire(blocking=False):
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    slots.release()
                    raise

            def process_request_thread(self, request, client_address):
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        try:
            self.httpd = Server((host, port), Handler)
        except OSError as e:
            raise UsageError(f"{option} {listen}: cannot listen there: {e.strerror}") from None
        self.host, self.port = host, self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="slotctl-metrics", daemon=True)

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    def start(self) -> "Endpoint":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
