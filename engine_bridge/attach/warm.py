"""Pages decoded ahead of a load, while ``cp -r SNAP MNT/engines/E/`` is still copying.

A session copied into an engine's folder is paged in once its last file is
copied (pffs.live's ``load_blobs``), so the page-in used to start only
after cp's requests for every file.  As cp copies each page file, the
daemon now tells the engine which blob the file holds (a ``warm`` message:
no answer); the agent reads that blob's frame from the store and decodes it
here, on one thread, while cp goes on.  The load that follows takes the
pages found here (:class:`engine_bridge.transport.store_blobs.BlobSource`) and decodes the
others as before.

Only named frames are decoded ahead (pffs.codec: the frame names its blob
and its bytes match its crc32, the checks a load makes anyway), so what is
taken from here is that blob's bytes whatever happened meanwhile: a page
file copied again, or a session never loaded.  At most *limit* bytes are
held; everything goes at the next load (taken or not) and after IDLE
seconds without one.

The buffers pages are decoded into are used again, from one load to the
next, until that idle time gives them back: a fresh 2 MiB buffer costs its
first touch of every memory page (on a virtual machine about as much as
decoding into it), and a load of 128 pages held 128 of them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from engine_bridge.transport.mountinfo import store_access
from engine_bridge.transport.store_blobs import fetch_frame
from pffs import codec as codec_mod
from pffs.errors import CodecError, PffsError
from pffs.types import Digest, digest_bytes, is_digest

log = logging.getLogger("engine_bridge.attach.warm")

#: Bytes of decoded pages an agent holds ahead of a load, by default.
WARM_BYTES = 256 << 20
#: Seconds after the last page asked for before what is held is dropped.
IDLE = 30.0


class WarmPages:
    """Blobs decoded ahead of a load, by digest (thread-safe)."""

    def __init__(self, limit: int, page_bytes: int, idle: float = IDLE):
        self.limit = limit
        self.page_bytes = page_bytes
        self.idle = idle
        self._lock = threading.Lock()
        self._pages: dict[str, bytearray] = {}
        self._held = 0
        self._spare: list[bytearray] = []   # page buffers holding nothing, used again
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stores: dict[str, Any] = {}   # mount -> (blobs, bucket), or None: not readable here
        self._gen = 0          # a load (or the idle time) drops what came before
        self._frozen = False   # a load is on: decode no more (its threads do)
        self._last = 0.0
        #: Pages asked for, decoded, taken by a load, and skipped (over the
        #: limit, not named, damaged, not readable from here); page buffers made.
        self.counts = {"asked": 0, "decoded": 0, "taken": 0, "skipped": 0, "buffers": 0}

    def want(self, mount: str, digests: list[str]) -> None:
        """Decode these blobs of *mount*'s store ahead (from the agent's reader thread)."""
        if self.limit <= 0:
            return
        with self._lock:
            self.counts["asked"] += len(digests)
            self._last = time.monotonic()
            gen = self._gen
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pffs-warm", daemon=True)
                self._thread.start()
        for d in digests:
            self._q.put((gen, mount, d))

    def take_into(self, digest: str, out: memoryview) -> int | None:
        """Copy the decoded bytes of *digest* into *out* if held here and as
        long as *out* (then no longer held); their length, else None."""
        with self._lock:
            data = self._pages.pop(digest, None)
            if data is None:
                return None
            self._held -= len(data)
        ok = len(data) == len(out)
        if ok:
            out[:] = data
        with self._lock:
            self._spare.append(data)
            self.counts["taken"] += ok
        return len(data) if ok else None

    def held(self) -> int:
        with self._lock:
            return self._held

    def freeze(self) -> None:
        """A load begins: keep what is held, decode nothing more (the load's
        own threads decode what is missing)."""
        with self._lock:
            self._frozen = True

    def clear(self) -> None:
        """Drop what is held and what is still asked for (after a load)."""
        with self._lock:
            self._gen += 1
            self._frozen = False
            self._spare.extend(self._pages.values())
            self._pages.clear()
            self._held = 0

    def stop(self) -> None:
        self.clear()
        with self._lock:
            self._spare.clear()
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(10)
            self._thread = None

    def _run(self) -> None:
        while True:
            try:
                job = self._q.get(timeout=self.idle)
            except queue.Empty:
                with self._lock:
                    if time.monotonic() - self._last >= self.idle:
                        if self._pages:
                            log.info("dropping %d pages decoded ahead of a load that did not come",
                                     len(self._pages))
                        self._gen += 1
                        self._pages.clear()
                        self._held = 0
                        self._spare.clear()
                continue
            if job is None:
                return
            gen, mount, d = job
            try:
                self._one(gen, mount, d)
            except Exception:   # (an optimisation: the load reads the page itself)
                log.exception("decoding %s ahead of a load", d)
                self.counts["skipped"] += 1

    def _one(self, gen: int, mount: str, d: str) -> None:
        with self._lock:
            if gen != self._gen or self._frozen or d in self._pages or not is_digest(d):
                return
            if self._held + self.page_bytes > self.limit:
                self.counts["skipped"] += 1
                return
        store = self._store(mount)
        if store is None:
            self.counts["skipped"] += 1
            return
        blobs, bucket = store
        with self._lock:
            out = self._spare.pop() if self._spare else None
        if out is None:
            out = bytearray(self.page_bytes)
            self.counts["buffers"] += 1
        try:
            frame, _ = fetch_frame(blobs, bucket, Digest(d))
            # (a frame without a name would be decoded unchecked: left to the load)
            checked = codec_mod.read_header(frame).named and \
                codec_mod.decode_into_checked(frame, out, digest_bytes(Digest(d)),
                                              rehash=blobs.verify == "sha256")[1]
        except (PffsError, CodecError, OSError):
            checked = False     # (the load says what is wrong with it, naming its page)
        n = len(out)
        with self._lock:
            if not checked:
                self.counts["skipped"] += 1
            if not checked or gen != self._gen or d in self._pages or self._held + n > self.limit:
                self._spare.append(out)
                return
            self._pages[d] = out
            self._held += n
            self.counts["decoded"] += 1

    def _store(self, mount: str):
        if mount not in self._stores:
            access = store_access(mount)
            self._stores[mount] = None if access is None else (access.blobs(), access.bucket)
        return self._stores[mount]
