"""The fleet: slots kept and moved between running llama-servers (docs/fleet.md).

- ``migrate``: a slot moved from one server to another, the restore proven;
- ``keep``: a server's slots kept across its restarts;
- ``view``: every server's slots and what its store holds for each (``slots`` over several servers).

Over :mod:`slotctl.keeping` (the stored states, their names, the conversion step, the server's states),
:mod:`slotctl.live` (the servers' API and the proof), :mod:`slotctl.store`, :mod:`slotctl.prune` and
:mod:`slotctl.validate`; beside :mod:`slotctl.serve`, which it never imports. Nothing here imports
llama.cpp or the CLI. Importing this package imports none of its modules.
"""
