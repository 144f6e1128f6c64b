"""A running llama-server, reached over its HTTP API, and what slotctl learns from it.

- ``http``: the API (``/health``, ``/props``, ``/slots``, slot actions, ``/completion``), every answer used
  checked against its shape; the client's one import (the names of the three below are its own too);
- ``transport``: one request, with the client's guarantees written once: no redirect followed, the answer
  bounded, a deadline on the whole request, the proxy environment, the key never logged;
- ``answers``: an answer bounded before it is parsed, an error status said in one line, the answers' shapes;
- ``errors``: what goes wrong talking to a server, one class per kind of failure;
- ``router``: what llama-server's router routes a request by, and the model's own server behind it;
- ``learn``: the flags to validate with for a running server, from what it reports (``/props``, ``/slots``);
- ``prove``: a restore proven by the server's own counts (a request after the restore), over validate's
  prediction.

The server's own rules (what it restores, refuses, drops; its defaults; the file names it accepts) are
:mod:`slotctl.server`, below this package; the fleet (:mod:`slotctl.fleet`) and the CLI are above it.
Nothing here imports llama.cpp or the CLI. Importing this package imports none of its modules: the CLI's
options read live mode's defaults here without the HTTP client.
"""

#: seconds a request may take, connection included, unless the caller says otherwise
DEFAULT_TIMEOUT = 30.0
#: a request that moves a whole slot file (save, restore, keep, migrate): the server writes or reads it all,
#: and waits for a busy slot to be idle first
SLOT_FILE_TIMEOUT = 600.0
#: the environment variable that holds the API key when ``--api-key`` is not given
API_KEY_ENV = "LLAMA_API_KEY"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a URL's host name or address) names this machine's loopback: here, below ``http`` and
    ``router``, which both ask it (``ipaddress`` imported when asked: the CLI's options import this package)."""
    import ipaddress

    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
