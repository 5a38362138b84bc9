"""Level t2, in process: the namespace measured in the test's process, with no mount.
``pffs du``'s figures (pffs.namespace.usage) against what removing the places
really frees: random trees of sessions, copies, forks (folded and not), pages
rewritten, manifests renamed and hard-linked across folders; then each
measured set of places is removed as ``rm -r`` would (a folded fork unfolded
by the listing, every entry unlinked) and gc's roots before and after are
compared with what du called the places' own (docs/operations.md, du)."""

from __future__ import annotations

import random
import sqlite3
import stat

import pytest

from pffs import namespace as ns
from pffs.namespace.usage import Place, PlaceMoved, usage_of

DIR, REG = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644


class Tree:
    """A namespace built by the namespace's own functions, the way the daemon changes it."""

    def __init__(self, conn: sqlite3.Connection, rnd: random.Random):
        self.conn, self.rnd = conn, rnd
        self.n = 0
        self.pool: list[str] = []       # page blobs, reused so that sessions share some
        self.sessions: list[int] = []   # session folders
        self.folders = [ns.ROOT_INODE]

    def blob(self) -> str:
        self.n += 1
        d = f"sha256:{self.n:064x}"
        self.conn.execute("INSERT INTO blobs VALUES (?,?,?,'zstd-1',0)",
                          (d, self.rnd.randint(100, 999), self.rnd.randint(50, 999)))
        return d

    def name(self, prefix: str) -> bytes:
        self.n += 1
        return f"{prefix}{self.n}".encode()

    def file(self, parent: int, name: bytes, d: str) -> int:
        ino = ns.make_inode(self.conn, parent, name, REG, 0, 0).id
        self.content(ino, d)
        return ino

    def content(self, ino: int, d: str) -> None:
        size = self.conn.execute("SELECT raw_size FROM blobs WHERE digest=?", (d,)).fetchone()[0]
        ns.set_content(self.conn, ino, size, d, [d], [], None)

    def manifest(self, folder: int, listed: list[str], d: str) -> int:
        """manifest.json with bytes *d* listing *listed* takes its name in *folder* (and forks)."""
        ino = self.file(folder, b"manifest.json", d)
        ns.record_manifest(self.conn, ino, listed, d)
        ns.fork_pages(self.conn, folder, d, 0, 0)
        return ino

    def session(self) -> None:
        folder = ns.make_inode(self.conn, self.rnd.choice(self.folders), self.name("s"), DIR, 0, 0).id
        pdir = ns.make_inode(self.conn, folder, b"pages", DIR, 0, 0).id
        listed = []
        for i in range(self.rnd.randint(1, 5)):
            d = self.rnd.choice(self.pool) if self.pool and self.rnd.random() < 0.3 else self.blob()
            self.pool.append(d)
            listed.append(d)
            self.file(pdir, b"%06d" % i, d)
        self.manifest(folder, listed, self.blob())
        self.sessions.append(folder)

    def entries(self, folder: int) -> list[tuple[bytes, int]]:
        return list(self.conn.execute("SELECT name, inode FROM dentries WHERE parent=?", (folder,)))

    def copy(self, how: str) -> None:
        """cp -r of a session (some pages, then manifest.json), or pffs fork (an empty pages/)."""
        src = self.rnd.choice(self.sessions)
        man = ns.lookup(self.conn, src, b"manifest.json")
        if man is None or self.conn.execute("SELECT 1 FROM manifests WHERE inode=?", (man,)).fetchone() is None:
            return
        d = ns.get_inode(self.conn, man).digest
        folder = ns.make_inode(self.conn, self.rnd.choice(self.folders), self.name("c"), DIR, 0, 0).id
        pdir = ns.make_inode(self.conn, folder, b"pages", DIR, 0, 0).id
        if how == "cp":
            spages = ns.lookup(self.conn, src, b"pages")
            if spages is not None:
                ns.unfold(self.conn, spages)
                for name, ino in self.entries(spages):
                    if self.rnd.random() < 0.7:
                        blocks = ns.blocks_of(self.conn, ino)
                        if blocks:
                            self.file(pdir, name, blocks[0])
        listed = ns.recorded_pages(self.conn, d)
        assert listed is not None
        self.manifest(folder, listed, d)
        self.sessions.append(folder)

    def page_file(self) -> tuple[int, bytes, int] | None:
        """(pages folder, name, inode) of a page file of some session, unfolding it."""
        s = self.rnd.choice(self.sessions)
        pdir = ns.lookup(self.conn, s, b"pages")
        if pdir is None:
            return None
        ns.unfold(self.conn, pdir)
        files = self.entries(pdir)
        if not files:
            return None
        name, ino = self.rnd.choice(files)
        return pdir, name, ino

    def step(self) -> None:
        r = self.rnd.random()
        if r < 0.08:
            self.folders.append(ns.make_inode(self.conn, self.rnd.choice(self.folders), self.name("d"),
                                              DIR, 0, 0).id)
        elif r < 0.25 or not self.sessions:
            self.session()
        elif r < 0.45:
            self.copy(self.rnd.choice(["cp", "fork"]))
        elif r < 0.57:
            found = self.page_file()     # a page rewritten
            if found is not None:
                self.content(found[2], self.blob())
        elif r < 0.69:
            found = self.page_file()     # a page (or a manifest.json) hard-linked elsewhere
            if found is not None:
                ino = found[2]
                if self.rnd.random() < 0.5:
                    ino = ns.lookup(self.conn, self.rnd.choice(self.sessions), b"manifest.json") or ino
                ns.link(self.conn, ino, self.rnd.choice(self.folders), self.name("l"))
        elif r < 0.8:                    # a session removed (its forks stay)
            s = self.sessions.pop(self.rnd.randrange(len(self.sessions)))
            parent, name = self.conn.execute("SELECT parent, name FROM dentries WHERE inode=?",
                                             (s,)).fetchone()
            self.rm_r(parent, name)
        else:
            s = self.rnd.choice(self.sessions)
            if ns.lookup(self.conn, s, b"manifest.json") is None:
                return
            if self.rnd.random() < 0.3:  # renamed away: its record stays
                ns.rename(self.conn, s, b"manifest.json", s, self.name("old"), 0, lambda _ino: False)
            else:                        # removed: a fork's page files or fold may hold its list alone
                ns.unlink(self.conn, s, b"manifest.json", lambda _ino: False)

    def rm_r(self, parent: int, name: bytes) -> None:
        """What rm -r does through the mount: list (which unfolds), unlink, rmdir."""
        ino = ns.lookup(self.conn, parent, name)
        if ino is None:
            return
        if ns.get_inode(self.conn, ino).is_dir:
            ns.unfold(self.conn, ino)
            for child, _ in self.entries(ino):
                self.rm_r(ino, child)
            ns.rmdir(self.conn, parent, name, lambda _ino: False)
        else:
            ns.unlink(self.conn, parent, name, lambda _ino: False)


def roots(conn: sqlite3.Connection) -> dict[str, tuple[int, int]]:
    """gc's live blobs that are stored: digest -> (raw size, stored size)."""
    live = set(ns.iter_referenced_blobs(conn))
    return {d: (r, s) for d, r, s in conn.execute("SELECT digest, raw_size, stored_size FROM blobs")
            if d in live}


def logical(conn: sqlite3.Connection, places: list[Place]) -> tuple[int, int]:
    """(files, bytes) below *places*, each inode once, folded page files included."""
    seen: set[int] = set()
    files = size = 0
    stack = [p.ino for p in places]
    while stack:
        ino = stack.pop()
        if ino in seen:
            continue
        seen.add(ino)
        node = ns.get_inode(conn, ino)
        if node.is_dir:
            stack += [c for (c,) in conn.execute("SELECT inode FROM dentries WHERE parent=?", (ino,))]
            fold = conn.execute("SELECT files, bytes FROM folds WHERE dir=?", (ino,)).fetchone()
            if fold is not None:
                files, size = files + fold[0], size + fold[1]
        elif node.is_reg:
            files, size = files + 1, size + node.size
    return files, size


def places_of(conn: sqlite3.Connection, rnd: random.Random) -> list[Place]:
    every = list(conn.execute("SELECT inode, parent, name FROM dentries"))
    if rnd.random() < 0.05:
        return [Place(ns.ROOT_INODE, None, None)]
    return [Place(*rnd.choice(every)) for _ in range(rnd.choice([1, 1, 2, 3]))]


@pytest.mark.parametrize("seed", range(12))
def test_what_du_calls_a_places_own_is_what_removing_it_frees(tmp_path, seed):
    rnd = random.Random(seed)
    conn = ns.open_db(tmp_path)
    tree = Tree(conn, rnd)
    with ns.transaction(conn):
        for _ in range(60):
            tree.step()
    measured = 0
    for _ in range(25):
        places = places_of(conn, rnd)
        u = usage_of(conn, places)
        assert (u.files, u.logical_bytes) == logical(conn, places)
        assert 0 <= u.exclusive_bytes <= u.unique_bytes and u.exclusive_blobs <= u.blobs
        before = roots(conn)
        conn.execute("BEGIN")
        try:
            for p in places:
                if p.parent is None:
                    for name, _ in tree.entries(ns.ROOT_INODE):
                        tree.rm_r(ns.ROOT_INODE, name)
                else:
                    tree.rm_r(p.parent, p.name)
            after = roots(conn)
        finally:
            conn.execute("ROLLBACK")
        freed = {d: before[d] for d in before.keys() - after.keys()}
        assert u.exclusive_blobs == len(freed)
        assert u.exclusive_bytes == sum(r for r, _ in freed.values())
        assert u.exclusive_stored_bytes == sum(s for _, s in freed.values())
        measured += u.exclusive_blobs > 0 and u.shared_bytes > 0
    assert measured, "no draw had both shared and exclusive blobs"
    conn.close()


def freed_by_removing(tree: Tree, places: list[Place]) -> set[str]:
    """The blobs gc would remove once *places* are removed (rolled back after)."""
    before = roots(tree.conn)
    tree.conn.execute("BEGIN")
    try:
        for p in places:
            tree.rm_r(p.parent, p.name)
        return set(before) - set(roots(tree.conn))
    finally:
        tree.conn.execute("ROLLBACK")


def test_a_page_list_that_only_forks_hold_is_shared_between_them(tmp_path):
    """A session forked twice (one fork folded, one looked into) and then gone,
    with both forks' manifest.json: each fork's pages are held by the other too."""
    conn = ns.open_db(tmp_path)
    tree = Tree(conn, random.Random(0))
    with ns.transaction(conn):
        tree.session()
        for _ in range(2):
            tree.copy("fork")
        s, folded, opened = tree.sessions
        ns.unfold(conn, ns.lookup(conn, opened, b"pages"))
        for session in (folded, opened):
            ns.unlink(conn, session, b"manifest.json", lambda _ino: False)
        parent, name = conn.execute("SELECT parent, name FROM dentries WHERE inode=?", (s,)).fetchone()
        tree.rm_r(parent, name)
    assert conn.execute("SELECT COUNT(*) FROM folds").fetchone()[0] == 1
    assert conn.execute("SELECT COUNT(*) FROM manifests").fetchone()[0] == 0
    places = {f: Place(*conn.execute("SELECT inode, parent, name FROM dentries WHERE inode=?",
                                     (f,)).fetchone()) for f in (folded, opened)}
    for f in (folded, opened):
        u = usage_of(conn, [places[f]])
        assert u.blobs > 0 and u.exclusive_blobs == 0 and freed_by_removing(tree, [places[f]]) == set()
    both = usage_of(conn, list(places.values()))
    assert both.exclusive_blobs == both.blobs == len(freed_by_removing(tree, list(places.values())))
    conn.close()


def test_a_place_whose_entry_changed_is_refused(tmp_path):
    conn = ns.open_db(tmp_path)
    with ns.transaction(conn):
        a = ns.make_inode(conn, ns.ROOT_INODE, b"a", DIR, 0, 0).id
        b = ns.make_inode(conn, ns.ROOT_INODE, b"b", DIR, 0, 0).id
    assert usage_of(conn, [Place(a, ns.ROOT_INODE, b"a")]).files == 0
    with pytest.raises(PlaceMoved):
        usage_of(conn, [Place(a, ns.ROOT_INODE, b"b")])
    with pytest.raises(PlaceMoved):
        usage_of(conn, [Place(b, None, None)])
    assert not conn.in_transaction
    assert usage_of(conn, [Place(b, ns.ROOT_INODE, b"b")]).files == 0   # (no temp table was left)
    conn.close()
