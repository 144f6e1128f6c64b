"""The fleet: slots kept and moved between running llama-servers (docs/fleet.md).

- ``states``: where kept states live, a directory or an ``s3://`` prefix;
- ``migrate``: a slot moved from one server to another, the restore proven;
- ``keep``: a server's slots kept across its restarts;
- ``view``: every server's slots and what its store holds for each (``slots`` over several servers).

Over :mod:`slotctl.live` (the servers' API and the proof), :mod:`slotctl.store`, :mod:`slotctl.prune` and
:mod:`slotctl.validate`. Nothing here imports llama.cpp or the CLI. Importing this package imports none of
its modules.
"""
