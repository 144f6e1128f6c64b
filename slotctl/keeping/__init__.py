"""Keeping a server's slots: what ``keep`` (slotctl.fleet.keep) and ``serve`` (slotctl.serve) share, below
both (docs/design.md).

- ``names``: the one naming scheme of stored states (``slotN-MODEL-NTOKENS-TOKENS.bin``; the names of the
  previous release, keep's ``slotN-MODEL-TOKENS.bin`` and serve's ``serve-MODEL-NTOKENS-TOKENS.bin``, still
  read) and of the working files a process has the server save into its ``--slot-save-path``;
- ``store``: where kept states live, a directory or an ``s3://`` prefix, and a save read back (``Saved``);
- ``conversion``: a state converted for a server's ``-np``/``-kvu`` (exact) or cache types (lossy);
- ``judged``: validate's verdict on a stored state for one slot of a server, as kept in the store's catalog;
- ``states``: one object per server and store (``ServerStates``): the server's flags it does not report
  learnt from its saves, each stored state judged through the catalog, placed and restored, each save
  checked and stored, the store pruned.

Over :mod:`slotctl.live`, :mod:`slotctl.catalog`, :mod:`slotctl.prune`, :mod:`slotctl.store` and
:mod:`slotctl.validate`; nothing here imports llama.cpp, the CLI, serve or the fleet. Importing this package
imports none of its modules.
"""
