"""``slotctl serve``: a prompt cache on disk and in S3 in front of a llama-server (docs/serve.md).

``proxy`` is the relay (aiohttp: every request passed on, completions given a slot and a restored prompt;
serve's own small requests through :mod:`slotctl.live.http`), ``slots`` serve's view of the slots and its
choice of one (plain code), ``cache`` the blocking side (the server's states as keep keeps them,
:class:`slotctl.keeping.states.ServerStates`, with serve's restore policy, counters and index), ``index`` the
stored states' tokens for prefix lookups, ``main`` the process (in :mod:`slotctl.unattended.shell`). Only
``proxy`` imports aiohttp (the ``[serve]`` extra), and only when ``slotctl serve`` runs; nothing here imports
the fleet.
"""
