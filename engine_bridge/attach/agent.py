"""The live-engine agent: attaches an engine to a mounted pffs (contract §3 engines/, §5).

Runs in the engine process.  It connects to the daemon's socket
(``STORE/engine.sock``, reached through ``MNT/.pffs/engine.sock``), registers
a name with the pool's geometry, dtype, layout and model identity, and shares
a staging buffer of page slots (a memfd, passed over the socket) so page
bytes never go through the socket.  Then one thread reads the daemon's
requests and a few workers serve them:

- ``list``: the engine's live sessions (each request it runs, and each
  session copied in, under the folder name it was copied as);
- ``snapshot``: between two steps, the session's token count and block
  list, each block pinned (an extra reference) until the daemon releases it;
- ``gather``: pinned blocks -> page bytes in staging slots (device ->
  staging -> shared memory), without the engine lock: the pinned blocks'
  slots below the fill never change, and slots past it are zeroed;
- ``store``: pinned blocks -> blobs in the mount's store, written by the
  bridge as its page-out writes them (for a copy out of ``engines/``: the
  daemon adopts and names them); refused where this process cannot use
  the store;
- ``page_in``: a complete session handed over in a memfd, paged in through
  the bridge between two steps (all checks, nothing allocated on refusal);
- ``save`` / ``load`` (``pffs fork`` out of and into ``engines/NAME``): a
  live session paged out to a path in the mount, or a session at a path
  paged in, by the bridge itself (the direct path where the store allows).

What an engine must provide is :class:`EngineAdapter`; the reference engine's
is :class:`ReferenceAdapter`.  ``python -m engine_bridge.attach.agent MNT --name N``
runs a reference engine attached as N (``--demo`` decodes a prompt,
``--control`` takes JSON commands on stdin, one per line).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch

from engine_bridge.attach.warm import WARM_BYTES, WarmPages
from engine_bridge.core.bridge import SUPPORTED_LAYOUTS, Bridge, SeqBlocks
from engine_bridge.core.pool import BlockId
from engine_bridge.errors import BridgeError, PageInError
from engine_bridge.transport.choose import as_source
from engine_bridge.transport.mountinfo import store_access
from engine_bridge.transport.session_io import SessionSource
from engine_bridge.transport.store_blobs import BlobSink, BlobSource
from pffs.live import protocol
from pffs.manifest import ManifestError
from pffs.types import Digest

log = logging.getLogger("engine_bridge.attach.agent")

DEFAULT_STAGING_BYTES = 64 << 20


class StepLock:
    """A first-come, first-served lock the engine holds across each step.

    The agent takes it between steps to pin or unpin blocks, list sequences
    and page sessions in; being FIFO, a busy engine loop that takes it again
    at once cannot starve the agent (a plain Lock gives no such promise).
    """

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._next = 0
        self._serving = 0

    def acquire(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while self._serving != ticket:
                self._cond.wait()

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self) -> "StepLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class EngineAdapter(Protocol):
    """What the agent needs from an engine.

    ``lock`` is held by the engine across every step and every other change
    to its sequences, blocks or allocator; the agent calls ``sequences``,
    ``pin``, ``unpin`` and ``page_in`` only while holding it.  ``pin`` adds a
    reference to blocks so they are neither freed nor reused until
    ``unpin``; an engine that writes into a sequence's partly filled last
    block may do so while it is pinned (only slots past the pinned fill
    change, and those are zeroed in the page bytes), or copy it on write.
    """

    bridge: Bridge
    lock: AbstractContextManager

    def sequences(self) -> list[SeqBlocks]: ...

    def pin(self, blocks: Sequence[BlockId]) -> None: ...

    def unpin(self, blocks: Sequence[BlockId]) -> None: ...

    def page_in(self, source: SessionSource) -> list[str]: ...


class ReferenceAdapter:
    """The reference engine's adapter: pins are allocator references.

    Step the engine through :meth:`step` (or hold ``lock`` around
    ``engine.step``).  A pinned, partly filled last block is copied on write
    by the engine's next step, so a snapshot costs that one block.
    """

    def __init__(self, engine, lock: AbstractContextManager | None = None):
        self.engine = engine
        self.bridge = engine.bridge
        self.lock = lock or StepLock()

    def sequences(self) -> list[SeqBlocks]:
        return self.engine.seq_blocks()

    def pin(self, blocks: Sequence[BlockId]) -> None:
        self.engine.allocator.incref(blocks)

    def unpin(self, blocks: Sequence[BlockId]) -> None:
        self.engine.allocator.free(blocks)

    def page_in(self, source: SessionSource) -> list[str]:
        return self.engine.page_in(source)

    def step(self, seq_ids=None):
        with self.lock:
            return self.engine.step(seq_ids)


class _ShmSource:
    """A session handed over by the daemon: page i at i*page_bytes of a memfd, then manifest.json."""

    def __init__(self, mm: mmap.mmap | bytes, sizes: list[int], page_bytes: int, manifest_len: int):
        self.mm = mm
        self.sizes = sizes
        self.pb = page_bytes
        self.manifest_at = len(sizes) * page_bytes
        self.manifest_len = manifest_len

    def read_manifest(self) -> bytes:
        return self.mm[self.manifest_at:self.manifest_at + self.manifest_len]

    def page_size(self, ix: int) -> int:
        if not 0 <= ix < len(self.sizes):
            raise FileNotFoundError(errno.ENOENT, "no such page", f"{ix:06d}")
        return self.sizes[ix]

    def read_page(self, ix: int) -> bytes:
        size = self.page_size(ix)
        if size != self.pb:
            raise FileNotFoundError(errno.ENOENT, "page of another size", f"{ix:06d}")
        return self.mm[ix * self.pb:(ix + 1) * self.pb]

    def read_page_into(self, ix: int, out: memoryview) -> int:
        size = self.page_size(ix)
        if size != len(out) or size != self.pb:
            return size
        with memoryview(self.mm) as view:
            memoryview(out).cast("B")[:] = view[ix * self.pb:(ix + 1) * self.pb]
        return size

    def page_digest(self, ix: int) -> Digest | None:
        return None


class _Snap:
    """A pinned snapshot: per page, its block and used token slots; the blocks pinned."""

    __slots__ = ("blocks", "used", "pinned", "event")

    def __init__(self, blocks: list[BlockId], used: list[int], pinned: list[BlockId], event):
        self.blocks, self.used, self.pinned, self.event = blocks, used, pinned, event


def socket_path(where: str | os.PathLike) -> Path:
    """The engine socket for a mount point (its ``.pffs/engine.sock``) or a socket path."""
    p = Path(where)
    return p / ".pffs" / "engine.sock" if p.is_dir() else p


class Agent:
    """One engine attached to one mount under *name*.

    ``attach()`` raises :class:`pffs.live.protocol.Refused` (``.errno``:
    EEXIST for a taken name, EACCES for a uid the daemon refuses, EINVAL
    for a registration it cannot use) or OSError when it cannot connect.
    """

    def __init__(self, adapter: EngineAdapter, where: str | os.PathLike, name: str, *,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, workers: int = 2,
                 on_detach: Callable[["Agent"], None] | None = None, warm_bytes: int = WARM_BYTES):
        self.adapter = adapter
        self.bridge = adapter.bridge
        self.pool = adapter.bridge.pool
        self.path = socket_path(where)
        # The mount (where the socket is MNT/.pffs/engine.sock): its store, for pages stored directly.
        self.mount = Path(where) if Path(where).is_dir() else self.path.parent.parent
        self.name = name
        self.on_detach = on_detach
        pb = self.pool.page_bytes
        self.slots = max(2, staging_bytes // pb)
        self.groups: dict[str, list[str]] = {}   # sessions copied in: folder name -> sequence ids
        self._snaps: dict[int, _Snap] = {}
        self._next_snap = 1
        self._snap_lock = threading.Lock()
        self._workers = workers
        self._chan: protocol.Channel | None = None
        self._reader: threading.Thread | None = None
        self._pool_ex: ThreadPoolExecutor | None = None
        self._store_ex: ThreadPoolExecutor | None = None    # (the store requests' pages, shared)
        self.attached = threading.Event()
        self.detached = threading.Event()
        self._closing = False
        self._memfd = -1
        self._mm: mmap.mmap | None = None
        self._host: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None
        self._registered_host = False
        #: pages of sessions being copied in, decoded ahead of their load
        #: (engine_bridge.attach.warm; *warm_bytes* 0: none)
        self.warm = WarmPages(warm_bytes, pb)

    # -- lifecycle -------------------------------------------------------------

    @property
    def snapshots_pinned(self) -> int:
        """Snapshots the daemon holds pinned in this engine now (released
        once its readers are done with them)."""
        with self._snap_lock:
            return len(self._snaps)

    def _make_staging(self) -> None:
        pb, n = self.pool.page_bytes, self.slots
        fd = os.memfd_create(f"pffs-staging-{self.name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, n * pb)
            # The daemon maps it: it must never shrink under it.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._mm = mmap.mmap(fd, n * pb, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._memfd = fd
        self._host = torch.frombuffer(self._mm, dtype=torch.uint8, count=n * pb).view(n, pb)
        if self.pool.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.pool.device)
            # Page-locked, so device -> staging copies are DMA straight into shared memory.
            try:
                rc = torch.cuda.cudart().cudaHostRegister(self._host.data_ptr(), n * pb, 0)
                self._registered_host = int(rc) == 0
            except (RuntimeError, AttributeError, TypeError):
                self._registered_host = False

    def _info(self) -> dict[str, Any]:
        pool, bridge = self.pool, self.bridge
        return {"name": self.name, "pid": os.getpid(), "geometry": pool.geometry,
                "page_bytes": pool.page_bytes, "slots": self.slots, "num_blocks": pool.num_blocks,
                "layout": SUPPORTED_LAYOUTS[0], "model": bridge.model, "kv": pool.kv,
                "engine": pool.engine_info(bridge.engine_name), "warms": self.warm.limit > 0, "stores": True}

    def attach(self) -> "Agent":
        """Connect, register and start serving; returns self."""
        self._make_staging()
        try:
            sock = protocol.connect(self.path)
            chan = protocol.Channel(sock)
            try:
                protocol.register(chan, self._info(), self._memfd)
            except BaseException:
                chan.close()
                raise
        except BaseException:
            self._free_staging()
            raise
        self._chan = chan
        self._pool_ex = ex = ThreadPoolExecutor(self._workers, thread_name_prefix=f"pffs-agent-{self.name}")
        self._store_ex = ThreadPoolExecutor(self.bridge.io_workers, thread_name_prefix=f"pffs-store-{self.name}")
        self.attached.set()
        self._reader = threading.Thread(target=self._serve, args=(chan, ex), name=f"pffs-agent-{self.name}",
                                        daemon=True)
        self._reader.start()
        log.info("attached to %s as %s (%d staging slots of %d bytes)", self.path, self.name,
                 self.slots, self.pool.page_bytes)
        return self

    def detach(self) -> None:
        """Leave: the engine's folder disappears from the mount; pins are dropped."""
        if self._chan is None or self.detached.is_set():
            return
        self._closing = True
        try:
            self._chan.send({"op": "bye"})
        except OSError:
            pass
        self._chan.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(10)

    def __enter__(self) -> "Agent":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _serve(self, chan: protocol.Channel, ex: ThreadPoolExecutor) -> None:
        try:
            while True:
                try:
                    got = chan.recv()
                except (OSError, protocol.ProtocolError) as e:
                    if not self._closing:
                        log.warning("connection to the daemon failed: %s", e)
                    break
                if got is None:
                    break
                msg, fds = got
                op = msg.get("op")
                if op == "release":
                    protocol.close_fds(fds)
                    self._release(msg.get("snap"))
                    continue
                if op == "warm":    # (no answer: a hint)
                    protocol.close_fds(fds)
                    mount, blobs = msg.get("mount"), msg.get("blobs")
                    if isinstance(mount, str) and os.path.isabs(mount) and isinstance(blobs, list) \
                            and all(isinstance(b, str) for b in blobs):
                        self.warm.want(mount, blobs)
                    continue
                ex.submit(self._answer, chan, msg, fds)
        finally:
            self._shutdown(chan, ex)

    def _shutdown(self, chan: protocol.Channel, ex: ThreadPoolExecutor) -> None:
        ex.shutdown(wait=True)
        if self._store_ex is not None:
            self._store_ex.shutdown(wait=True)
        self.warm.stop()
        with self.adapter.lock:
            with self._snap_lock:
                snaps, self._snaps = list(self._snaps.values()), {}
            for s in snaps:
                self.adapter.unpin(s.pinned)
        chan.close()
        self._free_staging()
        if not self._closing:
            log.warning("the daemon closed the connection; engine %s is detached", self.name)
        self.detached.set()
        if self.on_detach is not None:
            self.on_detach(self)

    def _free_staging(self) -> None:
        if self._registered_host and self._host is not None:  # (registered only once _host is set)
            torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())
            self._registered_host = False
        self._host = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None
        if self._memfd >= 0:
            os.close(self._memfd)
            self._memfd = -1

    # -- requests ---------------------------------------------------------------

    def _answer(self, chan: protocol.Channel, msg: dict[str, Any], fds: list[int]) -> None:
        rid, op = msg.get("id"), msg.get("op")
        try:
            handlers = {"list": self._list, "snapshot": self._snapshot, "gather": self._gather,
                        "page_in": self._page_in, "load_blobs": self._load_blobs, "save": self._save,
                        "load": self._load, "store": self._store}
            fn = handlers.get(op) if op is not None else None
            if fn is None:
                raise protocol.Refused(errno.EINVAL, f"unknown request {op!r}")
            reply = {"re": rid, "ok": True, **fn(msg, fds)}
        except PageInError as e:
            reply = {"re": rid, "ok": False, "errno": e.errno, "error": str(e)}
        except protocol.Refused as e:
            reply = {"re": rid, "ok": False, "errno": e.errno, "error": str(e)}
        except BridgeError as e:
            reply = {"re": rid, "ok": False, "errno": e.errno, "error": str(e)}
        except OSError as e:
            reply = {"re": rid, "ok": False, "errno": e.errno or errno.EIO,
                     "error": f"{e.strerror or e}: {e.filename}" if e.filename else str(e)}
        except Exception as e:
            log.exception("serving %s for the daemon", op)
            reply = {"re": rid, "ok": False, "errno": errno.EIO, "error": f"{type(e).__name__}: {e}"}
        finally:
            protocol.close_fds(fds)
        try:
            chan.send(reply)
        except OSError:
            pass

    def _session_names(self, seqs: list[SeqBlocks]) -> list[str]:
        live = {s.id for s in seqs}
        for name in list(self.groups):
            ids = [i for i in self.groups[name] if i in live]
            if ids:
                self.groups[name] = ids
            else:
                del self.groups[name]
        grouped = {i for ids in self.groups.values() for i in ids}
        names = list(self.groups)
        names += [s.id for s in seqs if s.id not in grouped and s.id not in self.groups]
        return names

    def _list(self, msg, fds) -> dict[str, Any]:
        with self.adapter.lock:
            return {"sessions": self._session_names(self.adapter.sequences())}

    def _chosen(self, name) -> list[SeqBlocks]:
        """The sequences of live session *name* (hold the adapter's lock)."""
        seqs = self.adapter.sequences()
        self._session_names(seqs)
        by_id = {s.id: s for s in seqs}
        if name in self.groups:
            return [by_id[i] for i in self.groups[name]]
        if name in by_id:
            return [by_id[name]]
        raise protocol.Refused(errno.ENOENT, f"no live session {name!r}")

    def _snapshot(self, msg, fds) -> dict[str, Any]:
        name = msg.get("session")
        with self.adapter.lock:
            chosen = self._chosen(name)
            manifest, blocks, used = self.bridge.plan(chosen)
            pinned = sorted(set(blocks))
            self.adapter.pin(pinned)
            event = None
            if self._stream is not None:
                # Gathers wait for everything the engine queued before this point.
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.pool.device))
            with self._snap_lock:
                sid = self._next_snap
                self._next_snap += 1
                self._snaps[sid] = _Snap(blocks, used, pinned, event)
        return {"snap": sid, "manifest": manifest.to_json().decode(), "n_pages": len(blocks)}

    def _release(self, sid) -> None:
        with self._snap_lock:
            snap = self._snaps.pop(sid, None)
        if snap is not None:
            with self.adapter.lock:
                self.adapter.unpin(snap.pinned)

    def _gather(self, msg, fds) -> dict[str, Any]:
        with self._snap_lock:
            snap = self._snaps.get(msg.get("snap"))
        if snap is None:
            raise protocol.Refused(errno.ENOENT, "no such snapshot")
        pages = sorted((int(slot), int(ix)) for ix, slot in msg.get("pages", []))
        n_pages, pool, P = len(snap.blocks), self.pool, self.pool.block_size
        for slot, ix in pages:
            if not (0 <= ix < n_pages and 0 <= slot < self.slots):
                raise protocol.Refused(errno.EINVAL, f"page {ix} / slot {slot} out of range")
        # Runs of consecutive slots are gathered in one go, straight into staging on a CPU pool.
        runs: list[list[tuple[int, int]]] = []
        for slot, ix in pages:
            if runs and runs[-1][-1][0] == slot - 1:
                runs[-1].append((slot, ix))
            else:
                runs.append([(slot, ix)])
        host = self._host
        assert host is not None  # staging lives from attach() until every request has been answered
        if self._stream is None:
            for run in runs:
                out = host[run[0][0]:run[-1][0] + 1]
                pool.gather(pool.block_index([snap.blocks[ix] for _, ix in run]), out)
                for r, (_, ix) in enumerate(run):
                    if snap.used[ix] < P:
                        pool.zero_tail(out, r, snap.used[ix])
            return {}
        with torch.cuda.stream(self._stream):
            if snap.event is not None:
                self._stream.wait_event(snap.event)
            for run in runs:
                dev = torch.empty((len(run), pool.page_bytes), dtype=torch.uint8, device=pool.device)
                pool.gather(pool.block_index([snap.blocks[ix] for _, ix in run]), dev)
                for r, (_, ix) in enumerate(run):
                    if snap.used[ix] < P:
                        pool.zero_tail(dev, r, snap.used[ix])
                host[run[0][0]:run[-1][0] + 1].copy_(dev, non_blocking=self._registered_host)
        self._stream.synchronize()
        return {}

    def _store(self, msg, fds) -> dict[str, Any]:
        """Store pages of a pinned snapshot as blobs straight into the mount's
        (local) store, as a page-out writes them: for a copy out of engines/,
        which the daemon then names (it adopts the blobs).  Refused
        (EOPNOTSUPP) where this process cannot use the store: the daemon then
        stores the pages itself from staging."""
        with self._snap_lock:
            snap = self._snaps.get(msg.get("snap"))
        if snap is None:
            raise protocol.Refused(errno.ENOENT, "no such snapshot")
        ixs = msg.get("pages")
        if not isinstance(ixs, list) or not all(isinstance(ix, int) and 0 <= ix < len(snap.blocks)
                                                for ix in ixs):
            raise protocol.Refused(errno.EINVAL, "pages out of range")
        access = store_access(self.mount)
        if access is None or access.bucket is not None:
            raise protocol.Refused(errno.EOPNOTSUPP, "this engine cannot store pages in the mount's store")
        if snap.event is not None:
            snap.event.synchronize()    # (what the engine queued before the snapshot wrote its blocks)
        sink = BlobSink(access)
        ex = self._store_ex
        if ex is None:
            raise protocol.Refused(errno.ESHUTDOWN, "the agent is detaching")
        self.bridge.write_blocks_on(ex, [snap.blocks[ix] for ix in ixs], [snap.used[ix] for ix in ixs], sink)
        return {"rows": [[ix, *sink.rows[i]] for i, ix in enumerate(ixs)]}

    def _save(self, msg, fds) -> dict[str, Any]:
        """Page a live session out as a session at *path* (in the mount: by the
        direct path where it can), its blocks pinned meanwhile, not the engine
        paused."""
        name, path = msg.get("session"), msg.get("path")
        if not isinstance(path, str) or not os.path.isabs(path):
            raise protocol.Refused(errno.EINVAL, "a save needs an absolute path")
        with self.adapter.lock:
            chosen = self._chosen(name)
            pinned = sorted({b for s in chosen for b in s.block_ids})
            self.adapter.pin(pinned)
            if self.pool.device.type == "cuda":
                # What the engine queued before this point has written those blocks.
                torch.cuda.current_stream(self.pool.device).synchronize()
        try:
            m = self.bridge.page_out(chosen, path)
        finally:
            with self.adapter.lock:
                self.adapter.unpin(pinned)
        log.info("saved %s as %s (%d pages)", name, path, len(m.pages))
        return {"pages": len(m.pages)}

    def _load(self, msg, fds) -> dict[str, Any]:
        """Page the session at *path* in as live session *name*, between two steps."""
        name, path = msg.get("name"), msg.get("path")
        if not isinstance(name, str) or not isinstance(path, str) or not os.path.isabs(path):
            raise protocol.Refused(errno.EINVAL, "a load needs a name and an absolute path")
        with self.adapter.lock:
            if name in self._session_names(self.adapter.sequences()):
                raise protocol.Refused(errno.EEXIST, f"engine {self.name} has a session {name!r}")
            ids = self.adapter.page_in(as_source(path))
            self._group(name, ids)
        log.info("loaded %s as %s: sequences %s", path, name, ", ".join(ids))
        return {"seqs": ids}

    def _group(self, name: str, ids: list[str]) -> None:
        # These ids now name the new sequences, whatever group they were in.
        for group in list(self.groups):
            left = [i for i in self.groups[group] if i not in ids]
            if left:
                self.groups[group] = left
            else:
                del self.groups[group]
        self.groups[name] = list(ids)

    def _load_blobs(self, msg, fds) -> dict[str, Any]:
        """A session copied into the engine's folder whose pages are all blobs of
        the mount's store: read them from the store (the direct path), as a
        page-in of the session's manifest (in the memfd) would."""
        name, mount = msg.get("name"), msg.get("mount")
        sizes = [int(s) for s in msg.get("sizes", [])]
        mlen = int(msg.get("manifest_bytes", 0))
        if len(fds) != 1 or mlen <= 0 or not isinstance(name, str) or not isinstance(mount, str):
            raise protocol.Refused(errno.EINVAL, "a load_blobs needs a name, a mount, and the manifest in a memfd")
        access = store_access(mount) if os.path.isabs(mount) else None
        if access is None:
            raise protocol.Refused(errno.ENOTSUP, "this engine cannot read the mount's store directly")
        manifest = os.pread(fds[0], mlen, 0)
        try:
            source = BlobSource(manifest, sizes, access, warm=self.warm)
        except ManifestError as e:
            self.warm.clear()
            raise protocol.Refused(errno.EINVAL, f"manifest.json: {e}") from None
        self.warm.freeze()
        try:
            with self.adapter.lock:
                ids = self.adapter.page_in(source)
                self._group(name, ids)
        finally:
            self.warm.clear()
        log.info("paged in %s from the store: sequences %s", name, ", ".join(ids))
        return {"seqs": ids}

    def _page_in(self, msg, fds) -> dict[str, Any]:
        name = msg.get("name")
        sizes = [int(s) for s in msg.get("sizes", [])]
        pb = int(msg.get("page_bytes", 0))
        mlen = int(msg.get("manifest_bytes", 0))
        if len(fds) != 1 or pb <= 0 or not isinstance(name, str):
            raise protocol.Refused(errno.EINVAL, "a page-in needs a name, page_bytes and one memfd")
        total = len(sizes) * pb + mlen
        mm = mmap.mmap(fds[0], total, mmap.MAP_SHARED, mmap.PROT_READ) if total else None
        try:
            source = _ShmSource(mm if mm is not None else b"", sizes, pb, mlen)  # (nothing handed over)
            with self.adapter.lock:
                ids = self.adapter.page_in(source)
                self._group(name, ids)
        finally:
            if mm is not None:
                mm.close()
        log.info("paged in %s: sequences %s", name, ", ".join(ids))
        return {"seqs": ids}


# ---------------------------------------------------------------------------- demo / control


def _logits_digest(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


def attach_or_report(agent: "Agent", name: str) -> bool:
    """Attach; if refused, say so (a JSON answer on stdout, one line on stderr) and return False."""
    try:
        agent.attach()
    except (protocol.Refused, OSError) as e:
        print(json.dumps({"ok": False, "errno": e.errno, "error": str(e)}), flush=True)
        print(f"attach {name}: {e}", file=sys.stderr)
        return False
    return True


def command_loop(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Answer JSON commands read from stdin, one reply line each, until ``exit``."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            if cmd.get("cmd") == "exit":
                break
            reply = {"ok": True, **handle(cmd)}
        except Exception as ex:
            reply = {"ok": False, "error": f"{type(ex).__name__}: {ex}"}
        print(json.dumps(reply), flush=True)


def common_command(engine, adapter, agent: "Agent", cmd: dict[str, Any]) -> dict[str, Any] | None:
    """The control commands every engine answers alike; None for the others."""
    c = cmd.get("cmd")
    if c == "add":
        with adapter.lock:
            engine.add_request(cmd["id"], cmd["prompt"])
        return {}
    if c == "page_out":
        with adapter.lock:
            m = engine.page_out(cmd["dest"], cmd.get("ids"))
        return {"pages": len(m.pages)}
    if c == "remove":
        with adapter.lock:
            engine.remove(cmd["id"])
        return {}
    if c == "detach":
        agent.detach()
        return {}
    return None


class _Controller:
    """JSON commands on stdin, one answer per line on stdout (for scripts and tests)."""

    def __init__(self, engine, adapter: ReferenceAdapter, agent: Agent):
        self.engine, self.adapter, self.agent = engine, adapter, agent
        self._run: threading.Thread | None = None
        self._stop = threading.Event()
        self._history: dict[str, Any] = {}

    def _record(self, out, toks, logs) -> None:
        for sid, o in out.items():
            toks.setdefault(sid, []).append(o.token)
            logs.setdefault(sid, []).append(_logits_digest(o.logits))

    def _background(self, ids) -> None:
        toks, logs = self._history["tokens"], self._history["logits"]
        while not self._stop.is_set():
            self._record(self.adapter.step(ids), toks, logs)
            self._history["steps"] += 1

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        e, c = self.engine, cmd.get("cmd")
        done = common_command(e, self.adapter, self.agent, cmd)
        if done is not None:
            return done
        if c == "step":
            toks: dict[str, list[int]] = {}
            logs: dict[str, list[str]] = {}
            for _ in range(int(cmd.get("n", 1))):
                self._record(self.adapter.step(cmd.get("ids")), toks, logs)
            return {"tokens": toks, "logits": logs}
        if c == "run":
            if self._run is not None:
                raise ValueError("already running")
            self._stop.clear()
            self._history = {"steps": 0, "tokens": {}, "logits": {}}
            self._run = threading.Thread(target=self._background, args=(cmd.get("ids"),), daemon=True)
            self._run.start()
            return {}
        if c == "pause":
            if self._run is None:
                raise ValueError("not running")
            self._stop.set()
            self._run.join()
            self._run = None
            return dict(self._history)
        if c == "page_in":
            # Straight from a session folder (a live one too), not through engines/.
            with self.adapter.lock:
                ids = e.page_in(cmd["src"])
                return {"seqs": ids, "n_tokens": {s.id: s.n_tokens for s in e.seq_blocks(ids)}}
        if c == "state":
            with self.adapter.lock:
                seqs = {s.id: {"n_tokens": s.n_tokens, "blocks": [int(b) for b in s.block_ids],
                               "tokens": e.tokens(s.id)} for s in e.seq_blocks()}
                return {"seqs": seqs, "free": e.allocator.num_free(),
                        "free_list": [int(b) for b in e.allocator.free_list()],
                        "groups": dict(self.agent.groups), "attached": not self.agent.detached.is_set()}
        raise ValueError(f"unknown command {c!r}")

    def loop(self) -> None:
        command_loop(self.handle)


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def main(argv: list[str] | None = None) -> int:
    from engine_bridge.demo import PROMPT, tokenize
    from engine_bridge.reference.reference_engine import ModelConfig, ReferenceEngine

    ap = argparse.ArgumentParser(prog="python -m engine_bridge.attach.agent",
                                 description="Run the reference engine attached to a pffs mount.")
    ap.add_argument("mount", help="mount point (or the engine socket's path)")
    ap.add_argument("--name", required=True, help="the engine's folder name under MNT/engines/")
    ap.add_argument("--blocks", type=int, default=256, help="KV pool blocks")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--seed", type=int, default=0, help="weights seed (engines must share it to exchange sessions)")
    ap.add_argument("--staging", default="64M", help="shared staging buffer size")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--demo", action="store_true", help="decode a prompt as request demo-1, then idle")
    mode.add_argument("--control", action="store_true", help="JSON commands on stdin, answers on stdout")
    ap.add_argument("--steps", type=int, default=200, help="--demo: steps to run (each decodes every sequence)")
    ap.add_argument("--interval", type=float, default=0.05, help="--demo: seconds between steps")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    cfg = ModelConfig()
    engine = ReferenceEngine(cfg, dtype=args.dtype, num_blocks=args.blocks, block_size=args.block_size,
                             seed=args.seed, name=args.name)
    adapter = ReferenceAdapter(engine)
    gone = threading.Event()
    agent = Agent(adapter, args.mount, args.name, staging_bytes=_size(args.staging),
                  on_detach=lambda a: gone.set())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))    # detach on the way out
    if not attach_or_report(agent, args.name):
        return 2
    try:
        if args.control:
            print(json.dumps({"ok": True, "attached": args.name, "pid": os.getpid()}), flush=True)
            _Controller(engine, adapter, agent).loop()
        else:
            if args.demo:
                prompt = tokenize(PROMPT, cfg.vocab_size)
                with adapter.lock:
                    engine.add_request("demo-1", prompt)
                print(f"engine {args.name}: request demo-1 ({len(prompt)} prompt tokens) is live under "
                      f"{Path(args.mount) / 'engines' / args.name / 'demo-1'}", file=sys.stderr)
            for _ in range(args.steps if args.demo else 0):
                if gone.wait(args.interval):
                    break
                with adapter.lock:
                    # Every sequence with its tokens decodes, sessions copied in too.
                    ids = [s.id for s in engine.seq_blocks() if s.token_ids is not None]
                    if ids:
                        engine.step(ids)
            while not gone.wait(0.5):   # attached until interrupted or unmounted
                pass
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        agent.detach()
    return 0


if __name__ == "__main__":
    sys.exit(main())
