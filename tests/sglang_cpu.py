"""SGLang's HiCache (radix cache, host KV pool, cache controller, L3 storage) on a machine
without an accelerator: test-only workarounds and a small builder.

SGLang 0.5.23 is installed by scripts/setup.sh from third_party/sglang/requirements.txt
with ``--no-deps`` (no triton, torchvision, flashinfer or CUDA libraries; torch stays
2.13.0+cpu).  Its HiCache code is device-agnostic Python, but a few things on its import
and transfer paths assume an accelerator.  :func:`install` patches them at run time,
from here only (nothing in SGLang's files is edited); each workaround below names the
SGLang code it replaces and why.

The builder follows SGLang's own unit-test kit
(``sglang/test/kits/unified_radix_cache/{fixtures,mixins,storage}.py``: ``build_fixture``,
``_init_hicache``, ``_l3_produce``, ``_l3_consumer``, ``_consume_prefetch``).  The kit
itself is not imported: its ``config.py`` imports ``sglang.test.test_utils``, which
imports SGLang's benchmark datasets (``datasets``, ``pandas``, ``pyarrow``), far from
light.  The objects are SGLang's real ones: ``MHATokenToKVPool`` on the CPU, its
``PagedTokenToKVPoolAllocator``, the ``UnifiedRadixCache`` (SGLang's radix cache; its
``init_hicache`` builds the host pool group, the ``MHATokenToKVPoolHost`` and the
``HybridCacheController``, a ``HiCacheController``), and the storage backend that
the controller's ``StorageBackendFactory`` creates.  With ``mla=True`` the device pool
is SGLang's ``MLATokenToKVPool`` and ``init_hicache`` builds an ``MLATokenToKVPoolHost``
(one latent row a token and layer; :func:`random_latent`, :meth:`HiCache.host_latent`,
:func:`mla_page_bytes`).  Write-through to L3 and prefetch
run on the controller's own backup and prefetch threads.

Usage::

    import sglang_cpu
    kw = dict(page_size=16, n_layers=2, n_heads=4, head_dim=64, dtype=torch.bfloat16,
              layout="page_first_direct", storage_backend="file", storage_dir=tmp)
    tokens = list(range(1, 65))
    with sglang_cpu.make_hicache(**kw) as hc:
        k, v = sglang_cpu.random_kv(hc, len(tokens))   # (n_layers, n_tokens, heads, dim)
        hc.insert(tokens, k, v)        # device pool + radix cache; starts the write-through
        hc.wait_storage_writes()       # device -> host -> L3 done
    with sglang_cpu.make_hicache(**kw) as fresh:        # new host pool and controller
        host_indices = fresh.prefetch(tokens)           # L3 -> host pool
        assert fresh.host_page_bytes(host_indices) == sglang_cpu.contract_page_bytes(k, v, 16)
        device_slots = fresh.load_back(tokens)          # host -> device pool

A dynamic backend: ``storage_backend="dynamic", backend_extra_config={"backend_name":
"pffs", "module_path": "engine_bridge.sglang", "class_name": "PffsHiCacheStorage",
"interface_v1": 1, "root": MOUNT}``.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
import threading
import time
import types
import weakref
from array import array
from typing import Any, Optional

import torch

_installed = False
_install_lock = threading.Lock()

# ---------------------------------------------------------------------------
# Import stubs: triton and torchvision, for SGLang's own modules only.
# ---------------------------------------------------------------------------
# sglang/srt/utils/common.py (and many kernel modules on the HiCache import chain:
# sglang/kernels/ops/..., srt/layers/...) import triton at module level and decorate
# functions with @triton.jit; sglang/srt/multimodal/internvl_utils.py (reached from
# srt/configs/__init__.py) imports torchvision.transforms.  Neither is installed here:
# triton is GPU-only weight, and torchvision's wheel is built against another torch
# (installed with --no-deps, its C++ ops fail to register against 2.13.0+cpu:
# "operator torchvision::nms does not exist").  None of those kernels or transforms
# run on the HiCache path.  The stubs are handed out by an
# ``builtins.__import__`` wrapper only to importers whose module name starts with
# "sglang": they never enter sys.modules, so torch (torch.utils._triton,
# torch._inductor) and transformers (is_torchvision_available, find_spec) still see
# neither package and keep their no-triton / no-torchvision paths.

_STUB_ROOTS = ("triton", "torchvision")


class _Anything:
    """A permissive stand-in for any attribute of a stubbed package (decorators,
    ``tl.constexpr`` annotations, dtypes, ``triton.cdiv``...)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, key: str):
        return _stub_attr(self._name, key)

    def __call__(self, *args, **kwargs):
        # As a decorator (@triton.jit, @triton.autotune(...)(fn)): return the function.
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _Anything):
            return args[0]
        return _Anything(f"{self._name}()")

    def __getitem__(self, key):
        return _Anything(f"{self._name}[]")

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __repr__(self):
        return f"<sglang_cpu stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, key: str):
        return _stub_attr(self.__name__, key)


def _stub_attr(owner: str, key: str) -> _Anything:
    """Attribute *key* of stub *owner*: any name is an :class:`_Anything`, but for dunders
    and ``driver`` (triton.runtime.driver.active...: "no active driver", as SGLang's fla
    utils expect on a machine without a GPU: they catch it and fall back to the cpu)."""
    if key.startswith("__"):
        raise AttributeError(key)
    if key == "driver":
        raise AttributeError(f"{owner}.driver (triton stub: no driver)")
    return _Anything(f"{owner}.{key}")


_stubs: dict[str, _StubModule] = {}


def _stub_module(name: str) -> _StubModule:
    mod = _stubs.get(name)
    if mod is None:
        mod = _stubs[name] = _StubModule(name)
        mod.__path__ = []  # a package: submodules import
        mod.__file__ = None
        if name == "triton":
            mod.__version__ = "3.5.0"
            mod.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
            mod.cdiv = lambda a, b: -(-a // b)
        elif name == "torchvision":
            mod.__version__ = "0.0.0"
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(_stub_module(parent), leaf, mod)
    return mod


_real_import = builtins.__import__


def _sglang_stub_import(name, globals=None, locals=None, fromlist=(), level=0):
    if (level == 0 and name.partition(".")[0] in _STUB_ROOTS
            and ((globals or {}).get("__name__") or "").startswith("sglang")):
        mod = _stub_module(name)
        return mod if fromlist else _stub_module(name.partition(".")[0])
    return _real_import(name, globals, locals, fromlist, level)


def _install_import_stubs() -> None:
    if builtins.__import__ is not _sglang_stub_import:
        builtins.__import__ = _sglang_stub_import


# ---------------------------------------------------------------------------
# Host pools without pinned memory.
# ---------------------------------------------------------------------------
# sglang/srt/mem_cache/pool_host/base.py HostKVCache.__init__ takes pin_memory from
# its subclasses (MHATokenToKVPoolHost defaults it to True); with it,
# pool_host/common.py alloc_with_host_register calls cudaHostRegister and
# MHATokenToKVPoolHost.get_dummy_flat_data_page asks torch for pinned memory, both of
# which need CUDA.  Every host pool is built with pin_memory=False instead (what
# SGLang's own kit does for its CPU-indexed fixtures, by wrapping
# get_mha_host_pool_cls).

def _patch_host_pool_pin_memory() -> None:
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    orig = HostKVCache.__init__
    if getattr(orig, "_sglang_cpu", False):
        return

    def __init__(self, *args, **kwargs):
        kwargs["pin_memory"] = False
        orig(self, *args, **kwargs)

    __init__._sglang_cpu = True
    __init__.__wrapped__ = orig
    HostKVCache.__init__ = __init__


# ---------------------------------------------------------------------------
# Device <-> host KV copies for the "direct" io backend, in plain torch.
# ---------------------------------------------------------------------------
# sglang/srt/mem_cache/pool_host/mha.py binds transfer_kv_direct,
# transfer_kv_per_layer_direct_pf_lf and transfer_kv_all_layer_direct_lf_pf from
# sgl_kernel.kvcacheio only on CUDA/HIP (or from _kvcacheio on XPU); elsewhere the
# names are unbound and MHATokenToKVPoolHost.backup_from_device_all_layer /
# load_to_device_per_layer fail with NameError.  These are the same copies by torch
# indexing, token by token (host token h of page_first_direct lives at
# kv_buffer[k|v, h // page_size, layer, h % page_size]).

def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """layer_first: dst_layers[i][dst_indices] = src_layers[i][src_indices]."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def _transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Device (layer-first: src_ptrs = [k_layer_0.., v_layer_0..]) -> host
    page_first_direct (dst_ptrs = [k_buffer, v_buffer], (page, layer, slot, head, dim)).
    MLA: src_ptrs = [latent_layer_0..], dst_ptrs = [kv_buffer] (page, layer, slot, 1, dim)."""
    num_layers = len(src_ptrs) // len(dst_ptrs)
    dst_indices = dst_indices.to(torch.int64).cpu()
    pages, slots = dst_indices // page_size, dst_indices % page_size
    for kv, dst in enumerate(dst_ptrs):
        for layer in range(num_layers):
            src = src_ptrs[kv * num_layers + layer]
            dst[pages, layer, slots] = src[src_indices.to(torch.int64).to(src.device)].to(dst.device)


def _transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, layer_id, dst_indices,
                                        page_size):
    """Host page_first_direct (src_ptrs = [k_buffer, v_buffer]) -> device layer
    ``layer_id`` (dst_ptrs = [k_layer, v_layer])."""
    src_indices = src_indices.to(torch.int64).cpu()
    pages, slots = src_indices // page_size, src_indices % page_size
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst[dst_indices.to(torch.int64).to(dst.device)] = src[pages, layer_id, slots].to(dst.device)


# The "kernel" io backend's device -> host copy into a page_first host pool
# (sgl_kernel.kvcacheio transfer_kv_all_layer_lf_pf, CUDA only) takes the device
# layers as a table of data pointers (pool_host/common.py make_kernel_ptr_table:
# tensor.data_ptr() on the CPU).  The stand-in finds the device pool's tensors by those
# pointers among the ones make_hicache registered, and copies by torch indexing: host
# token h, layer l of page_first lives at kv_buffer[k|v, h, l].  (SGLang's server
# arguments turn page_first with the direct backend into page_first_direct, so
# page_first runs only on this backend.)

_device_layers: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _register_device_layers(kv_pool) -> None:
    for t in (*kv_pool.k_buffer, *kv_pool.v_buffer):
        _device_layers[t.data_ptr()] = t


def _transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices,
                                 item_size, dst_layout_dim, num_layers):
    """Device (layer-first pointer tables) -> host page_first (dst_k, dst_v:
    (tokens, layers, heads, dim))."""
    row = dst_k.shape[-2] * dst_k.shape[-1] * dst_k.element_size()
    if (item_size, dst_layout_dim) != (row, row * num_layers):
        raise ValueError(f"not a page_first host pool: item {item_size}, layer stride {dst_layout_dim}")
    src_indices = src_indices.to(torch.int64).cpu()
    dst_indices = dst_indices.to(torch.int64).cpu()
    for ptrs, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        for layer, ptr in enumerate(ptrs.tolist()[:num_layers]):
            src = _device_layers[int(ptr)]
            dst[dst_indices, layer] = src[src_indices.to(src.device)].to(dst.device)


# MLA (sglang/srt/mem_cache/pool_host/mla.py binds its kvcacheio names the same way):
# the direct copies above serve its layer_first and page_first_direct pools (one
# latent buffer instead of K and V); its page_first pool runs on the kernel backend,
# whose two copies stand in here (host token h, layer l of page_first lives at
# kv_buffer[h, l], a (1, latent) row; a device layer is (slots, 1, latent)).

def _register_device_latent_layers(kv_pool) -> None:
    for t in kv_pool.kv_buffer:
        _device_layers[t.data_ptr()] = t


def _transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size,
                                     dst_layout_dim, num_layers):
    """Device MLA layers (a pointer table) -> host page_first (dst: (tokens, layers, 1, latent))."""
    row = dst.shape[-2] * dst.shape[-1] * dst.element_size()
    if (item_size, dst_layout_dim) != (row, row * num_layers):
        raise ValueError(f"not a page_first MLA host pool: item {item_size}, layer stride {dst_layout_dim}")
    src_indices = src_indices.to(torch.int64).cpu()
    dst_indices = dst_indices.to(torch.int64).cpu()
    for layer, ptr in enumerate(src_layers.tolist()[:num_layers]):
        src = _device_layers[int(ptr)]
        dst[dst_indices, layer] = src[src_indices.to(src.device)].to(dst.device)


def _transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size,
                                     src_layout_dim):
    """Host page_first MLA (src: (tokens, layers, 1, latent)) -> device layer *dst*."""
    row = src.shape[-2] * src.shape[-1] * src.element_size()
    if (item_size, src_layout_dim) != (row, row * src.shape[1]):
        raise ValueError(f"not a page_first MLA host pool: item {item_size}, layer stride {src_layout_dim}")
    src_indices = src_indices.to(torch.int64).cpu()
    dst[dst_indices.to(torch.int64).to(dst.device)] = src[src_indices, layer_id].to(dst.device)


def _patch_transfers() -> None:
    from sglang.srt.mem_cache.pool_host import mha, mla

    for mod, name, fn in ((mha, "transfer_kv_direct", _transfer_kv_direct),
                          (mha, "transfer_kv_all_layer_direct_lf_pf", _transfer_kv_all_layer_direct_lf_pf),
                          (mha, "transfer_kv_per_layer_direct_pf_lf", _transfer_kv_per_layer_direct_pf_lf),
                          (mha, "transfer_kv_all_layer_lf_pf", _transfer_kv_all_layer_lf_pf),
                          (mla, "transfer_kv_direct", _transfer_kv_direct),
                          (mla, "transfer_kv_all_layer_direct_lf_pf", _transfer_kv_all_layer_direct_lf_pf),
                          (mla, "transfer_kv_per_layer_direct_pf_lf", _transfer_kv_per_layer_direct_pf_lf),
                          (mla, "transfer_kv_all_layer_mla_lf_pf", _transfer_kv_all_layer_mla_lf_pf),
                          (mla, "transfer_kv_per_layer_mla_pf_lf", _transfer_kv_per_layer_mla_pf_lf)):
        if not hasattr(mod, name):
            setattr(mod, name, fn)


# ---------------------------------------------------------------------------
# get_device() on a machine with no accelerator.
# ---------------------------------------------------------------------------
# sglang/srt/utils/common.py get_device answers "cpu" only in SGLang's CPU-engine mode
# (SGLANG_USE_CPU_ENGINE=1, which needs sgl_kernel's CPU build: memory_pool.py then
# imports sgl_kernel) and otherwise raises "No accelerator ... is available".  SGLang's
# unit-test kit (fixtures.build_fixture) places its pools with it.  The wrapper answers
# "cpu" where the original raises; modules that already bound the name are rebound.

def _patch_get_device() -> None:
    import sys

    from sglang.srt.utils import common

    orig = common.get_device
    if getattr(orig, "_sglang_cpu", False):
        return

    def get_device(device_id: Optional[int] = None) -> str:
        try:
            return orig(device_id)
        except RuntimeError:
            return "cpu"

    get_device._sglang_cpu = True
    get_device.__wrapped__ = orig
    for name, mod in list(sys.modules.items()):
        if name.startswith("sglang") and getattr(mod, "get_device", None) is orig:
            mod.get_device = get_device


# ---------------------------------------------------------------------------
# torch.cpu.Stream.synchronize.
# ---------------------------------------------------------------------------
# sglang/srt/mem_cache/l2_transfer.py L2TransferEngine._submission runs the device<->host
# copies on get_device_module().Stream() -- torch.cpu.Stream here -- and on an error
# calls stream.synchronize() before re-raising; torch.cpu.Stream has no synchronize, so
# the AttributeError would hide the copy's own error.  CPU work is synchronous: a no-op.

def _patch_cpu_stream_synchronize() -> None:
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None


# ---------------------------------------------------------------------------
# A single-rank topology.
# ---------------------------------------------------------------------------
# HiCache reads the process's place in the parallel groups (runtime_context
# get_parallel(): tp_rank, tp_size, pp_rank, pp_size -- HiCacheController
# _generate_storage_config, HiCacheFile's file names) and raises where nothing
# published it, as in a unit test without torch.distributed.  SGLang's kit forces the
# local single-rank topology with get_parallel().override(...) around each fixture;
# here it is stated once for the test process (only where nothing else stated it).

def _single_rank_topology() -> None:
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        _ = parallel.tp_rank
    except RuntimeError:
        parallel.override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)


def install() -> None:
    """Apply every workaround (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _install_import_stubs()
        _patch_get_device()
        _patch_cpu_stream_synchronize()
        _patch_host_pool_pin_memory()
        _patch_transfers()
        _single_rank_topology()
        _installed = True


# ---------------------------------------------------------------------------
# The builder.
# ---------------------------------------------------------------------------

def _poll(cond, timeout: float, what: str, pump=None) -> None:
    """Call *pump* (SGLang's scheduler-side event pump) and test *cond* until it holds
    or *timeout* seconds pass (TimeoutError).  The controller's storage threads do the
    work; between rounds this yields the CPU for at most a millisecond."""
    deadline = time.monotonic() + timeout
    while True:
        if pump is not None:
            pump()
        if cond():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done after {timeout} s")
        time.sleep(0.001)


@dataclasses.dataclass
class StorageWrite:
    """One host -> L3 write the controller's backup thread ran (a StorageOperation)."""
    keys: list[str]
    host_indices: torch.Tensor
    completed_tokens: int
    page_size: int

    @property
    def complete(self) -> bool:
        return self.completed_tokens == len(self.keys) * self.page_size


@dataclasses.dataclass
class HiCache:
    """SGLang's real HiCache objects on the CPU, and test helpers around them."""

    server_args: Any            # sglang.srt.server_args.ServerArgs
    req_to_token_pool: Any      # ReqToTokenPool
    kv_pool: Any                # MHATokenToKVPool (device pool, on the CPU; MLATokenToKVPool with mla)
    allocator: Any              # PagedTokenToKVPoolAllocator
    cache: Any                  # UnifiedRadixCache (the radix tree, HiCache on)
    controller: Any             # HybridCacheController (a HiCacheController)
    host_pool: Any              # MHATokenToKVPoolHost (MLATokenToKVPoolHost), the group's anchor
    storage: Any                # the L3 backend (HiCacheFile, a dynamic backend, ...)
    page_size: int
    mla: bool = False           # a latent (MLA) cache: K is the latent, there is no V
    storage_writes: list = dataclasses.field(default_factory=list)
    _closed: bool = False

    # -- device side --------------------------------------------------------
    def write_kv(self, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V, each (n_layers, len(indices), n_heads, head_dim), at device
        token slots *indices* of the device pool.  MLA: *k* is the latent,
        (n_layers, len(indices), kv_lora_rank + qk_rope_head_dim), *v* None, stored by
        the pool's own set_kv_buffer (a whole latent row a token)."""
        if self.mla:
            if v is not None:
                raise ValueError("an MLA pool caches one latent a token: no V")
            for layer in range(self.kv_pool.layer_num):
                self.kv_pool.set_kv_buffer(None, indices, k[layer].unsqueeze(1), None,
                                           layer_id_override=layer)
            return
        for layer in range(self.kv_pool.layer_num):
            # (an fp8 pool stores uint8: the fp8 values' bytes)
            store = self.kv_pool.k_buffer[layer].dtype
            self.kv_pool.k_buffer[layer][indices] = k[layer].to(self.kv_pool.dtype).view(store)
            self.kv_pool.v_buffer[layer][indices] = v[layer].to(self.kv_pool.dtype).view(store)

    def device_kv(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at device token slots *indices*: (n_layers, n, n_heads, head_dim) each."""
        k = torch.stack([self.kv_pool.k_buffer[layer][indices] for layer in range(self.kv_pool.layer_num)])
        v = torch.stack([self.kv_pool.v_buffer[layer][indices] for layer in range(self.kv_pool.layer_num)])
        return k.view(self.kv_pool.dtype), v.view(self.kv_pool.dtype)

    def device_latent(self, indices: torch.Tensor) -> torch.Tensor:
        """The MLA latent at device token slots *indices*: (n_layers, n, latent)."""
        lat = torch.stack([self.kv_pool.kv_buffer[layer][indices, 0]
                           for layer in range(self.kv_pool.layer_num)])
        return lat.view(self.kv_pool.dtype)

    def radix_key(self, tokens, extra_key: Optional[str] = None, cache_salt: Optional[str] = None):
        from sglang.srt.mem_cache.radix_cache import RadixKey
        return RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=cache_salt)

    def insert(self, tokens, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
               extra_key: Optional[str] = None, cache_salt: Optional[str] = None) -> torch.Tensor:
        """Allocate device slots for *tokens* (whole pages), store K/V there (when given)
        and insert the sequence into the radix cache, as a finished request's prefill
        does.  With the write_through policy the insert itself starts the device -> host
        backup; :meth:`wait_storage_writes` pumps it on to L3.  Returns the device slots."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        n = len(tokens)
        if n % self.page_size:
            raise ValueError(f"{n} tokens is not a whole number of {self.page_size}-token pages")
        indices = self.allocator.alloc(n)
        if indices is None:
            raise MemoryError(f"device pool has no room for {n} tokens")
        indices = indices.to(torch.int64)
        if k is not None:
            self.write_kv(indices, k, v)
        self.cache.insert(InsertParams(key=self.radix_key(tokens, extra_key, cache_salt), value=indices))
        return indices

    # -- write-through ------------------------------------------------------
    def storage_writes_pending(self) -> bool:
        c, cc = self.cache, self.controller
        return bool(c.ongoing_write_through or c.ongoing_backup or cc.write_queue
                    or cc.ack_write_queue or (cc.enable_storage and not cc.backup_queue.empty()))

    def wait_storage_writes(self, timeout: float = 30.0, check: bool = True) -> list[StorageWrite]:
        """Pump SGLang's event loop step (UnifiedRadixCache.check_hicache_events: submit
        the device -> host copies, finish their acks, which queues the host -> L3 writes,
        and drain the storage acks) until no backup is in flight.  Returns the storage
        writes run so far (and forgets them); with *check*, raises if one did not
        complete."""
        _poll(lambda: not self.storage_writes_pending(), timeout, "HiCache storage writes",
              self.cache.check_hicache_events)
        done, self.storage_writes[:] = list(self.storage_writes), []
        if check:
            bad = [w for w in done if not w.complete]
            if bad:
                raise RuntimeError(f"storage writes incomplete: {bad}")
        return done

    # -- prefetch -----------------------------------------------------------
    def prefetch(self, tokens, timeout: float = 30.0, rid: Optional[str] = None,
                 extra_key: Optional[str] = None, cache_salt: Optional[str] = None) -> torch.Tensor:
        """Prefetch *tokens* from L3 into the host pool, as the scheduler does for a new
        request whose prefix is not cached (UnifiedRadixCache.prefetch_from_storage from
        the root, then check_hicache_events / check_prefetch_progress until done), and
        return the host token indices now holding the sequence's cached prefix (those of
        its matched host nodes, root first; empty if nothing was fetched)."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        self._prefetch_seq = getattr(self, "_prefetch_seq", 0) + 1
        handle = CacheRequestHandle(rid or f"sglang_cpu-prefetch-{self._prefetch_seq}", 0)
        self.cache.prefetch_from_storage(handle, self.cache.root_node_handle(), array("q", tokens),
                                         None, None, extra_key=extra_key, cache_salt=cache_salt)
        _poll(lambda: self.cache.check_prefetch_progress(handle), timeout, "HiCache prefetch",
              self.cache.check_hicache_events)
        self.cache.pop_prefetch_loaded_tokens(handle)
        return self.host_indices(tokens, extra_key=extra_key, cache_salt=cache_salt)

    def host_indices(self, tokens, extra_key: Optional[str] = None,
                     cache_salt: Optional[str] = None) -> torch.Tensor:
        """Host token indices of the host-only (not on device) prefix of *tokens* in the
        radix cache: the transfer the cache would load back (tree_core
        .build_load_back_spec of the deepest host node)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        m = self.cache.match_prefix(MatchPrefixParams(key=self.radix_key(tokens, extra_key, cache_salt)))
        if m.host_hit_length == 0:
            return torch.empty((0,), dtype=torch.int64)
        kv_xfer, _ = self.cache.tree_core.build_load_back_spec(m.last_host_node)
        return kv_xfer.host_indices

    def load_back(self, tokens, extra_key: Optional[str] = None, cache_salt: Optional[str] = None,
                  timeout: float = 30.0) -> torch.Tensor:
        """Load the host-only prefix of *tokens* back into the device pool (host -> device,
        as SGLang's kit does it: UnifiedRadixCache.load_back of the deepest host node,
        ready_to_load_host_cache, then loading_check once the copy's ack is done) and
        return the device slots of the sequence's whole cached prefix."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        key = self.radix_key(tokens, extra_key, cache_salt)
        m = self.cache.match_prefix(MatchPrefixParams(key=key))
        if m.host_hit_length:
            if not self.cache.load_back(m.last_host_node):
                raise MemoryError("load_back refused (device pool full?)")
            self.cache.ready_to_load_host_cache()
            for ack in list(self.controller.ack_load_queue):
                ack.finish_event.synchronize()
            _poll(lambda: not self.cache.ongoing_load_back, timeout, "HiCache load-back",
                  self.cache.loading_check)
            m = self.cache.match_prefix(MatchPrefixParams(key=key))
        return self.cache.path_device_indices(m.last_device_node)

    # -- host pool bytes ----------------------------------------------------
    def host_pages(self, host_indices: torch.Tensor) -> list[torch.Tensor]:
        """The host pool page of every page_size run of *host_indices*, as SGLang hands a
        page to storage (MHATokenToKVPoolHost.get_data_page: for page_first_direct,
        kv_buffer[:, p] of shape (2, n_layers, page_size, n_heads, head_dim))."""
        ps = self.page_size
        return [self.host_pool.get_data_page(int(host_indices[i]), flat=False)
                for i in range(0, len(host_indices), ps)]

    def host_latent(self, host_indices: torch.Tensor) -> torch.Tensor:
        """The MLA host pool's latent at host token indices *host_indices*, whatever its
        layout: (n_layers, n, latent) (MLATokenToKVPoolHost.init_kv_buffer: layer_first
        (layers, tokens, 1, latent), page_first (tokens, layers, 1, latent),
        page_first_direct (pages, layers, page_size, 1, latent))."""
        buf, idx, layout = self.host_pool.kv_buffer, host_indices.to(torch.int64), self.host_pool.layout
        if layout == "layer_first":
            return buf[:, idx, 0]
        if layout == "page_first":
            return buf[idx, :, 0].transpose(0, 1)
        if layout == "page_first_direct":
            return buf[idx // self.page_size, :, idx % self.page_size, 0].transpose(0, 1)
        raise ValueError(f"no latent view of host layout {layout!r}")

    def host_page_bytes(self, host_indices: torch.Tensor) -> list[bytes]:
        """The bytes of each page of :meth:`host_pages` (K then V, each
        [n_layers, page_size, n_heads, head_dim], C order: pffs contract §1)."""
        return [_tensor_bytes(page) for page in self.host_pages(host_indices)]

    def page_keys(self, tokens, extra_key: Optional[str] = None,
                  cache_salt: Optional[str] = None) -> list[str]:
        """SGLang's storage key of every full page of *tokens* (mem_cache/utils.py
        get_storage_hash_str: the chain seeded by the request's namespace)."""
        from sglang.srt.mem_cache.utils import get_storage_hash_str
        key = self.radix_key(tokens, extra_key, cache_salt).page_aligned(self.page_size)
        return list(get_storage_hash_str(key, None, page_size=self.page_size)) if len(key) else []

    def close(self) -> None:
        """Stop the controller's storage threads and release the host pool."""
        if self._closed:
            return
        self._closed = True
        import atexit
        atexit.unregister(self.cache.shutdown)
        if self.controller.enable_storage:
            self.controller._stop_storage_threads()
        self.cache.release_host_resources()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _record_storage_writes(hc: HiCache) -> None:
    """Keep each host -> L3 write the backup thread runs (per-instance wrapper of the
    controller's own _page_backup_or_log) in hc.storage_writes."""
    cc = hc.controller
    inner = cc._page_backup_or_log

    def _page_backup_or_log(operation):
        try:
            inner(operation)
        finally:
            hc.storage_writes.append(StorageWrite(list(operation.hash_value or []),
                                                  operation.host_indices,
                                                  operation.completed_tokens, hc.page_size))

    cc._page_backup_or_log = _page_backup_or_log


def make_hicache(page_size: int = 16, n_layers: int = 2, n_heads: int = 4, head_dim: int = 64,
                 dtype: torch.dtype = torch.bfloat16, layout: str = "page_first_direct",
                 storage_backend: Optional[str] = "file", storage_dir: Optional[str] = None,
                 backend_extra_config: Optional[dict] = None, device_tokens: int = 1024,
                 host_tokens: Optional[int] = None, prefetch_threshold: Optional[int] = None,
                 write_policy: str = "write_through", tree_core: Optional[str] = None,
                 model_path: str = "dummy", mla: bool = False, kv_lora_rank: int = 128,
                 qk_rope_head_dim: int = 32) -> HiCache:
    """Build SGLang's HiCache stack on the CPU, the way its unit-test kit does
    (fixtures.build_fixture + mixins._init_hicache) with the production controller.

    - device: ``MHATokenToKVPool`` (*device_tokens* slots, on "cpu"), its
      ``PagedTokenToKVPoolAllocator`` and a ``ReqToTokenPool``;
    - ``UnifiedRadixCache`` with the FULL component, then ``init_hicache``: the host
      pool (``MHATokenToKVPoolHost``, *layout*, *host_tokens* slots, default twice the
      device pool) in a host pool group, and the ``HybridCacheController`` with io
      backend "direct" ("kernel" for page_first, the one backend SGLang runs it
      on: its copy stands in above), *write_policy* and the L3 backend, created by SGLang's
      ``StorageBackendFactory`` from ``--hicache-storage-backend`` *storage_backend*
      and ``--hicache-storage-backend-extra-config`` (JSON of *backend_extra_config*;
      with "file", *storage_dir* goes in as its "file_storage_path");
    - *prefetch_threshold* (tokens, default one page: a prefetch of a shorter prefix is
      declined) goes in the extra config, as SGLang reads it from there;
    - *tree_core*: "python" or "rust" (SGLang's default, which falls back to python
      where the Rust core lacks a feature), the radix tree's core.

    - *mla*: a latent cache instead: the device pool is SGLang's ``MLATokenToKVPool``
      (*kv_lora_rank* + *qk_rope_head_dim* values a token and layer; *n_heads* and
      *head_dim* unused), so ``init_hicache`` builds an ``MLATokenToKVPoolHost`` and the
      controller tells the storage backend ``is_mla_model``.

    The storage backend may be None (host pool only)."""
    install()
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    if device_tokens % page_size:
        raise ValueError("device_tokens must be a whole number of pages")
    host_tokens = 2 * device_tokens if host_tokens is None else host_tokens
    extra = dict(backend_extra_config or {})
    extra.setdefault("prefetch_threshold", page_size if prefetch_threshold is None else prefetch_threshold)
    if storage_backend == "file":
        if storage_dir is None:
            raise ValueError('storage_backend="file" needs a storage_dir')
        if os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"):
            raise RuntimeError("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR is set: HiCacheFile "
                               "would use it instead of storage_dir")
        extra["file_storage_path"] = str(storage_dir)
    server_args = ServerArgs(
        model_path=model_path,
        page_size=page_size,
        hicache_ratio=host_tokens / device_tokens,
        hicache_io_backend="kernel" if layout == "page_first" else "direct",
        hicache_mem_layout=layout,
        hicache_write_policy=write_policy,
        hicache_storage_backend=storage_backend,
        hicache_storage_backend_extra_config=json.dumps(extra) if storage_backend else None,
        hicache_storage_prefetch_policy="wait_complete",
        hicache_host_memory_mode="cache",
        kv_cache_dtype={torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}.get(dtype, "auto"),
    )
    set_global_server_args_for_scheduler(server_args)

    req_to_token_pool = ReqToTokenPool(size=8, max_context_len=device_tokens, device="cpu",
                                       enable_memory_saver=False)
    if mla:
        kv_pool = MLATokenToKVPool(size=device_tokens, page_size=page_size, dtype=dtype,
                                   kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                                   layer_num=n_layers, device="cpu", enable_memory_saver=False)
        _register_device_latent_layers(kv_pool)
    else:
        kv_pool = MHATokenToKVPool(size=device_tokens, page_size=page_size, dtype=dtype, head_num=n_heads,
                                   head_dim=head_dim, layer_num=n_layers, device="cpu",
                                   enable_memory_saver=False)
        _register_device_layers(kv_pool)
    allocator = PagedTokenToKVPoolAllocator(size=device_tokens, page_size=page_size, dtype=dtype,
                                            device="cpu", kvcache=kv_pool, need_sort=False)
    params = CacheInitParams(req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
                             page_size=page_size, disable=False, tree_components=(ComponentType.FULL,),
                             tree_core_backend=tree_core)
    cache = UnifiedRadixCache(params=params)
    cache.init_hicache(server_args, params)
    cc = cache.cache_controller
    hc = HiCache(server_args=server_args, req_to_token_pool=req_to_token_pool, kv_pool=kv_pool,
                 allocator=allocator, cache=cache, controller=cc,
                 host_pool=cc.mem_pool_host.anchor_entry.host_pool, storage=cc.storage_backend,
                 page_size=page_size, mla=mla)
    if cc.enable_storage:
        # As SGLang's kit does: the controller leaves half the host pool to write-back
        # and declines a prefetch past the rest; a test may prefetch a whole host pool.
        cc.prefetch_capacity_limit = max(cc.prefetch_capacity_limit, cc.mem_pool_host.size)
        _record_storage_writes(hc)
    return hc


def random_kv(hc: HiCache, n_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V for *n_tokens* tokens: (n_layers, n_tokens, n_heads, head_dim) each,
    in the pool's dtype."""
    g = torch.Generator().manual_seed(seed)
    pool = hc.kv_pool
    shape = (pool.layer_num, n_tokens, pool.head_num, pool.head_dim)
    return (torch.randn(shape, generator=g).to(pool.dtype), torch.randn(shape, generator=g).to(pool.dtype))


def contract_page_bytes(k: torch.Tensor, v: torch.Tensor, page_size: int) -> list[bytes]:
    """pffs contract §1 page bytes of K/V (n_layers, n_tokens, n_heads, head_dim): per full
    page, K[:, page] then V[:, page], C order."""
    return [_tensor_bytes(k[:, s:s + page_size]) + _tensor_bytes(v[:, s:s + page_size])
            for s in range(0, k.shape[1] - page_size + 1, page_size)]


def random_latent(hc: HiCache, n_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MLA cache rows for *n_tokens* tokens, in the pool's dtype: the compressed
    KV (n_layers, n_tokens, kv_lora_rank) and its rotary part (n_layers, n_tokens,
    qk_rope_head_dim)."""
    g = torch.Generator().manual_seed(seed)
    pool = hc.kv_pool
    nope = torch.randn((pool.layer_num, n_tokens, pool.kv_lora_rank), generator=g).to(pool.dtype)
    rope = torch.randn((pool.layer_num, n_tokens, pool.qk_rope_head_dim), generator=g).to(pool.dtype)
    return nope, rope


def mla_page_bytes(nope: torch.Tensor, rope: torch.Tensor, page_size: int) -> list[bytes]:
    """SPEC §1.1 page bytes, built by hand: per full page one C-ordered
    [n_layers, page_size, latent] array, each latent the compressed KV then the rotary part."""
    n_tokens = nope.shape[1]
    out = []
    for s in range(0, n_tokens - page_size + 1, page_size):
        page = bytearray()
        for layer in range(nope.shape[0]):
            for t in range(s, s + page_size):
                page += _tensor_bytes(nope[layer, t]) + _tensor_bytes(rope[layer, t])
        out.append(bytes(page))
    return out
