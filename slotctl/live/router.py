"""llama-server's router mode: what b11434's router routes a request by, written once (docs/fleet.md,
"llama-server's router mode").

A llama-server started without ``-m`` (``--models-dir``, ``--models-preset``) is a router: it starts each
model's own llama-server (a child on ``127.0.0.1``, on a port it picks anew at each load) and passes a
request on to the model the request names. What b11434 reads (``tools/server/server-models.cpp``,
``server_models_routes::init_routes``):

* a GET (``proxy_get``: ``/slots``, ``/props``, ``/metrics``) is routed by its query's ``model``; ``/props``
  without one answers for the router itself (``"role": "router"``);
* a POST (``proxy_post``: ``/slots/N?action=...``, ``/completion``, ...) is routed by the ``"model"`` of its
  JSON body only; its query's ``model`` is not read;
* either loads the model first when it is not running, unless the query's ``autoload`` is ``false``
  (``is_autoload``); then the router answers HTTP 400 ``model is not loaded`` (``router_validate_model``);
  a name it does not know is HTTP 400 ``model 'NAME' not found``, no name at all HTTP 400 ``model name is
  missing from the request``;
* ``/models`` and ``/v1/models`` are the router's own list of models (``get_router_models``): each one's
  ``status.value`` (``loaded``, ``unloaded``, ...) and ``status.args``, the child's command line, whose
  ``--port`` is where the model's own server listens while it is loaded; ``/health`` is the router's own.

slotctl names the model in both places (the query's ``model`` and the body's ``"model"``) and always sends
``autoload=false``: a read or an act of slotctl never makes a router load a model. A slot action the router
refuses as unrouted (other builds reject slot actions in router mode: llama.cpp #18703, #22373) is sent
again to the model's own server, looked up in the router's ``GET /models`` at that moment.

Which model a router URL stands for is set once per process by the command line (``--router-model``, or the
configuration file's server entry a command acts on): :func:`use_model`; :func:`slotctl.live.http.request` reads
it, unless the request names its model itself (``model=``: the fleet view's entries of one router, serve's models
behind one router).

b11669's router (Debian's llama.cpp 0.7.0, measured, ``tests/test_router.py``) routes as b11434's does and lists in
``GET /v1/models`` each model's ``aliases`` and its command line (``status.args``) whether it is loaded or not (an
unloaded model's ``--port`` is ``0``, or the port of its last load); ``GET /props`` without a model answers
``max_instances`` (``--models-max``) and ``models_autoload``. Read once here: :func:`parse_models` (each model,
its own server while loaded, its GGUF, its ``-kvu``/``-ctk``/``-ctv`` from its command line:
:func:`command_line_flags`), :func:`resolve` (a request's name or alias to the model), :func:`autoloads` (whether
the router loads a model for a request). Which requests refresh a model's place in the router's LRU order (the
model the router unloads first past ``--models-max``): its POSTs only (b11549's ``proxy_post``, "update last usage
for POST request only"); a GET never does.
"""

from __future__ import annotations

import sys
from typing import Any

from slotctl.errors import UsageError

__all__ = ["ROUTER_NO_MODEL", "ROUTER_NOT_LOADED", "answer_for", "autoloads", "command_line_flags", "model_for",
           "own_server_url", "parse_models", "resolve", "routed", "unrouted", "use_model", "wanted"]

#: what b11434's router answers (HTTP 400) to a request that names no model (``router_validate_model``)
ROUTER_NO_MODEL = "model name is missing from the request"
#: ... and to one naming a model that is not running, with ``autoload=false``
ROUTER_NOT_LOADED = "model is not loaded"

def not_found(model: str) -> str:
    """What b11434's router answers (HTTP 400) to a request naming a model it does not list."""
    return f"model '{model}' not found"


#: the router's own endpoints: never given a model
OWN_PATHS = frozenset({"/models", "/health", "/models/load", "/models/unload"})

#: router base URL -> the model's name, for this process
_MODELS: dict[str, str] = {}
#: (router, model) pairs whose fallback was already said on stderr
_SAID: set[tuple[str, str]] = set()


def use_model(base: str, model: str | None) -> None:
    """From now on, requests to the router at ``base`` (a normalized URL) name ``model`` (None: nothing).
    UsageError for an empty name, or a second, different model for the same URL in one process."""
    if model is None:
        return
    if not model.strip() or any(not c.isprintable() for c in model):
        raise UsageError(f"--router-model {model!r}: give the model's name, as the router's GET /models lists it")
    held = _MODELS.get(base)
    if held is not None and held != model:
        raise UsageError(f"{base}: one model per router URL in one run (both {held!r} and {model!r} were given)")
    _MODELS[base] = model


def model_for(base: str) -> str | None:
    """The model named for requests to ``base`` (None: none: it is taken as one model's own server)."""
    return _MODELS.get(base)


def wanted(base: str, path: str, model: str | None = None) -> str | None:
    """The model to name in a request to ``path`` at ``base``: ``model`` when the request names one (``""``:
    none), else the one :func:`use_model` set for ``base``; None for the router's own endpoints."""
    if path in OWN_PATHS:
        return None
    return (model or None) if model is not None else _MODELS.get(base)


def routed(model: str, method: str, query: dict[str, str] | None, body: Any) -> tuple[dict[str, str], Any]:
    """The query and body that route a request to ``model`` without ever loading it: ``?model=NAME`` (what a
    GET is routed by) and ``autoload=false``; a POST's JSON object gets ``"model": NAME`` (what a POST is
    routed by)."""
    q = dict(query or {})
    q["model"] = model
    q["autoload"] = "false"
    if method == "POST":
        body = dict(body or {}, model=model)
    return q, body


def unrouted(status: int, message: str, path: str) -> bool:
    """Whether a router's refusal of a slot action says it was not routed to the model at all (so the model's
    own server may take it): HTTP 400 ``model name is missing`` (the body's model not read) or HTTP 404 (no
    such route on the router). Any other refusal is the model's own answer, or the router's about the model
    (not loaded, not found), and is not sent again."""
    if not path.startswith("/slots/"):
        return False
    return status == 404 or (status == 400 and message == ROUTER_NO_MODEL)


def pick_model(models: list[dict], model: str) -> dict | None:
    """The entry of the router's ``GET /models`` (as :func:`parse_models` reads it) for ``model``."""
    return next((m for m in models if m["name"] == model), None)


def resolve(models: list[dict], name: str) -> dict | None:
    """The model a request naming ``name`` goes to: the entry of that name, else the one with that alias (the
    router's ``router_validate_model``: an alias is resolved to its model's name); None when none is."""
    return pick_model(models, name) or next((m for m in models if name in m["aliases"]), None)


#: at most this many models of a router are read (a router's list is the operator's; past it, not a router)
MAX_MODELS = 4096
#: the command line flags of a model's own server that give its -m (the GGUF the router starts it with)
_MODEL_FLAGS = ("-m", "--model")


def parse_models(answer: Any) -> list[dict]:
    """A router's ``GET /models`` (or ``/v1/models``) answer read: one dict per model, ``name``, ``aliases``,
    ``status`` (``loaded``, ``loading``, ``unloaded``, ...), ``port`` and ``url`` (the model's own server on the
    router's ``127.0.0.1``, while it is loaded: the ``--port`` of its command line, picked anew at each load;
    else None), ``args`` (its command line, [] when not said), ``model_path`` (its ``-m``: the GGUF, a path on
    the router's machine; None when not said) and ``meta`` (what its server says of its model, while loaded).
    Entries of another shape are left out."""
    data = answer.get("data") if isinstance(answer, dict) else None
    out = []
    for m in data[:MAX_MODELS] if isinstance(data, list) else ():
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            continue
        status = m.get("status") if isinstance(m.get("status"), dict) else {}
        args = status.get("args") if isinstance(status.get("args"), list) else []
        args = [a for a in args if isinstance(a, str)]
        port = path = None
        for flag, value in zip(args, args[1:]):
            if flag == "--port" and value.isdigit() and 0 < int(value) < 65536:
                port = int(value)
            elif flag in _MODEL_FLAGS:
                path = value
        state = status.get("value") if isinstance(status.get("value"), str) else "unknown"
        loaded = port is not None and state == "loaded"
        aliases = m.get("aliases") if isinstance(m.get("aliases"), list) else []
        meta = m.get("meta") if isinstance(m.get("meta"), dict) else None
        out.append({"name": m["id"], "aliases": [a for a in aliases if isinstance(a, str)], "status": state,
                    "port": port if loaded else None, "url": f"http://127.0.0.1:{port}" if loaded else None,
                    "args": args, "model_path": path, "meta": meta})
    return out


#: the flags a server does not report (serve's and keep's -kvu, -ctk, -ctv), by ServerFlags field
UNREPORTED = ("kv_unified", "cache_type_k", "cache_type_v")


def command_line_flags(args: list[str]):
    """What a model's own command line (the router's ``status.args``) says of the flags its server does not
    report: ``(ServerFlags, given)``, ``-kvu``, ``-ctk``, ``-ctv`` as the command line sets them (llama-server's
    defaults when it does not: the whole command line is known), all three ``given``. The environment the router
    passes on to its children may set them otherwise: the model's saves say so, and are believed over this
    (:class:`slotctl.server.saved.Learnt`). A value the server would refuse is left at its default (the model's
    saves say what it runs)."""
    from slotctl.server.flags import FLAGS, NEGATED_FLAGS, FlagError, ServerFlags, server_arg

    values: dict = {}
    by_spelling = {s: field for field in UNREPORTED for s in FLAGS[field]}
    negated = {s: field for field in UNREPORTED for s in NEGATED_FLAGS.get(field, ())}
    i = 0
    while i < len(args):
        word = args[i]
        name, eq, value = word.partition("=") if word.startswith("--") else (word, "", "")
        norm = name.replace("_", "-") if name.startswith("--") else name
        if norm in negated:
            values[negated[norm]] = False
        elif norm in by_spelling and by_spelling[norm] == "kv_unified":
            values["kv_unified"] = True
        elif norm in by_spelling:
            if not eq and i + 1 < len(args):
                value, i = args[i + 1], i + 1
            values[by_spelling[norm]] = value
        else:
            arg = server_arg(name) if name.startswith("-") else None
            i += (arg.values - (1 if eq else 0)) if arg is not None and arg.values > 0 else 0
        i += 1
    flags = ServerFlags()
    for field, value in values.items():
        try:
            flags = flags.replace(**{field: value})
        except FlagError:
            pass
    return flags, frozenset(UNREPORTED)


def autoloads(router_props: Any, query: dict[str, str] | None = None) -> bool:
    """Whether the router loads a model that is not loaded for a request whose query is ``query``: its
    ``autoload`` when given (``true`` or ``1``), else the router's own ``models_autoload`` (its ``/props``;
    b11549's ``is_autoload``)."""
    given = (query or {}).get("autoload")
    if given is not None and given != "":
        return given in ("true", "1")
    return not isinstance(router_props, dict) or router_props.get("models_autoload") is not False


def own_server_url(base: str, model: str, models: list[dict]) -> str:
    """The model's own server now (the ``--port`` of its child's command line in the router's ``GET /models``:
    it changes at each load, so it is looked up again at each call). UsageError when the router does not
    list the model, or it is not loaded (slotctl never loads it), or the router is not on this machine (its
    children listen on the router's ``127.0.0.1`` only)."""
    import urllib.parse

    entry = pick_model(models, model)
    if entry is None:
        raise UsageError(f"{base} (router): no model named {model!r} (GET /models: "
                         f"{', '.join(m['name'] for m in models) or 'none'})")
    if entry["url"] is None:
        raise UsageError(f"{base} (router): model {model!r} is {entry['status']}, not loaded: slotctl never loads "
                         f"a model (load it with POST /models/load, or send it a request)")
    from slotctl.live import is_loopback

    host = urllib.parse.urlsplit(base).hostname or ""
    if not is_loopback(host):
        raise UsageError(f"{base} (router): model {model!r}'s own server listens on the router's 127.0.0.1 only "
                         f"({entry['url']} there): run slotctl on the router's machine")
    return entry["url"]


def say_fallback(base: str, model: str, own: str, why: str) -> None:
    """Say once per process, on stderr, that the router's slot actions for ``model`` go to its own server."""
    if (base, model) in _SAID:
        return
    _SAID.add((base, model))
    from slotctl.errors import escape_text

    sys.stderr.write(escape_text(f"slotctl: the router at {base} did not route a slot action by the body's "
                                 f"\"model\" ({why}): sent to the model's own server, {own} ({model!r}: its port "
                                 f"as the router's GET /models lists it now; looked up again at each action)")
                     + "\n")


def answer_for(model: str, path: str, answer: Any) -> Any:
    """A router's answer as the model's own server would give it: ``/v1/models`` (the router's list of every
    model) cut to the model's entry, so that what is read there (its ``meta``) is the model's."""
    if path == "/v1/models" and isinstance(answer, dict) and isinstance(answer.get("data"), list):
        return dict(answer, data=[m for m in answer["data"] if isinstance(m, dict) and m.get("id") == model])
    return answer
