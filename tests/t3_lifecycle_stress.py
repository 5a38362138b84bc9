"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
Stress: concurrent cp -r forks, rsync in and out, and readers on one mount, then a clean check."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import threading
import time

import pytest

from mountutil import pffs
from pffs import manifest as mf
from sessions import tree_digest, varied_pages, write_session

STRESS_SECONDS = float(os.environ.get("PFFS_TEST_STRESS_SECONDS", "60"))


def sh(*cmd) -> None:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {r.returncode}: {r.stderr.strip()}")


@pytest.mark.slow
def test_forks_rsync_and_readers_for_a_minute(mnt, bf16_pages, tmp_path):
    src = tmp_path / "src"
    for k in range(3):
        write_session(src / f"base{k}", varied_pages(bf16_pages, 16, salt=600 + k), seq_id=f"b{k}")
    (src / "notes.txt").write_text("plain file\n")
    sh("cp", "-r", src, mnt / "src")
    want = tree_digest(src)
    stop = threading.Event()
    errors: list[str] = []
    done = {"forks": 0, "rsyncs": 0, "reads": 0}
    lock = threading.Lock()

    def forker(t: int) -> None:
        rng = random.Random(t)
        mine: list[str] = []
        n = 0
        try:
            while not stop.is_set():
                base = f"base{rng.randrange(3)}"
                dst = mnt / "forks" / f"t{t}-{n}"
                dst.parent.mkdir(exist_ok=True)
                sh("cp", "-r", mnt / "src" / base, dst)
                if tree_digest(dst) != tree_digest(src / base):
                    errors.append(f"fork {dst} differs from {base}")
                mine.append(dst.name)
                n += 1
                if len(mine) > 3:
                    sh("rm", "-rf", mnt / "forks" / mine.pop(0))
                with lock:
                    done["forks"] += 1
        except Exception as e:  # noqa: BLE001 (reported by the test thread)
            errors.append(f"forker {t}: {e}")

    def rsyncer() -> None:
        n = 0
        try:
            while not stop.is_set():
                dst = mnt / "rsync" / f"r{n % 2}"
                dst.parent.mkdir(exist_ok=True)
                sh("rsync", "-aH", "--delete", f"{src}/", dst)
                back = tmp_path / f"back{n % 2}"
                sh("rsync", "-aH", "--delete", f"{dst}/", back)
                if tree_digest(back) != want:
                    errors.append(f"rsync round trip {n} differs")
                n += 1
                with lock:
                    done["rsyncs"] += 1
        except Exception as e:  # noqa: BLE001
            errors.append(f"rsync: {e}")

    def reader(r: int) -> None:
        rng = random.Random(50 + r)
        try:
            while not stop.is_set():
                base = mnt / "src" / f"base{rng.randrange(3)}"
                man = json.loads((base / "manifest.json").read_bytes())
                for i, d in enumerate(man["pages"]):
                    data = (base / "pages" / mf.page_name(i)).read_bytes()
                    if "sha256:" + hashlib.sha256(data).hexdigest() != d:
                        errors.append(f"reader {r}: {base.name} page {i} differs")
                with lock:
                    done["reads"] += 1
        except Exception as e:  # noqa: BLE001
            errors.append(f"reader {r}: {e}")

    threads = [threading.Thread(target=forker, args=(t,)) for t in range(4)]
    threads += [threading.Thread(target=rsyncer)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    end = time.monotonic() + STRESS_SECONDS
    try:
        while time.monotonic() < end and not errors and all(t.is_alive() for t in threads):
            time.sleep(0.2)  # the workers run on their own; this only watches the clock
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert not errors, errors[:5]
    assert done["forks"] >= 8 and done["rsyncs"] >= 2 and done["reads"] >= 8, done
    assert tree_digest(mnt / "src") == want
    stats = json.loads(pffs("stats", "--json", mnt.path).stdout)
    # Forks and copies add no blob bytes: the blobs are the three sessions' and rsync's.
    assert stats["unique_blobs"] <= 3 * 17 + 1 + 1
    assert mnt.stop() == 0
    r = pffs("check", "--store", mnt.store, "--read-data", check=False)
    assert r.returncode == 0 and "DAMAGE" not in r.stdout, r.stdout
