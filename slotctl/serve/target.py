"""Where a client's request goes upstream (docs/serve.md, "An upstream under a path").

An upstream reached under a path (``--upstream http://SWAP:8080/upstream/MODEL``, a server run with
``--api-prefix``) takes the client's path under it, or as it is when the client gave the prefix already. Such a
path is normalised first (:func:`under_prefix`): its dot segments resolved (``.`` and ``..``, also
percent-encoded, ``%2e%2e``), so that what goes upstream stays under the prefix; a path that would leave it (a
``..`` above its root) is refused (:class:`Leaves`, a ``400``), and so is a segment whose percent-encoded
separator (``%2f``, ``%5c``) hides a dot segment from this reading. Everything else is sent as the client
encoded it. An upstream without a path takes the client's path untouched (the server alone is the bar).
"""

from __future__ import annotations

import re
from urllib.parse import unquote

#: a segment's separators, as a server that decodes them before it routes would read them
_SEPARATORS = re.compile(r"[/\\]")


class Leaves(ValueError):
    """A path that leaves the upstream's prefix (or hides a dot segment behind an encoded separator)."""


def _dots(segment: str) -> str | None:
    """``.`` or ``..`` when ``segment`` is one (percent-encoded or not), else None; :class:`Leaves` when it
    hides one behind an encoded separator."""
    plain = unquote(segment, errors="surrogateescape")
    if plain in (".", ".."):
        return plain
    if _SEPARATORS.search(plain) and any(p in (".", "..") for p in _SEPARATORS.split(plain)):
        raise Leaves(f"a path segment hides a dot segment behind an encoded separator: {segment[:80]!r}")
    return None


def normalized(path: str) -> str:
    """``path`` (as the client encoded it, starting with ``/``) with its dot segments resolved (RFC 3986 5.2.4);
    :class:`Leaves` when a ``..`` would go above its root."""
    out: list[str] = []
    segments = path.split("/")[1:]
    for i, seg in enumerate(segments):
        dots = _dots(seg)
        last = i == len(segments) - 1
        if dots == ".":
            if last:
                out.append("")      # "/a/." is "/a/"
            continue
        if dots == "..":
            if not out:
                raise Leaves("the path goes above the upstream's root")
            out.pop()
            if last:
                out.append("")
            continue
        out.append(seg)
    return "/" + "/".join(out)


def under_prefix(prefix: str, raw_path: str) -> tuple[str, str]:
    """The path (with its query) a request for ``raw_path`` (as the client encoded it, query included) goes to
    under the upstream's ``prefix`` (its path, no trailing ``/``; empty: none), and the route it names there
    (the path without the prefix or the query, for serve's own reading: which requests are completions).
    Without a prefix: ``raw_path`` untouched. :class:`Leaves` for a path that would leave the prefix."""
    path, sep, query = raw_path.partition("?")
    if not prefix:
        return raw_path, path
    if path == prefix or path.startswith(prefix + "/"):
        path = path[len(prefix):]
        if not path:        # the prefix itself, as the client gave it
            return raw_path, "/"
    route = normalized(path)
    return prefix + route + sep + query, route
