"""The engine bridge: an inference engine's paged KV pool <-> pffs sessions.

Runs inside the engine process and needs torch; it never imports the
filesystem, and reaches a mount's store only through pffs.client.access.
The package by role:

- :mod:`.core` — the bridge itself: describing a pool (``pool``: layouts,
  dtypes, gathering and scattering blocks), bounded host staging
  (``staging``), page out / page in and what page-in checks (``bridge``), a
  model's identity (``identity``), a reference-counting block allocator
  (``allocator``)
- :mod:`.transport` — the ways page bytes travel, every sink and source:
  the protocols (``session_io``), folders through the mount (``folders``),
  memory (``in_memory``), finding a path's pffs mount and its store
  (``mountinfo``), a session straight to and from that store (``direct``),
  bare blobs of it (``store_blobs``), and which one a path gets (``choose``)
- :mod:`.attach` — a live engine attached to a mount (``MNT/engines/NAME/``):
  the agent serving the daemon (``agent``), what an engine must give it
  (``engine_adapter``), pages decoded ahead of a load (``warm``), the JSON
  control commands (``controls``) and the one command line,
  ``python -m engine_bridge.attach`` (``attach_cli``)
- one folder per engine: :mod:`.reference` (the reference engine, a small
  Llama-style transformer, and its live adapter), :mod:`.transformers`
  (Hugging Face transformers' continuous batching; imported on its own: it
  needs the pinned transformers release), :mod:`.vllm` (a KV connector)
- :mod:`.demo` — ``pffs demo``
- :mod:`.errors` — why a page-out or page-in is refused
"""

from engine_bridge.core.allocator import RefCountingAllocator
from engine_bridge.core.bridge import SUPPORTED_LAYOUTS, Bridge, PageInResult, SeqBlocks
from engine_bridge.core.identity import (config_sha256, weights_sha256_of_folder,
                                        weights_sha256_of_tensors)
from engine_bridge.core.pool import (
    DEFAULT_KV,
    FLASH_ATTN,
    FLASHINFER,
    FLASHINFER_HND,
    LAYOUTS,
    BlockAllocator,
    BlockId,
    KVLayout,
    KVPool,
    dtype_name,
)
from engine_bridge.core.staging import DEFAULT_STAGING_BYTES, Staging
from engine_bridge.errors import (
    BridgeError,
    DamagedPage,
    DigestMismatch,
    IncompleteSession,
    InvalidSession,
    MismatchError,
    ModelMismatch,
    NoFreeBlocks,
    PageError,
    PageInError,
    PageOutError,
    Refused,
    SourceChanged,
    Unfingerprinted,
    WrongSizePage,
)
from engine_bridge.transport.choose import as_sink, as_source, sink_for, source_for
from engine_bridge.transport.direct import DirectSink, DirectSource
from engine_bridge.transport.folders import DirSink, DirSource
from engine_bridge.transport.in_memory import MemorySession
from engine_bridge.transport.mountinfo import store_access
from engine_bridge.transport.session_io import SessionSink, SessionSource
from pffs.names import DIGEST_XATTR

__all__ = [
    "Bridge", "PageInResult", "SeqBlocks", "config_sha256", "weights_sha256_of_folder",
    "weights_sha256_of_tensors", "SUPPORTED_LAYOUTS",
    "KVPool", "KVLayout", "BlockId", "BlockAllocator", "LAYOUTS", "FLASH_ATTN", "FLASHINFER",
    "FLASHINFER_HND", "DEFAULT_KV", "dtype_name", "RefCountingAllocator",
    "SessionSink", "SessionSource", "DirSink", "DirSource", "MemorySession", "as_sink",
    "as_source", "sink_for", "source_for", "DirectSink", "DirectSource", "store_access", "DIGEST_XATTR", "Staging", "DEFAULT_STAGING_BYTES",
    "BridgeError", "PageOutError", "PageInError", "InvalidSession", "IncompleteSession",
    "MismatchError", "ModelMismatch", "PageError", "WrongSizePage", "DigestMismatch",
    "SourceChanged", "NoFreeBlocks", "Refused", "DamagedPage", "Unfingerprinted",
]
