"""The remote side: a running llama-server, reached over its HTTP API, and what slotctl learns from it.

- ``http``: the API (``/health``, ``/props``, ``/slots``, slot actions, ``/completion``): every request bounded
  in time, every answer checked against its shape, no redirect followed;
- ``live``: the flags to validate with for a running server, from what it reports (``/props``, ``/slots``).

The server's own rules (what it restores, refuses, drops; its defaults; the file names it accepts) are
:mod:`slotctl.server`, below this package; the object store and the commands that keep and move slots
between servers live here too, over the same rules. Nothing here imports llama.cpp or the CLI. Importing
this package imports none of its modules.
"""
