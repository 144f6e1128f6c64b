"""What goes wrong talking to a llama-server, as :class:`~slotctl.errors.SlotctlError` subclasses with one line each
(docs/live.md): the transport's (:mod:`slotctl.live.transport`), the answers' (:mod:`slotctl.live.answers`) and
the API's (:mod:`slotctl.live.http`).

* :class:`ServerUnreachable` (exit 2): nothing answers at the address, the connection broke, the answer took
  longer than the timeout, or what answered is not a llama-server (:class:`ServerAnswerError`: not the shape
  a llama-server answers; :class:`ServerRedirect`: a redirect, never followed; :class:`ProxyRefused`: the proxy
  between said no; :class:`ServerDropped`: the request went and the connection closed unanswered);
* :class:`ServerAuthError` (exit 2): the server wants an API key (``--api-key``) and did not get the right one;
* :class:`ServerRefused` (exit 1): the server answered and refused the operation (slot actions without
  ``--slot-save-path``, an invalid slot id, a file that does not restore, the model still loading, ...).
  ``status``, ``error_type`` and ``message`` hold what the server said.
"""

from __future__ import annotations

from typing import Any

from slotctl.errors import ExitStatus, SlotctlError


class ServerError(SlotctlError):
    """Base of every error talking to a server."""


class ServerUnreachable(ServerError):
    """No usable answer: connection refused or reset, unknown host, timeout, not a llama-server."""

    exit_status = ExitStatus.USAGE


class CutOff(ServerUnreachable):
    """A read cut off because the process is stopping (:func:`cut_off_reads`), not for anything the server did."""


class ServerAnswerError(ServerUnreachable):
    """The server answered, but not with what a llama-server answers there (a wrong shape or type)."""


class ServerDropped(ServerUnreachable):
    """The request was sent and the server closed the connection without an answer: it may have crashed."""

    code = "connection_dropped"


class ServerRedirect(ServerUnreachable):
    """The server answered with a redirect (HTTP 3xx); slotctl never follows one."""

    def __init__(self, message: str, *, status: int, location: str | None):
        self.status = status
        self.location = location
        super().__init__(message)


class ServerAuthError(ServerError):
    """The server wants an API key and was sent none or a wrong one (HTTP 401 or 403)."""

    exit_status = ExitStatus.USAGE

    def __init__(self, message: str, *, status: int, error_type: str | None = None):
        self.status = status
        self.error_type = error_type
        super().__init__(message)


class ServerRefused(ServerError):
    """The server answered with an error: it refused the operation.

    ``status`` is the HTTP status, ``error_type`` the server's ``error.type`` (``invalid_request_error``,
    ``not_supported_error``, ``unavailable_error``, ``server_error``, ...), ``message`` its ``error.message``,
    ``body`` the parsed answer (or None).
    """

    exit_status = ExitStatus.FAILED

    def __init__(self, line: str, *, status: int, message: str, error_type: str | None = None, body: Any = None):
        self.status = status
        self.message = message
        self.error_type = error_type
        self.body = body
        super().__init__(line)


class ProxyRefused(ServerUnreachable):
    """The proxy between slotctl and the server refused the request (HTTP 407: it wants credentials)."""


class RouterModelNotLoaded(ServerUnreachable):
    """The router's model (``--router-model``) is not loaded, and slotctl never makes a router load one (exit 2)."""

    code = "router_model_not_loaded"


class RouterMode(ServerUnreachable):
    """The URL is llama-server's router (router mode): no one model's server to use (exit 2)."""

    code = "router_mode"

