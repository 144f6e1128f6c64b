"""What serve reads of an answer it relays (plain code, no HTTP; the proxy feeds it the bytes as it passes them
on): whether the server completed it, and the server's own ``timings`` of it.

An answer is passed on untouched, chunk by chunk; only its last bytes are kept (:data:`TAIL` of them), for two
questions:

* **Did the server complete it?** A client may close its connection before the answer's last bytes reach it
  (the ``openai`` SDK's stream iterator closes right after ``data: [DONE]``, before the chunked body's end):
  the server's work is done all the same, and its slot holds the whole exchange. An answer that is not a
  stream (``application/json``) is complete once its headers came (llama-server answers a completion it
  did not stream when it is done); a stream (``text/event-stream``) when its last event is the last one the
  server sends: ``data: [DONE]`` (the OpenAI-compatible endpoints) or the event that carries ``stop_type``
  (``/completion``: ``eos``, ``limit``, ``word``; its partial events carry none).
* **What did its prompt cost?** The last ``"timings"`` object of the answer (the final event of a stream, the
  end of a JSON answer: b11434 writes it last): ``prompt_n``, ``prompt_ms``, ``cache_n``, ... (flat numbers),
  which serve's restore-or-prefill policy learns the server's speed from (:mod:`slotctl.serve.costs`).
"""

from __future__ import annotations

import json
import re

#: the bytes of an answer kept, from its end (a final event's ``stop_type`` and ``timings`` are within its last
#: few hundred bytes, whatever the length of the prompt it repeats)
TAIL = 16 << 10
_FINAL = re.compile(rb'"stop_type"\s*:\s*"(?!none")[a-z_]+"')
_TIMINGS = re.compile(rb'"timings"\s*:\s*(\{[^{}]*\})')


class Tail:
    """The last :data:`TAIL` bytes of one answer, fed as they are passed on; ``stream``: the answer is
    server-sent events."""

    def __init__(self, content_type: str | None):
        self.stream = (content_type or "").split(";")[0].strip().lower() == "text/event-stream"
        self.data = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * TAIL:
            del self.data[:-TAIL]

    def final(self) -> bool:
        """Whether the bytes seen so far end the server's work: a stream's last event is its final one; an
        answer that is not a stream is complete from its headers on."""
        if not self.stream:
            return True
        tail = bytes(self.data[-TAIL:]).rstrip()
        if tail.endswith(b"data: [DONE]"):
            return True
        last = tail.rpartition(b"data: ")[2]
        return _FINAL.search(last) is not None

    def timings(self) -> dict | None:
        """The answer's last ``timings`` object (its number fields), or None."""
        found = None
        for m in _TIMINGS.finditer(bytes(self.data[-TAIL:])):
            found = m
        if found is None:
            return None
        try:
            doc = json.loads(found.group(1))
        except ValueError:
            return None
        if not isinstance(doc, dict):
            return None
        return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, (int, float))
                and not isinstance(v, bool)}
