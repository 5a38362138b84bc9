"""The prefix index (SPEC §7): pages found by their token chain key, without a name.

Two sources answer a key, both rows of the namespace (see SCHEMA):

- a session's pages: the ``space`` and ``key`` columns of ``manifest_pages``,
  set when a manifest's page list is recorded (pagelists.record_manifest,
  given :func:`manifest_keys`), so they follow the page list: a fork (same
  manifest bytes) adds no row, and the keys go with the list's last holder.
  A key counts while a recorded manifest (``manifests``) holds its list and
  its blob is stored;
- pages stored by key alone (``cached_keys``): an engine's cache, a gc root
  per row, kept within a size limit, least recently used first out.

Keys are computed by :mod:`pffs.tokenkeys`, below the namespace; engines use
the same functions as :mod:`pffs.client.chainkeys`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Sequence

from pffs import manifest as mf
from pffs import tokenkeys
from pffs.types import Digest

#: A manifest's keys: (its key namespace, [(page index, key)]).
IndexKeys = tuple[str, list[tuple[int, str]]]
#: meta's key saying every recorded page list carries its keys.
BUILT_MARK = "prefix_index"


def manifest_keys(m: mf.Manifest) -> IndexKeys | None:
    """The keys of a parsed manifest's full pages (None: it has none to give).

    A manifest whose top-level ``inputs`` is present and not empty (LoRA,
    salt, multimodal inputs) is not keyed: its pages depend on more than
    the tokens, and no seed is derived from it.
    """
    if m.extra.get(tokenkeys.INPUTS_FIELD):
        return None
    out: dict[int, str] = {}
    for seq in m.logical_seqs:
        if seq.token_ids:
            for ix, key in tokenkeys.seq_page_keys(seq.page_ixs, seq.token_ids, m.page_size_tokens):
                out.setdefault(ix, key)
    if not out:
        return None
    space = tokenkeys.key_namespace(m.model, m.dtype, m.n_layers, m.n_heads, m.head_dim,
                                    m.page_size_tokens, m.kv, m.layout, m.attention)
    return space, sorted(out.items())


def space_id(conn: sqlite3.Connection, name: str, create: bool = True) -> int | None:
    """The ``key_spaces`` row of namespace *name* (made if asked; else None when unknown)."""
    row = conn.execute("SELECT id FROM key_spaces WHERE name=?", (name,)).fetchone()
    if row is not None or not create:
        return row[0] if row is not None else None
    return conn.execute("INSERT INTO key_spaces (name) VALUES (?)", (name,)).lastrowid


def page_rows(conn: sqlite3.Connection, manifest: str, pages: Sequence[str],
              keys: IndexKeys | None) -> list[tuple]:
    """The ``manifest_pages`` rows of a page list, with their keys."""
    if keys is None:
        return [(manifest, i, d, None, None) for i, d in enumerate(pages)]
    space = space_id(conn, keys[0])
    by_ix = dict(keys[1])
    return [(manifest, i, d, space if i in by_ix else None, by_ix.get(i)) for i, d in enumerate(pages)]


def ensure_keys(conn: sqlite3.Connection, manifest: str, keys: IndexKeys | None) -> None:
    """Give an already recorded page list its keys where it lacks them (a list recorded
    before the index was built, or by a holder that did not key it).  O(1) when it has them."""
    if keys is None or not keys[1]:
        return
    first_ix, first_key = keys[1][0]
    row = conn.execute("SELECT key FROM manifest_pages WHERE manifest=? AND page_ix=?",
                       (manifest, first_ix)).fetchone()
    if row is None or row[0] == first_key:
        return
    space = space_id(conn, keys[0])
    conn.execute("UPDATE manifest_pages SET space=NULL, key=NULL WHERE manifest=?", (manifest,))
    conn.executemany("UPDATE manifest_pages SET space=?, key=? WHERE manifest=? AND page_ix=?",
                     [(space, k, manifest, ix) for ix, k in keys[1]])


# -- what a key finds ---------------------------------------------------------

#: Keys one statement asks for (a lookup of a 128-key batch is two statements).
FIND_BATCH = 256


def _hits(conn: sqlite3.Connection, sid: int, keys: list[str]) -> tuple[dict, dict]:
    """({key: digest} a session holds, {key: digest} the key-only cache holds) of *keys*,
    each only where the page's blob has a row: two statements, whatever their number."""
    marks = ",".join("?" * len(keys))
    held = dict(conn.execute(
        f"SELECT p.key, p.digest FROM manifest_pages p WHERE p.space = ? AND p.key IN ({marks})"
        " AND EXISTS (SELECT 1 FROM manifests m WHERE m.digest = p.manifest)"
        " AND EXISTS (SELECT 1 FROM blobs b WHERE b.digest = p.digest)", (sid, *keys)).fetchall())
    rest = [k for k in keys if k not in held]
    cached = dict(conn.execute(
        f"SELECT c.key, c.digest FROM cached_keys c WHERE c.space = ? AND c.key IN ({','.join('?' * len(rest))})"
        " AND EXISTS (SELECT 1 FROM blobs b WHERE b.digest = c.digest)", (sid, *rest)).fetchall()
    ) if rest else {}
    return held, cached


def find(conn: sqlite3.Connection, space: str, keys: Iterable[str]) -> list[tuple[Digest, bool]]:
    """The leading run of *keys* found in namespace *space*: [(digest, whether only the
    key-only cache gave it)], in order, stopping at the first key not found.

    Two indexed statements for each :data:`FIND_BATCH` keys asked (one where a
    session holds them all), stopping at the batch with the first miss: a
    statement a key cost twice the time at a million keys (docs/prefix-index.md)."""
    sid = space_id(conn, space, create=False)
    out: list[tuple[Digest, bool]] = []
    if sid is None:
        return out
    keys = list(keys)
    for at in range(0, len(keys), FIND_BATCH):
        part = keys[at:at + FIND_BATCH]
        held, cached = _hits(conn, sid, part)
        for key in part:
            d = held.get(key)
            if d is None:
                d = cached.get(key)
                if d is None:
                    return out
                out.append((Digest(d), True))
            else:
                out.append((Digest(d), False))
    return out


def holders(conn: sqlite3.Connection, space: str, key: str) -> list[tuple[int, int]]:
    """(manifest inode, page index) of every recorded manifest whose page list has *key*."""
    sid = space_id(conn, space, create=False)
    if sid is None:
        return []
    return [(ino, ix) for ino, ix in conn.execute(
        "SELECT m.inode, p.page_ix FROM manifest_pages p JOIN manifests m ON m.digest = p.manifest"
        " WHERE p.space = ? AND p.key = ? ORDER BY m.inode", (sid, key))]


# -- pages stored by key alone -------------------------------------------------

def cache_page(conn: sqlite3.Connection, space: str, key: str, digest: str, size: int, t: int,
               limit: int) -> int:
    """Keep blob *digest* (of *size* bytes) under *key* in the key-only cache, used at *t*;
    then evict least recently used rows past *limit* bytes.  Returns how many went."""
    return cache_pages(conn, space, [(key, digest, size)], t, limit)


def cache_pages(conn: sqlite3.Connection, space: str, rows: Iterable[tuple[str, str, int]],
                t: int, limit: int) -> int:
    """Keep each blob of *rows* (key, digest, size) under its key in the key-only cache,
    used at *t*; then evict least recently used rows past *limit* bytes.  Returns how
    many went."""
    return cache_pages_counted(conn, space, rows, t, limit)[0]


def cache_pages_counted(conn: sqlite3.Connection, space: str, rows: Iterable[tuple[str, str, int]],
                        t: int, limit: int, total: int | None = None) -> tuple[int, int]:
    """:func:`cache_pages` for a caller that keeps count of the cache's bytes: *total*
    is what it held before (None: summed here, one pass over every row), and the
    answer is (rows evicted, bytes it holds after).  With *total* the work is the
    rows given and those evicted, whatever the cache's size."""
    sid = space_id(conn, space)
    new = list({k: (k, d, n) for k, d, n in rows}.values())      # (a key twice: the last)
    if total is not None:
        for k, _, _ in new:         # (rows replaced give their bytes back)
            old = conn.execute("SELECT size FROM cached_keys WHERE space=? AND key=?", (sid, k)).fetchone()
            total -= old[0] if old is not None else 0
    conn.executemany("INSERT OR REPLACE INTO cached_keys (space, key, digest, size, used_ns)"
                     " VALUES (?,?,?,?,?)", [(sid, k, d, n, t) for k, d, n in new])
    if total is None:
        total = conn.execute("SELECT COALESCE(SUM(size), 0) FROM cached_keys").fetchone()[0]
    else:
        total += sum(n for _, _, n in new)
    return evict_counted(conn, limit, total)


def evict(conn: sqlite3.Connection, limit: int) -> int:
    """Drop the least recently used key-only rows until they hold at most *limit* bytes."""
    total = conn.execute("SELECT COALESCE(SUM(size), 0) FROM cached_keys").fetchone()[0]
    return evict_counted(conn, limit, total)[0]


def evict_counted(conn: sqlite3.Connection, limit: int, total: int) -> tuple[int, int]:
    """:func:`evict` of a cache holding *total* bytes: (rows evicted, bytes held after)."""
    gone = 0
    while total > limit:
        row = conn.execute("SELECT space, key, size FROM cached_keys ORDER BY used_ns, space, key"
                           " LIMIT 1").fetchone()
        if row is None:
            total = 0
            break
        conn.execute("DELETE FROM cached_keys WHERE space=? AND key=?", row[:2])
        total -= row[2]
        gone += 1
    return gone, total


def touch(conn: sqlite3.Connection, space: str, keys: Iterable[str], t: int) -> int:
    """Mark key-only rows of *keys* used at *t* (LRU); returns how many there were."""
    sid = space_id(conn, space, create=False)
    if sid is None:
        return 0
    return conn.executemany("UPDATE cached_keys SET used_ns=? WHERE space=? AND key=?",
                            [(t, sid, k) for k in keys]).rowcount


# -- the whole index -------------------------------------------------------------

def is_built(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM meta WHERE key=?", (BUILT_MARK,)).fetchone() is not None


def recorded_lists(conn: sqlite3.Connection) -> list[tuple[str, int]]:
    """(manifest bytes, an inode holding them) of every recorded manifest whose file still
    holds those bytes."""
    return list(conn.execute("SELECT m.digest, MIN(m.inode) FROM manifests m JOIN inodes i"
                             " ON i.id = m.inode WHERE i.digest IS m.digest GROUP BY m.digest"))


def keys_of_lists(conn: sqlite3.Connection, read: Callable[[int], bytes]
                  ) -> Iterable[tuple[str, int, IndexKeys | None | Exception]]:
    """For each recorded manifest: (its bytes' digest, an inode holding them, its keys, or
    the error reading or parsing it)."""
    for digest, ino in recorded_lists(conn):
        try:
            yield digest, ino, manifest_keys(mf.parse(read(ino)))
        except Exception as e:     # (the caller reports it: unreadable blob, bad manifest)
            yield digest, ino, e


def stored_keys(conn: sqlite3.Connection, manifest: str) -> IndexKeys | None:
    """The keys the index holds for page list *manifest* (None: none)."""
    rows = conn.execute("SELECT s.name, p.page_ix, p.key FROM manifest_pages p JOIN key_spaces s"
                        " ON s.id = p.space WHERE p.manifest = ? AND p.key IS NOT NULL"
                        " ORDER BY p.page_ix", (manifest,)).fetchall()
    if not rows:
        return None
    return rows[0][0], [(ix, k) for _, ix, k in rows]


def short_list(conn: sqlite3.Connection, manifest: str) -> bool:
    """Whether the page list of *manifest* lacks rows (the check reports it; repair records it
    again, with its keys)."""
    return conn.execute("SELECT (SELECT MAX(n_pages) FROM manifests WHERE digest = ?)"
                        " != (SELECT COUNT(*) FROM manifest_pages WHERE manifest = ?)",
                        (manifest, manifest)).fetchone()[0] == 1


def disagreements(conn: sqlite3.Connection, read: Callable[[int], bytes]) -> list[tuple[int, str]]:
    """(an inode holding it, why) for every recorded manifest whose keys in the index are
    not those its bytes give, and every key-only row whose blob has no row."""
    out = []
    for digest, ino, keys in keys_of_lists(conn, read):
        if isinstance(keys, Exception) or short_list(conn, digest):
            continue    # (the check says why it cannot be read, or that its list is short)
        have = stored_keys(conn, digest)
        if have != keys:
            n_want = len(keys[1]) if keys else 0
            n_have = len(have[1]) if have else 0
            out.append((ino, f"the prefix index holds {n_have} keys of its pages, its bytes give {n_want}"
                        if n_have != n_want else "the prefix index holds other keys than its bytes give"))
    n = conn.execute("SELECT COUNT(*) FROM cached_keys WHERE digest NOT IN (SELECT digest FROM blobs)"
                     ).fetchone()[0]
    if n:
        out.append((0, f"{n} key-only prefix cache rows name blobs without a row"))
    return out


def rebuild(conn: sqlite3.Connection, read: Callable[[int], bytes]) -> tuple[int, int]:
    """Compute the keys of every recorded manifest again (*read*: an inode's bytes), in
    the caller's transaction, and mark the index built.  Returns (lists keyed, keys)."""
    conn.execute("UPDATE manifest_pages SET space=NULL, key=NULL WHERE key IS NOT NULL")
    lists = n = 0
    for digest, _ino, keys in list(keys_of_lists(conn, read)):
        if isinstance(keys, Exception) or keys is None:
            continue
        ensure_keys(conn, digest, keys)
        lists += 1
        n += len(keys[1])
    conn.execute("DELETE FROM key_spaces WHERE id NOT IN (SELECT space FROM manifest_pages"
                 " WHERE space IS NOT NULL) AND id NOT IN (SELECT space FROM cached_keys)")
    conn.execute("DELETE FROM cached_keys WHERE digest NOT IN (SELECT digest FROM blobs)")
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, '1')", (BUILT_MARK,))
    return lists, n
