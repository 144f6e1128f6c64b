"""Running unattended: the parts a long-running process (``keep``, ``serve``) needs beside its work
(docs/fleet.md, "Running unattended").

- ``shell``: the process around the work, one for keep and serve: the lock (or lease) taken and released,
  the metrics endpoint and the store probe, systemd's notify protocol and watchdog, SIGTERM and SIGINT;
- ``lock``: one keeper per server and store (``flock`` in a directory store, a lease object in ``s3://``),
  and its journal of the states already stored;
- ``config``: the TOML configuration file (servers, stores, budgets, retention, the proof policy);
- ``metrics``: counters and gauges in Prometheus's text format, ``/metrics``, ``/livez``, ``/readyz`` on a
  small standard-library HTTP server thread;
- ``systemd``: the ``NOTIFY_SOCKET`` protocol (``READY=1``, ``WATCHDOG=1``, ``STOPPING=1``) and the unit
  files shipped as package data (``units/``).

Over :mod:`slotctl.store` (the lease's conditional puts) and the standard library; nothing here imports
llama.cpp, the CLI or :mod:`slotctl.fleet`. Importing this package imports none of its modules.
"""
