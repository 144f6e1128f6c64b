"""A llama-server's answers, bounded before they are parsed and checked against their shapes (docs/live.md, "What
slotctl trusts"):

* **bounded in bytes, values and depth before it is parsed** (:func:`parse_answer`: :data:`MAX_ANSWER_BYTES`
  read at most, by the transport; :data:`MAX_ANSWER_ITEMS`, :data:`MAX_ANSWER_ESCAPES`,
  :data:`MAX_ANSWER_DEPTH`);
* **an error status said in one line** with what the server said (:func:`raise_http_error`: 401/403
  :class:`~slotctl.live.errors.ServerAuthError`, 404 not a llama-server endpoint, else
  :class:`~slotctl.live.errors.ServerRefused`);
* **every answer used checked against its shape** (:data:`SHAPES`, :func:`check_shape`,
  :class:`~slotctl.live.errors.ServerAnswerError`, exit 2): ``null``, ``[]``, ``{}`` or a wrong type where an
  object with typed fields is expected says what was wrong instead of passing for success.
"""

from __future__ import annotations

import json
import re
from typing import Any

from slotctl.live import API_KEY_ENV
from slotctl.live.errors import ServerAnswerError, ServerAuthError, ServerRefused, ServerUnreachable
from slotctl.server.flags import MAX_PARALLEL

#: at most this many bytes of an answer are read (a slot listing of 256 slots is far smaller); what its parse
#: holds is a small multiple of it (:func:`parse_answer`)
MAX_ANSWER_BYTES = 16 << 20

#: the most values (objects, lists, strings, numbers...), escapes (``\\n``, ``\\u00e9``) and the deepest nesting an
#: answer may have: a llama-server's answers (256 slots at most, /props, a completion with its probabilities)
#: are far below
MAX_ANSWER_ITEMS = 250_000
MAX_ANSWER_ESCAPES = 250_000
MAX_ANSWER_DEPTH = 64

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def parse_answer(raw: bytes, what: str) -> Any:
    """The JSON answer ``raw`` (at most :data:`MAX_ANSWER_BYTES`), bounded in values, escapes and depth
    before it is parsed (ServerAnswerError past :data:`MAX_ANSWER_ITEMS`, :data:`MAX_ANSWER_ESCAPES` or
    :data:`MAX_ANSWER_DEPTH`): 64 MiB of ``[{},...]`` made 1.7 GB of objects, 62 MiB of ``"\\u00e9..."``
    1.4 GB of pieces of one string, and deep nesting a RecursionError. ValueError when it is not JSON.

    Every count is made on the bytes (``bytes.count``, a C-speed regular expression) before anything of
    their size is made: the strings (each a quote pair) are counted before they are emptied, so the
    emptied copy has at most as many pieces as the bound; only the brackets, at most twice the bound,
    are walked for the depth. What the parse then holds is bounded by the byte cap (measured in
    tests/test_live_hardened.py: peak under 10 x :data:`MAX_ANSWER_BYTES`, the width of a Python string
    of 4-byte characters included).
    """
    def refuse(why: str) -> ServerAnswerError:
        return ServerAnswerError(f"{what}: unexpected answer: {why} (is this a llama-server?)")

    escapes = raw.count(b"\\")
    if escapes > MAX_ANSWER_ESCAPES:
        raise refuse(f"more than {MAX_ANSWER_ESCAPES:,} escaped characters")
    if raw.count(b'"') // 2 > MAX_ANSWER_ITEMS:
        raise refuse(f"more than {MAX_ANSWER_ITEMS:,} strings")
    bare = _JSON_STRING.sub(b'""', raw)
    opens = bare.count(b"[") + bare.count(b"{")
    items = bare.count(b",") + opens + 1
    if items > MAX_ANSWER_ITEMS:
        raise refuse(f"more than {MAX_ANSWER_ITEMS:,} values")
    brackets = bare.translate(None, _NOT_BRACKETS)
    del bare
    if len(brackets) <= 2 * opens:   # more closing than opening brackets: not JSON, json says where
        depth = deepest = 0
        for c in brackets:
            depth += 1 if c in (0x5B, 0x7B) else -1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_ANSWER_DEPTH:
                    raise refuse(f"nested deeper than {MAX_ANSWER_DEPTH} levels")
    try:
        return json.loads(raw)
    except RecursionError:   # pragma: no cover - the depth bound is far below the interpreter's
        raise refuse("nested too deep") from None


def snippet(raw: bytes, limit: int = 80) -> str:
    text = raw[:limit].decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    return repr(text + ("…" if len(raw) > limit else ""))


def raise_http_error(what: str, status: int, raw: bytes) -> None:
    body: Any = None
    message = ""
    error_type = None
    try:
        body = parse_answer(raw, what) if raw else None
    except (ValueError, ServerAnswerError):
        body = None
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            message = str(err.get("message") or "")
            error_type = err.get("type")
        elif isinstance(err, str):
            message = err
    if not message:
        message = snippet(raw).strip("'\"") if raw else ""
    said = f": {message}" if message else ""
    if status in (401, 403):
        raise ServerAuthError(
            f"{what}: HTTP {status}{said} (give the server's key with --api-key or {API_KEY_ENV})",
            status=status, error_type=error_type)
    if status == 404:
        # llama-server answers an unknown route with 404 "File Not Found": a wrong URL, or another server
        raise ServerUnreachable(f"{what}: HTTP 404{said or ' Not Found'}: no llama-server endpoint at this URL "
                                f"(give the server's base URL, e.g. http://127.0.0.1:8080)")
    if body is None and not (400 <= status < 600):
        raise ServerUnreachable(f"{what}: unexpected HTTP {status}")
    raise ServerRefused(f"{what}: the server refused (HTTP {status}){said}",
                        status=status, message=message, error_type=error_type, body=body)




#: kinds of values: a test and how it is named in an error
_KINDS = {
    "object": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "count": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a count (an integer >= 0)"),
    "positive": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer"),
    "slots": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_PARALLEL,
              f"a number of slots, 1 to {MAX_PARALLEL}"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, "a number >= 0"),
}

#: what each endpoint's answer must hold, as llama-server b11434 writes it (tools/server): key -> (kind,
#: required, shape of an object value). Only what slotctl uses is checked; other keys may be anything.
SHAPES: dict[str, dict] = {
    "/health": {"status": ("str", True, None)},
    "/props": {
        "total_slots": ("slots", True, None),
        "model_path": ("str", False, None),
        "build_info": ("str", False, None),
        "modalities": ("object", False, None),
        "default_generation_settings": ("object", False, {"n_ctx": ("count", False, None)}),
    },
    "/slots[]": {
        "id": ("count", True, None),
        "n_ctx": ("count", False, None),
        "speculative": ("bool", False, None),
        "is_processing": ("bool", False, None),
        "n_prompt_tokens": ("count", False, None),
        "params": ("object", False, None),
    },
    "save": {"id_slot": ("count", True, None), "filename": ("str", True, None), "n_saved": ("count", True, None),
             "n_written": ("count", True, None), "timings": ("object", False, {"save_ms": ("number", False, None)})},
    "restore": {"id_slot": ("count", True, None), "filename": ("str", True, None),
                "n_restored": ("count", True, None), "n_read": ("count", True, None),
                "timings": ("object", False, {"restore_ms": ("number", False, None)})},
    "erase": {"id_slot": ("count", True, None), "n_erased": ("count", True, None)},
}


def show(v: Any, limit: int = 60) -> str:
    text = json.dumps(v, ensure_ascii=True)
    return text if len(text) <= limit else text[:limit] + "…"


def check_shape(what: str, answer: Any, shape: dict, where: str = "") -> Any:
    """``answer`` when it is an object holding ``shape`` (see :data:`SHAPES`); else ServerAnswerError."""

    def wrong(key: str, want: str, got: Any) -> ServerAnswerError:
        return ServerAnswerError(f"{what}: unexpected answer: {key} should be {want}, got {show(got)} "
                                 f"(is this a llama-server?)")

    if not isinstance(answer, dict):
        raise wrong(where or "the answer", "an object", answer)
    for key, (kind, required, inner) in shape.items():
        name = f"{where}.{key}" if where else key
        if key not in answer:
            if required:
                raise ServerAnswerError(f"{what}: unexpected answer: {name} is missing (is this a llama-server?)")
            continue
        test, desc = _KINDS[kind]
        if not test(answer[key]):
            raise wrong(name, desc, answer[key])
        if inner:
            check_shape(what, answer[key], inner, name)
    return answer


