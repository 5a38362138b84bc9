"""pffs as SGLang's HiCache storage tier: :class:`PffsHiCacheStorage`.

SGLang's hierarchical cache moves pages GPU -> host pool -> an L3 store keyed
by a chain hash of each page's tokens (its ``get_hash_str``), and prefetches
them back for any prompt starting with the same tokens.  This backend makes
a pffs mount that store, through the token-chain index (SPEC §7,
``docs/prefix-index.md``):

- ``batch_exists``/``batch_get_v1`` look the keys up in the index, so a page
  of any session (saved by any engine: vLLM, transformers, a fork, a pull) is
  a hit, as is a page SGLang stored itself;
- ``batch_set_v1`` puts the host pool's pages into the mount's store by the
  direct path (page bytes never cross FUSE) and keeps them by key in the
  key-only cache (``user.pffs.prefix.put``: one request a batch), which the
  mount keeps within ``-o prefix_cache_size=`` (LRU; session pages never go).

A page is the SPEC §1 page (K then V, each ``[layers, tokens, heads,
head_dim]``): SGLang's ``page_first_direct`` host layout holds it as two
contiguous halves; ``page_first`` and ``layer_first`` are converted on the way.
A model with multi-head latent attention (SGLang's ``MLATokenToKVPoolHost``:
DeepSeek-V2/V3/R1, Kimi K2) has the SPEC §1.1 page instead, one
``[layers, tokens, latent]`` array (each latent ``kv_lora_rank`` compressed
values, then ``qk_rope_head_dim`` rotary ones), in the same three host layouts
(``engine_bridge/sglang/mla_host.py``); its key namespace is MLA's own (the
template manifest says ``attention: "mla"``), so an MHA session is never its hit.
Every page read is checked as the mount's reads are (the frame's name and
crc32, or its sha256 where the mount says ``-o verify=sha256``): a missing or
damaged blob is a miss (False), never wrong bytes.  A damaged blob is set
aside, and a write-through of its key stores the page again instead of
skipping it, so the damage heals.

Attach it with SGLang's dynamic backend (``docs/engines.md``)::

    --enable-hierarchical-cache --hicache-mem-layout page_first_direct
    --hicache-storage-backend dynamic --page-size 16
    --hicache-storage-backend-extra-config '{"backend_name": "pffs",
        "module_path": "engine_bridge.sglang", "class_name": "PffsHiCacheStorage",
        "interface_v1": 1, "root": "/mnt/kvcache"}'

``interface_v1`` 1 has SGLang read and write pages in place in its host
pool; without it SGLang's legacy ``batch_get``/``batch_set`` hand over a
copy of each page (the same blobs under the same keys).

Extra config: ``root`` (a pffs mount, required), ``config_sha256`` and
``weights_sha256`` (the model's identity when SGLang's model path is not a
local Hugging Face folder; without a weights fingerprint the backend
refuses to start), ``io_threads`` (pages encoded, decoded and hashed at once; default
up to 4; 8 or twice the cores for a bucket), ``kv_scales`` (an fp8 cache's scales, ``{"k": [one per layer], "v": [...]}``:
SGLang does not show a storage backend its attention layers; default null, 1.0).
An fp8 cache (``--kv-cache-dtype`` fp8_e4m3, fp8_e5m2: a uint8 host pool) is
stored as fp8 pages of that dtype, with zstd (1-byte values have no byte planes).  Refused at start, in one line: pipeline parallel,
extra host pools (Mamba, sliding window, draft), a host layout other than
the three above; for MLA also decode or attention context parallel (a rank
holds a slice of a page's tokens), draft layers in the host pool, packed
(DSA fp8) latent rows and a DeepSeek-V4 pool.  At tensor parallel > 1 every
rank reads its heads of the whole-head pages; SGLang writes per-rank slices,
which pffs does not keep (sessions hold whole heads): those ranks store
nothing and say so once.  MLA at tensor parallel > 1: every rank holds and
reads the whole latent; rank 0 alone stores, the others store nothing and
answer success (as SGLang's own backends, whose controller skips their
write-back).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from engine_bridge.core.bridge import SUPPORTED_LAYOUTS
from engine_bridge.core.identity import checkpoint_weights_sha256, hf_config_sha256
from engine_bridge.core.pool import DEFAULT_KV, DTYPE_NAMES
from engine_bridge.errors import DamagedPage
from engine_bridge.sglang import mla_host
from engine_bridge.transport.mountinfo import StoreAccess, store_access
from engine_bridge.transport.store_blobs import decode_page, fetch_frame
from engine_bridge.transport.store_puts import PagePuts
from pffs.client.chainkeys import manifest_namespace
from pffs.client.prefix_lookup import PrefixIndex, cache_blobs
from pffs.codec import for_itemsize
from pffs.errors import MissingBlob, PffsError
from pffs.manifest import Manifest, plain_scales
from pffs.types import Digest, digest_of

log = logging.getLogger("sglang.pffs")

LAYOUTS = ("page_first_direct", "page_first", "layer_first")
#: The folder under the root holding each key namespace's template manifest.
TEMPLATES = ".hicache"
HEX = frozenset("0123456789abcdef")


def is_key(k: object) -> bool:
    return isinstance(k, str) and len(k) == 64 and HEX.issuperset(k)


#: SGLang's fp8 ``--kv-cache-dtype`` names: its host pool keeps such a cache as
#: uint8, the bytes of this dtype.
FP8_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def contiguous_runs(view: torch.Tensor, most: int = 8) -> list | None:
    """*view*'s memory as at most *most* contiguous runs in its element order
    (writable byte arrays), or None where it is not (the runs of a strided
    view would be too many and too short to be worth decoding into)."""
    parts = [view] if view.is_contiguous() else list(view.unbind(0)) if view.dim() > 1 else []
    if not parts or len(parts) > most or not all(p.is_contiguous() for p in parts):
        return None
    return [p.reshape(-1).view(torch.uint8).numpy() for p in parts]


def page_dtype(host_dtype: torch.dtype) -> torch.dtype:
    """The dtype a page of a host pool of *host_dtype* holds: a uint8 pool is the fp8
    cache SGLang's kv_cache_dtype names (ValueError for any other)."""
    if host_dtype != torch.uint8:
        return host_dtype
    from sglang.srt.runtime_context import get_model
    name = str(get_model().kv_cache_dtype)
    if name not in FP8_CACHE_DTYPES:
        raise ValueError(f"pffs HiCache storage: a uint8 host pool of kv_cache_dtype {name!r} is not "
                         f"supported (fp8 caches are: {', '.join(FP8_CACHE_DTYPES)}; a checkpoint's own "
                         "KV quantization is not)")
    return FP8_CACHE_DTYPES[name]


def model_identity(model_path: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    """The model part of the key namespace: the config's sha256 and the weights'
    fingerprint as the other engines' bridges compute them (so their sessions are
    hits), each from *extra* or else the model folder.  No fingerprint: ValueError
    (the keys would meet those of sessions that do not say which weights wrote them)."""
    weights = str(extra.get("weights_sha256") or "") or checkpoint_weights_sha256(model_path)
    if not weights:
        raise ValueError(f"pffs HiCache storage: no weight files found for model {model_path!r}: "
                         "give extra config weights_sha256 (engine_bridge.weights_sha256_of_folder "
                         "of its checkpoint folder)")
    if extra.get("config_sha256"):
        return {"config_sha256": str(extra["config_sha256"]), "weights_sha256": weights}
    if model_path:
        try:
            from transformers import AutoConfig
            cfg = AutoConfig.from_pretrained(model_path, local_files_only=True)
            return {"config_sha256": hf_config_sha256(cfg), "weights_sha256": weights}
        except Exception as e:      # (not a local folder: the name alone)
            log.warning("pffs HiCache storage: no config of %r (%s): keys named by the model's "
                        "name only; give extra config config_sha256 to meet other engines' sessions",
                        model_path, e)
    return {"name": model_path, "revision": None, "weights_sha256": weights}


class PffsHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 storage in a pffs mount (``interface_v1``, zero-copy; the legacy
    ``batch_get``/``batch_set`` of flat page copies without it)."""

    def __init__(self, storage_config: Any, kwargs: Any = None):
        extra = dict(storage_config.extra_config or {})
        if not extra.get("root"):
            raise ValueError("pffs HiCache storage needs extra config 'root': a pffs mount")
        self.mla = bool(storage_config.is_mla_model)
        split = {"decode context parallel": getattr(storage_config, "dcp_size", 1),
                 "attention context parallel": getattr(storage_config, "attn_cp_size", 1)}
        split = {name: n for name, n in split.items() if (n or 1) > 1}
        if self.mla and split:
            raise ValueError("pffs HiCache storage: MLA with " + ", ".join(
                f"{name} (size {n})" for name, n in split.items()) + " is not supported (each rank "
                "holds a slice of a page's tokens)")
        if storage_config.pp_size > 1:
            raise ValueError(f"pffs HiCache storage: pipeline parallel (size {storage_config.pp_size}) "
                             "is not supported")
        access = store_access(extra["root"])
        if access is None:
            raise ValueError(f"pffs HiCache storage: {extra['root']} is not in a pffs mount whose "
                             "store this process may use directly")
        self.access: StoreAccess = access
        self.root = str(extra["root"])
        self.mount = access.mountpoint
        self.blobs = access.blobs()
        self.tp_rank, self.tp_size = storage_config.tp_rank, storage_config.tp_size
        # MLA: every rank holds the whole latent, so rank 0 alone writes (SGLang's
        # is_storage_writer); MHA: each rank its heads (see _set).
        self.writer = self.tp_rank == 0 or not self.mla
        self.identity = model_identity(storage_config.model_name, extra)
        self.extra = extra
        # (A bucket's reads and writes mostly wait on the network: more of them at once.)
        cpus = os.cpu_count() or 1
        self.io_threads = max(1, int(extra.get("io_threads", min(4, cpus) if access.bucket is None
                                               else max(8, 2 * cpus))))
        self._threads = ThreadPoolExecutor(self.io_threads, thread_name_prefix="pffs-hicache")
        self._local = threading.local()
        self._said_slices = False
        self.space = ""
        self.mem_pool_host: Any = None

    # -- the host pool ------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        host = mem_pool_host
        layout = getattr(host, "layout", None)
        if layout not in LAYOUTS:
            raise ValueError(f"pffs HiCache storage: host layout {layout!r} is not one of {', '.join(LAYOUTS)}")
        if self.mla:
            n_layers, latent, kv = mla_host.latent_geometry(host)
        elif all(hasattr(host, a) for a in ("head_num", "head_dim", "layer_num", "kv_buffer")):
            n_layers, kv = int(host.layer_num), dict(DEFAULT_KV)
        else:
            raise ValueError(f"pffs HiCache storage: a {type(host).__name__} host pool is not an MHA "
                             "pool of K and V")
        dtype = page_dtype(host.dtype)
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"pffs HiCache storage: KV dtype {host.dtype} is not one pages hold")
        kv["scales"] = plain_scales(self.extra.get("kv_scales"))
        if not DTYPE_NAMES[dtype].startswith("fp8") and kv["scales"] is not None:
            raise ValueError("pffs HiCache storage: kv_scales given for a KV cache that is not fp8")
        super().register_mem_pool_host(host)
        self.page_size, self.n_layers = int(host.page_size), n_layers
        if self.mla:        # (SPEC §1.1: one latent a token, the whole of it on every rank)
            self.heads, self.head_dim, self.n_heads, self.first_head = 1, latent, 1, 0
            self.page_shape: tuple[int, ...] = mla_host.page_shape(n_layers, self.page_size, latent)
        else:
            self.heads, self.head_dim = int(host.head_num), int(host.head_dim)
            self.n_heads = self.heads * self.tp_size          # whole-head pages
            self.first_head = self.heads * self.tp_rank
            self.page_shape = (2, n_layers, self.page_size, self.n_heads, self.head_dim)
        # (fp8 pages: zstd, not byte planes of 16-bit values)
        self.codec = for_itemsize(self.blobs.codec, dtype.itemsize)
        self.page_bytes = host.dtype.itemsize
        for n in self.page_shape:
            self.page_bytes *= n
        # The manifest this engine's pages would have: their key namespace is its
        # (an MLA page's is its own: the manifest says attention "mla").
        self.template = Manifest(page_size_tokens=self.page_size, n_layers=self.n_layers,
                                 n_heads=self.n_heads, head_dim=self.head_dim,
                                 dtype=DTYPE_NAMES[dtype], pages=[], layout=SUPPORTED_LAYOUTS[0],
                                 model=self.identity, kv=kv, engine={"name": "sglang"},
                                 attention="mla" if self.mla else "mha")
        self.space = manifest_namespace(json.loads(self.template.to_json()))
        if self.tp_rank == 0:
            self._write_template()
        log.info("pffs HiCache storage on %s: %s, %d layers x %d heads x %d x %d tokens (%s), %s layout, "
                 "key namespace %s", self.mount, "MLA" if self.mla else "MHA", self.n_layers, self.n_heads,
                 self.head_dim, self.page_size, DTYPE_NAMES[dtype], layout, self.space[:16])

    def _write_template(self) -> None:
        """``ROOT/.hicache/<namespace>.json``: a manifest with no pages, of this model,
        geometry and KV conventions: ``pffs from-tokens --like`` it makes a named session
        of pages SGLang stored.  Written once (an existing one is left)."""
        folder = os.path.join(self.root, TEMPLATES)
        path = os.path.join(folder, f"{self.space}.json")
        if os.path.exists(path):
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(folder, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(self.template.to_json())
            os.replace(tmp, path)
        except OSError as e:
            log.warning("pffs HiCache storage: cannot write %s: %s", path, e.strerror or e)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) not in ("kv", "PoolName.KV"):
            raise ValueError(f"pffs HiCache storage: extra host pool {str(host_pool_name)!r} "
                             "(Mamba, sliding window, draft, ...) is not supported")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _view(self, index: int) -> torch.Tensor:
        """The host pool's page starting at token *index*, as [2, layers, tokens, heads, dim]
        (MLA: [layers, tokens, 1, latent])."""
        if self.mla:
            return mla_host.page_view(self.mem_pool_host, index, self.page_size)
        buf, t = self.mem_pool_host.kv_buffer, self.page_size
        layout = self.mem_pool_host.layout
        if layout == "page_first_direct":
            return buf[:, index // t]
        if layout == "page_first":
            return buf[:, index:index + t].permute(0, 2, 1, 3, 4)
        return buf[:, :, index:index + t]

    def _flat_view(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page as SGLang's legacy interface hands it (``get_data_page`` /
        ``set_from_flat_data_page`` order of the host layout), as [2, layers, tokens, heads, dim]
        (MLA: [layers, tokens, 1, latent])."""
        if self.mla:
            return mla_host.flat_page_view(self.mem_pool_host, flat, self.n_layers, self.page_size)
        t, n, h, d = self.page_size, self.n_layers, self.heads, self.head_dim
        if self.mem_pool_host.layout == "page_first":
            return flat.view(2, t, n, h, d).permute(0, 2, 1, 3, 4)
        return flat.view(2, n, t, h, d)

    def _staging(self) -> torch.Tensor:
        """This thread's page buffer (whole heads; MLA: the whole latent)."""
        st = getattr(self._local, "staging", None)
        if st is None or st.numel() != self.page_bytes:
            st = self._local.staging = torch.empty(self.page_bytes, dtype=torch.uint8)
        return st

    def _typed(self, staging: torch.Tensor) -> torch.Tensor:
        return staging.view(self.mem_pool_host.dtype).view(self.page_shape)

    def _index(self) -> PrefixIndex:
        """This thread's view of the mount's index (SQLite connections stay with their thread)."""
        ix = getattr(self._local, "index", None)
        if ix is None:
            ix = self._local.index = PrefixIndex(self.mount)
        return ix

    @staticmethod
    def _starts(keys: Sequence[str], host_indices: torch.Tensor, page_size: int) -> list[int]:
        flat = host_indices.reshape(-1).tolist()
        if len(flat) != len(keys) * page_size:
            raise ValueError(f"{len(flat)} host indices for {len(keys)} pages of {page_size} tokens")
        return [int(flat[i * page_size]) for i in range(len(keys))]

    # -- lookups and reads --------------------------------------------------------

    def _found(self, keys: Sequence[str], touch: bool) -> list[Digest]:
        lead = []
        for k in keys:
            if not is_key(k):
                break
            lead.append(k)
        return self._index().longest_prefix(self.space, lead, touch=touch) if lead else []

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        try:
            return len(self._found(keys, touch=False))
        except PffsError as e:
            log.warning("pffs HiCache storage: lookup of %d keys failed: %s", len(keys), e)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _read_page(self, d: Digest, dest: torch.Tensor) -> bool:
        """Blob *d* into the page view *dest* (this rank's heads); False for a blob
        missing, damaged or of another size.  Where *dest* is a whole page in a
        few large contiguous runs (page_first_direct: its K and its V; a flat
        page of the legacy interface) it is decoded straight into them, and a
        miss may leave them changed: SGLang frees the host slots of every page
        from a prefetch's first miss on.  Else (page_first, layer_first, a
        rank's heads) through this thread's staging buffer, *dest* untouched
        by a miss."""
        whole = self.tp_size == 1 or self.mla     # (MLA: every rank the whole latent)
        runs = contiguous_runs(dest) if whole else None
        staging = self._staging() if runs is None else None
        try:
            frame, cached = fetch_frame(self.blobs, self.access.bucket, d)
            if runs is not None:
                n, checked = decode_page(self.blobs, self.access.bucket, 0, d, frame, cached, runs)
            else:
                assert staging is not None
                out = staging.numpy().data
                n, checked = decode_page(self.blobs, self.access.bucket, 0, d, frame, cached, out)
                checked = checked or (n == self.page_bytes and digest_of(out) == d)
            if n != self.page_bytes or not checked:
                log.warning("pffs HiCache storage: blob %s is not a page of this geometry or is "
                            "damaged: a miss", d)
                return False
        except (MissingBlob, DamagedPage, PffsError) as e:
            log.warning("pffs HiCache storage: blob %s: %s: a miss", d, e)
            return False
        if staging is not None:
            page = self._typed(staging)
            if not whole:
                page = page[:, :, :, self.first_head:self.first_head + self.heads]
            dest.copy_(page)
        return True

    def _get(self, keys: Sequence[str], views: Callable[[int], list[torch.Tensor]]) -> list[bool]:
        """The leading run of *keys* the store holds, read into ``views(n)`` (the first n
        pages' views): True for each page read, up to the first miss."""
        ok = [False] * len(keys)
        try:
            digests = self._found(keys, touch=True)
            got = list(self._threads.map(self._read_page, digests, views(len(digests))))
        except (PffsError, ValueError) as e:
            log.warning("pffs HiCache storage: get of %d pages failed: %s", len(keys), e)
            return ok
        for i, g in enumerate(got):     # (the leading run only: a miss ends a prefix)
            if not g:
                break
            ok[i] = True
        return ok

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        return self._get(keys, lambda n: [self._view(s) for s in
                                          self._starts(keys, host_indices, self.page_size)[:n]])

    # -- writes -------------------------------------------------------------------

    def _put_page(self, src: torch.Tensor, puts: PagePuts, durable: bool) -> Digest:
        """Pin and store the page *src* (durable when this returns where *durable*)."""
        staging = self._staging()
        self._typed(staging).copy_(src)
        return puts.put(staging.numpy().data, codec=self.codec, durable=durable)

    def _set(self, keys: Sequence[str], views: Callable[[], list[torch.Tensor]]) -> list[bool]:
        """Store the pages ``views()`` gives (one a key) and keep them by *keys*."""
        if not self.writer:
            # MLA at tensor parallel > 1: rank 0 stores the latent every rank holds; the
            # others store nothing and say it is done, as SGLang's own backends do.
            return [True] * len(keys)
        if self.tp_size > 1 and not self.mla:
            if not self._said_slices:
                self._said_slices = True
                log.warning("pffs HiCache storage: at tensor parallel %d SGLang writes per-rank "
                            "slices and pffs keeps whole-head pages: rank %d stores nothing "
                            "(lookups and reads of stored pages work)", self.tp_size, self.tp_rank)
            return [False] * len(keys)
        if not all(is_key(k) for k in keys):
            log.warning("pffs HiCache storage: %d keys are not 64 hex digits: not stored", len(keys))
            return [False] * len(keys)
        try:
            # Pages the store holds by these keys already (a session's, or stored
            # before) are not stored again: no key-only row for a session's page.
            found = self._found(keys, touch=False)
        except PffsError:
            found = []
        held = len(found)
        # Those from the first whose blob is not stored (a read found it damaged
        # and set it aside, or it went) are written again: the damage heals.
        good = self._stored_run(found)
        if good == len(keys):
            return [True] * len(keys)
        try:
            # Pinned, the gc lock held shared while they are put, let go before the
            # keys are registered through the mount (engine_bridge.transport.store_puts).
            with PagePuts(self.access, self.blobs) as puts:
                pages = views()
                # (Healed pages are durable at once: the mount knows their blob rows
                # already, so its adoption of the new ones would not sync them.)
                healed = list(self._threads.map(lambda v: self._put_page(v, puts, True), pages[good:held]))
                if healed:
                    log.info("pffs HiCache storage: %d damaged or missing pages stored again", len(healed))
                digests = list(self._threads.map(lambda v: self._put_page(v, puts, False), pages[held:]))
                puts.stored()       # (a bucket: every upload in it before the mount looks)
                # (A page computed again to other bytes is kept by its key too.)
                changed = [(k, d) for k, d, was in zip(keys[good:held], healed, found[good:held]) if d != was]
                cache_blobs(self.mount, self.space, changed + list(zip(keys[held:], digests)))
            return [True] * len(keys)
        except (PffsError, OSError, ValueError) as e:
            log.warning("pffs HiCache storage: set of %d pages failed: %s", len(keys), e)
            return [False] * len(keys)

    def _stored_run(self, found: list[Digest]) -> int:
        """How many of the blobs *found* by key, from the first, the store holds
        (a local store: one stat each; a bucket is trusted, never asked)."""
        if self.access.bucket is not None:
            return len(found)
        for i, d in enumerate(found):
            if not self.blobs.contains(d):
                return i
        return len(found)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        return self._set(keys, lambda: [self._view(s) for s in
                                        self._starts(keys, host_indices, self.page_size)])

    # -- the legacy interface (without interface_v1): flat page copies -------------

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        """Each key's page into its flat target (a new one where none is given): the
        targets of the leading hits, None for the rest."""
        targets = list(target_locations) if target_locations is not None else \
            [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        ok = self._get(keys, lambda n: [self._flat_view(t) for t in targets[:n]])
        return [t if g else None for t, g in zip(targets, ok)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        pages = [v.reshape(-1) for v in values or ()]
        if len(pages) != len(keys):
            log.warning("pffs HiCache storage: %d pages for %d keys: not stored", len(pages), len(keys))
            return False
        return all(self._set(keys, lambda: [self._flat_view(p) for p in pages]))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def clear(self) -> None:
        """Nothing: the store's pages are sessions' and the key-only cache evicts itself."""

    def close(self) -> None:
        self._threads.shutdown(wait=True)
