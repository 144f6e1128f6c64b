"""``slotctl serve``: a prompt cache on disk and in S3 in front of a llama-server (docs/serve.md).

``proxy`` is the HTTP side (aiohttp: every request passed on, completions given a slot and a restored
prompt), ``cache`` the blocking side (the server's facts, validate's verdict, restores and saves through
live mode's HTTP API, the store and prune's budget), ``index`` the stored states' tokens for prefix lookups.
Only ``proxy`` imports aiohttp (the ``[serve]`` extra), and only when ``slotctl serve`` runs.
"""
