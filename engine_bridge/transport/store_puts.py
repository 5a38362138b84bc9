"""Pages put straight into a mount's store by a writer outside the daemon,
kept safe from gc until the writer names them: the crash-safety steps of
the direct page-out (engine_bridge.transport.direct.DirectSink) and of the
SGLang HiCache writes (engine_bridge.sglang.hicache), written once.
"""

from __future__ import annotations

from typing import Any

from engine_bridge.transport.mountinfo import StoreAccess
from pffs import codec as codec_mod
from pffs.client.access import PUT_FIRST_MAX, Blobs, gc_lock
from pffs.errors import PffsError
from pffs.types import Digest, digest_of


class PagePuts:
    """Puts pages into the store of *access* so that no gc sweeps one before
    the caller names it (commits a manifest, registers keys through the
    mount).  The steps, in order, and why each (pffs.store.storedir.GcLock):

    1. (a local store) open a pin file, then take the gc lock shared
       (``hold_shared``, on descriptors of its own: any thread may let it
       go): from here until :meth:`stored`, gc's exclusive section cannot
       run, so no blob this writer finds stored or puts is removed;
    2. :meth:`put`, per page, from any number of threads: the page's digest
       is added to the pin file *first*, while the lock is held shared (so
       gc's next exclusive section sees the pin, or the blob is not there
       yet), then the blob is put: into a batch whose fsyncs the daemon
       does when it adopts the blobs, or durable at once (*durable*: a blob
       the mount already knows by a row, whose adoption would not sync it).
       A bucket: a page over ``PUT_FIRST_MAX`` bytes is looked for with a
       HEAD on the store's threads while this one compresses it, and not
       sent again if there; a smaller one goes with a conditional PUT;
    3. :meth:`stored`: (a bucket) wait until every upload is in the bucket,
       raising the store's error (the mount looks the blobs up when they are
       named); then let go of the gc lock, *before* the caller names the
       pages: the daemon's commit passes through ``gc.intent``, which a
       waiting gc holds, so holding the lock there could deadlock.  From
       here the pins alone keep the pages;
    4. the caller names the pages (through the mount);
    5. :meth:`close`: let go of the lock if still held (a failure before
       :meth:`stored`), wait for a bucket's uploads ignoring their errors
       (no upload outlives the writer; what landed unnamed, gc takes), and
       close the pin file: the pages are named, or given up.

    A bucket has neither lock nor pins: its gc keeps every blob younger than
    its grace period, and puts back from its trash one a manifest names.
    Usable as a context manager (``close`` on the way out).
    """

    def __init__(self, access: StoreAccess, blobs: Blobs | None = None):
        self.access = access
        self.blobs: Any = blobs if blobs is not None else access.blobs()
        self.bucket = access.bucket
        # Puts with a batch skip their own fsyncs, or (a bucket) run on the
        # upload threads until stored() waits for them.
        self.batch: Any = self.blobs.batch()
        #: (a local store) the pin file, and the gc lock held shared until stored()
        self.pins: Any = None
        self.hold: Any = None
        self._stored = False
        self._closed = False
        if self.bucket is None:
            gc = gc_lock(access.root)
            self.pins = gc.pin()
            try:
                self.hold = gc.hold_shared()
            except BaseException:
                self.pins.close()
                raise

    def put(self, data, digest: Digest | None = None, *, codec: codec_mod.Codec | None = None,
            durable: bool = False) -> Digest:
        """Pin and put the page *data* (consumed when this returns); its digest.

        *codec*: the store's own where None.  *durable*: the blob is on disk
        (in the bucket) when this returns, instead of in the batch.  Raises
        the store's error (PffsError) as its put does."""
        if self._stored or self._closed:
            raise ValueError("PagePuts.put after stored() or close(): the page would not be kept")
        d = digest if digest is not None else digest_of(data)
        if self.pins is not None:
            self.pins.add((d,))
        batch = None if durable else self.batch
        bucket = self.bucket
        if bucket is None or memoryview(data).nbytes <= PUT_FIRST_MAX:
            # (A small page into a bucket: its conditional PUT says whether it has it.)
            self.blobs.put(data, d, batch=batch, codec=codec)
        else:
            # Whether the bucket holds the page already (a HEAD) is asked on the
            # store's threads while this one compresses it.
            head = bucket.pool.submit(bucket.stat, d)
            frame = codec_mod.encode_parts(data, codec or bucket.codec)
            if head.result() is None:
                bucket.put(data, d, batch=batch, frame=frame)
        return d

    def stored(self) -> None:
        """Every page put is in the store (a bucket: raising the store's error,
        PffsError, for an upload that failed); then the gc lock goes, before
        the caller names the pages: from here the pins alone keep them."""
        if self.bucket is not None:
            self.batch.sync()
        self._stored = True
        self._release()

    def close(self) -> None:
        """Done (the pages named, or given up): the lock let go if still held, a
        bucket's uploads waited for (their errors ignored), the pins closed.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._release()
            if self.bucket is not None and not self._stored:
                try:
                    self.batch.sync()  # no upload outlives the writer (what landed, gc takes)
                except PffsError:
                    pass
        finally:
            if self.pins is not None:
                self.pins.close()

    def _release(self) -> None:
        hold, self.hold = self.hold, None
        if hold is not None:
            hold.release()

    def __enter__(self) -> "PagePuts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
