"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
Random file operations on a real mount, checked against a model after every read.

In the manner of fsx: several names in two folders, hard links, several
descriptors open on one file at once (read-write, read-only and O_APPEND
ones, and files unlinked while open), writes at random offsets (holes, past
the end, up to 1 MiB + 1), truncates, fsyncs, renames over existing names,
cp-style rewrites (O_TRUNC), shared mmap reads and writes. Every read is
compared with the model's bytes, and the whole tree again after a remount.

``FSX_SEEDS="1 2 3 ..."`` and ``FSX_OPS=N`` run longer searches.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import threading
from pathlib import Path

import pytest

NAMES = ["a", "b", "c", "d/e", "d/f"]
MAX_FDS = 8
RW, RO, APPEND = "rw", "ro", "append"
OPS = {  # operation: weight
    "open": 8, "open_ro": 4, "append": 4, "close": 6, "write": 20, "read": 20, "truncate": 5,
    "fsync": 3, "rename": 4, "link": 3, "unlink": 3, "stat": 4, "cat": 5, "mmap": 3,
    "mmap_write": 2, "replace": 3,
}


class Model:
    """What every file holds: inode -> bytes, name -> inode."""

    def __init__(self) -> None:
        self.data: dict[int, bytearray] = {}
        self.names: dict[str, int] = {}
        self.next_ino = 1
        self.unsure: set[int] = set()  # files whose bytes a crash may have cut short

    def new(self, name: str) -> int:
        self.names[name] = ino = self.next_ino
        self.next_ino += 1
        self.data[ino] = bytearray()
        return ino

    def write(self, ino: int, off: int, buf: bytes) -> None:
        d = self.data[ino]
        if off > len(d):
            d.extend(bytes(off - len(d)))
        d[off:off + len(buf)] = buf

    def truncate(self, ino: int, size: int) -> None:
        d = self.data[ino]
        if size < len(d):
            del d[size:]
        else:
            d.extend(bytes(size - len(d)))

    def of(self, name: str) -> bytes:
        return bytes(self.data[self.names[name]])


class Fsx:
    def __init__(self, root: Path, seed: int):
        self.root = root
        self.rnd = random.Random(seed)
        self.model = Model()
        self.fds: list[tuple[int, int, str]] = []  # (fd, inode, RW | RO | APPEND)
        self.log: list[str] = []

    def run(self, n_ops: int, crash=None) -> Model:
        """*n_ops* random operations; then ``crash()``, if given, with the descriptors still open."""
        (self.root / "d").mkdir()
        ops, weights = list(OPS), list(OPS.values())
        try:
            for step in range(n_ops):
                op = self.rnd.choices(ops, weights)[0]
                getattr(self, "op_" + op)(step, self.rnd.choice(NAMES))
            if crash is not None:
                # Files open for writing may hold bytes not yet committed: the model
                # vouches only for the others.
                self.model.unsure = {ino for _, ino, mode in self.fds if mode != RO}
                crash()
        finally:
            for fd, _, _ in self.fds:
                try:
                    os.close(fd)
                except OSError:
                    if crash is None:  # (after a crash the connection is gone)
                        raise
        # Files no name holds any more went with their last descriptor.
        live = set(self.model.names.values())
        self.model.data = {k: v for k, v in self.model.data.items() if k in live}
        return self.model

    def fd(self, *modes: str):
        choices = [f for f in self.fds if f[2] in modes]
        return self.rnd.choice(choices) if choices else None

    def check(self, got: bytes, want: bytes, what: str) -> None:
        if got != want:
            first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            raise AssertionError(f"{what}: {len(got)} bytes read, {len(want)} expected, first difference at "
                                 f"{first}; last operations:\n" + "\n".join(self.log[-15:]))

    def note(self, step: int, what: str) -> None:
        self.log.append(f"{step} {what}")

    # -- descriptors ----------------------------------------------------------

    def op_open(self, step, name, mode=RW):
        if len(self.fds) >= MAX_FDS:
            return
        path = self.root / name
        if name not in self.model.names:
            if mode == RO:
                return
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            self.model.new(name)
        else:
            fd = os.open(path, os.O_RDWR if mode == RW else os.O_RDONLY)
        ino = self.model.names[name]
        self.fds.append((fd, ino, mode))
        self.note(step, f"open {name} {mode} -> fd {fd} (file {ino})")

    def op_open_ro(self, step, name):
        self.op_open(step, name, RO)

    def op_append(self, step, name):
        if name not in self.model.names or len(self.fds) >= MAX_FDS:
            return
        fd = os.open(self.root / name, os.O_WRONLY | os.O_APPEND)
        ino = self.model.names[name]
        buf = self.rnd.randbytes(self.rnd.randrange(1, 150_000))
        os.lseek(fd, self.rnd.randrange(0, 1000), os.SEEK_SET)  # O_APPEND writes at the end anyway
        assert os.write(fd, buf) == len(buf)
        self.model.write(ino, len(self.model.data[ino]), buf)
        self.fds.append((fd, ino, APPEND))
        self.note(step, f"append {len(buf)} bytes to {name} -> fd {fd}")

    def op_close(self, step, name):
        if self.fds:
            f = self.rnd.choice(self.fds)
            self.fds.remove(f)
            os.close(f[0])
            self.note(step, f"close fd {f[0]}")

    # -- data -----------------------------------------------------------------

    def op_write(self, step, name):
        f = self.fd(RW, APPEND)
        if not f:
            return
        size = len(self.model.data[f[1]])
        rnd = self.rnd
        off = rnd.choice([0, size, rnd.randrange(0, size + 1), rnd.randrange(0, size + 300_000)])
        buf = rnd.randbytes(rnd.choice([1, 4095, 4096, rnd.randrange(1, 200_000), (1 << 20) + 1]))
        assert os.pwrite(f[0], buf, off) == len(buf)
        if f[2] == APPEND:
            off = size  # Linux: pwrite on an O_APPEND descriptor appends whatever the offset
        self.model.write(f[1], off, buf)
        self.note(step, f"pwrite fd {f[0]} at {off}, {len(buf)} bytes")

    def op_read(self, step, name):
        f = self.fd(RW, RO)
        if not f:
            return
        d = self.model.data[f[1]]
        off = self.rnd.randrange(0, len(d) + 10)
        n = self.rnd.choice([1, 4096, 10_240, self.rnd.randrange(1, 300_000), 1 << 20])
        self.note(step, f"pread fd {f[0]} at {off}, {n} bytes")
        self.check(os.pread(f[0], n, off), bytes(d[off:off + n]), f"pread fd {f[0]} at {off}")

    def op_truncate(self, step, name):
        f = self.fd(RW, APPEND)
        if not f:
            return
        size = self.rnd.randrange(0, len(self.model.data[f[1]]) + 200_000)
        os.ftruncate(f[0], size)
        self.model.truncate(f[1], size)
        self.note(step, f"ftruncate fd {f[0]} to {size}")

    def op_fsync(self, step, name):
        f = self.fd(RW, APPEND)
        if f:
            os.fsync(f[0])
            self.note(step, f"fsync fd {f[0]}")

    def op_replace(self, step, name):
        # What cp does to a name that exists: open with O_TRUNC, write, close.
        buf = self.rnd.randbytes(self.rnd.choice([0, 147_456, self.rnd.randrange(1, 400_000)]))
        ino = self.model.names.get(name) or self.model.new(name)
        fd = os.open(self.root / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            assert os.write(fd, buf) == len(buf)
        finally:
            os.close(fd)
        self.model.truncate(ino, 0)
        self.model.write(ino, 0, buf)
        self.note(step, f"replace {name} with {len(buf)} bytes")

    def op_mmap(self, step, name):
        if name not in self.model.names or not self.model.data[self.model.names[name]]:
            return
        self.note(step, f"mmap read {name}")
        with open(self.root / name, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mm:
            self.check(bytes(mm), self.model.of(name), f"mmap {name}")

    def op_mmap_write(self, step, name):
        ino = self.model.names.get(name)
        if ino is None or not self.model.data[ino]:
            return
        size = len(self.model.data[ino])
        off = self.rnd.randrange(0, size)
        buf = self.rnd.randbytes(min(size - off, self.rnd.randrange(1, 20_000)))
        with open(self.root / name, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
            mm[off:off + len(buf)] = buf
            mm.flush()
        self.model.write(ino, off, buf)
        self.note(step, f"mmap write {name} at {off}, {len(buf)} bytes")

    # -- names ----------------------------------------------------------------

    def op_rename(self, step, name):
        other = self.rnd.choice(NAMES)
        if name not in self.model.names or other == name:
            return
        os.rename(self.root / name, self.root / other)
        if self.model.names.get(other) != self.model.names[name]:
            self.model.names[other] = self.model.names.pop(name)
        # (else both names link one file, and rename does nothing: POSIX)
        self.note(step, f"rename {name} -> {other}")

    def op_link(self, step, name):
        other = self.rnd.choice(NAMES)
        if name not in self.model.names or other in self.model.names:
            return
        os.link(self.root / name, self.root / other)
        self.model.names[other] = self.model.names[name]
        self.note(step, f"link {name} -> {other}")

    def op_unlink(self, step, name):
        if name not in self.model.names:
            with pytest.raises(FileNotFoundError):
                os.unlink(self.root / name)
            return
        os.unlink(self.root / name)
        del self.model.names[name]
        self.note(step, f"unlink {name}")

    def op_stat(self, step, name):
        if name in self.model.names:
            got = os.stat(self.root / name).st_size
            assert got == len(self.model.of(name)), f"stat {name}: size {got}\n" + "\n".join(self.log[-15:])
        else:
            with pytest.raises(OSError) as e:
                os.stat(self.root / name)
            assert e.value.errno == errno.ENOENT

    def op_cat(self, step, name):
        if name in self.model.names:
            self.note(step, f"cat {name}")
            self.check((self.root / name).read_bytes(), self.model.of(name), f"cat {name}")


def check_tree(root: Path, model: Model) -> None:
    for name in NAMES:
        if name in model.names:
            got = (root / name).read_bytes()
            assert model.names[name] in model.unsure or got == model.of(name), name
        else:
            assert not (root / name).exists(), name
    for ino in set(model.names.values()):
        holders = sorted(n for n, i in model.names.items() if i == ino)
        assert len({os.stat(root / n).st_ino for n in holders}) == 1, holders
        assert os.stat(root / holders[0]).st_nlink == len(holders), holders


SEEDS = [int(s) for s in os.environ.get("FSX_SEEDS", "1 2 3").split()]


@pytest.mark.parametrize("opts", [(), ("cache_size=256K,staging_memory=256K,sync=close",)],
                         ids=["default", "small-caches"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_operations_match_a_model(mount_factory, seed, opts):
    # small-caches: staged bytes spill to disk and decompressed blobs are evicted all the time.
    m = mount_factory(opts=opts)
    model = Fsx(m.path, seed).run(int(os.environ.get("FSX_OPS", "600")))
    check_tree(m.path, model)
    assert m.stop() == 0
    m.start()
    check_tree(m.path, model)


@pytest.mark.parametrize("seed", SEEDS)
def test_kill9_after_random_operations_keeps_every_closed_file(mount_factory, seed):
    """kill -9 of the daemon with files still open: after a remount every
    name is there and every file not open for writing holds what the model
    says, byte for byte (contract §3.7); the store checks clean."""
    m = mount_factory()
    model = Fsx(m.path, 1000 + seed).run(int(os.environ.get("FSX_OPS", "600")) // 2, crash=m.kill9)
    m.start()
    check_tree(m.path, model)
    assert m.stop() == 0
    r = m.check_store()
    assert r.returncode == 0 and "DAMAGE" not in r.stdout, r.stdout


@pytest.mark.parametrize("seed", SEEDS)
def test_random_operations_in_three_folders_at_once(mount_factory, seed):
    """Three threads, each with its own folder and model, on one mount."""
    m = mount_factory()
    runs = []
    for k in range(3):
        (m.path / f"t{k}").mkdir()
        runs.append(Fsx(m.path / f"t{k}", 100 * seed + k))
    models: dict[int, Model] = {}
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            models[k] = runs[k].run(int(os.environ.get("FSX_OPS", "600")) // 2)
        except BaseException as e:  # noqa: BLE001 (raised again by the test thread)
            errors.append(e)
    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    for k, model in models.items():
        check_tree(m.path / f"t{k}", model)
    assert m.stop() == 0
    m.start()
    for k, model in models.items():
        check_tree(m.path / f"t{k}", model)
