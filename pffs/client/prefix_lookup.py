"""What a mount holds for a prompt's leading pages, by their token chain keys (SPEC §7).

An engine computes the keys of a request's full pages
(:func:`pffs.client.chainkeys.chain_keys`, in the namespace of its model and
KV layout, :func:`~pffs.client.chainkeys.key_namespace`) and asks
:func:`longest_prefix` for the digests of the leading run of them that the
mount's store holds, whichever sessions hold them (or the key-only cache);
it then reads those blobs (the direct path, ``pffs.client.access``) or
forks them into a session.

The lookup reads the mount's namespace read-only beside the daemon, as
``pffs du`` does (:func:`pffs.client.du.open_namespace`): one indexed query
per key asked, none through FUSE.  Hits that only the key-only cache gave
are marked used with one setxattr on the mount's root
(``user.pffs.prefix.touch``), which the daemon writes: a reader never writes
the namespace.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pffs import manifest as mf
from pffs.client.chainkeys import INPUTS_FIELD, chain_keys, key_namespace, keys_value, pairs_value
from pffs.client.du import open_namespace, target
from pffs.errors import PffsError
from pffs.names import PREFIX_PUT_XATTR, PREFIX_TOUCH_XATTR, PREFIX_XATTR, STORE_XATTR
from pffs.namespace import path_of, prefix_index
from pffs.types import Digest

log = logging.getLogger(__name__)
#: Buckets opened for the shared index, by their mount's store.json.
_BUCKETS: dict[bytes, Any] = {}
_BUCKETS_LOCK = threading.Lock()

#: Keys per touch (an xattr value holds at most 64 KiB).
TOUCH_BATCH = 900
#: (key, blob) pairs per ``user.pffs.prefix.put`` (130 bytes each).
PUT_BATCH = 400


class PrefixIndex:
    """A mount's prefix index, its namespace held open for repeated lookups.

    A mount of an S3 store shares its index through the bucket
    (pffs.bucket.shared_index): keys past the local run are asked of the bucket,
    within a bounded wait, and what it holds is adopted into the mount's key-only
    cache (no page bytes move until read)."""

    def __init__(self, mountpoint: str | os.PathLike, *, shared: bool = True):
        self.mountpoint = os.fspath(mountpoint)
        self.conn: sqlite3.Connection = open_namespace(self.mountpoint)
        self._bucket: Any = None if shared else False     # (None: not looked for yet; False: none)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> PrefixIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def longest_prefix(self, space: str, keys: Sequence[str], *, touch: bool = True) -> list[Digest]:
        """The digests of the leading run of *keys* (hex, in namespace *space*) that the
        store holds: ``[]`` when the first is not found.  *touch*: key-only hits count
        as used for the cache's LRU order."""
        self.conn.execute("BEGIN")     # (one read transaction: one snapshot of the index)
        try:
            found = prefix_index.find(self.conn, space, keys)
        finally:
            self.conn.execute("COMMIT")
        cached = [k for k, (_, only_cache) in zip(keys, found) if only_cache]
        if touch and cached:
            touch_keys(self.mountpoint, space, cached)
        out = [d for d, _ in found]
        if len(out) < len(keys):
            out += self._from_bucket(space, keys[len(out):])
        return out

    def bucket(self) -> Any:
        """The mount's bucket where its store is one this process may read (else None)."""
        if self._bucket is None:
            self._bucket = False
            try:
                raw = os.getxattr(self.mountpoint, STORE_XATTR)
                info = json.loads(raw)
            except (OSError, ValueError):
                info = {}
            if info.get("url"):
                with _BUCKETS_LOCK:     # (one client a store and process: threads share it)
                    if raw not in _BUCKETS:
                        from pffs.client.access import NoDirectAccess, open_bucket
                        try:
                            _BUCKETS[raw] = open_bucket(info)
                            _ = _BUCKETS[raw].client      # (made now: not within a lookup's deadline)
                        except NoDirectAccess as e:
                            log.info("%s: the shared index is not asked: %s", self.mountpoint, e)
                            _BUCKETS[raw] = False
                    self._bucket = _BUCKETS[raw]
        return self._bucket or None

    def _from_bucket(self, space: str, keys: Sequence[str]) -> list[Digest]:
        """The leading run of *keys* another mount of the bucket published, adopted here."""
        bucket = self.bucket()
        if bucket is None:
            return []
        from pffs.bucket.shared_index import lookups, remote_run
        pairs = remote_run(bucket, space, keys, check_blobs=False)
        if pairs:
            # Adopted beside the answer: the mount checks each blob is in the bucket
            # (a HEAD each) as it keeps them.  A page whose blob went is a miss when
            # read (its frame is not found), as any page gc took.
            lookups().pool.submit(_adopt, self.mountpoint, bucket, space, pairs)
        return [d for _, d in pairs]


def _adopt(mountpoint: str, bucket: Any, space: str, pairs: list) -> None:
    """Keep pages another mount published in *mountpoint*'s key-only cache (a thread)."""
    from pffs.bucket.shared_index import stored
    try:
        cache_blobs(mountpoint, space, [(k, str(d)) for k, d in pairs])
    except PffsError as e:
        # A blob gone (the batch refused), or a mount this caller may not write:
        # the blobs checked here (an entry whose blob went is removed), the rest kept.
        pairs = stored(bucket, space, pairs)
        try:
            cache_blobs(mountpoint, space, [(k, str(d)) for k, d in pairs])
        except PffsError:
            log.info("shared index: %d pages found in the bucket not kept here: %s", len(pairs), e)


def longest_prefix(mountpoint: str | os.PathLike, space: str, keys: Sequence[str], *,
                   touch: bool = True) -> list[Digest]:
    """:meth:`PrefixIndex.longest_prefix` with the namespace opened for this one lookup."""
    with PrefixIndex(mountpoint) as index:
        return index.longest_prefix(space, keys, touch=touch)


def touch_keys(mountpoint: str | os.PathLike, space: str, keys: Sequence[str]) -> None:
    """Mark key-only cache rows of *keys* used now (the daemon writes it).  Best effort: on
    a read-only mount, or for a caller who may not write the mount's root, the cache keeps
    its order."""
    for k in range(0, len(keys), TOUCH_BATCH):
        try:
            os.setxattr(mountpoint, PREFIX_TOUCH_XATTR, keys_value(space, keys[k:k + TOUCH_BATCH]))
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                return
            raise PffsError(f"{mountpoint}: cannot mark prefix cache keys used: {e.strerror}") from None


def cache_page(path: str | os.PathLike, space: str, key: str) -> None:
    """Keep the page file at *path* (in a mount) in the key-only prefix cache under *key*:
    its blob stays, found by the key, after the file is removed, until evicted."""
    try:
        os.setxattr(path, PREFIX_XATTR, keys_value(space, [key]))
    except OSError as e:
        raise PffsError(f"{path}: cannot keep it by key: {e.strerror}") from None


def cache_blobs(mountpoint: str | os.PathLike, space: str, pairs: Sequence[tuple[str, str]]) -> None:
    """Keep blobs put into the mount's store beside it (the direct path) in the key-only
    prefix cache: *pairs* of (key, digest ``sha256:<hex>``), one request a
    :data:`PUT_BATCH` of them.  The blobs must be pinned (their put's gc lock
    protocol) until this returns; a blob not in the store fails the batch it is in."""
    for k in range(0, len(pairs), PUT_BATCH):
        chunk = [(key, d.removeprefix("sha256:")) for key, d in pairs[k:k + PUT_BATCH]]
        try:
            os.setxattr(mountpoint, PREFIX_PUT_XATTR, pairs_value(space, chunk))
        except OSError as e:
            raise PffsError(f"{mountpoint}: cannot keep {len(chunk)} pages by key: {e.strerror}") from None


# -- pffs prefix ---------------------------------------------------------------------

@dataclass
class PrefixPage:
    """One keyed page of ``pffs prefix``'s answer."""
    index: int                  # the page's place in the sequence asked about
    key: str
    holders: list[str]          # sessions (folders) whose manifests list a page under this key
    cached: bool                # the key-only cache keeps a page under it


@dataclass
class PrefixReport:
    space: str
    page_size_tokens: int
    pages: list[PrefixPage]
    found: int                  # leading pages the store holds (what longest_prefix gives)


def prefix_report(session: str, tokens: Sequence[int] | None = None, *, most: int = 3) -> PrefixReport:
    """``pffs prefix``: who holds the full pages of *session*'s first sequence with tokens
    (or of *tokens*, keyed in the namespace of *session*'s manifest), at most *most*
    holders named a page."""
    place = target(session)
    try:
        with open(os.path.join(session, mf.MANIFEST_NAME), "rb") as f:
            m = mf.parse(f.read(mf.MAX_MANIFEST_BYTES + 1))
    except OSError as e:
        raise PffsError(f"{session}: no readable manifest.json ({e.strerror})") from None
    except mf.ManifestError as e:
        raise PffsError(f"{session}: manifest.json is not valid ({e})") from None
    space = key_namespace(m.model, m.dtype, m.n_layers, m.n_heads, m.head_dim, m.page_size_tokens,
                          m.kv, m.layout, m.attention)
    if tokens is None:
        seq = next((s for s in m.logical_seqs if s.token_ids), None)
        tokens = seq.token_ids if seq is not None and not m.extra.get(INPUTS_FIELD) else []
    keys = chain_keys(tokens or [], m.page_size_tokens)
    conn = open_namespace(place.mount)
    try:
        conn.execute("BEGIN")
        pages = []
        for i, key in enumerate(keys):
            held = prefix_index.holders(conn, space, key)
            names = [os.path.dirname(path_of(conn, ino)) or "/" for ino, _ in held[:most]]
            if len(held) > most:
                names.append(f"(+{len(held) - most} more)")
            hit = prefix_index.find(conn, space, [key])
            pages.append(PrefixPage(i, key, names, bool(hit) and hit[0][1]))
        found = len(prefix_index.find(conn, space, keys))
        conn.execute("COMMIT")
    finally:
        conn.close()
    if found < len(keys):       # (what other mounts of the bucket keyed, adopted here)
        with PrefixIndex(place.mount) as index:
            more = index._from_bucket(space, keys[found:])
        for p in pages[found:found + len(more)]:
            p.holders, p.cached = ["(another mount, through the bucket)"], True
        found += len(more)
    return PrefixReport(space, m.page_size_tokens, pages, found)


def read_tokens(tokens_file: str) -> list[int]:
    """The JSON list of token ids in *tokens_file* (PffsError saying why not)."""
    import json
    try:
        with open(tokens_file) as f:
            tokens = json.load(f)
    except (OSError, ValueError) as e:
        raise PffsError(f"{tokens_file}: not a readable JSON list of token ids ({e})") from None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise PffsError(f"{tokens_file}: not a JSON list of token ids")
    return tokens


def prefix_command(session: str, tokens_file: str | None, as_json: bool, out=print) -> int:
    """``pffs prefix SESSION [--tokens FILE] [--json]``: print :func:`prefix_report`."""
    import json
    tokens = None if tokens_file is None else read_tokens(tokens_file)
    r = prefix_report(session, tokens)
    if as_json:
        out(json.dumps({"namespace": r.space, "page_size_tokens": r.page_size_tokens, "found": r.found,
                        "pages": [vars(p) for p in r.pages]}, indent=2))
        return 0
    out(f"namespace {r.space[:16]}: {len(r.pages)} full pages of {r.page_size_tokens} tokens keyed,"
        f" the store holds the first {r.found}")
    for p in r.pages:
        who = ", ".join(p.holders) + (" (key-only cache)" if p.cached else "")
        out(f"{p.index:6d}  {p.key[:16]}  {who or '-'}")
    return 0


def add_arguments(s) -> None:
    """``pffs prefix``'s arguments (pffs.cli's parser)."""
    s.add_argument("session", help="a session in a mounted pffs: its first sequence with token_ids")
    s.add_argument("--tokens", metavar="FILE", help="a JSON list of token ids to look up instead, in"
                   " the key namespace of SESSION's model and geometry")
    s.add_argument("--json", action="store_true", help="print JSON (full keys)")
    s.set_defaults(func=lambda args: prefix_command(args.session, args.tokens, args.json))
