"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
Random session work on a real mount, checked against a model.

Sessions are written with `cp -r`, forked every way contract §3 offers (`cp -r`,
`cp -al`, `pffs fork`, the metadata-only recipe), their pages rewritten and
removed, missing pages brought back by putting the manifest in place again,
sealed, removed, and the store collected (`pffs gc --grace 0`) in between.
After each step one session is compared file by file with the model; at the
end every session, after a remount, and `pffs check --read-data` is clean.
Forks and copies never add blob bytes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from mountutil import pffs
from pffs import manifest as mf
from pffs.client import mounted as tools
from sessions import digest, make_manifest, varied_pages

OPS = {"new": 3, "fork_cp": 3, "fork_al": 2, "fork_pffs": 3, "fork_meta": 3, "rewrite": 4,
       "rm_page": 3, "replace_manifest": 3, "seal": 2, "rm": 2, "gc": 2, "stats": 2, "remount": 1}


class Box:
    """One file's bytes; hard links share a Box."""

    def __init__(self, data: bytes):
        self.data = data


class Session:
    def __init__(self, manifest: Box, pages: dict[str, Box]):
        self.manifest = manifest  # Box of manifest.json bytes
        self.pages = pages        # page file name -> Box


class SessionFsx:
    def __init__(self, root: Path, work: Path, pool: list[bytes], store: Path, seed: int,
                 remount=None):
        self.root, self.work, self.pool, self.store = root, work, pool, store
        self.remount = remount    # unmounts (asserting exit 0) and mounts the store again
        self.rnd = random.Random(seed)
        self.by_digest = {digest(p): p for p in pool}
        self.sessions: dict[str, Session] = {}
        self.n = 0
        self.log: list[str] = []

    def run(self, n_ops: int) -> None:
        ops, weights = list(OPS), list(OPS.values())
        for step in range(n_ops):
            op = self.rnd.choices(ops, weights)[0] if self.sessions else "new"
            if op.startswith("fork_"):
                self.fork(op[len("fork_"):])
            else:
                getattr(self, "op_" + op)()
            if self.sessions:
                self.verify(self.rnd.choice(sorted(self.sessions)))

    def fresh_name(self) -> str:
        self.n += 1
        return f"s{self.n}"

    def pick(self) -> str:
        return self.rnd.choice(sorted(self.sessions))

    def fail(self, msg: str) -> None:
        raise AssertionError(msg + "; last operations:\n" + "\n".join(self.log[-int(os.environ.get("SESSION_FSX_LOG", "12")):]))

    def verify(self, name: str) -> None:
        s = self.sessions[name]
        d = self.root / name
        if (d / mf.MANIFEST_NAME).read_bytes() != s.manifest.data:
            self.fail(f"{name}/manifest.json differs")
        got = sorted(os.listdir(d / mf.PAGES_DIR))
        if got != sorted(s.pages):
            self.fail(f"{name}/pages holds {got}, expected {sorted(s.pages)}")
        for p, box in s.pages.items():
            if (d / mf.PAGES_DIR / p).read_bytes() != box.data:
                self.fail(f"{name}/pages/{p} differs")

    def manifest_pages(self, s: Session) -> list[str]:
        return json.loads(s.manifest.data)["pages"]

    def stored_bytes(self) -> int:
        return json.loads((self.root / ".pffs" / "stats.json").read_text())["stored_bytes"]

    # -- operations -------------------------------------------------------------

    def op_new(self) -> None:
        name = self.fresh_name()
        pages = [self.rnd.choice(self.pool) for _ in range(self.rnd.randrange(1, 10))]
        src = self.work / name
        (src / "pages").mkdir(parents=True)
        for i, p in enumerate(pages):
            (src / "pages" / mf.page_name(i)).write_bytes(p)
        data = make_manifest(pages, seq_id=name).to_json()
        (src / mf.MANIFEST_NAME).write_bytes(data)
        subprocess.run(["cp", "-r", str(src), str(self.root / name)], check=True)
        shutil.rmtree(src)
        self.sessions[name] = Session(Box(data), {mf.page_name(i): Box(p) for i, p in enumerate(pages)})
        self.log.append(f"new {name}: {len(pages)} pages")

    def fork(self, how: str) -> None:
        src, dst = self.pick(), self.fresh_name()
        s = self.sessions[src]
        before = self.stored_bytes()
        if how == "cp":
            subprocess.run(["cp", "-r", str(self.root / src), str(self.root / dst)], check=True)
            new = Session(Box(s.manifest.data), {p: Box(b.data) for p, b in s.pages.items()})
        elif how == "al":
            subprocess.run(["cp", "-al", str(self.root / src), str(self.root / dst)], check=True)
            new = Session(s.manifest, dict(s.pages))
        else:
            if how == "pffs":
                tools.fork(str(self.root / src), str(self.root / dst))
            else:  # mkdir -p dst/pages && cp src/manifest.json dst/
                (self.root / dst / mf.PAGES_DIR).mkdir(parents=True)
                subprocess.run(["cp", str(self.root / src / mf.MANIFEST_NAME), str(self.root / dst)],
                               check=True)
            # Every listed page appears (its blob is stored: the source's manifest holds it).
            new = Session(Box(s.manifest.data), {
                mf.page_name(i): Box(self.by_digest[d]) for i, d in enumerate(self.manifest_pages(s))})
        if how in ("cp", "al"):
            # cp takes a folder's entries in inode order (gnulib's savedir): when pages/
            # came first, manifest.json took its name beside it and, as contract §3.4 says,
            # brought back the listed pages the source is missing.
            sd = self.root / src
            if os.stat(sd / mf.PAGES_DIR).st_ino < os.stat(sd / mf.MANIFEST_NAME).st_ino:
                for i, dg in enumerate(self.manifest_pages(s)):
                    new.pages.setdefault(mf.page_name(i), Box(self.by_digest[dg]))
        self.sessions[dst] = new
        if self.stored_bytes() != before:
            self.fail(f"fork {how} {src} -> {dst} added {self.stored_bytes() - before} stored bytes")
        self.log.append(f"fork {how} {src} -> {dst}")

    def pick_page(self) -> tuple[str, Session, str] | None:
        name = self.pick()
        s = self.sessions[name]
        return (name, s, self.rnd.choice(sorted(s.pages))) if s.pages else None

    def op_rewrite(self) -> None:
        picked = self.pick_page()
        if picked is None:
            return
        name, s, p = picked
        data = self.rnd.choice(self.pool)
        with open(self.root / name / mf.PAGES_DIR / p, "r+b") as f:  # in place: hard links see it
            f.write(data)
        s.pages[p].data = data
        self.log.append(f"rewrite {name}/pages/{p}")

    def op_rm_page(self) -> None:
        picked = self.pick_page()
        if picked is None:
            return
        name, s, p = picked
        os.unlink(self.root / name / mf.PAGES_DIR / p)
        del s.pages[p]
        self.log.append(f"rm {name}/pages/{p}")

    def op_replace_manifest(self) -> None:
        # A copy renamed onto manifest.json: the missing listed pages come back.
        name = self.pick()
        s = self.sessions[name]
        d = self.root / name
        subprocess.run(["cp", str(d / mf.MANIFEST_NAME), str(d / "m.tmp")], check=True)
        os.rename(d / "m.tmp", d / mf.MANIFEST_NAME)
        s.manifest = Box(s.manifest.data)  # a new file now: no longer linked
        for i, dg in enumerate(self.manifest_pages(s)):
            s.pages.setdefault(mf.page_name(i), Box(self.by_digest[dg]))
        self.log.append(f"manifest of {name} put in place again")

    def op_seal(self) -> None:
        name = self.pick()
        s = self.sessions[name]
        listed = self.manifest_pages(s)
        if sorted(s.pages) != [mf.page_name(i) for i in range(len(listed))]:
            return  # seal refuses gaps and lost pages (t3_mount_sessions covers that)
        n, changed = tools.seal(str(self.root / name))
        now = [digest(s.pages[mf.page_name(i)].data) for i in range(n)]
        if changed != sum(a != b for a, b in zip(listed, now)):
            self.fail(f"seal {name}: {changed} changed")
        s.manifest = Box((self.root / name / mf.MANIFEST_NAME).read_bytes())
        if self.manifest_pages(s) != now:
            self.fail(f"seal {name}: manifest lists other pages")
        self.log.append(f"seal {name}: {changed} changed")

    def op_rm(self) -> None:
        name = self.pick()
        subprocess.run(["rm", "-r", str(self.root / name)], check=True)
        del self.sessions[name]
        self.log.append(f"rm -r {name}")

    def op_stats(self) -> None:
        # Files count names (a hard link once per name), folded forks' files included.
        st = json.loads((self.root / ".pffs" / "stats.json").read_text())
        want = (sum(1 + len(s.pages) for s in self.sessions.values()),
                sum(len(s.manifest.data) + sum(len(b.data) for b in s.pages.values())
                    for s in self.sessions.values()))
        if (st["files"], st["logical_bytes"]) != want:
            self.fail(f"stats: {st['files']} files of {st['logical_bytes']} bytes, expected"
                      f" {want[0]} of {want[1]}")
        self.log.append(f"stats: {want[0]} files")

    def op_remount(self) -> None:
        if self.remount is not None:
            self.remount()
            self.log.append("unmounted and mounted again")

    def op_gc(self) -> None:
        r = pffs("gc", "--store", self.store, "--grace", "0")
        self.log.append(f"gc: {r.stdout.strip()}")


SEEDS = [int(s) for s in os.environ.get("SESSION_FSX_SEEDS", "1 2").split()]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_session_work_matches_a_model(mount_factory, bf16_pages, tmp_path, seed):
    size = len(bf16_pages[0])
    pool = varied_pages([p for p in bf16_pages if len(p) == size], 12, salt=seed)
    m = mount_factory()
    work = tmp_path / "work"
    work.mkdir()
    def remount():
        assert m.stop() == 0
        m.start()
    fsx = SessionFsx(m.path, work, pool, m.store, seed, remount)
    fsx.run(int(os.environ.get("SESSION_FSX_OPS", "60")))
    for name in sorted(fsx.sessions):
        fsx.verify(name)
    assert m.stop() == 0
    r = pffs("check", "--store", m.store, "--read-data", check=False)
    assert r.returncode == 0 and "DAMAGE" not in r.stdout, r.stdout
    m.start()
    for name in sorted(fsx.sessions):
        fsx.verify(name)
