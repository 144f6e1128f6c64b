"""The configuration file of a long-running slotctl (``keep --config FILE``, ``slots --config FILE``): TOML,
read with the standard library's ``tomllib`` (docs/fleet.md, "The configuration file").

::

    [[servers]]                          # one table per server (keep keeps one of them, slots shows all)
    name = "qwen"                        # optional: how keep.server and the logs name it
    url = "http://127.0.0.1:8080"
    slot_dir = "/var/lib/llama/qwen/slots"
    store = "/var/lib/llama/qwen/store"  # or "s3://BUCKET/PREFIX/"
    api_key_env = "LLAMA_API_KEY"        # the variable that holds the API key (never the key itself)
    model = "qwen"                       # only when url is llama-server's router: the model acted on (several
                                         # entries may name models of one router; serve fronts the router's
                                         # entry without one)

    [keep]
    server = "qwen"                      # the name (or URL) of the server kept: default the only one
    every = 30                           # seconds between two looks
    min_tokens = 256
    timeout = 600
    lease = 60                           # seconds an s3:// lease holds without a renewal
    listen = "127.0.0.1:9464"            # /metrics, /livez, /readyz ("" or absent: none)

    [serve]
    server = "qwen"                      # the name (or URL) of the server serve fronts: default the only one
    listen = "127.0.0.1:8081"            # where serve's proxy listens
    metrics_listen = "127.0.0.1:9465"    # serve's /metrics, /livez, /readyz ("" or absent: none)
    min_gain = 16
    restore_policy = "cost"              # "cost": restore only when predicted faster than prefill; "tokens"
    max_connections = 4096               # clients' connections at once (--max-connections)
    idle_timeout = 30                    # seconds a connection may wait without a request (--idle-timeout)
    max_body = "8M"                      # a completion body serve reads to cache it (--max-body)
    timeout = 600
    lease = 60

    [budget]
    max_size = "20G"                     # the store held under it by prune's rules

    [retention]
    newest = 5                           # states kept per slot and model, the newest

    [proof]
    policy = "always"                    # "always": every restore proven; "never"

Every key is checked: an unknown key, a value of the wrong type or out of range, or a file that is not
TOML is one line naming the file, the key and what was expected (:class:`ConfigError`, exit 2). A number
written with more than :data:`MAX_DIGITS` digits is refused before the file is parsed. Flags given on the
command line override the file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from slotctl.errors import UsageError

#: a configuration file larger than this is not one
MAX_BYTES = 1 << 20
#: digits a number of the file may have (a size in bytes has at most 20)
MAX_DIGITS = 24
_LONG_NUMBER = re.compile(rb"[0-9_]{%d,}" % (MAX_DIGITS + 1))
PROOF_POLICIES = ("always", "never")


class ConfigError(UsageError):
    """The configuration file is unreadable, not TOML, or a key holds what it may not (exit 2)."""

    code = "bad_config"


@dataclass
class ServerEntry:
    url: str
    name: str | None = None
    slot_dir: str | None = None
    store: str | None = None
    api_key_env: str | None = None
    #: the url is llama-server's router and this its model (slotctl.live.router)
    model: str | None = None

    @property
    def label(self) -> str:
        return self.name or self.url

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


@dataclass
class Config:
    path: str | None = None
    servers: list[ServerEntry] = field(default_factory=list)
    keep: dict[str, Any] = field(default_factory=dict)
    serve: dict[str, Any] = field(default_factory=dict)
    max_size: str | None = None
    newest: int | None = None
    proof: str | None = None

    def server(self, which: str | None = None, section: str = "keep") -> ServerEntry | None:
        """The server ``which`` names (a name or a URL); without it, ``[section].server``, else the only server
        (None when there is none)."""
        if which is None:
            which = getattr(self, section).get("server")
        if which is None:
            if len(self.servers) > 1:
                raise ConfigError(f"{self.path}: {section}.server: expected the name of one of the "
                                  f"{len(self.servers)} [[servers]] ({', '.join(s.label for s in self.servers)})")
            return self.servers[0] if self.servers else None
        for s in self.servers:
            if which in (s.name, s.url):
                return s
        if self.servers:
            raise ConfigError(f"{self.path}: {section}.server: {which!r} is none of the [[servers]] "
                              f"({', '.join(s.label for s in self.servers)})")
        return ServerEntry(url=which)

    def fill(self, section: str, url: str | None, slot_dir, store: str | None, api_key: str | None) -> tuple:
        """``(url, slot_dir, store, api_key, model)`` of the server ``[section]`` uses (``url`` names one, or the
        section's ``server``, or the only one), each value given on the command line kept over the file's;
        as given when no file was read (``model``: the entry's router model, None then)."""
        entry = self.server(url, section) if self.path is not None else None
        if entry is None:
            return url, slot_dir, store, api_key, None
        from pathlib import Path

        return (entry.url,
                slot_dir if slot_dir is not None else (Path(entry.slot_dir) if entry.slot_dir else None),
                store if store is not None else entry.store,
                api_key if api_key is not None else entry.api_key(), entry.model)


# -- checking ------------------------------------------------------------------------------------------


class _Checker:
    def __init__(self, path: str):
        self.path = path

    def fail(self, key: str, expected: str, got: Any = None, *, show: bool = True) -> ConfigError:
        shown = f", got {_show(got)}" if show else ""
        return ConfigError(f"{self.path}: {key}: expected {expected}{shown}")

    def table(self, doc: dict, key: str, allowed: dict[str, str]) -> dict:
        t = doc.get(key, {})
        if not isinstance(t, dict):
            raise self.fail(key, "a table ([" + key + "])", t)
        for k in t:
            if k not in allowed:
                raise ConfigError(f"{self.path}: {key}.{k}: unknown key (expected one of: {', '.join(allowed)})")
        return t

    def string(self, t: dict, key: str, where: str, *, empty: bool = False) -> str | None:
        v = t.get(key)
        if v is None:
            return None
        if not isinstance(v, str) or (not v and not empty) or len(v) > 4096 or "\x00" in v:
            raise self.fail(f"{where}.{key}", "a string" + ("" if empty else " (not empty)"), v)
        return v

    def number(self, t: dict, key: str, where: str, *, low: float, high: float, integer: bool = False,
               what: str = "a number") -> float | int | None:
        v = t.get(key)
        if v is None:
            return None
        ok = isinstance(v, int) if integer else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok or not (low <= v <= high):
            hi = f"{high:,}" if isinstance(high, int) else f"{high:g}"
            raise self.fail(f"{where}.{key}", f"{what} from {low:g} to {hi}", v)
        return v


def _show(v: Any) -> str:
    if isinstance(v, str):
        text = v if len(v) <= 60 else v[:57] + "..."
        return repr(text)
    if isinstance(v, dict):
        return "a table"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if len(repr(v)) <= 60 else f"a {type(v).__name__}"


_SERVER_KEYS = {"name": "", "url": "", "slot_dir": "", "store": "", "api_key_env": "", "model": ""}
_KEEP_KEYS = {"server": "", "every": "", "min_tokens": "", "timeout": "", "lease": "", "listen": ""}
_SERVE_KEYS = {"server": "", "listen": "", "metrics_listen": "", "min_gain": "", "restore_policy": "", "timeout": "",
               "lease": "", "max_connections": "", "idle_timeout": "", "max_body": ""}
#: serve's restore policies (``--restore-policy``): by predicted cost, or by tokens alone
RESTORE_POLICIES = ("cost", "tokens")


def parse(raw: bytes, path: str) -> Config:
    """The configuration in ``raw`` (the bytes of the file ``path``), checked key by key."""
    import tomllib

    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{path}: more than {MAX_BYTES:,} bytes: expected a configuration file of at most that")
    m = _LONG_NUMBER.search(raw)
    if m is not None:
        line = raw.count(b"\n", 0, m.start()) + 1
        raise ConfigError(f"{path}: line {line}: a number of {len(m.group()):,} digits: expected at most "
                          f"{MAX_DIGITS}")
    try:
        text = raw.decode("utf-8")
        doc = tomllib.loads(text)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: byte {e.start}: expected UTF-8 text (TOML)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not TOML: {e}") from None
    c = _Checker(path)
    for k in doc:
        if k not in ("servers", "keep", "serve", "budget", "retention", "proof"):
            raise ConfigError(f"{path}: {k}: unknown key (expected one of: servers, keep, serve, budget, retention, "
                              f"proof)")
    cfg = Config(path=path)
    servers = doc.get("servers", [])
    if not isinstance(servers, list):
        raise c.fail("servers", "an array of tables ([[servers]])", servers)
    for i, t in enumerate(servers):
        where = f"servers[{i}]"
        if not isinstance(t, dict):
            raise c.fail(where, "a table", t)
        for k in t:
            if k not in _SERVER_KEYS:
                raise ConfigError(f"{path}: {where}.{k}: unknown key (expected one of: {', '.join(_SERVER_KEYS)})")
        url = c.string(t, "url", where)
        if url is None:
            raise c.fail(f"{where}.url", "the server's URL (http://HOST:PORT)", show=False)
        store = c.string(t, "store", where)
        if store is not None and "://" in store and not store.startswith("s3://"):
            raise c.fail(f"{where}.store", "a directory or s3://BUCKET/PREFIX/", store)
        env = c.string(t, "api_key_env", where)
        if env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", env):
            raise c.fail(f"{where}.api_key_env", "the name of an environment variable", env)
        model = c.string(t, "model", where)
        if model is not None and (not model.strip() or any(not ch.isprintable() for ch in model)):
            raise c.fail(f"{where}.model", "the model's name, as the router's GET /models lists it", model)
        cfg.servers.append(ServerEntry(url=url, name=c.string(t, "name", where), slot_dir=c.string(t, "slot_dir", where),
                                       store=store, api_key_env=env, model=model))
    names = [s.name for s in cfg.servers if s.name]
    if len(set(names)) != len(names):
        raise c.fail("servers", "a different name for each server", show=False)
    from slotctl.unattended.lock import MIN_TTL as MIN_LEASE   # the shortest s3:// lease, its one home

    keep = c.table(doc, "keep", _KEEP_KEYS)
    k: dict[str, Any] = {}
    k["server"] = c.string(keep, "server", "keep")
    k["every"] = c.number(keep, "every", "keep", low=0.05, high=86400.0, what="seconds")
    k["min_tokens"] = c.number(keep, "min_tokens", "keep", low=1, high=1 << 24, integer=True, what="an integer")
    k["timeout"] = c.number(keep, "timeout", "keep", low=0.001, high=86400.0, what="seconds")
    k["lease"] = c.number(keep, "lease", "keep", low=MIN_LEASE, high=86400.0, what="seconds")
    k["listen"] = _listen(c, keep, "listen", "keep")
    cfg.keep = {key: v for key, v in k.items() if v is not None}
    serve = c.table(doc, "serve", _SERVE_KEYS)
    v: dict[str, Any] = {}
    v["server"] = c.string(serve, "server", "serve")
    v["listen"] = _listen(c, serve, "listen", "serve", empty=False)
    v["metrics_listen"] = _listen(c, serve, "metrics_listen", "serve")
    v["min_gain"] = c.number(serve, "min_gain", "serve", low=1, high=1 << 24, integer=True, what="an integer")
    v["restore_policy"] = c.string(serve, "restore_policy", "serve")
    if v["restore_policy"] is not None and v["restore_policy"] not in RESTORE_POLICIES:
        raise c.fail("serve.restore_policy", " or ".join(f'"{p}"' for p in RESTORE_POLICIES), v["restore_policy"])
    v["timeout"] = c.number(serve, "timeout", "serve", low=0.001, high=86400.0, what="seconds")
    v["lease"] = c.number(serve, "lease", "serve", low=MIN_LEASE, high=86400.0, what="seconds")
    v["max_connections"] = c.number(serve, "max_connections", "serve", low=1, high=1 << 20, integer=True,
                                    what="an integer")
    v["idle_timeout"] = c.number(serve, "idle_timeout", "serve", low=0.1, high=86400.0, what="seconds")
    v["max_body"] = c.string(serve, "max_body", "serve")
    if v["max_body"] is not None:
        from slotctl.prune import parse_size

        try:
            parse_size(v["max_body"])
        except UsageError:
            raise c.fail("serve.max_body", "a size such as 8M", v["max_body"]) from None
    cfg.serve = {key: x for key, x in v.items() if x is not None}
    budget = c.table(doc, "budget", {"max_size": ""})
    cfg.max_size = c.string(budget, "max_size", "budget")
    if cfg.max_size is not None:
        from slotctl.prune import parse_size

        try:
            parse_size(cfg.max_size)
        except UsageError:
            raise c.fail("budget.max_size", "a size such as 20G or 500M", cfg.max_size) from None
    retention = c.table(doc, "retention", {"newest": ""})
    cfg.newest = c.number(retention, "newest", "retention", low=1, high=1 << 20, integer=True, what="an integer")
    proof = c.table(doc, "proof", {"policy": ""})
    cfg.proof = c.string(proof, "policy", "proof")
    if cfg.proof is not None and cfg.proof not in PROOF_POLICIES:
        raise c.fail("proof.policy", " or ".join(f'"{p}"' for p in PROOF_POLICIES), cfg.proof)
    return cfg


def _listen(c: _Checker, t: dict, key: str, where: str, *, empty: bool = True) -> str | None:
    """A ``HOST:PORT`` key (empty: none, where that is allowed)."""
    v = c.string(t, key, where, empty=empty)
    if v:
        from slotctl.unattended.metrics import parse_listen

        try:
            parse_listen(v)
        except UsageError as e:
            raise c.fail(f"{where}.{key}", "HOST:PORT", v) from e
    return v


def load(path: str | os.PathLike) -> Config:
    """The configuration file at ``path`` (:func:`parse`); a file that cannot be read is one line too."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the configuration file: {e.strerror}") from None
    return parse(raw, p)
