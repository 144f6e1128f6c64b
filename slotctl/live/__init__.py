"""A running llama-server, reached over its HTTP API, and what slotctl learns from it.

- ``http``: the transport and the API (``/health``, ``/props``, ``/slots``, slot actions, ``/completion``):
  every request bounded in time, every answer checked against its shape, no redirect followed;
- ``learn``: the flags to validate with for a running server, from what it reports (``/props``, ``/slots``);
- ``prove``: a restore proven by the server's own counts (a request after the restore), over validate's
  prediction.

The server's own rules (what it restores, refuses, drops; its defaults; the file names it accepts) are
:mod:`slotctl.server`, below this package; the fleet (:mod:`slotctl.fleet`) and the CLI are above it.
Nothing here imports llama.cpp or the CLI. Importing this package imports none of its modules.
"""
