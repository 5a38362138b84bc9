"""Page out and page in: between an engine's KV pool and a session (contract §5).

Page out gathers each distinct block of the given sequences into staging,
zeroes the unused token slots of partly filled last pages, hands the bytes to
a sink (which hashes and stores them), then writes manifest.json and commits
the whole session at once.

Page in checks the manifest against the pool (geometry, dtype, layout, kv
conventions, model), checks that every listed page is there with the right
size, verifies each needed page's sha256, and only then allocates blocks
and scatters the bytes into them.  A refusal leaves the pool tensors and the
allocator exactly as they were.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from engine_bridge.core.pool import DEFAULT_KV, BlockAllocator, BlockId, KVPool
from engine_bridge.core.staging import DEFAULT_STAGING_BYTES, Staging, batches
from engine_bridge.errors import (
    DamagedPage,
    DigestMismatch,
    IncompleteSession,
    InvalidSession,
    MismatchError,
    ModelMismatch,
    NoFreeBlocks,
    PageOutError,
    SourceChanged,
    Unfingerprinted,
    WrongSizePage,
)
from engine_bridge.transport.choose import as_page_sink, as_sink, as_source
from engine_bridge.transport.session_io import PageSink, SessionSource, SinkLike, SourceLike
from pffs.manifest import LAYOUTS as PAGE_LAYOUTS
from pffs.manifest import LogicalSeq, Manifest, ManifestError, parse, plain_scales
from pffs.types import Digest, digest_of

#: The page-byte layouts this bridge reads and writes.
SUPPORTED_LAYOUTS = ("paged-batchinvariant-v1",)
assert all(name in PAGE_LAYOUTS for name in SUPPORTED_LAYOUTS)

#: Pages of this many bytes and more are paged in on io_workers threads,
#: smaller ones on one (Bridge.page_in_workers).  Page-in from a store,
#: one thread against two: 144 KiB pages 971 against 598 MB/s, 256 KiB 1,078
#: against 867, 512 KiB 1,095 against 1,215, 2 MiB 1,119 against 2,357.
PAGE_IN_THREADS_FROM = 512 << 10
_PLACEHOLDER = Digest("sha256:" + "0" * 64)


@dataclass
class SeqBlocks:
    """One logical sequence as an engine holds it.

    ``block_ids[i]`` holds tokens ``i*block_size ..``; the last block holds
    the remaining ``n_tokens`` (so ``len(block_ids) == ceil(n_tokens /
    block_size)``).  ``token_ids``, when known, are the ``n_tokens`` tokens
    whose KV the blocks hold.
    """

    id: str
    block_ids: list[BlockId]
    n_tokens: int
    token_ids: list[int] | None = None


@dataclass
class PageInResult:
    """What a page-in built: the sequences (on new blocks) and the blocks taken.

    Each block in ``blocks`` was allocated once and holds one reference; a
    page shared by several sequences is one block appearing in each of them,
    so an engine that counts references adds the extra ones when it adopts
    the sequences.
    """

    seqs: list[SeqBlocks]
    blocks: list[BlockId]
    manifest: Manifest


def _kv_norm(kv: dict[str, Any] | None) -> dict[str, Any]:
    # (scales null and scales all 1.0 are one convention: values not scaled)
    out = {**DEFAULT_KV, **(kv or {})}
    out["scales"] = plain_scales(out["scales"])
    return out


def check_manifest(manifest: Manifest, geometry: dict[str, Any], kv: dict[str, Any] | None,
                   model: dict[str, Any] | None, *, force: bool = False,
                   trust_unfingerprinted: bool = False) -> None:
    """Refuse a manifest whose pages mean something else in a pool of *geometry*.

    Geometry, dtype, page layout and kv conventions must match; the model
    identity must match where both sides give a field (``force`` skips only
    that check).  A session without ``model.weights_sha256`` goes into an
    engine that has one only with *trust_unfingerprinted* (or ``force``):
    nothing says which weights wrote it.  A manifest without ``kv`` is taken
    to follow :data:`~engine_bridge.core.pool.DEFAULT_KV`.  Attention comes
    first: an MLA page (one latent vector a token) is no K/V page of any geometry.
    """
    mine_att = geometry.get("attention", "mha")
    if manifest.attention != mine_att:
        raise MismatchError("attention", manifest.attention, mine_att)
    for key in ("page_size_tokens", "n_layers", "n_heads", "head_dim", "dtype"):
        if getattr(manifest, key) != geometry[key]:
            raise MismatchError(key, getattr(manifest, key), geometry[key])
    if manifest.layout not in SUPPORTED_LAYOUTS:
        raise MismatchError("layout", manifest.layout, SUPPORTED_LAYOUTS[0])
    mine, theirs = _kv_norm(kv), _kv_norm(manifest.kv)
    for key in sorted(mine.keys() | theirs.keys()):
        if mine.get(key) != theirs.get(key):
            raise MismatchError(f"kv.{key}", theirs.get(key), mine.get(key))
    if force or not model:
        return
    saved = manifest.model or {}
    # The weights first: they say the most about which model wrote the pages.
    for key in sorted(saved.keys() & model.keys(), key=lambda k: (k != "weights_sha256", k)):
        a, b = saved[key], model[key]
        if a is not None and b is not None and a != b:
            raise ModelMismatch(f"model.{key}", a, b)
    if model.get("weights_sha256") and not saved.get("weights_sha256") \
            and not trust_unfingerprinted:
        raise Unfingerprinted(model["weights_sha256"])


def read_manifest(source: SessionSource) -> Manifest:
    """Parse a source's manifest.json (InvalidSession / layout MismatchError)."""
    try:
        data = source.read_manifest()
    except FileNotFoundError:
        raise InvalidSession("no manifest.json") from None
    except OSError as e:
        raise InvalidSession(f"manifest.json: {e.strerror or e}") from None
    try:
        return parse(data)
    except ManifestError as e:
        if e.field == "layout":
            raise MismatchError("layout", json.loads(data).get("layout"),
                                SUPPORTED_LAYOUTS[0]) from None
        raise InvalidSession(f"manifest.json: {e}") from None


def check_present(source: SessionSource, manifest: Manifest) -> None:
    """Refuse a session with a page missing or of the wrong size (IncompleteSession, WrongSizePage)."""
    # Completeness and sizes from metadata, where the source can tell them
    # (a page_size of None: it cannot without reading the page).
    missing, sizes = [], {}
    for ix in range(len(manifest.pages)):
        try:
            size = source.page_size(ix)
        except FileNotFoundError:
            missing.append(ix)
            continue
        if size is not None:
            sizes[ix] = size
    if missing:
        raise IncompleteSession(missing)
    want = manifest.page_bytes
    for ix, size in sizes.items():
        if size != want:
            raise WrongSizePage(ix, f"{size} bytes, the session's geometry makes pages of {want}")


class _GivenBlocks:
    """An allocator that hands out blocks an engine already allocated, in order.

    For engines (vLLM) whose scheduler picks the blocks a page-in fills;
    ``free`` gives nothing back: the blocks stay the engine's.
    """

    def __init__(self, blocks: Sequence[int]):
        self._blocks = [BlockId(int(b)) for b in blocks]

    def num_free(self) -> int:
        return len(self._blocks)

    def allocate(self, n: int) -> list[BlockId]:
        if n != len(self._blocks):
            raise NoFreeBlocks(n, len(self._blocks))
        return list(self._blocks)

    def free(self, blocks: Sequence[BlockId]) -> None:
        pass


class Bridge:
    """Moves pages between one engine's pool and sessions.

    *model* is the engine's model identity (``name``, ``revision``,
    ``config_sha256``, ``weights_sha256``: :mod:`engine_bridge.core.identity`),
    written into manifests and compared at page-in.
    The staging buffers are allocated once, grow up to *staging_bytes* of host
    memory whatever the session size, and are reused by every call.
    """

    def __init__(self, pool: KVPool, allocator: BlockAllocator | None = None, *,
                 engine_name: str = "engine", model: dict[str, Any] | None = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, io_workers: int | None = None):
        self.pool = pool
        self.allocator = allocator
        self.engine_name = engine_name
        self.model = dict(model) if model else None
        self.staging = Staging(pool.device, pool.page_bytes, staging_bytes)
        # Threads that hash and read or write page files (hashlib and file I/O release the GIL).
        self.io_workers = io_workers or max(1, min(4, os.cpu_count() or 1))
        self._lock = threading.Lock()
        self._rows = threading.local()  # (write_blocks_on: a gather row per thread)

    # ----------------------------------------------------------------- page out

    def plan(self, seqs: Sequence[SeqBlocks], *, include_token_ids: bool = True,
             extra: dict[str, Any] | None = None) -> tuple[Manifest, list[BlockId], list[int]]:
        """The manifest (digests still unset) and, per page, its block and used slots.

        A page is one (block, used token slots) pair: a block shared by
        several sequences with the same fill is one page, listed once.
        *extra* holds top-level manifest fields of the engine's own.
        """
        P = self.pool.block_size
        page_of: dict[tuple[int, int], int] = {}
        blocks: list[BlockId] = []
        used: list[int] = []
        lseqs: list[LogicalSeq] = []
        for s in seqs:
            n_pages = len(s.block_ids)
            if s.n_tokens < 0 or n_pages != -(-s.n_tokens // P):
                raise PageOutError(f"sequence {s.id!r}: {s.n_tokens} tokens need "
                                   f"{-(-max(s.n_tokens, 0) // P)} blocks of {P}, not {n_pages}")
            if n_pages and not (0 <= min(s.block_ids) and max(s.block_ids) < self.pool.num_blocks):
                raise PageOutError(f"sequence {s.id!r}: block ids outside 0..{self.pool.num_blocks - 1}")
            toks = None
            if include_token_ids and s.token_ids is not None:
                toks = [int(t) for t in s.token_ids]
                if len(toks) != s.n_tokens:
                    raise PageOutError(f"sequence {s.id!r}: {len(toks)} token ids for {s.n_tokens} tokens")
            last_used = s.n_tokens - (n_pages - 1) * P
            ixs = []
            for j, b in enumerate(s.block_ids):
                key = (int(b), P if j < n_pages - 1 else last_used)
                ix = page_of.get(key)
                if ix is None:
                    ix = page_of[key] = len(blocks)
                    blocks.append(BlockId(key[0]))
                    used.append(key[1])
                ixs.append(ix)
            lseqs.append(LogicalSeq(s.id, ixs, s.n_tokens % P, toks))
        manifest = Manifest(**self.pool.geometry, pages=[_PLACEHOLDER] * len(blocks),
                            logical_seqs=lseqs, layout=SUPPORTED_LAYOUTS[0], model=self.model,
                            kv=dict(self.pool.kv), engine=self.pool.engine_info(self.engine_name),
                            extra=dict(extra or {}))
        try:
            manifest.validate()
        except ManifestError as e:
            raise PageOutError(f"cannot describe these sequences: {e}") from None
        return manifest, blocks, used

    def page_out(self, seqs: Sequence[SeqBlocks], dest: SinkLike, *,
                 include_token_ids: bool = True, extra: dict[str, Any] | None = None) -> Manifest:
        """Write *seqs* as one session into *dest* (a sink or a directory path).

        The session appears complete or not at all; an existing name raises
        FileExistsError.  Returns the manifest written.
        """
        manifest, blocks, used = self.plan(seqs, include_token_ids=include_token_ids, extra=extra)
        sink = as_sink(dest)
        sink.expect_values(self.pool.itemsize)
        try:
            with self._lock:
                manifest.pages = self._write_pages(blocks, used, sink)
            sink.write_manifest(manifest.to_json())
            sink.commit()
        except BaseException:
            sink.abort()
            raise
        return manifest

    def write_blocks(self, blocks: list[BlockId], used: list[int], sink) -> list[Digest]:
        """Write the pages held in *blocks* (each with its *used* token slots,
        the rest written as zeros) to *sink* as pages 0, 1, ...: what a
        page-out does with a session's pages, for blocks the caller keeps
        pinned (a live snapshot's)."""
        sink = as_page_sink(sink)
        with self._lock:
            return self._write_pages(blocks, used, sink)

    def write_blocks_on(self, ex: ThreadPoolExecutor, blocks: list[BlockId], used: list[int],
                        sink) -> list[Digest]:
        """write_blocks for callers that overlap (a live agent answers several
        ``store`` requests at once): on a CPU pool, each page is gathered into
        a row of its thread's own and written on *ex*, whose threads the
        callers share, so that one call's pages keep the cores busy while
        another's last ones finish.  (write_blocks holds the staging, one call
        at a time, and its threads end with it: a core idled at the end of
        every call, and between calls, a fifth of a copy's time out of
        ``engines/`` at 8 pages a call.)  Elsewhere (a GPU pool gathers
        through the staging) write_blocks."""
        sink = as_page_sink(sink)
        if self.pool.device.type != "cpu" or not sink.concurrent:
            return self.write_blocks(blocks, used, sink)
        pool, P, mode = self.pool, self.pool.block_size, torch.is_inference_mode_enabled()

        def one(r: int) -> Digest:
            row = getattr(self._rows, "row", None)
            if row is None:
                row = self._rows.row = torch.empty((1, pool.page_bytes), dtype=torch.uint8)
            with torch.inference_mode(mode):
                pool.gather([blocks[r]], row)  # (a CPU pool: block ids as they are)
                if used[r] < P:
                    pool.zero_tail(row, 0, used[r])
            return sink.write_page(r, row.numpy()[0].data)
        futs = [ex.submit(one, r) for r in range(len(blocks))]
        wait(futs)
        return [f.result() for f in futs]

    def _write_pages(self, blocks: list[BlockId], used: list[int], sink: PageSink) -> list[Digest]:
        n = len(blocks)
        if not n:
            return []
        if self.pool.device.type == "cpu" and sink.concurrent:
            return self._write_pages_cpu(blocks, used, sink)
        st, pool, P = self.staging, self.pool, self.pool.block_size
        size = _batch_size(n, st.max_batch)
        st.reserve(size)
        jobs = list(batches(n, size))
        digests: list[Digest] = []

        def fetch(j: int, a: int, b: int) -> None:
            # Device side of batch j: gather, clear unused slots, start the copy out.
            half = j % 2
            with st.on_stream():
                buf = st.dev(half, b - a)
                pool.gather(pool.block_index(blocks[a:b]), buf)
                for r in range(a, b):
                    if used[r] < P:
                        pool.zero_tail(buf, r - a, used[r])
                st.to_host(half, b - a)
                st.mark(half)

        # Sinks that allow it get pages from several threads; others from one
        # writer thread, in order.  Either way writing batch j overlaps fetching j+1.
        workers = self.io_workers if sink.concurrent else 1
        ex = ThreadPoolExecutor(workers, thread_name_prefix="pffs-page-out")
        st.begin()
        try:
            fetch(*jobs[0])
            prev: list[Future] = []
            for k, (j, a, b) in enumerate(jobs):
                st.wait(j % 2)
                cur = [ex.submit(sink.write_page, r, st.host_row(j % 2, r - a).data)
                       for r in range(a, b)]
                # Batch j+1 goes into the half batch j-1 used: wait until it is written.
                digests.extend(f.result() for f in prev)
                if k + 1 < len(jobs):
                    fetch(*jobs[k + 1])
                prev = cur
            digests.extend(f.result() for f in prev)
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
            st.synchronize()
        return digests

    def _write_pages_cpu(self, blocks: list[BlockId], used: list[int], sink: PageSink) -> list[Digest]:
        # A CPU pool has no copy engine to overlap: each I/O thread gathers its
        # own page into a staging row of its own and hands it to the sink, so
        # the gathers run on every core beside the hashing and compressing.
        st, pool, P = self.staging, self.pool, self.pool.block_size
        k = max(1, min(self.io_workers, len(blocks), st.max_batch))
        st.reserve(k)
        rows = st.dev(0, k)
        free: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(k):
            free.put(i)

        mode = torch.is_inference_mode_enabled()  # (thread-local: the workers take the caller's)

        def one(r: int) -> Digest:
            i = free.get()
            try:
                with torch.inference_mode(mode):
                    out = rows[i:i + 1]
                    pool.gather([blocks[r]], out)  # (a CPU pool: block ids as they are)
                    if used[r] < P:
                        pool.zero_tail(out, 0, used[r])
                return sink.write_page(r, st.host_row(0, i).data)
            finally:
                free.put(i)
        with ThreadPoolExecutor(k, thread_name_prefix="pffs-page-out") as ex:
            return _run_each(ex, k, one, len(blocks))

    def read_page(self, seq: SeqBlocks, page_no: int) -> bytes:
        """The page bytes of page *page_no* of a live sequence (for live views)."""
        P = self.pool.block_size
        n_pages = len(seq.block_ids)
        if not 0 <= page_no < n_pages:
            raise IndexError(f"sequence {seq.id!r} has {n_pages} pages")
        fill = P if page_no < n_pages - 1 else seq.n_tokens - (n_pages - 1) * P
        st = self.staging
        with self._lock:
            st.reserve(1)
            st.begin()
            with st.on_stream():
                buf = st.dev(0, 1)
                self.pool.gather(self.pool.block_index([seq.block_ids[page_no]]), buf)
                if fill < P:
                    self.pool.zero_tail(buf, 0, fill)
                st.to_host(0, 1)
                st.mark(0)
            st.wait(0)
            st.synchronize()
            return bytes(st.host_row(0, 0))

    # ------------------------------------------------------------------ page in

    def check(self, manifest: Manifest, *, force: bool = False,
              trust_unfingerprinted: bool = False) -> None:
        """Refuse a manifest whose pages mean something else in this pool (see :func:`check_manifest`)."""
        check_manifest(manifest, self.pool.geometry, self.pool.kv, self.model, force=force,
                       trust_unfingerprinted=trust_unfingerprinted)

    def page_in(self, src: SourceLike, *, force: bool = False, trust_unfingerprinted: bool = False,
                accept: Callable[[Manifest], None] | None = None) -> PageInResult:
        """Load a complete session into freshly allocated blocks.

        *force* and *trust_unfingerprinted* are :func:`check_manifest`'s.
        *accept*, if given, sees the checked manifest before anything is
        allocated and may raise to refuse it (e.g. a sequence id already in
        use).  Raises a :class:`~engine_bridge.errors.PageInError` naming the
        reason; then no block is taken and the pool is untouched.
        """
        allocator = self.allocator
        if allocator is None:
            raise ValueError("this bridge has no allocator: it can page out only")
        source = as_source(src)
        manifest = read_manifest(source)
        self.check(manifest, force=force, trust_unfingerprinted=trust_unfingerprinted)
        if accept is not None:
            accept(manifest)
        needed = sorted({ix for s in manifest.logical_seqs for ix in s.page_ixs})
        check_present(source, manifest)
        free = allocator.num_free()
        if free < len(needed):
            raise NoFreeBlocks(len(needed), free)
        with self._lock:
            blocks = self._load(source, manifest, needed, allocator)
        block_of = dict(zip(needed, blocks))
        P = manifest.page_size_tokens
        seqs = [SeqBlocks(s.id, [block_of[ix] for ix in s.page_ixs], s.n_tokens(P),
                          None if s.token_ids is None else list(s.token_ids))
                for s in manifest.logical_seqs]
        return PageInResult(seqs, blocks, manifest)

    def load_into(self, src: SourceLike, page_ixs: Sequence[int], blocks: Sequence[int], *,
                  force: bool = False, trust_unfingerprinted: bool = False) -> Manifest:
        """Page pages *page_ixs* of a session into the given *blocks* (one each, in order).

        For an engine whose scheduler chose the blocks.  The manifest is
        checked as :meth:`page_in` checks it, and every page's size and
        sha256 before its bytes count; on a refusal the blocks' contents are
        unspecified (the engine must not use them) and nothing else changed.
        """
        if len(page_ixs) != len(blocks) or len(set(page_ixs)) != len(page_ixs):
            raise ValueError("load_into needs one block per page and distinct pages")
        source = as_source(src)
        manifest = read_manifest(source)
        self.check(manifest, force=force, trust_unfingerprinted=trust_unfingerprinted)
        if page_ixs and not (0 <= min(page_ixs) and max(page_ixs) < len(manifest.pages)):
            raise InvalidSession(f"pages {min(page_ixs)}..{max(page_ixs)} not in a session of "
                                 f"{len(manifest.pages)} pages")
        check_present(source, manifest)
        with self._lock:
            self._load(source, manifest, list(page_ixs), _GivenBlocks(blocks))
        return manifest

    def _read_verified(self, source: SessionSource, manifest: Manifest, ix: int,
                       row: np.ndarray, *, again: bool = False) -> None:
        # Fill a staging row with page ix and check its size and digest.
        want = len(row)
        got: Digest | None = None
        try:
            # A source reading the store's frames may check them itself (by the
            # name and crc32 a frame holds: pffs.codec), sparing the sha256 here.
            size, got = source.read_page_into_checked(ix, row.data)
        except FileNotFoundError:
            raise IncompleteSession([ix]) from None
        if size != want:
            raise WrongSizePage(ix, f"{size} bytes, the session's geometry makes pages of {want}")
        if got is None:
            got = digest_of(row)
        if got != manifest.pages[ix]:
            why = source.why_mismatch(ix)
            if why is not None:
                raise DamagedPage(ix, why)
            cls, what = (SourceChanged, "changed while being paged in: ") if again else (DigestMismatch, "")
            raise cls(ix, f"{what}its sha256 is {got}, manifest.json lists {manifest.pages[ix]}")

    def _load(self, source: SessionSource, manifest: Manifest, needed: list[int],
              allocator: BlockAllocator) -> list[BlockId]:
        n = len(needed)
        if not n:
            return []
        k = self.page_in_workers()
        ex = ThreadPoolExecutor(k, thread_name_prefix="pffs-page-in")
        try:
            if n <= self.staging.capacity:
                return self._load_held(source, manifest, needed, ex, k, allocator)
            return self._load_streamed(source, manifest, needed, ex, k, allocator)
        finally:
            ex.shutdown(wait=True, cancel_futures=True)

    def page_in_workers(self) -> int:
        """Threads a page-in reads and decodes on: ``io_workers``, or one for
        pages under PAGE_IN_THREADS_FROM bytes, whose decode is a dozen short
        calls that each let the GIL go and take it back: on two threads the
        hand-offs cost more than the second thread gives (docs/performance.md)."""
        return self.io_workers if self.pool.page_bytes >= PAGE_IN_THREADS_FROM else 1

    def _read_all(self, ex: ThreadPoolExecutor, k: int, tasks) -> None:
        # Run (source, manifest, ix, row, again) reads on k threads; raise the
        # first failure in page order once all have stopped touching staging.
        def one(r: int) -> None:
            t = tasks[r]
            self._read_verified(*t[:4], again=t[4])
        _run_each(ex, k, one, len(tasks))

    def _load_held(self, source, manifest, needed, ex, k: int, allocator: BlockAllocator) -> list[BlockId]:
        # Small enough to hold: read and verify everything, then allocate and write once.
        st, pool, n = self.staging, self.pool, len(needed)
        per_half = -(-n // 2)
        st.reserve(per_half)
        self._read_all(ex, k, [(source, manifest, ix, st.host_row(r // per_half, r % per_half), False)
                               for r, ix in enumerate(needed)])
        blocks = allocator.allocate(n)
        try:
            if pool.device.type == "cpu":
                # Each I/O thread scatters some of the pages: every core copies.
                mode = torch.is_inference_mode_enabled()  # (thread-local: the workers take the caller's)

                def put(r: int) -> None:
                    half, row = divmod(r, per_half)
                    with torch.inference_mode(mode):
                        pool.scatter([blocks[r]], st.dev(half, row + 1)[row:row + 1])
                _run_each(ex, k, put, n)
                return blocks
            st.begin()
            for j, a, b in batches(n, per_half):
                with st.on_stream():
                    st.to_device(j, b - a)
                    pool.scatter(pool.block_index(blocks[a:b]), st.dev(j, b - a))
            st.synchronize()
        except BaseException:
            st.synchronize()
            allocator.free(blocks)
            raise
        return blocks

    def _stream_cpu(self, source, manifest, needed, ex, workers: int,
                    allocator: BlockAllocator) -> list[BlockId]:
        # A CPU pool: each I/O thread reads, verifies and scatters pages one at
        # a time through a staging row of its own, so the copies into the pool
        # run on every core beside the decoding and hashing.
        st, pool, n = self.staging, self.pool, len(needed)
        k = max(1, min(workers, n, st.max_batch))
        rows = st.dev(0, k)
        free: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(k):
            free.put(i)
        blocks = allocator.allocate(n)
        mode = torch.is_inference_mode_enabled()  # (thread-local: the workers take the caller's)

        def one(r: int) -> None:
            i = free.get()
            try:
                self._read_verified(source, manifest, needed[r], st.host_row(0, i), again=True)
                with torch.inference_mode(mode):
                    pool.scatter([blocks[r]], rows[i:i + 1])
            finally:
                free.put(i)
        try:
            _run_each(ex, k, one, n)
        except BaseException:
            # As below: the blocks go back free; their old, unused contents are not restored.
            allocator.free(blocks)
            raise
        return blocks

    def _load_streamed(self, source, manifest, needed, ex, workers: int,
                       allocator: BlockAllocator) -> list[BlockId]:
        # Larger than staging: verify every page first (from the source's own
        # digests where it gives them, else by reading it), then allocate and
        # stream read -> verify -> scatter, reading batch j+1 while batch j is
        # scattered.  The bytes scattered are always the bytes just hashed.
        st, pool, n = self.staging, self.pool, len(needed)
        st.reserve(st.max_batch)
        unknown = []
        for ix in needed:
            known = source.page_digest(ix)
            if known is None:
                unknown.append(ix)
            elif known != manifest.pages[ix]:
                raise DigestMismatch(ix, f"its sha256 is {known}, manifest.json lists {manifest.pages[ix]}")
        for _, a, b in batches(len(unknown), st.capacity):
            self._read_all(ex, workers, [(source, manifest, unknown[r],
                                          st.host_row((r - a) % 2, (r - a) // 2), False)
                                         for r in range(a, b)])

        if pool.device.type == "cpu":
            return self._stream_cpu(source, manifest, needed, ex, workers, allocator)
        jobs = list(batches(n, st.max_batch))

        def read(j: int, a: int, b: int) -> list[Future]:
            return [ex.submit(self._read_verified, source, manifest, needed[r],
                              st.host_row(j % 2, r - a), again=True) for r in range(a, b)]

        blocks = allocator.allocate(n)
        futs: list[Future] = []
        try:
            st.begin()
            futs = read(*jobs[0])
            for k, (j, a, b) in enumerate(jobs):
                wait(futs)
                for f in futs:
                    f.result()
                if k + 1 < len(jobs):
                    st.wait((j + 1) % 2)  # the copy out of that half (batch j-1) is done
                    futs = read(*jobs[k + 1])
                else:
                    futs = []
                with st.on_stream():
                    st.to_device(j % 2, b - a)
                    pool.scatter(pool.block_index(blocks[a:b]), st.dev(j % 2, b - a))
                    st.mark(j % 2)
            st.synchronize()
        except BaseException:
            # Only a source changing under us (or failing to read) gets here:
            # the blocks go back free; their old, unused contents are not restored.
            wait(futs)
            st.synchronize()
            allocator.free(blocks)
            raise
        return blocks


def _run_each(ex: ThreadPoolExecutor, k: int, fn: Callable[[int], Any], n: int) -> list:
    """``fn(r)`` for r in 0..n-1 on *k* tasks of *ex*, each taking the next r
    until none is left: their results in order, or, once every task has
    stopped, the failure of the first r that failed (a failure stops the
    tasks from taking more; every r before it was taken, so has run).

    One task a thread, not one a page: a future a page kept the caller's
    thread busy creating them, holding the GIL, for longer than a small
    page's decode takes (docs/performance.md)."""
    results: list = [None] * n
    errors: dict[int, BaseException] = {}
    taken = itertools.count()    # (next() on it is atomic)
    stop = threading.Event()

    def task() -> None:
        while not stop.is_set():
            r = next(taken)
            if r >= n:
                return
            try:
                results[r] = fn(r)
            except BaseException as e:
                errors[r] = e
                stop.set()
                return
    futs = [ex.submit(task) for _ in range(max(1, min(k, n)))]
    wait(futs)
    for f in futs:
        f.result()
    if errors:
        raise errors[min(errors)]
    return results


def _batch_size(n: int, max_batch: int) -> int:
    """Pages per batch: at most the staging half, and small enough to overlap."""
    return max(1, min(max_batch, -(-n // 4)))
