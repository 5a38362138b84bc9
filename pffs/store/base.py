"""The blob store protocol: what the commit path, reads and the daemon need of a
store, implemented by ``pffs.store.local.LocalBlobStore`` (a folder) and
``pffs.store.s3.S3BlobStore`` (a bucket, with a local cache folder).

What a store can do beyond it is declared, never guessed from its class:
``remote`` says a get may wait on a network (prefetch then asks for one blob
a job, and forks adopt pages from the bucket); a store whose ``remote`` is
False is a folder of blob files on this host (a client beside the mount may
put frames there itself, and gc and repair work on it).  Each store declares
it as a ``Literal``, so that a check of it tells the type checker which
store it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pffs import codec as codec_mod
from pffs.types import Digest


@dataclass(frozen=True)
class PutResult:
    """What a put did: the blob's name, its raw and stored sizes, the codec it is
    stored with ("" where the store held it already) and whether it did."""
    digest: Digest
    raw_size: int
    stored_size: int
    codec: str
    existed: bool


class BlobBatch(Protocol):
    """Puts whose durability is deferred: ``sync`` makes them durable, in
    groups (each store makes its own: ``BlobStore.batch``)."""

    def __len__(self) -> int: ...

    def sync(self) -> list[Digest]: ...


class BlobStore(Protocol):
    @property
    def remote(self) -> bool:
        """A get may wait on a network (an S3 bucket); False for a local folder."""
        ...

    #: The folder the store's local files live in (statfs reports its disk).
    root: Path
    #: The codec new blobs are written with.
    codec: codec_mod.Codec
    #: What every read checks: "crc32" (a named frame's name and the crc32 of its
    #: bytes) or "sha256" (the sha256 of its bytes); docs/format.md.
    verify: str

    def contains(self, digest: Digest) -> bool: ...

    def stored_size(self, digest: Digest) -> int: ...

    def batch(self) -> BlobBatch: ...

    def put(self, data, digest: Digest | None = None, *, batch: BlobBatch | None = None,
            codec: codec_mod.Codec | None = None, frame: Any = None) -> PutResult: ...

    def get(self, digest: Digest, *, verify: bool = True,
            hold: Callable[[int], Any] | None = None, rehash: bool = False) -> bytes: ...

    def get_view(self, digest: Digest, *, hold: Callable[[int], Any] | None = None) -> bytes | memoryview: ...

    def set_aside(self, digest: Digest, why: str) -> bool:
        """A blob a read found damaged (*why*): moved out of the way if the store
        can, so the next put of its bytes stores them afresh; True if moved."""
        ...

    def temp_files(self) -> Iterator[Path]: ...
