"""Keeping a server's slots: what ``keep`` (slotctl.fleet.keep) and ``serve`` (slotctl.serve) share, below
both (docs/design.md).

- ``names``: the one naming scheme of stored states (``slotN-MODEL-NTOKENS-TOKENS.bin``; the names of the
  previous release, keep's ``slotN-MODEL-TOKENS.bin`` and serve's ``serve-MODEL-NTOKENS-TOKENS.bin``, still
  read) and of the working files a process has the server save into its ``--slot-save-path``;
- ``store``: where kept states live, a directory or an ``s3://`` prefix, and a save read back (``Saved``);
- ``conversion``: a state converted for a server's ``-np``/``-kvu`` (exact) or cache types (lossy);
- ``judged``: validate's verdict on a stored state for one slot of a server, as kept in the store's catalog;
- ``states``: one object per server and store (``ServerStates``): the server's facts and the flags it does not
  report learnt from its saves, the save and restore requests, and its parts, each with one reason to change:
- ``identity``: the server's model identified by its content, and which stored states are its model's;
- ``judging``: each stored state judged once per identity through the store's catalog;
- ``placing``: a stored state copied, downloaded or converted into the slot directory to be restored;
- ``storing``: a checked save named by its content and stored once;
- ``housekeeping``: the store pruned, what processes that are gone left swept.

Over :mod:`slotctl.live`, :mod:`slotctl.catalog`, :mod:`slotctl.prune`, :mod:`slotctl.store` and
:mod:`slotctl.validate`; nothing here imports llama.cpp, the CLI, serve or the fleet. Importing this package
imports none of its modules.
"""
