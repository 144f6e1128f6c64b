"""Start an instance of a template unit as systemd would, as far as a machine without a running systemd allows
(tests/test_units.py): ``python3 start_unit.py UNIT_FILE INSTANCE PID_FILE``.

``%i`` is the instance and ``%C`` ``/var/cache``; the ``CacheDirectory=`` made there, owned by ``User=``; the
``EnvironmentFile=`` (``-``: when it exists) and ``Environment=`` lines given; ``ExecStart=`` run as ``User=``
(its group, its supplementary groups) with ``env -i``: systemd's default ``PATH`` and what systemd sets
(``HOME`` of the user, ``USER``, ``LOGNAME``, ``SHELL``, ``NOTIFY_SOCKET``), from ``/``, in a session of its own.
Returns once the service said ``READY=1`` (``Type=notify``: ``systemctl start`` returns then), its pid in
PID_FILE; exit 1 with its stderr when it exits first. The sandbox (``ProtectSystem=`` and the like) is not
reproduced: a test of the unit's own directories does that (tests/test_units.py).
"""

from __future__ import annotations

import os
import pwd
import shlex
import socket
import subprocess
import sys
import tempfile

SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"


def main(unit_file: str, instance: str, pid_file: str) -> int:
    d: dict[str, list[str]] = {}
    for line in open(unit_file, encoding="utf-8").read().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, val = line.partition("=")
            d.setdefault(key, []).append(val.replace("%i", instance).replace("%C", "/var/cache"))
    user = pwd.getpwnam(d["User"][0])
    for name in d.get("CacheDirectory", []):
        path = os.path.join("/var/cache", name)
        os.makedirs(path, exist_ok=True)
        os.chown(path, user.pw_uid, user.pw_gid)
    env = {"PATH": SYSTEMD_PATH, "HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name,
           "SHELL": user.pw_shell}
    for f in d.get("EnvironmentFile", []):
        optional, f = f.startswith("-"), f.lstrip("-")
        if optional and not os.path.exists(f):
            continue
        for line in open(f, encoding="utf-8"):
            if "=" in line and not line.lstrip().startswith("#"):
                k, _, v = line.strip().partition("=")
                env[k] = v
    for e in d.get("Environment", []):
        k, _, v = e.partition("=")
        env[k] = v
    where = tempfile.mkdtemp(prefix="notify-")
    os.chmod(where, 0o755)
    sock_path = os.path.join(where, "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    os.chmod(sock_path, 0o777)
    sock.settimeout(120)
    env["NOTIFY_SOCKET"] = sock_path
    (cmd,) = d["ExecStart"]
    log = open(os.path.join(where, "stderr"), "w+")
    proc = subprocess.Popen(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups",
                             "env", "-i", *[f"{k}={v}" for k, v in env.items()], *shlex.split(cmd)],
                            cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                            start_new_session=True)
    said: list[str] = []
    try:
        while "READY=1" not in said:
            said += sock.recv(4096).decode().split("\n")
    except TimeoutError:
        pass
    if "READY=1" not in said or proc.poll() is not None:
        log.seek(0)
        print(f"{unit_file}: no READY=1 ({said}); exit {proc.poll()}: {log.read()[-3000:]}", file=sys.stderr)
        proc.kill()
        return 1
    with open(pid_file, "w") as f:
        f.write(str(proc.pid))
    print(next((x for x in said if x.startswith("STATUS=")), "STATUS="))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
