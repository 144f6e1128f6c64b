"""Output that fits: ``ls`` in a real terminal (tmux) at 60, 80 and 200 columns, and the commands whose output
was megabytes on a pipe (``demo``, ``restore --continue``) laid out for COLUMNS, else 80, with no value cut."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[1]
MODEL = DATA / "target.gguf"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "SLOTCTL_NO_PROGRESS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**env, **extra}


def piped(*args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slotctl", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=_env(**env))


def in_tmux(tmp_path: Path, args: list[str], width: int, height: int = 50) -> tuple[int, list[str]]:
    """Run ``slotctl ARGS`` in a tmux pane of ``width`` x ``height`` (a real pseudo-terminal on stdout and
    stderr, as an operator's); returns its exit code and every line of the pane, scrollback included, with
    the lines the terminal wrapped joined back (``capture-pane -J``)."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    sock = str(tmp_path / f"tmux-{width}.sock")
    done = tmp_path / f"rc-{width}"
    # the shell writes END after slotctl's output on the same terminal: once the pane shows it, the pane holds
    # every line slotctl wrote (a fixed wait after the exit raced tmux's reading of the terminal under load)
    end = "slotctl-test-output-ends-here"
    cmd = (f"{shlex.join([sys.executable, '-m', 'slotctl', *args])}; echo $? > {shlex.quote(str(done))}; "
           f"echo {end}; sleep 600")
    tmux = ["tmux", "-S", sock, "-f", "/dev/null"]
    subprocess.run([*tmux, "new-session", "-d", "-s", "slotctl", "-x", str(width), "-y", str(height), cmd], check=True,
                   env=_env(TERM="xterm-256color"), timeout=30)
    try:
        deadline = time.monotonic() + 300
        while True:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-J", "-S", "-", "-t", "slotctl"], check=True,
                                    capture_output=True, text=True, timeout=30).stdout
            lines = [line.rstrip() for line in screen.splitlines()]
            if end in lines and done.exists() and done.read_text().strip():
                break
            assert time.monotonic() < deadline, "slotctl did not finish in the terminal"
            time.sleep(0.2)
        return int(done.read_text()), [line for line in lines if line != end]
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory) -> Path:
    """50 real server files (more than the pool threshold: workers and a progress bar), with long and short
    names, plus a refused, an empty and a cut file and a README."""
    d = tmp_path_factory.mktemp("terminal") / "slots"
    d.mkdir()
    sources = sorted(DATA.glob("srv-*.bin")) + sorted((DATA / "kinds").glob("srv-*.bin"))
    for i in range(50):
        src = sources[i % len(sources)]
        name = f"chat-{i:02d}.bin" if i % 7 else f"conversation-of-a-user-with-a-long-name-{i:02d}-{src.name}"
        shutil.copyfile(src, d / name)
    raw = (DATA / "srv-np1.bin").read_bytes()
    (d / "cut.bin").write_bytes(raw[:len(raw) // 2])
    (d / "empty.bin").write_bytes(b"")
    (d / "zeros.bin").write_bytes(bytes(4096))
    (d / "README.md").write_text("not a slot file\n")
    return d


@pytest.mark.parametrize("width", [60, 80, 200])
def test_ls_fits_the_terminal_and_leaves_no_progress_bar(tmp_path, slot_dir, width):
    code, lines = in_tmux(tmp_path, ["ls", str(slot_dir)], width)
    text = "\n".join(lines)
    assert code == 1, text                                   # empty and zeros refused, cut short
    # nothing the terminal had to wrap: every line, joined back, fits
    assert max(len(line) for line in lines) <= width, text
    assert "reading" not in text and "━" not in text, text   # the progress bar is gone
    flat = "".join(text.split())
    for p in slot_dir.iterdir():
        if p.suffix == ".bin":
            assert p.name in flat, p.name                    # every file, its name whole
    assert "README.md" not in text
    total = " ".join(text[text.index("total: "):].split())
    assert total.startswith("total: 53 file(s)") and "2 refused" in total and "1 undecided" in total, total
    assert "1 file(s) that are not slot files left out" in total
    if width >= 80:   # a table: the header, then one line per file that starts with its size
        assert lines[0].split()[:3] == ["size", "age", "ver"], text
    if width == 200:  # wide enough for every name on its row
        assert sum(line.endswith(".bin") for line in lines) == 53


def test_ls_on_a_pipe_fits_columns(slot_dir):
    for columns, width in (("", 80), ("60", 60), ("200", 200)):
        r = piped("ls", slot_dir, COLUMNS=columns)
        lines = r.stdout.splitlines()
        assert r.returncode == 1 and max(map(len, lines)) <= width, r.stdout
        assert r.stderr == ""


def test_restore_continue_on_a_pipe_is_small_and_whole():
    args = ["restore", DATA / "srv-np1.bin", "-m", MODEL, "--continue", " x", "-n", "24"]
    r = piped(*args)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.encode()) < 10_000, len(r.stdout)     # it was 5-9 MB: a line of a million characters
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= 80, r.stdout
    doc = json.loads(piped(*args, "--json").stdout)
    text = doc["continuation"]["text"]
    assert len(text) > 0
    # the generated text whole (wrapped inside the panel, never elided)
    inside = "".join(line.strip("│ ") for line in lines if line.startswith("│"))
    assert "".join(text.split()) in "".join(inside.split())


def test_demo_to_a_file_is_under_100_kb(tmp_path):
    out = tmp_path / "demo.txt"
    with open(out, "w") as f:
        r = subprocess.run([sys.executable, "-m", "slotctl", "demo", "--dir", str(tmp_path / "d")], stdout=f,
                           stderr=subprocess.PIPE, text=True, timeout=600, env=_env())
    assert r.returncode == 0, r.stderr
    size = out.stat().st_size
    assert 1_000 < size < 100_000, size                       # it was 6-10 MB
    lines = out.read_text().splitlines()
    assert max(map(len, lines)) <= 80
    assert any(line.startswith("$ slotctl restore") for line in lines)


@pytest.mark.parametrize("args", [
    ["inspect", DATA / "srv-draft.bin", "-m", MODEL],
    ["validate", "{dir}", "-m", MODEL, "--no-load"],
    ["diff", DATA / "srv-np1.bin", "{dir}/cut.bin"],
    ["diff", DATA / "srv-np1.bin", DATA / "srv-kvq8.bin"],
    ["strip-draft", "--dry-run", "{dir}"],
    ["prune", "{dir}", "--broken", "--dry-run"],
    ["identify", DATA / "srv-np1.bin", "-m", MODEL, "-m", DATA / "draft.gguf"],
], ids=lambda a: a[0])
def test_every_command_on_a_pipe_fits_80_columns(slot_dir, args):
    """Paths of 60 characters and more, messages of 150: wrapped at 80, whole."""
    argv = [str(a).replace("{dir}", str(slot_dir)) for a in args]
    r = piped(*argv)
    assert r.returncode in (0, 1, 3), r.stderr
    lines = r.stdout.splitlines()
    assert lines and max(map(len, lines)) <= 80, r.stdout


def test_inspect_tokens_on_a_pipe_lists_every_id_in_lines_that_fit(tmp_path):
    """--tokens prints every token id, in order, below the prompt panel, in plain lines that fit COLUMNS
    (a prompt of millions of tokens was one rich Text wrapped word by word inside a panel: minutes)."""
    import struct

    import numpy as np

    from slotctl.slotfile import open_slot_file

    src = DATA / "srv-np1.bin"
    want = [str(t) for t in open_slot_file(src).tokens.tokens]
    for columns in ("60", "200"):
        r = piped("inspect", src, "--tokens", COLUMNS=columns)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("tokens ("))
        body = []
        for line in lines[at + 1:]:
            if not line.startswith("  "):
                break
            body.append(line)
        assert " ".join(body).split() == want
        assert all(len(line) <= int(columns) for line in body)
    # a plain token list of a million words after the same payload: every id, and still lines that fit
    raw = src.read_bytes()
    sf = open_slot_file(src)
    ids = (np.arange(1 << 20, dtype=np.int32) % 300) + 1
    big = tmp_path / "big.bin"
    big.write_bytes(struct.pack("<III", 0x67677371, 4, len(ids)) + ids.tobytes() + raw[sf.header_end:])
    r = piped("inspect", big, "--tokens")
    out = r.stdout.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("tokens ("))
    got = [w for line in out[at + 1:] if line.startswith("  ") for w in line.split()]
    assert len(got) == len(ids) and got[:3] == ["1", "2", "3"] and got[-1] == str(ids[-1])
    assert max(len(line) for line in out[at + 1:at + 1000]) <= 80


def test_a_long_token_list_in_json_is_whole_and_compact(tmp_path):
    """--json and --jsonl write a long token array in blocks, compact on one line, never as one string of the
    whole document: every id is there, in order, and the document is valid JSON."""
    import struct

    import numpy as np

    from slotctl.slotfile import open_slot_file

    src = DATA / "srv-np1.bin"
    sf = open_slot_file(src)
    ids = (np.arange(200_000, dtype=np.int32) * 7) % 3000
    big = tmp_path / "big.bin"
    big.write_bytes(struct.pack("<III", 0x67677371, 4, len(ids)) + ids.tobytes() + src.read_bytes()[sf.header_end:])
    for flag in ("--json", "--jsonl"):
        r = piped("inspect", big, "--tokens", flag)
        doc = json.loads(r.stdout.splitlines()[0] if flag == "--jsonl" else r.stdout)
        got = (doc if flag == "--jsonl" else doc["files"][0])["prompt"]["tokens"]
        assert got == ids.tolist()
    small = json.loads(piped("inspect", src, "--tokens", "--json").stdout)["files"][0]["prompt"]["tokens"]
    assert small == [int(t) for t in sf.tokens.tokens]


def test_text_that_spells_an_array_mark_stays_text():
    """A prompt's text is untrusted: one that spells the mark Output.json leaves for a long array (with
    any nonce) is written as the text it is, and the array where it belongs."""
    import io

    import numpy as np

    from slotctl.cli.output import Output

    ids = np.arange(10_000, dtype=np.int32)
    for spelled in ("\x00slotctl-array-0\x00", "\x00slotctl-array-1\x00", "\x00slotctl-array-0123456789abcdef-0\x00"):
        for jsonl in (False, True):
            buf = io.StringIO()
            Output(json_mode=True, jsonl=jsonl, stdout=buf).json({"text": spelled, "tokens": ids, "more": [1, 2]})
            doc = json.loads(buf.getvalue())
            assert doc == {"text": spelled, "tokens": ids.tolist(), "more": [1, 2]}
