"""Level t3, mounts: the daemon's start-up (``Daemon.open``) run in the test's process.
Each step of it is made to fail in turn: what the steps before it opened is
closed again (the store lock, the namespace's connections, the commit
threads, the engine socket and its file, the FUSE mount, and an S3 store's
registration in the bucket, which says "unmounted" at once instead of
"mounted" until its lease runs out).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import trio

import pffs.bucket.lease
import pffs.daemon.handlers
import pffs.fs.content
import pffs.fs.db
import pffs.live.server
from mountutil import is_mounted
from pffs.bucket.transfer import decode_registration
from pffs.daemon import mount
from pffs.store.storedir import StoreDir
from seaweed import weed  # noqa: F401  (fixture)


class Refused(RuntimeError):
    """The failure a test puts into one step of the start-up."""


# Each step, in order: (name, the object and attribute that runs it).
STEPS = [
    ("namespace", mount.namespace, "open_db"),
    ("database", pffs.fs.db, "Database"),
    ("registration", pffs.bucket.lease, "attach"),      # (S3 stores only)
    ("content", pffs.fs.content, "ContentStore"),
    ("handlers", pffs.daemon.handlers, "build"),
    ("socket", pffs.live.server.LiveEngines, "listen"),
    ("fuse", mount.pyfuse3, "init"),
    ("built", mount.Daemon, "__init__"),                # after the mount is made
]


def fds() -> dict[int, str]:
    """This process's open file descriptors: number → what it names."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass        # (the listing's own descriptor, gone)
    return out


def tcp_sockets() -> set[str]:
    """This host's TCP sockets, as /proc/self/fd names them (``socket:[INODE]``)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            out.update(f"socket:[{line.split()[9]}]" for line in list(f)[1:])
    return out


def pffs_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("pffs-")}


def fail_each_step(monkeypatch, store_of, mnt: Path, skip=()) -> dict[str, StoreDir]:
    """Run Daemon.open once for each step, that step made to raise Refused
    (the steps before it run as they do); after each, nothing it opened is
    left open. The store of each run, by step."""
    stores = {}
    for name, target, attr in STEPS:
        if name in skip:
            continue
        store = store_of()
        before_fds, before_threads = fds(), pffs_threads()

        def refused(*args, _attr=attr, **kwargs):
            raise Refused(f"{_attr} refused by the test")

        async def main():
            async with trio.open_nursery() as nursery:
                with pytest.raises(Refused):
                    mount.Daemon.open(store, mnt, mount.MountOptions(reserve=0), nursery)
        with monkeypatch.context() as m:
            m.setattr(target, attr, refused)
            trio.run(main)
        assert store.in_use() is None, f"{name}: the store lock is still held"
        assert not os.path.lexists(store.socket_path), f"{name}: the engine socket's file stayed"
        assert not is_mounted(mnt), f"{name}: the mount stayed"
        # (An S3 client keeps its HTTP connections to the bucket in a pool of
        # its own, for the life of the process: not a part of the daemon's.)
        left = {fd: what for fd, what in fds().items() if before_fds.get(fd) != what
                and what not in tcp_sockets()}
        assert left == {}, f"{name}: descriptors left open: {left}"
        assert pffs_threads() <= before_threads, f"{name}: threads left running"
        stores[name] = store
    return stores


def test_a_failed_start_up_of_a_local_store_closes_what_it_opened(monkeypatch, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fail_each_step(monkeypatch, lambda: StoreDir(tmp_path / "store", reserve=0, mounted=True), mnt,
                   skip=("registration",))
    # The store mounts afterwards, as if nothing had been tried.
    async def main():
        async with trio.open_nursery() as nursery:
            d = mount.Daemon.open(StoreDir(tmp_path / "store", reserve=0, mounted=True), mnt,
                                  mount.MountOptions(reserve=0), nursery)
            d.close(unmount=True)
    trio.run(main)
    assert not is_mounted(mnt)


def test_a_failed_start_up_of_an_s3_store_unregisters_the_mount(monkeypatch, tmp_path, weed):
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/team"
    mnt = tmp_path / "mnt"
    mnt.mkdir()

    def registration() -> dict | None:
        keys = list(weed.objects(bucket, "team/mounts/"))
        if not keys:
            return None
        assert len(keys) == 1, keys
        return decode_registration(weed.client.get_object(Bucket=bucket, Key=keys[0])["Body"].read())

    states = {}
    for name in [s[0] for s in STEPS]:
        stores = fail_each_step(monkeypatch, lambda: StoreDir(url, cache=tmp_path / "cache", reserve=0,
                                                              mounted=True),
                                mnt, skip=[s[0] for s in STEPS if s[0] != name])
        reg = registration()
        states[name] = None if reg is None else reg["state"]
        assert stores
    # Before the registration was made, none is written; after, it says the mount is gone.
    assert states == {"namespace": None, "database": None, "registration": None, "content": "unmounted",
                      "handlers": "unmounted", "socket": "unmounted", "fuse": "unmounted",
                      "built": "unmounted"}, states
