"""The systemd units ``slotctl unit keep|serve`` prints, and the README's production steps, started as far as
this machine allows (no systemd runs here): printed by a fresh venv's slotctl (made by Debian's python3, as the README's production steps make
it), checked by ``systemd-analyze verify``, and their ``ExecStart=`` line run as systemd runs it: as the
unit's ``User=`` (``nobody`` here: a user that is not root and has no home), with ``env -i`` and systemd's
default ``PATH``, the unit's ``Environment=`` (the catalog's ``CacheDirectory=``, made by the test as systemd
makes it: owned by the user), ``/`` as the working directory and a real ``NOTIFY_SOCKET``; against a real
llama-server b11434 and a real SeaweedFS.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import start_server
from llama_server import free_port
from seaweed import BUCKET
from keeping import wait_until
from serving import ARGS, TURN1

ROOT = Path(__file__).resolve().parents[1]
#: systemd's default PATH for services (a merged /usr, Debian 12): no venv's bin in it
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
#: Debian's own Python, which the README's production steps make the venv with
DEBIAN_PYTHON = "/usr/bin/python3"
USER = "nobody"


def _world_readable_dir(prefix: str) -> Path:
    """A directory under /tmp every user may pass and read (pytest's own is root's, 0700), as /opt is."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    d.chmod(0o755)
    return d


def _readable_model(base: Path, model: Path) -> Path:
    """A copy of ``model`` in ``base`` every user may read (pytest's own temporary directories are the test user's
    alone): the unit's user hashes it (a model's identity is its content, docs/fleet.md)."""
    copy = base / model.name
    shutil.copyfile(model, copy)
    copy.chmod(0o644)
    return copy


@pytest.fixture(scope="module")
def venv():
    """A fresh venv made by Debian's python3, slotctl installed into it (with the [serve] extra) as the
    README's production steps install it (the [serve] and [s3] extras): a regular install, not an editable
    one."""
    if not os.access(DEBIAN_PYTHON, os.X_OK) or subprocess.run([DEBIAN_PYTHON, "-c", "import ensurepip"],
                                                                capture_output=True).returncode != 0:
        pytest.skip(f"{DEBIAN_PYTHON} with venv (Debian's python3-venv) is not on this machine")
    base = _world_readable_dir("slotctl-unit-venv-")
    try:
        subprocess.run([DEBIAN_PYTHON, "-m", "venv", str(base / "venv")], check=True, capture_output=True,
                       timeout=300)
        r = subprocess.run([str(base / "venv" / "bin" / "pip"), "install", "-q", f"{ROOT}[serve,s3]"],
                           capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, r.stderr[-3000:]
        yield base / "venv"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def unit(venv: Path, name: str, *more: str) -> str:
    """The unit as the venv's ``slotctl unit NAME --user nobody`` prints it (``more``: other options); no
    note on stderr (nobody can read the venv: nothing would keep the unit from starting)."""
    r = subprocess.run([str(venv / "bin" / "slotctl"), "unit", name, "--user", USER, *more], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return r.stdout


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, val = line.partition("=")
            out.setdefault(key, []).append(val)
    return out


class Notify:
    """A NOTIFY_SOCKET the unit's user may write to: the lines it was told, in order."""

    def __init__(self, where: Path):
        self.path = where / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.path.chmod(0o777)
        self.sock.settimeout(120)
        self.got: list[str] = []

    def until(self, line: str) -> list[str]:
        while not any(x == line or x.startswith(line) for x in self.got):
            self.got += self.sock.recv(4096).decode().split("\n")
        return self.got

    def close(self) -> None:
        self.sock.close()


def run_exec_start(text: str, instance: str, config: Path, cache_root: Path, notify: Notify,
                   env_file: dict[str, str] | None = None, environment: bool = True) -> subprocess.Popen:
    """The unit's ``ExecStart=`` as systemd starts it: ``%i`` the instance, its configuration file (under
    /etc/slotctl on a machine that runs it) at ``config``, as ``User=`` with ``env -i``, systemd's default
    PATH and the variables systemd sets (HOME, USER, NOTIFY_SOCKET), the unit's ``Environment=`` (``%C``:
    ``cache_root``; none with ``environment`` False) and its ``EnvironmentFile=``'s (``env_file``), from /."""
    d = directives(text)
    (line,) = d["ExecStart"]
    words = shlex.split(line.replace("%i", instance))
    assert words[-2:] == ["--config", f"/etc/slotctl/{instance}.toml"], words
    words[-1] = str(config)
    user = d["User"][0]
    env = {"PATH": SYSTEMD_PATH, "HOME": "/nonexistent", "USER": user, "LOGNAME": user,
           "NOTIFY_SOCKET": str(notify.path), **(env_file or {})}
    if environment:
        for e in d.get("Environment", []):
            k, _, v = e.partition("=")
            env[k] = v.replace("%C", str(cache_root))
    cmd = ["setpriv", f"--reuid={user}", "--regid=nogroup", "--clear-groups", "env", "-i",
           *[f"{k}={v}" for k, v in env.items()], *words]
    return subprocess.Popen(cmd, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def stopped(proc: subprocess.Popen, notify: Notify | None = None) -> tuple[int, str]:
    """SIGTERM (when it still runs, then STOPPING=1 awaited); its exit code and stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        if notify is not None:
            notify.until("STOPPING=1")
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err


@pytest.fixture
def layout(llama_server_bin, tiny_models):
    """/var/lib/llama's like, every user may pass it: the server's slot directory (the unit's user writes in
    it) and a llama-server b11434 saving there."""
    base = _world_readable_dir("slotctl-unit-")
    slots = base / "slots"
    slots.mkdir()
    slots.chmod(0o777)
    # the model where the unit's user reads it too: keep and serve tell the server's model by its file's content
    model = _readable_model(base, tiny_models.target)
    srv = start_server(llama_server_bin, model, base, "unit", args=ARGS, slot_save_path=slots)
    srv.save_dir = slots
    try:
        yield base, srv
    finally:
        srv.stop()
        shutil.rmtree(base, ignore_errors=True)


def complete(url: str, prompt: str) -> dict:
    body = json.dumps({"prompt": prompt, "n_predict": 4, "cache_prompt": True}).encode()
    req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_the_units_name_the_venvs_python_and_systemd_accepts_them(venv):
    """ExecStart is the fresh venv's interpreter by its absolute path (not resolved to Debian's python3, which
    would lose the venv); the unit's user, cache directory and descriptor limit; systemd-analyze verify
    accepts both (it checks that ExecStart's program exists and every key). The old ExecStart, `env slotctl`
    on systemd's PATH, does not find a venv's slotctl: exit 127."""
    for name in ("keep", "serve"):
        text = unit(venv, name)
        d = directives(text)
        assert d["ExecStart"] == [f"{venv}/bin/python3 -m slotctl {name} --config /etc/slotctl/%i.toml"], d
        assert d["User"] == [USER] and "Group" not in d
        assert d["CacheDirectory"] == ["slotctl"] and d["Environment"] == ["SLOTCTL_CACHE_DIR=%C/slotctl"]
        assert d["LimitNOFILE"] == ["65536"] and d["ProtectHome"] == ["read-only"]
        if shutil.which("systemd-analyze") is not None:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"slotctl-{name}@test.service"
                # as printed for llama-server's user (systemd-analyze warns of nobody: "not safe")
                path.write_text(text.replace(f"User={USER}\n", "User=llama\n"))
                r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                                   timeout=120)
                assert r.returncode == 0 and r.stderr == "", r
    r = subprocess.run(["env", "-i", f"PATH={SYSTEMD_PATH}", "/usr/bin/env", "slotctl", "--version"],
                       capture_output=True, text=True, cwd="/")
    assert r.returncode == 127, r
    r = subprocess.run(["env", "-i", f"PATH={SYSTEMD_PATH}", f"{venv}/bin/python3", "-m", "slotctl", "--version"],
                       capture_output=True, text=True, cwd="/")
    assert r.returncode == 0 and r.stdout.startswith("slotctl "), r


def test_slotctl_unit_says_what_would_keep_it_from_starting(venv, tmp_path):
    """A user that does not exist: the note says how to make it; a user that cannot reach the install (here
    the test's own venv, under a directory of mode 0700: Debian 12's home directories): the note names the
    directory; none for a user that can."""
    r = subprocess.run([str(venv / "bin" / "slotctl"), "unit", "keep", "--user", "no-such-user-slotctl"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "User=no-such-user-slotctl" in r.stdout
    assert r.stderr.startswith("note: user no-such-user-slotctl does not exist on this machine: make it with: "
                               "sudo useradd --system"), r.stderr
    closed = tmp_path / "home"
    closed.mkdir(mode=0o700)
    shutil.copytree(venv, closed / "venv", symlinks=True)
    r = subprocess.run([str(closed / "venv" / "bin" / "python3"), "-m", "slotctl", "unit", "keep", "--user",
                        USER, "--json"], capture_output=True, text=True, timeout=120)
    doc = json.loads(r.stdout)
    assert doc["python"] == f"{closed}/venv/bin/python3" and doc["user"] == USER
    assert any(f"user {USER} cannot read {closed}/venv/bin/python3" in n and "drwx------" in n
               for n in doc["notes"]), doc["notes"]


@pytest.mark.server
def test_keeps_unit_starts_as_its_user_with_systemds_path(venv, layout):
    """keep's ExecStart, run as systemd runs it (as nobody, env -i, systemd's PATH, from /): READY=1 with its
    status, a save of the real server's slot stored in the directory store, STOPPING=1 and exit 0 on
    SIGTERM."""
    base, srv = layout
    store = base / "store"
    store.mkdir()
    shutil.chown(store, USER)
    config = base / "qwen.toml"
    config.write_text(f'[[servers]]\nname = "qwen"\nurl = "{srv.url}"\nslot_dir = "{srv.save_dir}"\n'
                      f'store = "{store}"\n\n[keep]\nevery = 0.3\n')
    cache = base / "cache"
    notify = Notify(base)
    proc = run_exec_start(unit(venv, "keep"), "qwen", config, cache, notify)
    try:
        got = notify.until("READY=1")
        assert any(x.startswith(f"STATUS=keeping {srv.url}") for x in got), got
        complete(srv.url, TURN1)
        stored = wait_until(lambda: [p for p in store.iterdir() if p.suffix == ".bin"], timeout=120)
        assert stored[0].stat().st_uid == 65534        # written as the unit's user
    finally:
        code, err = stopped(proc, notify)
        notify.close()
    assert code == 0, err


@pytest.mark.server
def test_serves_unit_starts_as_its_user_and_keeps_its_catalog_in_the_cache_directory(venv, layout, seaweed):
    """serve's ExecStart, run as systemd runs it, an s3:// store on a real SeaweedFS (its AWS_* as the
    unit's EnvironmentFile gives them): READY=1, a completion through serve answered and its state stored
    in the bucket, the catalog in the unit's CacheDirectory (SLOTCTL_CACHE_DIR=%C/slotctl); without the
    unit's Environment= line the user (no home, ProtectHome=read-only) has nowhere to keep it: serve says
    the catalog is not used."""
    import obstore

    base, srv = layout
    cache = base / "cache"
    (cache / "slotctl").mkdir(parents=True)         # CacheDirectory=slotctl: made by systemd, the user's
    shutil.chown(cache / "slotctl", USER)
    prefix = f"unit-{os.getpid()}-{time.monotonic_ns()}/"
    port = free_port()
    config = base / "qwen.toml"
    config.write_text(f'[[servers]]\nname = "qwen"\nurl = "{srv.url}"\nslot_dir = "{srv.save_dir}"\n'
                      f'store = "s3://{BUCKET}/{prefix}"\n\n[serve]\nlisten = "127.0.0.1:{port}"\n')
    text = unit(venv, "serve")
    for environment in (True, False):
        notify = Notify(base)
        proc = run_exec_start(text, "qwen", config, cache, notify, env_file=seaweed.env(), environment=environment)
        try:
            notify.until("READY=1")
            assert complete(f"http://127.0.0.1:{port}", TURN1)["content"]
            wait_until(lambda: [m for m in obstore.list(seaweed.client(), prefix=prefix).collect()
                                if m["path"].endswith(".bin")], timeout=120)
        finally:
            code, err = stopped(proc, notify)
            notify.close()
            notify.path.unlink()
        assert code == 0, err
        catalogs = list((cache / "slotctl" / "catalog").glob("*.sqlite")) if environment else []
        if environment:
            assert len(catalogs) == 1 and catalogs[0].stat().st_uid == 65534, err
            assert "the catalog is not used" not in err, err
        else:
            assert re.search(r"catalog.*the catalog is not used", err), err


def _production_steps() -> list[str]:
    """The README's production steps: the first ``sh`` block under "In production", line by line."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## In production"):]
    block = re.search(r"```sh\n(.*?)\n```", section, re.S).group(1)
    return block.splitlines()


@pytest.mark.server
def test_the_readmes_production_steps_work_on_a_machine_without_a_llama_user(llama_server_bin, tiny_models,
                                                                           tmp_path):
    """The README's production steps, run as written (as root, ``sudo`` a no-op) in a mount namespace of their
    own that makes a machine without a llama user: /etc a copy (users, units, configuration), /opt (pip's
    local indexes kept), /var/lib and /var/cache empty but for the server's slot directory and a directory
    store. Debian's python3 makes the venv under /opt, slotctl is installed into it from this checkout, the
    llama user is made, the venv's slotctl prints the unit (nothing to note on stderr), and ``systemctl
    enable --now`` starts it as systemd would (tests/start_unit.py: as llama, env -i, systemd's PATH, READY=1).
    Then keep stores a real llama-server b11434's save in its store, as llama, and /readyz says the server is
    up and the store reachable."""
    if not os.access(DEBIAN_PYTHON, os.X_OK) or shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root, unshare and Debian's python3 (a mount namespace of the test's own)")
    if subprocess.run(["id", "llama"], capture_output=True).returncode == 0:
        pytest.skip("this machine has a llama user: the steps are for one without")
    base = _world_readable_dir("slotctl-readme-")
    try:
        for d in ("opt", "varcache", "varlib/llama/slots", "varlib/llama/store"):
            (base / d).mkdir(parents=True)
        for d in ("varlib/llama/slots", "varlib/llama/store"):
            (base / d).chmod(0o777)     # the server's directory (llama-server runs as llama where it is real)
        srv = start_server(llama_server_bin, _readable_model(base, tiny_models.target), base, "readme", args=ARGS,
                           slot_save_path=base / "varlib/llama/slots")
        port = free_port()
        (base / "qwen.toml").write_text(
            f'[[servers]]\nname = "qwen"\nurl = "{srv.url}"\nslot_dir = "/var/lib/llama/slots"\n'
            f'store = "/var/lib/llama/store"\n\n[keep]\nevery = 0.3\nlisten = "127.0.0.1:{port}"\n')
        steps = [line.replace("9464", str(port)) for line in _production_steps()]
        script = "\n".join([
            "set -euo pipefail",
            f"T={shlex.quote(str(base))}",
            "cp -a /etc \"$T/etc\" && mount --bind \"$T/etc\" /etc",
            "for x in /opt/*; do mkdir \"$T/opt/${x##*/}\" && mount --bind \"$x\" \"$T/opt/${x##*/}\"; done",
            "mount --bind \"$T/opt\" /opt && mount --bind \"$T/varlib\" /var/lib && mount --bind \"$T/varcache\" /var/cache",
            "! id llama 2>/dev/null",
            "sudo() { \"$@\"; }",
            "sudoedit() { cp \"$T/qwen.toml\" \"$1\"; }",
            "apt() { python3 -c 'import ensurepip'; }      # python3-venv: there",
            f"systemctl() {{ case \"$1\" in enable) python3 {shlex.quote(str(ROOT / 'tests' / 'start_unit.py'))} "
            "\"/etc/systemd/system/${3%@*}@.service\" \"${3#*@}\" \"$T/unit.pid\";; esac; }",
            "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            *[f"echo '+ {line}' >&2; {line}" for line in steps],
            "id llama",
        ])
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", script], cwd=ROOT,
                           capture_output=True, text=True, timeout=1800, env={k: v for k, v in os.environ.items()
                                                                              if not k.startswith("VIRTUAL_ENV")})
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
        assert "STATUS=keeping " + srv.url in r.stdout, r.stdout
        assert "uid=" in r.stdout.splitlines()[-1] and "(llama)" in r.stdout.splitlines()[-1], r.stdout
        unit_line = next(x for x in r.stderr.splitlines() if x.startswith("+ /opt/slotctl/bin/slotctl unit"))
        after = r.stderr.split(unit_line, 1)[1].split("\n+ ", 1)[0]
        assert "note:" not in after, after        # nothing would keep the unit from starting
        pid = int((base / "unit.pid").read_text())
        try:
            complete(srv.url, TURN1)
            stored = wait_until(lambda: [p for p in (base / "varlib/llama/store").iterdir() if p.suffix == ".bin"],
                                timeout=120)
            assert stored[0].stat().st_uid == int(r.stdout.splitlines()[-1].split("uid=")[1].split("(")[0])
            wait_until(lambda: b"server: up\nstore: reachable" in urllib.request.urlopen(
                f"http://127.0.0.1:{port}/readyz", timeout=10).read(), timeout=60)
        finally:
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: not os.path.exists(f"/proc/{pid}") or
                       open(f"/proc/{pid}/stat").read().split()[2] == "Z", timeout=120)
            srv.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
