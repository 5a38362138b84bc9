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

What an engine must provide is an
:class:`~engine_bridge.attach.engine_adapter.EngineAdapter` (each engine's is
in its folder); ``python -m engine_bridge.attach MNT --engine E --name N``
runs engine E attached as N (engine_bridge.attach.attach_cli).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from engine_bridge.attach.engine_adapter import EngineAdapter
from engine_bridge.attach.warm import WARM_BYTES, WarmPages
from engine_bridge.core.bridge import SUPPORTED_LAYOUTS, SeqBlocks
from engine_bridge.core.pool import BlockId
from engine_bridge.errors import BridgeError, PageInError
from engine_bridge.transport.choose import as_source
from engine_bridge.transport.mountinfo import store_access
from engine_bridge.transport.session_io import SourceBase
from engine_bridge.transport.store_blobs import BlobSink, BlobSource
from pffs.live import protocol
from pffs.manifest import ManifestError
from pffs.names import CONTROL_DIR, SOCKET_NAME
from pffs.types import Digest

log = logging.getLogger("engine_bridge.attach.agent")

#: Bytes of the staging slots shared with the daemon, by default.
SHARED_STAGING_BYTES = 64 << 20


class _ShmSource(SourceBase):
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
    return p / CONTROL_DIR / SOCKET_NAME if p.is_dir() else p


class Agent:
    """One engine attached to one mount under *name*.

    ``attach()`` raises :class:`pffs.live.protocol.Refused` (``.errno``:
    EEXIST for a taken name, EACCES for a uid the daemon refuses, EINVAL
    for a registration it cannot use) or OSError when it cannot connect.
    """

    def __init__(self, adapter: EngineAdapter, where: str | os.PathLike, name: str, *,
                 staging_bytes: int = SHARED_STAGING_BYTES, workers: int = 2,
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
