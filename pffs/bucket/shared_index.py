"""The token-chain index shared through the bucket: what one mount keys, any mount of
the bucket finds by the same tokens (SPEC §7, docs/s3.md "One index for every host").

Each mount's namespace keeps its own index (pffs.namespace.prefix_index).  A mount
of an S3 store also *publishes* every key it records, a session's pages as its
manifest takes its name and pages kept by key alone, as one small object::

    PREFIX/index/<namespace>/<key>      body: the page's digest ("sha256:<hex>")

written if absent (a conditional PUT), so two mounts publishing one key at once
agree on the first.  The keys one record makes in chain order (a manifest's, a
batch SGLang stores) are also published as *runs*, one object for up to
:data:`RUN_MAX` of them from each run's first key::

    PREFIX/runs/<namespace>/<first key>     body: "<key> <digest>" lines, in order

Publishing runs on threads of its own and never delays a request; a key or run
already published by this mount is not sent again.

A lookup whose local run stops short asks the bucket for the keys after it
(:func:`remote_run`): first the run published from its first key (one GET for a
prefix of up to RUN_MAX keys, then the run from the key after it, and so on);
the keys no run covers are asked for each at once (a GET each), the run ending
at the first key the bucket lacks; the pages found are adopted through the mount, which checks
their blobs are in ``blobs/`` (or here, :func:`stored`, where the mount cannot
adopt them).  An entry whose blob is gone is a miss, and is removed.  A bucket
that gives no answer within ``DEADLINE`` (50 ms) is a miss and is not asked again
for ``QUIET`` seconds, so an engine's requests wait on a dead bucket at most
50 ms once a second; one that answers has ``LIMIT`` (2 s) for the rest.  Misses are remembered for
``NEGATIVE_TTL`` seconds (a key asked for again and again by requests that
share a prefix costs one GET a window).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from pffs.errors import PffsError
from pffs.store.s3 import S3BlobStore
from pffs.types import Digest, is_digest

log = logging.getLogger(__name__)

INDEX = "index/"
#: How long a lookup waits for the bucket's first answer, in seconds.
DEADLINE = 0.05
#: How long the bucket's part of one lookup may take once it answers.
LIMIT = 2.0
#: After a lookup found the bucket silent, how long lookups do not ask it.
QUIET = 1.0
#: How long a key the bucket did not hold is not asked for again.
NEGATIVE_TTL = 2.0
#: GETs in flight at once (for every lookup of the process).
LOOKUP_THREADS = 32
#: Keys this mount remembers having published (not sent again).
PUBLISHED_MAX = 1 << 20
RUNS = "runs/"
#: Keys a run object holds at most (a 128-key lookup, SGLang's batch, is one GET).
RUN_MAX = 256
#: Runs one lookup reads one after another before asking for its other keys each.
RUN_GETS = 8


def object_key(space: str, key: str) -> str:
    return f"{INDEX}{space}/{key}"


def run_key(space: str, first: str) -> str:
    return f"{RUNS}{space}/{first}"


def run_body(pairs: Sequence[tuple[str, str]]) -> bytes:
    return "".join(f"{k} {d}\n" for k, d in pairs).encode("ascii")


def parse_run(body: bytes) -> list[tuple[str, Digest]]:
    """A run object's (key, digest) pairs; a malformed line ends it."""
    out = []
    for line in body.decode("ascii", "replace").splitlines():
        k, _, d = line.partition(" ")
        if len(k) != 64 or not is_digest(d):
            break
        out.append((k, Digest(d)))
    return out


class Publisher:
    """A mount's publishing of index entries into its bucket (threads of its own)."""

    def __init__(self, blobs: S3BlobStore, threads: int = 4):
        self.blobs = blobs
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pffs-index-publish")
        self._sent: OrderedDict[tuple, None] = OrderedDict()     # (space, key), (space, first, n)
        self._lock = threading.Lock()
        # (stats.json's "shared_index"): keys and runs waiting to be sent, entries this
        # mount wrote, keys the bucket had already, keys or runs not sent (the bucket failed).
        # Runs written are counted apart ("runs").
        self.counts = {"pending": 0, "published": 0, "present": 0, "failed": 0, "runs": 0}
        self._pending: set[Future] = set()

    def publish(self, space: str, pairs: Sequence[tuple[str, str]]) -> None:
        """Publish (key, digest) pairs of namespace *space*, in chain order where
        they are a chain's (they are also published as runs); returns at once."""
        pairs = [(k, d) for k, d in pairs if is_digest(d)]
        todo, runs = [], []
        with self._lock:
            for key, digest in pairs:
                if (space, key) in self._sent:
                    continue
                self._remember((space, key))
                todo.append((key, digest))
            if len(pairs) > 1:
                for i in range(0, len(pairs), RUN_MAX):
                    part = pairs[i:i + RUN_MAX]
                    if (space, part[0][0], len(part)) not in self._sent:
                        self._remember((space, part[0][0], len(part)))
                        runs.append(part)
        if not todo and not runs:
            return
        with self._lock:
            self.counts["pending"] += len(todo) + len(runs)
            # (a batch over every thread: a key is a request or two of its own)
            step = max(1, -(-len(todo) // self.threads))
            futs = [self._pool.submit(self._put, space, todo[i:i + step]) for i in range(0, len(todo), step)]
            futs += [self._pool.submit(self._put_run, space, part) for part in runs]
            self._pending.update(futs)
        for fut in futs:
            fut.add_done_callback(self._done)

    def _remember(self, what: tuple) -> None:
        self._sent[what] = None
        if len(self._sent) > PUBLISHED_MAX:
            self._sent.popitem(last=False)

    def _put_run(self, space: str, part: list[tuple[str, str]]) -> None:
        try:
            wrote = self.blobs.put_object(run_key(space, part[0][0]), run_body(part),
                                          if_absent=True, background=True)
            failed = None
        except PffsError as e:
            wrote, failed = False, str(e)
        with self._lock:
            self.counts["pending"] -= 1
            self.counts["runs"] += bool(wrote)
            if failed is not None:
                self.counts["failed"] += 1
                self._sent.pop((space, part[0][0], len(part)), None)
        if failed is not None:
            log.warning("shared index: a run of %d keys not published to %s (%s)", len(part),
                        self.blobs.url, failed)

    def _done(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _put(self, space: str, pairs: list[tuple[str, str]]) -> None:
        wrote, failed = 0, []
        for key, digest in pairs:
            try:
                if self.blobs.put_object(object_key(space, key), digest.encode("ascii"),
                                         if_absent=True, background=True):
                    wrote += 1
            except PffsError as e:
                failed.append((key, str(e)))
        with self._lock:
            self.counts["pending"] -= len(pairs)
            self.counts["published"] += wrote
            self.counts["present"] += len(pairs) - wrote - len(failed)
            self.counts["failed"] += len(failed)
            for key, _ in failed:       # (sent again by the next record of the key)
                self._sent.pop((space, key), None)
        if failed:
            log.warning("shared index: %d of %d keys not published to %s (%s)", len(failed), len(pairs),
                        self.blobs.url, failed[0][1])

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for every publish submitted so far (True when all ended in time)."""
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return True
        done, _ = wait(pending, timeout=timeout)
        return len(done) == len(pending)

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True, cancel_futures=True)


class _Lookups:
    """The bucket side of lookups in one process: threads, misses remembered, quiet time."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="pffs-index-lookup")
        self.lock = threading.Lock()
        self.missing: dict[tuple[str, str, str], float] = {}    # (bucket url, space, key) -> until
        self.quiet_until = 0.0
        self.requests = 0           # GETs and HEADs sent (tests count them)
        # (bucket url, space, key) -> the first key of the run a lookup found it in
        self.run_of: OrderedDict[tuple[str, str, str], str] = OrderedDict()

    def missed(self, url: str, space: str, key: str, now: float) -> bool:
        with self.lock:
            until = self.missing.get((url, space, key))
            if until is not None and until <= now:
                del self.missing[(url, space, key)]
                return False
            return until is not None

    def miss(self, url: str, space: str, key: str, now: float) -> None:
        with self.lock:
            if len(self.missing) > 100_000:
                self.missing = {k: t for k, t in self.missing.items() if t > now}
            self.missing[(url, space, key)] = now + NEGATIVE_TTL


_LOOKUPS = _Lookups()


def lookups() -> _Lookups:
    return _LOOKUPS


def _get(blobs: S3BlobStore, space: str, key: str) -> Digest | None:
    with _LOOKUPS.lock:
        _LOOKUPS.requests += 1
    got = blobs.get_object(object_key(space, key))
    if got is None:
        return None
    text = got[0].decode("ascii", "replace").strip()
    return Digest(text) if is_digest(text) else None


def _get_run(blobs: S3BlobStore, space: str, first: str) -> list[tuple[str, Digest]] | None:
    with _LOOKUPS.lock:
        _LOOKUPS.requests += 1
    got = blobs.get_object(run_key(space, first))
    return None if got is None else parse_run(got[0])


def remote_run(blobs: S3BlobStore, space: str, keys: Sequence[str], *, deadline: float = DEADLINE,
               limit: float = LIMIT, check_blobs: bool = True) -> list[tuple[str, Digest]]:
    """The leading run of *keys* that the bucket's shared index holds: [(key, digest)].

    The run published from the first key is asked for first (of three keys or
    more), then the one from the key after it, up to :data:`RUN_GETS` runs; the
    keys no run covers are asked for at once (GETs on :data:`LOOKUP_THREADS`
    threads).  A bucket that gives no answer within *deadline* seconds is a miss
    (and not asked again for :data:`QUIET` seconds); one that answers has *limit*
    seconds for the rest, what has not answered by then ending the run.
    *check_blobs*: each digest found is also checked to be in ``blobs/``
    (:func:`stored`); a caller that adopts the pages through the mount, which
    checks them itself, skips it.  Never raises for the bucket's faults."""
    now = time.monotonic()
    if not keys or now < _LOOKUPS.quiet_until:
        return []
    url = blobs.url
    ask = []
    for key in keys:
        if _LOOKUPS.missed(url, space, key, now):
            break
        ask.append(key)
    if not ask:
        return []
    out: list[tuple[str, Digest]] = []
    answered = False
    for _ in range(RUN_GETS if len(ask) > 2 else 0):
        first = ask[len(out)]
        if _LOOKUPS.missed(url, space, RUNS + first, now):
            break
        fut = _LOOKUPS.pool.submit(_get_run, blobs, space, first)
        try:
            run = fut.result(timeout=max(0.0, (now + deadline if not answered else now + limit)
                                         - time.monotonic()))
        except Exception:
            if answered:
                break
            return _silent(url, deadline)
        answered = True
        if run is None:
            _LOOKUPS.miss(url, space, RUNS + first, now)
            break
        before = len(out)
        for k, found in run:
            if len(out) == len(ask) or ask[len(out)] != k:
                break
            out.append((k, found))
        with _LOOKUPS.lock:
            for k, _ in out[before:]:
                _LOOKUPS.run_of[(url, space, k)] = first
            while len(_LOOKUPS.run_of) > PUBLISHED_MAX:
                _LOOKUPS.run_of.popitem(last=False)
        if len(out) == len(ask) or len(out) == before:
            break
    rest = ask[len(out):]
    if rest:
        futs = [_LOOKUPS.pool.submit(_get, blobs, space, k) for k in rest]
        if not answered:
            got, _ = wait(futs, timeout=deadline, return_when=FIRST_COMPLETED)
            if not got or all(f.exception() is not None for f in got):
                for f in futs:
                    f.cancel()
                return _silent(url, deadline)
        done, _ = wait(futs, timeout=max(0.0, now + limit - time.monotonic()))
        for k, f in zip(rest, futs):
            if f not in done or f.exception() is not None:
                break
            got_d = f.result()
            if got_d is None:
                _LOOKUPS.miss(url, space, k, now)
                break
            out.append((k, got_d))
        for f in futs:
            f.cancel()      # (GETs past a miss not yet sent)
    return stored(blobs, space, out, now + limit) if check_blobs else out


def _silent(url: str, deadline: float) -> list[tuple[str, Digest]]:
    _LOOKUPS.quiet_until = time.monotonic() + QUIET
    log.info("shared index: %s gave no answer in %.0f ms: lookups miss there for %.0f s",
             url, deadline * 1000, QUIET)
    return []


def stored(blobs: S3BlobStore, space: str, found: list[tuple[str, Digest]],
           end: float | None = None) -> list[tuple[str, Digest]]:
    """The leading run of *found* whose blobs the bucket stores (HEADs in parallel,
    until monotonic time *end*); an entry whose blob is gone is removed from the
    shared index."""
    if not found:
        return []
    fut = _LOOKUPS.pool.submit(blobs.lookup_many, [d for _, d in found])
    with _LOOKUPS.lock:
        _LOOKUPS.requests += len(found)
    try:
        rows = fut.result(timeout=None if end is None else max(0.0, end - time.monotonic()))
    except Exception:       # (late or failed: a miss, as any bucket fault here)
        return []
    out = []
    for key, d in found:
        if d not in rows:
            log.info("shared index: %s names %s, which %s no longer holds: entry removed",
                     key[:16], d, blobs.url)
            _LOOKUPS.pool.submit(_forget, blobs, space, key)
            break
        out.append((key, d))
    return out


def _forget(blobs: S3BlobStore, space: str, key: str) -> None:
    """Remove *key*'s entry, and the run it was found in (runs are not rewritten:
    its other keys are found each by its own entry until a run is published again)."""
    with _LOOKUPS.lock:
        first = _LOOKUPS.run_of.pop((blobs.url, space, key), None)
    try:
        blobs.delete_object(object_key(space, key))
        if first is not None:
            blobs.delete_object(run_key(space, first))
    except PffsError:
        pass
