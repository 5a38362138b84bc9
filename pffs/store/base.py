"""The blob store protocol: what the commit path, reads and the daemon need of a
store, implemented by ``pffs.store.local.LocalBlobStore`` (a folder) and
``pffs.store.s3.S3BlobStore`` (a bucket, with a local cache folder).

What a store can do beyond it is declared, never guessed from its class:
``remote`` says a get may wait on a network (prefetch then asks for one blob
a job, and forks adopt pages from the bucket).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from pffs import codec as codec_mod
from pffs.store.local import PutResult
from pffs.types import Digest


class PutBatch(Protocol):
    """Blobs written but not yet durable: ``sync`` makes them so, in groups."""

    def __len__(self) -> int: ...

    def sync(self) -> list[Digest]: ...


class BlobStore(Protocol):
    #: A get may wait on a network (an S3 bucket); False for a local folder.
    remote: bool
    #: The folder the store's local files live in (statfs reports its disk).
    root: Path
    #: The codec new blobs are written with.
    codec: codec_mod.Codec

    def contains(self, digest: Digest) -> bool: ...

    def stored_size(self, digest: Digest) -> int: ...

    def batch(self) -> Any: ...

    def put(self, data, digest: Digest | None = None, *, batch: Any = None,
            codec: codec_mod.Codec | None = None, frame: Any = None) -> PutResult: ...

    def get(self, digest: Digest, *, verify: bool = True,
            hold: Callable[[int], Any] | None = None, rehash: bool = False) -> bytes: ...

    def get_view(self, digest: Digest, *, hold: Callable[[int], Any] | None = None) -> bytes | memoryview: ...

    def temp_files(self) -> Iterator[Path]: ...
