"""Which blobs are referenced: the gc roots (contract §4), written once.

A blob is referenced while one of three rows names it:

- a ``blocks`` row: a file holds it (also a file unlinked but still open);
- a ``manifest_pages`` row: a manifest's page list lists it;
- a ``cached_keys`` row: the key-only prefix cache keeps it.

A fork's page file (a ``blocks`` row with ``via`` set) holds its blob
through its pageset's page list. That list lists the blob and stays while the
row does (:mod:`pffs.namespace.pagelists`). So a lookup by digest finds
such a row through the list: only ``via IS NULL`` rows are in the by-blob
index. ``pffs check`` reports a fork row whose list lacks its blob as damage.

Two ways to ask, one rule. :func:`iter_referenced_blobs` reads every root
in a scan; it counts every ``blocks`` row, ``via`` set or not, so a damaged
fork row still keeps its blob. :func:`referenced_sql` and the lookups on it
ask about some digests by index. Both give the same answer on a sound
namespace. gc marks with the scan and re-checks its candidates by index.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

from pffs.types import Digest

# Every referenced digest, each once.
REFERENCED = ("SELECT blob FROM blocks UNION SELECT digest FROM manifest_pages"
              " UNION SELECT digest FROM cached_keys")


def referenced_sql(digest: str, *, files_gone: str | None = None, lists_gone: str | None = None) -> str:
    """An SQL expression, true when the blob whose digest is the SQL *digest* is referenced.

    *files_gone* and *lists_gone* are subqueries of inodes and of page lists
    (``manifest_pages.manifest``) not to count: ``pffs du`` asks what stays
    referenced once some places are gone.
    """
    files = f"SELECT 1 FROM blocks ref_b WHERE ref_b.blob = {digest} AND ref_b.via IS NULL"
    if files_gone is not None:
        files += f" AND ref_b.inode NOT IN ({files_gone})"
    lists = f"SELECT 1 FROM manifest_pages ref_p WHERE ref_p.digest = {digest}"
    if lists_gone is not None:
        lists += f" AND ref_p.manifest NOT IN ({lists_gone})"
    cached = f"SELECT 1 FROM cached_keys ref_c WHERE ref_c.digest = {digest}"
    return f"(EXISTS ({files}) OR EXISTS ({lists}) OR EXISTS ({cached}))"


def iter_referenced_blobs(conn: sqlite3.Connection) -> Iterable[Digest]:
    """Every referenced blob: the gc roots."""
    for (d,) in conn.execute(REFERENCED):
        yield Digest(d)


def is_referenced(conn: sqlite3.Connection, digest: str) -> bool:
    """Whether blob *digest* is referenced (by index)."""
    return bool(conn.execute(f"SELECT {referenced_sql(':d')}", {"d": digest}).fetchone()[0])


def referenced_among(conn: sqlite3.Connection, digests: Iterable[str]) -> set[str]:
    """Those of *digests* that are referenced (by index)."""
    out: set[str] = set()
    uniq = list(set(digests))
    for k in range(0, len(uniq), 400):
        chunk = uniq[k:k + 400]
        asked = ",".join(["(?)"] * len(chunk))
        out.update(d for (d,) in conn.execute(
            f"WITH asked(d) AS (VALUES {asked}) SELECT d FROM asked WHERE {referenced_sql('asked.d')}", chunk))
    return out


def drop_unreferenced_blob_row(conn: sqlite3.Connection, digest: str) -> bool:
    """Delete the ``blobs`` row of *digest* unless the blob is referenced; whether it went."""
    return conn.execute(f"DELETE FROM blobs WHERE digest=:d AND NOT {referenced_sql(':d')}",
                        {"d": digest}).rowcount > 0
