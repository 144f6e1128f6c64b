"""Outputs, deletions and strips under races and over what is not a regular file (issue 19, items 3-6 and
11; issue 16, item 11): real FIFOs, devices, sockets, symbolic links, hard links, bind mounts, a full
tmpfs, another user, and real writer processes racing the commands."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.slotfile import open_slot_file

from conftest import DATA
from appendices import build_file

runner = CliRunner()
SLOT = DATA / "srv-np1.bin"
DAY = 86400
ROOT = Path(__file__).resolve().parent.parent


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    return lines[0]


def old(path: Path) -> None:
    t = time.time() - DAY
    os.utime(path, (t, t))


# -- -o OUT replaces only a regular file ----------------------------------------------------------------


def _convert(out: Path, *extra):
    return cli("convert", SLOT, "-o", out, "--state-version", "3", *extra)


def _strip(src: Path, out: Path, *extra):
    return cli("strip-draft", src, "-o", out, "--grace", "0", *extra)


@pytest.fixture
def stripped_source(tmp_path):
    return build_file(tmp_path / "src.bin").path


@pytest.mark.parametrize("command", ["convert", "strip-draft"])
def test_output_over_a_device_a_fifo_or_a_socket_is_refused_even_with_force(tmp_path, stripped_source, command):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        for target, kind in ((Path("/dev/null"), "a character device"), (fifo, "a FIFO"), (sock_path, "a socket")):
            before = os.lstat(target)
            res = _convert(target, "--force") if command == "convert" else _strip(stripped_source, target, "--force")
            assert res.exit_code == 2
            assert one_error(res) == f"error: {target}: {kind}; only a regular file is ever replaced"
            after = os.lstat(target)
            assert (after.st_ino, stat.S_IFMT(after.st_mode)) == (before.st_ino, stat.S_IFMT(before.st_mode))
    finally:
        sock.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "sock", "src.bin"]   # no temporary file left


@pytest.mark.parametrize("command", ["convert", "strip-draft"])
def test_output_through_a_symbolic_link_needs_follow_symlinks(tmp_path, stripped_source, command):
    target = tmp_path / "target.bin"
    target.write_bytes(b"old contents")
    link = tmp_path / "link.bin"
    link.symlink_to(target)

    def run(*extra):
        return _convert(link, *extra) if command == "convert" else _strip(stripped_source, link, *extra)

    res = run("--force")
    assert res.exit_code == 2
    assert one_error(res) == (f"error: {link}: a symbolic link (to {target}); --follow-symlinks writes the file it "
                              f"points to, or remove the link")
    assert link.is_symlink() and target.read_bytes() == b"old contents"
    assert run("--follow-symlinks").exit_code == 2          # the target exists: still needs --force
    res = run("--follow-symlinks", "--force")
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and os.readlink(link) == str(target)     # the link stays a link ...
    assert not open_slot_file(target).errors                          # ... and its target is the new file


def test_a_refused_rename_names_the_output_not_the_temporary_file(tmp_path):
    """A bind mount over OUT: rename(2) refuses (EBUSY); the error names OUT, no temporary file is left."""
    out = tmp_path / "out.bin"
    out.write_bytes(b"mounted over")
    src = tmp_path / "elsewhere.bin"
    src.write_bytes(b"x")
    if subprocess.run(["mount", "--bind", str(src), str(out)], capture_output=True).returncode:
        pytest.skip("bind mounts need root")
    try:
        res = _convert(out, "--force")
    finally:
        subprocess.run(["umount", str(out)], check=True)
    assert res.exit_code == 2
    line = one_error(res)
    assert line.startswith(f"error: {out}: cannot rename the new file over it: ") and ".tmp" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.bin", "out.bin"]


def test_out_of_space_names_the_output(tmp_path):
    """convert onto a tmpfs smaller than the file: the error names OUT (it named no path)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        res = cli("convert", SLOT, "-o", mnt / "out.bin", "--state-version", "3", "--json")
        left = os.listdir(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert res.exit_code == 2
    doc = json.loads(res.stdout)
    assert doc["error"] == {"code": "no_space", "message": f"{mnt / 'out.bin'}: No space left on device"}
    assert left == []


def _as_nobody(fn) -> dict:
    """``fn()`` run in a forked child with the uid and gid of ``nobody``; its JSON-able result."""
    if os.getuid() != 0:
        pytest.skip("changing user needs root")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = json.dumps(fn()).encode()
        except BaseException as e:   # noqa: BLE001 - reported to the parent
            out = json.dumps({"child_error": repr(e)}).encode()
        os.write(w, out)
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    doc = json.loads(data)
    assert "child_error" not in doc, doc
    return doc


def test_the_copy_path_refuses_what_the_truncate_path_refuses(tmp_path_factory):
    """A user who may not write a file (root's, 0644, in a directory everyone may write) gets it stripped
    by neither path: the truncate was refused, the copy replaced it (and gave it the user's uid)."""
    from slotctl.strip import strip_files

    d = Path(tmp_path_factory.mktemp("shared"))
    d.chmod(0o777)
    d.parent.chmod(0o755)
    d.parent.parent.chmod(0o755)
    cut, copy = build_file(d / "cut.bin"), build_file(d / "copy.bin")
    for b in (cut, copy):
        b.path.chmod(0o644)

    def run():
        return [r.as_dict() for r in strip_files([str(cut.path)], grace=0)
                + strip_files([str(copy.path)], checkpoints=True, grace=0)]

    res = _as_nobody(run)
    assert [(f["status"], f["method"], f["removed"], f["error"]["code"], f["exit_code"]) for f in res] == \
           [("refused", None, [], "permission_denied", 2)] * 2
    for b in (cut, copy):
        st = os.stat(b.path)
        assert b.path.read_bytes() == b.original and (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o644)
    assert sorted(p.name for p in d.iterdir()) == ["copy.bin", "cut.bin"]


def test_a_copy_that_cannot_keep_the_owner_is_refused(tmp_path_factory):
    """nobody may write root's file (0666) but not give a new file root's uid: the copy would change the
    owner, so it is refused; the file stays root's and unchanged."""
    from slotctl.strip import strip_files

    d = Path(tmp_path_factory.mktemp("owned"))
    d.chmod(0o777)
    b = build_file(d / "slot.bin")
    b.path.chmod(0o666)
    [res] = _as_nobody(lambda: [r.as_dict() for r in strip_files([str(b.path)], checkpoints=True, grace=0)])
    assert res["status"] == "refused" and res["error"]["code"] == "permission_denied"
    assert "owned by uid 0 gid 0; replacing it would give it this user's uid 65534" in res["error"]["message"]
    assert b.path.read_bytes() == b.original and os.stat(b.path).st_uid == 0


# -- hard links -------------------------------------------------------------------------------------------


def test_a_file_with_other_hard_links_is_copied_and_the_links_keep_their_contents(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    store = tmp_path / "store.bin"
    os.link(b.path, store)
    res = cli("strip-draft", b.path, "--grace", "0", "--json")
    assert res.exit_code == 0, res.output
    [f] = json.loads(res.stdout)["files"]
    assert (f["status"], f["method"], f["other_links"]) == ("stripped", "copy", 1)
    assert b.path.read_bytes() == b.stripped and store.read_bytes() == b.original
    assert os.stat(b.path).st_ino != os.stat(store).st_ino
    assert "has 1 other name(s) (hard links); it was copied, so they keep the draft state" in res.stderr


def test_all_links_cuts_the_file_itself_for_every_name(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    store = tmp_path / "store.bin"
    os.link(b.path, store)
    res = cli("strip-draft", b.path, "--grace", "0", "--all-links", "--json")
    assert res.exit_code == 0, res.output
    [f] = json.loads(res.stdout)["files"]
    assert (f["method"], f["other_links"]) == ("truncate", 1)
    assert b.path.read_bytes() == store.read_bytes() == b.stripped


def test_all_links_with_a_strip_that_needs_a_copy_is_refused_untouched(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    os.link(b.path, tmp_path / "store.bin")
    res = cli("strip-draft", b.path, "--grace", "0", "--all-links", "--checkpoints", "--json")
    assert res.exit_code == 1
    [f] = json.loads(res.stdout)["files"]
    assert (f["status"], f["method"], f["removed"], f["error"]["code"]) == ("refused", None, [], "hard_links")
    assert b.path.read_bytes() == b.original


# -- strip-draft and a file being written -----------------------------------------------------------------


def test_a_file_modified_within_the_grace_period_is_refused(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    res = cli("strip-draft", b.path, "--json")           # just written: within the default 60 s
    assert res.exit_code == 1
    [f] = json.loads(res.stdout)["files"]
    assert (f["status"], f["removed"], f["method"], f["error"]["code"]) == ("refused", [], None, "being_written")
    assert "within --grace 60 s (being written?)" in f["error"]["message"]
    assert b.path.read_bytes() == b.original
    old(b.path)
    assert cli("strip-draft", b.path).exit_code == 0 and b.path.read_bytes() == b.stripped


WRITER = textwrap.dedent("""
    import sys, time
    path, data, chunk, pause = sys.argv[1], open(sys.argv[2], "rb").read(), int(sys.argv[3]), float(sys.argv[4])
    with open(path, "wb") as f:          # a server saving a slot in place: from the start to the end
        for i in range(0, len(data), chunk):
            f.write(data[i:i + chunk]); f.flush()
            if i == 0:
                print("started", flush=True)
            time.sleep(pause)
""")


def test_strip_draft_never_cuts_a_save_still_being_written(tmp_path):
    """A real writer saves a file with draft state slowly; strip-draft runs against it again and again: it
    refuses every time, and the file ends as the writer wrote it (with --grace 0 the first strip that sees
    the SDFT appendix would cut it and the writer would carry on past the cut)."""
    b = build_file(tmp_path / "src.bin")
    target = tmp_path / "slot.bin"
    target.write_bytes(b.original)   # an older save, there before the writer starts again
    old(target)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(b.path), "4096", "0.05"],
                              stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "started"
    codes = []
    while writer.poll() is None:
        res = cli("strip-draft", target, "--json")
        codes.append(res.exit_code)
        if res.exit_code == 1:
            [f] = json.loads(res.stdout)["files"]
            assert f["error"]["code"] in ("being_written", "damaged"), f
    writer.wait()
    assert codes and set(codes) == {1}, codes
    assert target.read_bytes() == b.original


# -- prune and a writer saving onto the files it deletes --------------------------------------------------

PRUNE_WRITER = textwrap.dedent("""
    import os, random, sys, time
    directory, n, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    data = open(sys.argv[4], "rb").read()[:4096]
    name = lambda i: os.path.join(directory, f"s{i:04d}.bin")
    saved = []
    print("ready", flush=True)
    # one file in STEP is saved onto when prune deletes a file a random few before it: saves land anywhere
    # in prune's steps, some between its check of the file and its deletion
    most, step = int(sys.argv[6]), int(sys.argv[7])
    for i in range(most + 1, n, step):
        lead = random.randint(1, most)   # how far behind prune is when the save starts: anywhere
        deadline = time.monotonic() + 20
        while os.path.exists(name(i - lead)) and time.monotonic() < deadline:
            pass
        until = time.perf_counter() + random.uniform(0, float(sys.argv[5]))
        while time.perf_counter() < until:
            pass
        body = data + f"fresh save {i}".encode()
        if how == "in-place":
            with open(name(i), "wb") as f:
                f.write(body)
        else:
            with open(name(i) + ".new", "wb") as f:
                f.write(body)
            os.rename(name(i) + ".new", name(i))
        saved.append(name(i))
    print("\\n".join(saved), flush=True)
""")


#: the writer of the prune race: a random pause (seconds) and lead (files) before each save, one save in STEP files
JITTER, LEAD, STEP = "300e-6", "3", "30"


@pytest.mark.parametrize("how", ["in-place", "rename"])
def test_prune_never_deletes_a_file_saved_onto_the_next_one_to_go(tmp_path, how):
    """prune --keep 0 deletes old files in order while a real writer saves a fresh file onto the next one
    to go, again and again: every save the writer made is there afterwards with its contents (before, a
    re-check and an unlink in two steps deleted 113 of 1,416 in-place saves and 21 of 4,915 renamed ones)."""
    raw = SLOT.read_bytes()[:4096]
    n = 3000
    d = tmp_path / "slots"
    d.mkdir()
    for i in range(n):
        p = d / f"s{i:04d}.bin"
        p.write_bytes(raw)
        old(p)
    writer = subprocess.Popen([sys.executable, "-c", PRUNE_WRITER, str(d), str(n), how, str(SLOT), JITTER, LEAD, STEP],
                              stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "ready"
    prune = subprocess.run([sys.executable, "-m", "slotctl", "prune", str(d), "--keep", "0", "--json"],
                           capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "SLOTCTL_NO_PROGRESS": "1"})
    saved = writer.stdout.read().split()
    writer.wait()
    assert prune.returncode == 0, prune.stderr
    actions = {Path(f["path"]).name: f["action"] for f in json.loads(prune.stdout)["files"]}
    onto = {Path(name).name for name in saved}
    assert len(saved) == len(range(int(LEAD) + 1, n, int(STEP)))
    lost = [name for name in saved
            if not Path(name).exists()
            or Path(name).read_bytes() != raw + f"fresh save {int(name[-8:-4])}".encode()]
    assert not lost, f"{len(lost)} of {len(saved)} saves lost: {lost[:5]}"
    # the files nobody saved onto are gone
    assert all(action == "deleted" for name, action in actions.items() if name not in onto)
    assert not list(d.glob(".*.slotctl-prune-*"))


def test_prune_keeps_a_file_another_process_has_open(tmp_path):
    """A file a writer still has open (a server saving slowly into it, or reading it for a restore) is kept:
    the write lease prune takes on the file it set aside is granted only when no other descriptor of it is
    open, so whatever that writer writes next is never lost with the file."""
    raw = SLOT.read_bytes()[:4096]
    held, free = tmp_path / "held.bin", tmp_path / "free.bin"
    for p in (held, free):
        p.write_bytes(raw)
        old(p)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; f = open(sys.argv[1], 'r+b'); print('open', "
                               "flush=True); sys.stdin.read(); f.seek(0, 2); f.write(b'more'); f.close()", str(held)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        res = cli("prune", tmp_path, "--keep", "0", "--json")
        assert res.exit_code == 0, res.output
        actions = {Path(f["path"]).name: (f["action"], f["reason"]) for f in json.loads(res.stdout)["files"]}
        assert actions["free.bin"][0] == "deleted" and not free.exists()
        assert actions["held.bin"] == ("skipped", "open in another process (being written or read?)")
    finally:
        holder.communicate("", timeout=30)
    assert held.read_bytes() == raw + b"more"      # the writer's last bytes are in the file, under its name
    assert not list(tmp_path.glob(".*.slotctl-prune-*"))


def test_a_file_a_killed_prune_left_aside_is_put_back_by_the_next(tmp_path):
    raw = SLOT.read_bytes()[:4096]
    aside = tmp_path / ".s0001.bin.slotctl-prune-999999999.tmp"   # no such process
    aside.write_bytes(raw)
    old(aside)
    res = cli("prune", tmp_path, "--keep", "1", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "s0001.bin").read_bytes() == raw and not aside.exists()


def test_prune_temp_files_deletes_what_killed_writes_left_and_nothing_in_use(tmp_path):
    """--temp-files: a `.NAME.slotctl-*.tmp` a killed write left (untouched for --grace) goes; one still being
    written (recent), one another process holds open (an atomic write still writing), a file a running prune
    set aside and its note stay; --dry-run deletes nothing; without the option they are skipped."""
    raw = SLOT.read_bytes()[:4096]
    slot = tmp_path / "a.bin"
    left = tmp_path / ".a.bin.slotctl-1a2b3c4d.tmp"          # a killed write's
    recent = tmp_path / ".b.bin.slotctl-5e6f7a8b.tmp"        # a write in progress
    held = tmp_path / ".c.bin.slotctl-9c0d1e2f.tmp"          # open in another process
    aside = tmp_path / f".d.bin.slotctl-prune-{os.getpid()}.tmp"    # a running prune's (this process is alive)
    for p in (slot, left, recent, held, aside):
        p.write_bytes(raw)
        if p is not recent:
            old(p)

    def actions(*args):
        res = cli("prune", tmp_path, *args, "--json")
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        assert doc["policy"]["temp_files"] == ("--temp-files" in args)
        return {Path(f["path"]).name: (f["action"], f["temp"]) for f in doc["files"]}, doc["summary"]

    got, _ = actions("--keep", "5")
    assert all(got[p.name] == ("skipped", True) for p in (left, recent, held, aside))
    got, summary = actions("--temp-files", "--dry-run")
    assert got[left.name] == ("would_delete", True) and got[recent.name] == ("skipped", True)
    assert got[aside.name] == ("skipped", True) and got[slot.name] == ("kept", False)
    assert summary["size_before"] == summary["size_after"] == len(raw) and left.exists()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; f = open(sys.argv[1], 'r+b'); print('open', "
                               "flush=True); sys.stdin.read()", str(held)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        got, summary = actions("--temp-files")
    finally:
        holder.communicate("", timeout=30)
    assert got[left.name] == ("deleted", True) and not left.exists()
    assert got[held.name] == ("skipped", True) and held.read_bytes() == raw
    assert recent.exists() and aside.exists() and slot.read_bytes() == raw
    assert summary["freed"] == len(raw) and summary["size_after"] == len(raw)
    got, _ = actions("--temp-files", "--keep", "0", "--grace", "0")      # with a budget: both kinds go
    assert got[slot.name] == ("deleted", False) and got[held.name] == ("deleted", True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name]
