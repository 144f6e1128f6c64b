"""``slotctl serve``: a prompt cache on disk and in S3 in front of a llama-server (docs/serve.md).

``proxy`` is the proxy's life and its dispatch (serve's own small requests through :mod:`slotctl.live.http`),
``relay`` the relay of client traffic (aiohttp: every request passed on, its answer streamed back),
``completion`` the cached completion path (a slot given, a stored prompt restored, the slot saved after),
``models`` a proxy per model behind llama-server's router, ``slots`` serve's view of the slots and its
choice of one (plain code), ``cache`` the blocking side (the server's states as keep keeps them,
:class:`slotctl.keeping.states.ServerStates`, with serve's restore policy, counters and index), ``index`` the
stored states' tokens for prefix lookups, ``main`` the process (in :mod:`slotctl.unattended.shell`). Only
the request path's modules import aiohttp (the ``[serve]`` extra), and only when ``slotctl serve`` runs;
nothing here imports the fleet.
"""
