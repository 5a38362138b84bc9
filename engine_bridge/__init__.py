"""The engine bridge: an inference engine's paged KV pool <-> pffs sessions.

Runs inside the engine process and needs torch; it never imports the
filesystem.  Layout of the package:

- :mod:`.pool` — describing a pool (layouts, dtypes), gathering/scattering blocks
- :mod:`.staging` — bounded host staging buffers and the copy stream
- :mod:`.sessions` — where sessions go: sinks/sources, plain or mounted directories
- :mod:`.direct` — page bytes straight to and from a mounted pffs's store
- :mod:`.bridge` — page out / page in and what page-in checks
- :mod:`.allocator` — a reference-counting block allocator
- :mod:`.reference` — the reference engine (a small Llama-style transformer)
- :mod:`.transformers_adapter` — Hugging Face transformers' continuous batching
  (imported on its own: it needs the pinned transformers release)
- :mod:`.demo` — ``pffs demo``
- :mod:`.errors` — why a page-in is refused
"""

from engine_bridge.core.allocator import RefCountingAllocator
from engine_bridge.core.bridge import SUPPORTED_LAYOUTS, Bridge, PageInResult, SeqBlocks, config_sha256
from engine_bridge.transport.blobpath import DirectSink, DirectSource, as_sink, as_source, store_access
from engine_bridge.errors import (BridgeError, DamagedPage, DigestMismatch, IncompleteSession, InvalidSession,
                     MismatchError, ModelMismatch, NoFreeBlocks, PageError, PageInError,
                     PageOutError, Refused, SourceChanged, WrongSizePage)
from engine_bridge.core.pool import (DEFAULT_KV, FLASH_ATTN, FLASHINFER, FLASHINFER_HND, LAYOUTS, BlockAllocator,
                   BlockId, KVLayout, KVPool, dtype_name)
from engine_bridge.transport.folders import DIGEST_XATTR, DirSink, DirSource, MemorySession, SessionSink, SessionSource
from engine_bridge.core.staging import DEFAULT_STAGING_BYTES, Staging

__all__ = [
    "Bridge", "PageInResult", "SeqBlocks", "config_sha256", "SUPPORTED_LAYOUTS",
    "KVPool", "KVLayout", "BlockId", "BlockAllocator", "LAYOUTS", "FLASH_ATTN", "FLASHINFER",
    "FLASHINFER_HND", "DEFAULT_KV", "dtype_name", "RefCountingAllocator",
    "SessionSink", "SessionSource", "DirSink", "DirSource", "MemorySession", "as_sink",
    "as_source", "DirectSink", "DirectSource", "store_access", "DIGEST_XATTR", "Staging", "DEFAULT_STAGING_BYTES",
    "BridgeError", "PageOutError", "PageInError", "InvalidSession", "IncompleteSession",
    "MismatchError", "ModelMismatch", "PageError", "WrongSizePage", "DigestMismatch",
    "SourceChanged", "NoFreeBlocks", "Refused", "DamagedPage",
]
