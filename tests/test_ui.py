"""The ``/ui`` page (docs/fleet.md, "The /ui page"): the fleet view's table as plain HTML, every value
escaped, served by keep's endpoint; looked at in a real headless Chromium (Debian's, installed by .ci/run),
which dumps the page's DOM and takes a screenshot of it.
"""

from __future__ import annotations

import html as html_module
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import urllib.request
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

import json_schemas
from llama_server import free_port
from keeping import Keep, first_line, keep_proc, slotctl, stop, wait_until
from slotctl.fleet.ui import page
from slotctl.fleet.view import rows
from slotctl.tinymodels import SAMPLE_PROMPT

server = pytest.mark.server
CHROMIUM = "/usr/bin/chromium"
#: what a hostile server or store could put in a value shown on the page
HOSTILE = '<img src=x onerror=alert(1)>"\'&amp;\x1b[31m\u202e'


class Tags(HTMLParser):
    """Every start tag of a page, with its attributes; the text of each table cell."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.cells: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.cells.append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def parsed(html: str) -> Tags:
    p = Tags()
    p.feed(html)
    p.close()
    return p


def _doc(name: str, model: str, state: str, message: str | None = None) -> dict:
    slot = {"slot": 0, "n_ctx": 256, "n_tokens": 106, "busy": False, "task": 3, "stored_states": 1,
            "last_saved": "2026-12-03T08:00:00Z",
            "states": [{"name": state, "saved": "2026-12-03T08:00:00Z", "n_tokens": 106, "verdict": "restores",
                        "n_reused": 106, "reason": None}],
            "best": {"name": state, "n_tokens": 106, "n_reused": 106, "reason": None}}
    return {"server": "http://127.0.0.1:1", "name": name, "store": "/s", "model": model, "total_slots": 1,
            "build_info": "b11434", "error": None if message is None else {"code": "x", "message": message},
            "slots": [slot]}


def test_every_value_on_the_page_is_escaped():
    """A server's name, its model path, a state's name and an error message holding markup, quotes, an
    entity, an escape sequence and a bidirectional override: no tag but the page's own, each value shown
    as its text (control characters as \\xNN, as on a terminal)."""
    html = page([_doc(HOSTILE, "/m/" + HOSTILE, "slot0-ab-" + HOSTILE + ".bin", HOSTILE)], refresh=5)
    p = parsed(html)
    assert {t for t, _ in p.tags} <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "table",
                                      "thead", "tbody", "tr", "th", "td", "ul", "li"}, p.tags
    assert not any(k.startswith("on") or k == "src" for _, a in p.tags for k in a)
    shown = HOSTILE.replace("\x1b", "\\x1b").replace("\u202e", "\\u202e")
    assert p.cells.count(shown) == 3    # the server's name (both tables), the model's file name
    assert f"slot0-ab-{shown}.bin (best)" in p.cells      # the stored states' table
    assert "\x1b" not in html and "\u202e" not in html and "<img" not in html
    assert ('<meta http-equiv="refresh" content="5">') in html
    assert not any(t in ("script", "link", "img", "iframe", "object") for t, _ in p.tags)


def test_the_page_has_the_rows_of_the_table():
    docs = [_doc("one", "/m/tiny.gguf", "slot0-ab-cd.bin"), _doc("two", "/m/tiny.gguf", "slot0-ab-ef.bin", "down")]
    docs[1]["slots"] = []
    p = parsed(page(docs, refresh=0.2))
    cells = p.cells
    header, body = cells[:8], cells[8:]
    assert header == ["server", "model", "slot", "tokens", "state", "last saved", "stored", "best reuse"]
    assert [tuple(body[i:i + 8]) for i in range(0, 16, 8)] == rows(docs)
    assert ('meta', {'http-equiv': 'refresh', 'content': '1'}) in p.tags     # at least a second


def test_a_slot_whose_states_none_restores_says_so():
    d = _doc("one", "/m/tiny.gguf", "slot0-ab-cd.bin")
    st = d["slots"][0]["states"][0]
    st.update(verdict="refused", n_reused=None, reason="validate says the server refuses it: ...")
    d["slots"][0]["best"] = None
    assert rows([d])[0][6:] == ("1", "none restores")
    p = parsed(page([d], refresh=5))
    assert "none restores" in p.cells and "validate says the server refuses it: ..." in p.cells
    assert ("td", {"class": "refused"}) in p.tags


def test_keeps_ui_page_while_its_server_is_down(tmp_path):
    """No server at the URL: the page is served all the same, one row saying error and why."""

    port = free_port()
    down = f"http://127.0.0.1:{free_port()}"
    proc = keep_proc(down, tmp_path, "--every", "0.2", "--listen", str(port))
    try:
        first_line(proc)
        said = f"{down}: the server did not answer the last look"    # once keep has looked
        status, headers, html = wait_until(lambda: (lambda r: r if said in html_module.unescape(r[2]) else None)(
            get(f"http://127.0.0.1:{port}/ui")))
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        p = parsed(html)
        assert p.cells[8:16] == [down, "-", "-", "-", "error", "-", "-", "-"]
        assert f"{down}: the server did not answer the last look" in html_module.unescape(html)
    finally:
        assert stop(proc) == 0


# -- a real keep, a real server, a real browser -------------------------------------------------------------


def chromium_or_skip() -> str:
    """Debian's chromium, which .ci/run installs; a skip saying why only when it could not be installed
    (.ci/run says so in SLOTCTL_CHROMIUM_UNAVAILABLE); under CI without that word, a failure."""
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    why = os.environ.get("SLOTCTL_CHROMIUM_UNAVAILABLE")
    if why:
        pytest.skip(f"headless Chromium could not be installed: {why}")
    if os.environ.get("CI"):
        pytest.fail(f"{CHROMIUM} is missing and .ci/run did not say why (it installs Debian's chromium)")
    pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (as .ci/run does)")


def test_without_chromium_the_browser_test_says_why_or_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setattr(sys.modules[__name__], "CHROMIUM", str(tmp_path / "no-chromium"))
    monkeypatch.setenv("SLOTCTL_CHROMIUM_UNAVAILABLE", "apt-get install chromium failed: E: Unable to locate")
    with pytest.raises(pytest.skip.Exception, match="could not be installed: apt-get install chromium failed"):
        chromium_or_skip()
    monkeypatch.delenv("SLOTCTL_CHROMIUM_UNAVAILABLE")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="did not say why"):
        chromium_or_skip()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y chromium"):
        chromium_or_skip()


def chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium with the flags this machine needs (no sandbox as root, no GPU, no network of its
    own) and a fresh profile."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", f"--user-data-dir={profile}"]
    res = subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, f"chromium exited {res.returncode}: {res.stderr[-2000:]}"
    return res


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """A PNG's width, height and rows of RGB(A) pixels (8-bit truecolour, as Chromium writes; the five
    filters undone)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, head = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h, depth, colour, _, _, interlace = head
    assert depth == 8 and colour in (2, 6) and interlace == 0, head
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = w * bpp
    out, prev = [], bytearray(stride)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        out.append(bytes(line[x:x + 3]) for x in range(0, stride, bpp))
        out[-1] = b"".join(out[-1])
        prev = line
    return w, h, out


def get(url: str) -> tuple[int, dict, str]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, dict(r.headers), r.read().decode()


@server
def test_keeps_ui_page_in_a_real_headless_chromium(kept, tmp_path):
    """keep --listen against a real server and a directory store holding the state it stored and a copy
    under a hostile name: /ui is HTML with a Content-Security-Policy and a meta refresh; Chromium's DOM of
    it holds one row per slot (the slot used with its tokens, its state and the best's predicted reuse, the
    same words as `slotctl slots --store`), the hostile name nowhere (no stored state's name: never offered) and
    no element of its own;
    the screenshot is a real picture (many colours, text on a white page)."""
    binary = chromium_or_skip()
    store = tmp_path / "store"
    store.mkdir()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    keep = Keep(kept, store, "--every", "0.3", "--listen", f"127.0.0.1:{port}")
    try:
        keep.wait_for("up")
        kept.completion(SAMPLE_PROMPT + " The page", slot=0, n_predict=3)
        stored = keep.wait_for("stored", 0)["details"]
        hostile = stored["name"].rsplit("-", 1)[0] + "-" + HOSTILE.replace("\u202e", "") + ".bin"
        shutil.copy(store / stored["name"], store / hostile)
        time.sleep(1)      # a look after the save: the page's slot shows its tokens
        status, headers, html = get(base + "/ui")
        assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
        assert "default-src 'none'" in headers["Content-Security-Policy"] and "script-src" not in \
            headers["Content-Security-Policy"]
        assert '<meta http-equiv="refresh" content="2">' in html
        # the same rows as `slotctl slots --store` for this server (read by the command itself)
        doc = json.loads(slotctl("slots", "--server", kept.url, "--store", store, "--json", code=0).stdout)
        json_schemas.check("slots", doc)
        expected = rows(doc["servers"])
        dom = chromium(binary, tmp_path / "profile-dom", "--dump-dom", base + "/ui").stdout
        p = parsed(dom)
        n = len(expected[0])
        cells = p.cells[n:n + n * len(expected)]
        got = [tuple(cells[i:i + n]) for i in range(0, len(cells), n)]
        assert got == expected, (got, expected)
        row0 = doc["servers"][0]["slots"][0]
        # the hostile name is no stored state of this scheme (its model digest and checksum are hex): never
        # offered, never on the page (a model's identity is its content, docs/fleet.md)
        assert row0["stored_states"] == 1 and row0["best"] is not None
        assert got[0][2:5] == ("0", f"{row0['n_tokens']:,}", "idle") and got[0][6] == "1"
        assert got[0][7] == f"{row0['best']['n_reused']:,} of {row0['best']['n_tokens']:,}"
        assert not any("onerror" in c for c in p.cells), p.cells
        assert [t for t, _ in p.tags if t in ("img", "script")] == []
        # the screenshot
        shot = tmp_path / "ui.png"
        chromium(binary, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1100,600",
                 base + "/ui")
        w, h, pixels = png_pixels(shot)
        assert (w, h) == (1100, 600)
        counts: dict[bytes, int] = {}
        for line in pixels:
            for x in range(0, len(line), 3):
                px = line[x:x + 3]
                counts[px] = counts.get(px, 0) + 1
        background, most = max(counts.items(), key=lambda kv: kv[1])
        assert background == b"\xff\xff\xff"                       # the page's white
        assert len(counts) > 50 and w * h - most > 0.01 * w * h       # text and lines drawn on it
        if os.environ.get("SLOTCTL_UI_SCREENSHOT"):                   # to look at it by hand
            shutil.copy(shot, os.environ["SLOTCTL_UI_SCREENSHOT"])
    finally:
        assert keep.stop() == 0
