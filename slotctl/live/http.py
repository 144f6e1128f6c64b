"""The HTTP API of a running llama-server: its slots, properties and slot-file actions, every answer used checked
against its shape.

Endpoints (llama.cpp b11434, ``tools/server``): ``GET /health``, ``GET /props``, ``GET /slots``,
``POST /slots/{id}?action=save|restore|erase`` (body ``{"filename": NAME}`` for save and restore; NAME is a
plain file name inside the server's ``--slot-save-path``, see :func:`slotctl.server.filenames.check_filename`),
``POST /completion``; a router's ``GET /models`` (:mod:`slotctl.live.router`: a request to a router names its
model as the router routes).

Every request goes through :mod:`slotctl.live.transport` (no redirect followed, the answer bounded, a deadline
on the whole request, the proxy environment, the key never logged) and its answer through
:mod:`slotctl.live.answers` (bounded before it is parsed, an error status in one line, shapes); every failure is
one of :mod:`slotctl.live.errors` (docs/live.md, "What slotctl trusts"). Their public names are this module's
too, so that a user of the client imports it alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from slotctl.errors import UsageError
from slotctl.live import DEFAULT_TIMEOUT  # live mode's defaults, read by the CLI's options too
from slotctl.live import router
from slotctl.live.answers import (MAX_ANSWER_BYTES, MAX_ANSWER_DEPTH, MAX_ANSWER_ESCAPES, MAX_ANSWER_ITEMS, SHAPES,
                                  check_shape, parse_answer, raise_http_error, show, snippet)
from slotctl.live.errors import (CutOff, ProxyRefused, RouterMode, RouterModelNotLoaded, ServerAnswerError,
                                 ServerAuthError, ServerDropped, ServerError, ServerRedirect, ServerRefused,
                                 ServerUnreachable)
from slotctl.live.router import ROUTER_NO_MODEL
from slotctl.live.transport import Pool, check_timeout, connections_made, cut_off_reads, normalize_url, redact, send
from slotctl.server.filenames import check_filename
from slotctl.server.flags import MAX_PARALLEL

__all__ = [
    "DEFAULT_TIMEOUT", "MAX_ANSWER_BYTES", "MAX_ANSWER_DEPTH", "MAX_ANSWER_ESCAPES", "MAX_ANSWER_ITEMS", "SHAPES",
    "CutOff", "ProxyRefused", "RouterMode", "RouterModelNotLoaded", "ServerAnswerError", "ServerAuthError",
    "Pool", "ServerDropped", "ServerError", "ServerFacts", "ServerRedirect", "ServerRefused", "ServerUnreachable",
    "check_filename", "check_shape", "connections_made", "check_slot", "completion", "cut_off_reads", "erase_slot", "get_health",
    "get_models", "get_props", "get_slots", "normalize_url", "parse_answer", "redact", "request", "restore_slot",
    "load_for", "router_message", "unloaded_facts", "router_models", "router_props", "save_slot", "server_facts",
]


def request(url: str, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
            api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT, data: bytes | None = None,
            pool: Pool | None = None, model: str | None = None) -> Any:
    """Send one request to the server at ``url`` and return its parsed JSON answer.

    ``path`` starts with ``/``; ``body`` (for POST) is sent as JSON, or ``data``, a JSON body as bytes, as they
    are (a client's own request: a router's model is then named in the query only); ``api_key`` (default: the
    ``LLAMA_API_KEY`` environment variable) goes in ``Authorization: Bearer``, to this URL only: a
    redirect is reported (:class:`ServerRedirect`), never followed. ``timeout`` bounds the whole request,
    connection, sending and reading together (:func:`slotctl.live.transport.send`). Raises
    :class:`ServerUnreachable`, :class:`ServerAuthError` or :class:`ServerRefused` (:mod:`slotctl.live.errors`).
    A router's model (:mod:`slotctl.live.router`) is named as the router routes, and a slot action it does not
    route is sent to the model's own server. ``model``: the router's model this request names (None: the one
    :func:`slotctl.live.router.use_model` set for ``url``, if any). ``pool``: connections kept open between
    requests (:class:`~slotctl.live.transport.Pool`; None: a connection of the request's own).
    """
    check_timeout(timeout)
    base = normalize_url(url)
    model = router.wanted(base, path, model)   # a router's model, named as the router routes (slotctl.live.router)
    if model is not None:
        query, body = router.routed(model, method, query, body if data is None else None)
    sent = data if data is not None else json.dumps(body).encode() if body is not None else None
    what = f"{method} {base}{path}"
    status, raw = send(base, method, path, sent, query=query, api_key=api_key, timeout=timeout, pool=pool)
    if status >= 400:
        try:
            raise_http_error(what, status, raw)
        except ServerError as e:
            said = getattr(e, "message", "")
            if model is not None and router.unrouted(status, said, path):
                # the router did not route the slot action by its body's model: the model's own server, now
                own = router.own_server_url(base, model, router_models(base, api_key=api_key, timeout=timeout,
                                                                       pool=pool))
                router.say_fallback(base, model, own, f"HTTP {status}: {said or 'no such route'}")
                plain = {k: v for k, v in (query or {}).items() if k not in ("model", "autoload")}
                if isinstance(body, dict):
                    body = {k: v for k, v in body.items() if k != "model"}
                return request(own, method, path, body, query=plain, api_key=api_key, timeout=timeout, data=data,
                               pool=pool, model="")
            if model is not None and status == 400 and said == router.not_found(model):
                names = ", ".join(_escaped(m["name"]) for m in router_models(base, api_key=api_key, timeout=timeout,
                                                                                pool=pool))
                raise UsageError(f"{what}: the router has no model named {_escaped(model)!r} (GET /models: "
                                 f"{names or 'none'})") from None
            if model is not None and status == 400 and said == router.ROUTER_NOT_LOADED:
                raise RouterModelNotLoaded(f"{what}: the router's model {model!r} is not loaded, and no request "
                                           f"is made to load it (load it with POST {base}/models/load, or send it "
                                           f"a request) (docs/fleet.md, router mode)") from None
            # b11434's router, asked without a "model": its own words (server-models.cpp, router_validate_model)
            if isinstance(e, ServerRefused) and status == 400 and said == ROUTER_NO_MODEL and path != "/models":
                said = router_message(url, api_key=api_key, timeout=timeout, pool=pool, model=model)
                raise RouterMode(f"{what}: {said}") from None
            raise
    if not 200 <= status < 300:
        raise ServerUnreachable(f"{what}: unexpected HTTP {status}")
    try:
        answer = parse_answer(raw, what)
    except ValueError:
        raise ServerUnreachable(f"{what}: answered HTTP {status} with something that is not JSON "
                                f"({snippet(raw)}): is this a llama-server?") from None
    return router.answer_for(model, path, answer) if model is not None else answer


# -- endpoints ---------------------------------------------------------------------------------------


def get_health(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT,
               pool: Pool | None = None) -> Any:
    """``GET /health``: ``{"status": "ok"}`` once the model is loaded; ServerRefused (503) while loading."""
    return check_shape(f"GET {normalize_url(url)}/health", request(url, "GET", "/health", api_key=api_key,
                                                                    timeout=timeout, pool=pool), SHAPES["/health"])



def get_props(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT,
              pool: Pool | None = None, model: str | None = None) -> Any:
    """``GET /props``: model path, ``total_slots``, ``default_generation_settings.n_ctx``, build info, ...

    Checked against ``SHAPES["/props"]`` (ServerAnswerError, exit 2): an object with a positive
    ``total_slots``. A router (``"role": "router"``) is :class:`RouterMode`, naming its models' own servers.
    """
    answer = request(url, "GET", "/props", api_key=api_key, timeout=timeout, pool=pool, model=model)
    if isinstance(answer, dict) and answer.get("role") == "router":
        raise RouterMode(router_message(url, api_key=api_key, timeout=timeout, pool=pool, model=model))
    return check_shape(f"GET {normalize_url(url)}/props", answer, SHAPES["/props"])


def router_models(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                  pool: Pool | None = None) -> list[dict]:
    """A router's models (``GET /models``, read by :func:`slotctl.live.router.parse_models`): each one's
    ``name``, ``aliases``, ``status`` (``loaded``, ``unloaded``, ...), its command line and GGUF and, while it
    runs, ``url``: the model's own server, which the router starts on ``127.0.0.1`` and a port it chooses anew
    at each load (the ``--port`` of its command line)."""
    return router.parse_models(request(url, "GET", "/models", api_key=api_key, timeout=timeout, pool=pool))


def router_props(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 pool: Pool | None = None) -> dict | None:
    """The router's own ``GET /props`` (no model named: ``"role": "router"``, its ``max_instances`` and
    ``models_autoload``); None when ``url`` answers for one model's server (no router)."""
    answer = request(url, "GET", "/props", api_key=api_key, timeout=timeout, pool=pool, model="")
    return answer if isinstance(answer, dict) and answer.get("role") == "router" else None


def load_for(url: str, model: str, *, api_key: str, autoload: str | None, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """The router at ``url`` asked to have ``model`` loaded and ready (``GET /props?model=NAME``: the router
    loads it, past ``--models-max`` unloading the least recently used, and answers once it is ready), on behalf
    of a client's request for it that the router would load it for: ``api_key``, the client's own (``""``:
    none), ``autoload``, the client's query's (None: not given: the router's own rule). The one request of
    slotctl that may load a model (every other carries ``autoload=false``): serve's, before it restores a state
    into the model's fresh server. The model's ``/props``; the router's refusal raised."""
    query = {"model": model, **({"autoload": autoload} if autoload is not None else {})}
    return request(url, "GET", "/props", query=query, api_key=api_key, timeout=timeout, model="")


def _escaped(text: str) -> str:
    """A server's text with its control characters escaped (never cut)."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def unloaded_facts(url: str, entry: dict, build_info: str | None = None) -> ServerFacts:
    """What a router's model that is not loaded is known by (``entry``: its ``GET /models`` entry,
    :func:`slotctl.live.router.parse_models`): its GGUF (``model_path``, its ``-m``) and what its server would
    say of it in ``/v1/models`` (:func:`slotctl.model.info.served_meta`: the GGUF is read here, so the router must
    run on this machine), so that its states (named by its content: :mod:`slotctl.seal`) are the ones its
    server's saves get; nothing of slots. UsageError when the GGUF is not said or cannot be read."""
    from slotctl.model.info import served_meta

    base = normalize_url(url)
    if not entry.get("model_path"):
        raise UsageError(f"{base} (router): model {entry['name']!r}: its command line names no GGUF (-m)")
    meta = served_meta(entry["model_path"])
    return ServerFacts(url=base, model_path=entry["model_path"], total_slots=None, n_ctx_slot=None, n_ctx_from=None,
                       speculative=None, speculative_types=None, build_info=build_info, mmproj=False, model_meta=meta,
                       props={}, slots=None, notes=(f"{entry['name']!r} is {entry['status']}",))


def router_message(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                   pool: Pool | None = None, model: str | None = None) -> str:
    """The one line said when a command is pointed at a router: where each model's own server is."""
    base = normalize_url(url)
    try:
        models = router_models(url, api_key=api_key, timeout=timeout, pool=pool)
        shown = ", ".join(_escaped(f"{m['name']} {m['url']} ({m['status']})" if m["url"] else
                                   f"{m['name']} ({m['status']}: no server of its own now)")
                          for m in models) or "none"
    except ServerError as e:
        shown = f"not known (GET /models: {e})"
    model = model or router.model_for(base)
    if model is not None:   # named, and not routed by it: another build's router
        return (f"{base} is llama-server's router (router mode) and did not route the request by the model named "
                f"({model!r}, in ?model= and the body's \"model\"): point --server at the model's own server, on "
                f"the router's machine (its port changes at each load); models: {shown} (docs/fleet.md, router mode)")
    return (f"{base} is llama-server's router (router mode): it answers for no one model, and b11434's router "
            f"routes a slot action only by the \"model\" of its JSON body (never ?model=): name the model with "
            f"--router-model NAME (a server entry's model in --config), or point --server at the model's own "
            f"server, on the router's machine (its port changes at each load); models: {shown} "
            f"(docs/fleet.md, router mode)")


def get_slots(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT,
              pool: Pool | None = None, model: str | None = None) -> list:
    """``GET /slots``: one object per slot (``id``, ``n_ctx``, ``speculative``, ``is_processing``, ...).

    ServerRefused (HTTP 501) when the server runs with ``--no-slots``.
    """
    answer = request(url, "GET", "/slots", api_key=api_key, timeout=timeout, pool=pool, model=model)
    what = f"GET {normalize_url(url)}/slots"
    if not isinstance(answer, list) or not answer:
        raise ServerAnswerError(f"{what}: unexpected answer: should be a list of one object per slot, got "
                                f"{show(answer)} (is this a llama-server?)")
    if len(answer) > MAX_PARALLEL:
        raise ServerAnswerError(f"{what}: unexpected answer: {len(answer):,} slots, where a llama-server has "
                                f"at most {MAX_PARALLEL} (LLAMA_MAX_SEQ; is this a llama-server?)")
    for i, entry in enumerate(answer):
        check_shape(what, entry, SHAPES["/slots[]"], f"[{i}]")
    return answer


def get_models(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT,
               pool: Pool | None = None, model: str | None = None) -> Any:
    """``GET /v1/models``: ``data[0].meta`` holds ``n_vocab``, ``n_ctx_train``, ``n_embd``, ``n_params``, ``size``."""
    return request(url, "GET", "/v1/models", api_key=api_key, timeout=timeout, pool=pool, model=model)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class ServerFacts:
    """What a running llama-server says about itself that decides which slot files it restores.

    From ``GET /props``: ``model_path`` (a path on the server's machine), ``total_slots`` (``-np``),
    ``build_info``, ``mmproj`` (``modalities``: vision or audio input means a multimodal projector).
    From ``GET /slots`` (the entry of ``slot``): ``n_ctx_slot`` (the slot's context in tokens; from
    ``/props`` ``default_generation_settings.n_ctx`` when ``/slots`` is disabled, see ``n_ctx_from``),
    ``speculative`` (the slot decodes speculatively; None when ``/slots`` is disabled) and
    ``speculative_types`` (``params["speculative.types"]``, e.g. ``"none,draft-simple"``: the server's, read
    from the slot's entry or, when the slot has run no task yet, another slot's; None until some slot has run
    one).
    From ``GET /v1/models``: ``model_meta`` (``n_vocab``, ``n_ctx_train``, ``n_embd``, ``n_params``,
    ``size``; None when the server does not answer it). ``props`` / ``slots``: the answers as they came.

    llama-server b11434 does not report its draft model, its cache types (``-ctk``/``-ctv``/``-ctkd``/
    ``-ctvd``), flash attention, batch sizes, ``--swa-full`` or whether its cache is unified (``-kvu``).
    """

    url: str
    model_path: str | None
    total_slots: int | None
    n_ctx_slot: int | None
    n_ctx_from: str | None
    speculative: bool | None
    speculative_types: str | None
    build_info: str | None
    mmproj: bool
    model_meta: dict | None
    props: dict
    slots: list | None
    notes: tuple[str, ...] = field(default=())


def server_facts(url: str, slot: int = 0, *, api_key: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, pool: Pool | None = None, model: str | None = None) -> ServerFacts:
    """Read ``GET /props``, ``GET /slots`` and ``GET /v1/models`` (see :class:`ServerFacts`; ``model``: the
    router's model they are asked of).

    ``/props`` must answer (its errors propagate); a server started with ``--no-slots`` (``/slots``
    refused) or one without ``/v1/models`` is described from ``/props`` alone, with a note.
    """
    base = normalize_url(url)
    props = get_props(base, api_key=api_key, timeout=timeout, pool=pool, model=model)
    if not isinstance(props, dict):
        raise ServerUnreachable(f"GET {base}/props: expected an object, got {type(props).__name__}: "
                                f"is this a llama-server?")
    notes = []
    slots: list | None
    try:
        slots = get_slots(base, api_key=api_key, timeout=timeout, pool=pool, model=model)
    except ServerRefused as e:
        slots = None
        notes.append(f"GET /slots refused ({e.message or f'HTTP {e.status}'}): the slot's context is taken "
                     f"from /props, and whether it decodes speculatively is not known")
    entry = None
    if slots is not None:
        entry = next((s for s in slots if isinstance(s, dict) and s.get("id") == slot), None)
    dgs = props.get("default_generation_settings")
    n_ctx_props = _int(dgs.get("n_ctx")) if isinstance(dgs, dict) else None
    if entry is not None and _int(entry.get("n_ctx")) is not None:
        n_ctx_slot, n_ctx_from = _int(entry.get("n_ctx")), "/slots"
    elif n_ctx_props is not None:
        n_ctx_slot, n_ctx_from = n_ctx_props, "/props"
    else:
        n_ctx_slot, n_ctx_from = None, None
    speculative = bool(entry.get("speculative")) if entry is not None and "speculative" in entry else None
    # the server's speculative types are its own (a request sets none): the same in every slot that has run a
    # task (its entry has ``params``), so a slot that has run none takes them from one that has; read from the
    # asked slot alone they came and went with which slot the last requests used
    spec_types = None
    for e in [entry, *(slots or [])]:
        params = e.get("params") if isinstance(e, dict) else None
        if isinstance(params, dict) and isinstance(params.get("speculative.types"), str):
            spec_types = params["speculative.types"]
            break
    meta = None
    try:
        models = get_models(base, api_key=api_key, timeout=timeout, pool=pool, model=model)
        data = models.get("data") if isinstance(models, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("meta"), dict):
            meta = data[0]["meta"]
    except (ServerRefused, ServerUnreachable):
        notes.append("GET /v1/models did not answer: the model's identity is not checked")
    modalities = props.get("modalities")
    mmproj = isinstance(modalities, dict) and bool(modalities.get("vision") or modalities.get("audio")
                                                   or modalities.get("video"))
    model_path = props.get("model_path")
    return ServerFacts(
        url=base,
        model_path=model_path if isinstance(model_path, str) and model_path else None,
        total_slots=_int(props.get("total_slots")),
        n_ctx_slot=n_ctx_slot,
        n_ctx_from=n_ctx_from,
        speculative=speculative,
        speculative_types=spec_types if isinstance(spec_types, str) else None,
        build_info=props.get("build_info") if isinstance(props.get("build_info"), str) else None,
        mmproj=mmproj,
        model_meta=meta,
        props=props,
        slots=slots,
        notes=tuple(notes),
    )


def check_slot(url: str, slot: int, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT,
               pool: Pool | None = None, model: str | None = None) -> int:
    """UsageError unless the server has slot ``slot``; returns the server's number of slots (``GET /props``).

    llama-server itself takes any id modulo its number of slots (``get_slot_by_id``): on a 2-slot server
    ``/slots/7?action=erase`` erases slot 1 and answers ``"id_slot": 7``. This check keeps a wrong id from
    touching another slot.
    """
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise UsageError(f"--slot must be a slot id (0, 1, ...), got {slot!r}")
    props = get_props(url, api_key=api_key, timeout=timeout, pool=pool, model=model)   # its shape: total_slots > 0
    total = props["total_slots"]
    if slot >= total:
        raise UsageError(f"--slot {slot}: the server at {normalize_url(url)} has {total} slot(s), "
                         f"0..{total - 1} (llama-server would quietly take slot {slot} as slot {slot % total})")
    return total


def _slot_action(url: str, slot: int, action: str, body: Any, api_key: str | None, timeout: float,
                 check: bool, pool: Pool | None, model: str | None = None) -> Any:
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise UsageError(f"--slot must be a slot id (0, 1, ...), got {slot!r}")
    if check:
        check_slot(url, slot, api_key=api_key, timeout=timeout, pool=pool, model=model)
    answer = request(url, "POST", f"/slots/{slot}", body, query={"action": action}, api_key=api_key,
                     timeout=timeout, pool=pool, model=model)
    what = f"POST {normalize_url(url)}/slots/{slot}?action={action}"
    check_shape(what, answer, SHAPES[action])
    if answer["id_slot"] != slot:
        raise ServerAnswerError(f"{what}: unexpected answer: id_slot should be {slot}, got {show(answer['id_slot'])}")
    if "filename" in (body or {}) and answer["filename"] != body["filename"]:
        raise ServerAnswerError(f"{what}: unexpected answer: filename should be {show(body['filename'])}, "
                                f"got {show(answer['filename'])}")
    return answer


def save_slot(url: str, slot: int, filename: str, *, api_key: str | None = None,
              timeout: float = DEFAULT_TIMEOUT, check: bool = True, pool: Pool | None = None,
              model: str | None = None) -> Any:
    """``POST /slots/{slot}?action=save``: the server writes ``--slot-save-path``/``filename``.

    Answer: ``{id_slot, filename, n_saved, n_written, timings: {save_ms}}``. The name is checked first
    (:func:`check_filename`, UsageError) so that a name the server would refuse never leaves this host.
    With ``check`` (the default) the slot id is checked first too (:func:`check_slot`).
    """
    check_filename(filename)
    return _slot_action(url, slot, "save", {"filename": filename}, api_key, timeout, check, pool, model)


def restore_slot(url: str, slot: int, filename: str, *, api_key: str | None = None,
              timeout: float = DEFAULT_TIMEOUT, check: bool = True, pool: Pool | None = None,
              model: str | None = None) -> Any:
    """``POST /slots/{slot}?action=restore`` of ``--slot-save-path``/``filename``.

    Answer: ``{id_slot, filename, n_restored, n_read, timings: {restore_ms}}``; a file that does not load
    is ServerRefused (HTTP 400, "Unable to restore slot: ...").
    """
    check_filename(filename)
    return _slot_action(url, slot, "restore", {"filename": filename}, api_key, timeout, check, pool, model)


def erase_slot(url: str, slot: int, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT,
               check: bool = True, pool: Pool | None = None, model: str | None = None) -> Any:
    """``POST /slots/{slot}?action=erase``: the slot forgets its cached prompt. Answer: ``{id_slot, n_erased}``."""
    return _slot_action(url, slot, "erase", {}, api_key, timeout, check, pool, model)


def completion(url: str, body: dict, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT,
               pool: Pool | None = None, model: str | None = None) -> Any:
    """``POST /completion`` (not streamed): ``content``, ``tokens``, ``timings``, ``id_slot``, ..."""
    return request(url, "POST", "/completion", dict(body, stream=False), api_key=api_key, timeout=timeout,
                   pool=pool, model=model)

