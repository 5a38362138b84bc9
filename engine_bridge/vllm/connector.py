"""``PffsConnector``: vLLM requests save their KV as pffs sessions, and start from them.

A request names what it wants in ``kv_transfer_params``:

- ``{"pffs_save": NAME}``: when it finishes, the KV of its computed tokens
  (prompt and output) is paged out as the session ``ROOT/NAME`` (token ids,
  model identity, layout and the request's other inputs in the manifest).
  Its blocks stay held until the page-out is done, then vLLM frees them.
  The response says the save is *scheduled*; it ends, without any further
  step of the engine, with ``ROOT/NAME`` appearing whole, or with
  ``ROOT/NAME.save-failed`` holding one line that says why (kept outside
  the mount where it went away: pffs.client.wait; ``pffs wait ROOT/NAME``
  waits for either).  A name is checked when the request arrives
  (engine_bridge.transport.save_names).
- ``{"pffs_load_prefix": true}`` (or ``load_prefix`` in the connector's
  config: every request without a name): the longest run of the prompt's
  full pages that the mount's token-chain index holds, whichever sessions
  (or SGLang's stored pages) hold them, loaded as a named session's are.
- ``{"pffs_load": NAME}``: the full pages of session ``ROOT/NAME`` whose
  tokens the prompt starts with (at most the prompt less its last token,
  which vLLM computes) are loaded into the blocks vLLM allocated, after
  vLLM's own prefix cache: a local hit comes first.  The load runs beside
  the engine's steps; the request waits for it, other requests do not.

What the connector did comes back in the request's output
``kv_transfer_params``: ``pffs_save_scheduled``/``pffs_loaded`` (token
counts) or ``pffs_error`` (one line: why nothing was saved or loaded).  A
refusal never costs a block: the request then computes its prompt itself.

Sessions do not depend on parallelism: at tensor-parallel size k every rank
gives its heads of each page to the group's first rank, which writes
whole-head pages; a load at any size whose head split divides the heads
scatters each rank's slice.  Multi-head latent attention (DeepSeek-V2/V3,
Kimi K2) is saved as SPEC §1.1 pages (one latent vector a token and layer):
every rank holds the whole latent, so the first rank alone writes and every
rank loads whole pages; an engine whose rotary embedding turns MLA's key
view other than vLLM's reference code does is refused at start.
Sliding-window models run with vLLM's hybrid KV cache manager on
(``SupportsHMA``): each page takes every cache group's
block, the windowed layers only where the window reaches
(engine_bridge.vllm.windows).  Pipeline parallel is refused at start.
``docs/engines.md`` §10 says more.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec, SlidingWindowSpec

from engine_bridge.core.bridge import Bridge, SeqBlocks
from engine_bridge.core.identity import checkpoint_weights_sha256, hf_config_sha256
from engine_bridge.core.pool import DEFAULT_KV, DTYPE_NAMES, BlockId, KVPool, MlaKVPool, VllmKVPool, mla_kv
from engine_bridge.errors import BridgeError
from engine_bridge.transport.mountinfo import StoreAccess, mounted_store, store_access
from engine_bridge.transport.save_names import save_place
from engine_bridge.transport.store_blobs import BlobSource
from engine_bridge.vllm.kinds import kv_scales, page_dtype, refused_kind
from engine_bridge.vllm.lanes import HeadSlicePool, JoinedPool, Lane, wait_lanes
from engine_bridge.vllm.packing import check_latent_rope, check_latent_rows, engine_packing
from engine_bridge.vllm.plans import (
    INPUTS,
    LOAD,
    PREFIX,
    SAVE,
    LoadPlan,
    inputs_of,
    plan_load,
    plan_prefix,
    prefix_manifest,
    prefix_space,
    session_path,
)
from engine_bridge.vllm.windows import NULL_BLOCK, WindowedPool, kept, model_order
from pffs.client.prefix_lookup import PrefixIndex
from pffs.client.wait import failure_record, forget_failure, record_failure
from pffs.manifest import parse

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.pffs")

#: How long a step with nothing scheduled waits for a lane's job to end
#: (vLLM steps an idle engine in a loop while saves or loads are pending:
#: unchecked, that loop takes a core from the page-outs it waits for).
IDLE_WAIT = 0.05


@dataclass
class SaveJob:
    req_id: str
    name: str
    block_ids: list[int]
    n_tokens: int
    token_ids: list[int] | None
    inputs: dict[str, Any] = field(default_factory=dict)
    groups: list[list[int]] | None = None   # (cache groups: each group's blocks, page by page)


@dataclass
class LoadJob:
    req_id: str
    name: str
    page_ixs: list[int]
    block_ids: list[int]
    digests: list[str] | None = None    # a prefix found by tokens: page i is blob digests[i]
    trust: bool = False                 # a session without a weights fingerprint, trusted
    groups: list[list[int]] | None = None   # (cache groups: each group's blocks, page by page)


@dataclass
class PffsConnectorMetadata(KVConnectorMetadata):
    """What the scheduler asks the workers to do this step."""

    saves: list[SaveJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    idle: bool = False          # no token is computed this step


class PffsConnector(KVConnectorBase_V1, SupportsHMA):
    """A vLLM KV connector over a folder of a pffs mount (``extra_config["root"]``).

    ``kv_connector_extra_config``: ``root`` (required), ``engine`` (the
    manifest's engine name, default ``vllm``), ``token_ids`` (store the
    tokens, default true; without them a session cannot be loaded by
    prompt), ``model_name`` (default the model vLLM serves), ``save_nice``
    and ``load_nice`` (the lanes' nice values, default 0 and 15: a load
    yields the cores to the step, a save does not), ``load_failure``
    (``recompute``, the default, or ``fail``: vLLM's ``kv_load_failure_policy``
    is set from it).
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("root"):
            raise ValueError("PffsConnector needs kv_connector_extra_config.root: a folder in a pffs mount")
        self.root = Path(extra["root"])
        self.engine = str(extra.get("engine", "vllm"))
        self.store_tokens = bool(extra.get("token_ids", True))
        self.nice = (int(extra.get("save_nice", 0)), int(extra.get("load_nice", 15)))
        refused = refused_kind(vllm_config, kv_cache_config)
        if refused:
            raise ValueError(f"PffsConnector: {refused}")
        groups = kv_cache_config.kv_cache_groups
        spec = groups[0].kv_cache_spec
        assert isinstance(spec, AttentionSpec)      # (refused_kind refuses any other)
        par, mc = vllm_config.parallel_config, vllm_config.model_config
        if par.pipeline_parallel_size > 1:
            raise ValueError("PffsConnector: pipeline parallel (size "
                             f"{par.pipeline_parallel_size}) is not supported; use tensor parallel")
        self.tp = par.tensor_parallel_size
        # MLA (SPEC §1.1): one latent "head" of kv_lora_rank + qk_rope_head_dim
        # values, whole on every rank.
        self.mla = self._latent(spec, mc.hf_text_config) if isinstance(spec, MLAAttentionSpec) else None
        self.kv = mla_kv(*self.mla) if self.mla else dict(DEFAULT_KV)
        self.n_heads = 1 if self.mla else mc.get_total_num_kv_heads()
        if not self.mla and (self.n_heads % self.tp or spec.num_kv_heads * self.tp != self.n_heads):
            raise ValueError(f"PffsConnector: {self.n_heads} KV heads do not split evenly over "
                             f"tensor-parallel size {self.tp}")
        # vLLM's hybrid KV cache manager keeps sliding-window layers (and
        # full-attention layers past a group's size) in cache groups, each
        # with its blocks: a page takes every layer, in the model's order.
        self.layer_names = (list(groups[0].layer_names) if len(groups) == 1
                            else model_order([n for g in groups for n in g.layer_names]))
        self.group_layers = [[self.layer_names.index(n) for n in g.layer_names] for g in groups]
        self.windowed = [isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in groups]
        self.window = next((int(g.kv_cache_spec.sliding_window) for g in groups
                            if isinstance(g.kv_cache_spec, SlidingWindowSpec)), None)
        self.block_size = spec.block_size
        # Whole-head geometry: what a session holds at any parallelism.
        self.geometry = {"page_size_tokens": spec.block_size, "n_layers": len(self.layer_names),
                         "n_heads": self.n_heads, "head_dim": spec.head_size,
                         "dtype": DTYPE_NAMES[page_dtype(vllm_config.cache_config.cache_dtype, spec.dtype)]}
        try:
            self.kv["scales"] = kv_scales(vllm_config, self.layer_names)
        except ValueError as e:
            raise ValueError(f"PffsConnector: {e}") from None
        if self.mla:
            self.geometry["attention"] = "mla"
        if self.window:
            self.kv["window"] = {"tokens": self.window, "layers": sorted(
                i for layers, w in zip(self.group_layers, self.windowed) if w for i in layers)}
        weights = str(extra.get("weights_sha256") or "") or checkpoint_weights_sha256(mc.model, mc.revision)
        if not weights:
            raise ValueError(f"PffsConnector: no weight files found for model {mc.model!r}: give "
                             "kv_connector_extra_config.weights_sha256 (engine_bridge.weights_sha256_of_folder "
                             "of its checkpoint folder)")
        self.model = {"name": str(extra.get("model_name") or mc.served_model_name or mc.model),
                      "revision": mc.revision or getattr(mc.hf_config, "_commit_hash", None),
                      "config_sha256": hf_config_sha256(mc.hf_config), "weights_sha256": weights}
        self.prefix_all = bool(extra.get("load_prefix", False))
        # What vLLM does with a request whose load failed: its scheduler reads the
        # policy once it made this connector, and cannot tell its default ("fail":
        # the request ends with an error and no pffs_error) from a choice, so the
        # connector sets it from its own key.
        policy = str(extra.get("load_failure", "recompute"))
        if policy not in ("recompute", "fail"):
            raise ValueError(f"PffsConnector: load_failure {policy!r} is neither 'recompute' nor 'fail'")
        self._kv_transfer_config.kv_load_failure_policy = policy  # type: ignore[assignment]
        self.space = prefix_space(self.geometry, self.model, self.kv)
        self._index: PrefixIndex | None = None
        self._access: StoreAccess | None = None
        # (mount point, store) the root is in at start; every save and load checks it still is.
        self._home = self._bind_mount()
        # Scheduler side.
        self._plans: dict[str, LoadPlan] = {}
        self._to_load: list[LoadJob] = []
        self._loading: dict[str, LoadJob] = {}   # req -> its load in flight
        self._to_save: list[SaveJob] = []
        self._saving: dict[str, str] = {}       # req -> name being saved
        # Worker side.
        self._pool: KVPool | None = None
        self._lanes: tuple[Lane, Lane] | None = None
        self._save_bridge: Bridge | None = None
        self._load_bridge: Bridge | None = None
        self._joined: JoinedPool | None = None    # (tensor parallel: what a save pages out)
        self._rank = 0
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()

    @staticmethod
    def _latent(spec: Any, hf: Any) -> tuple[int, int]:
        """(kv_lora_rank, qk_rope_head_dim) of an MLA model, checked against its cache spec."""
        rank, rope = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
        if not isinstance(rank, int) or not isinstance(rope, int) or rank + rope != spec.head_size:
            raise ValueError(f"PffsConnector: an MLA cache of {spec.head_size} values a token that the "
                             f"model's kv_lora_rank {rank} and qk_rope_head_dim {rope} do not make up")
        return rank, rope

    @property
    def requires_kv_delivery(self) -> bool:
        # A save that does not happen is a later cache miss, never wrong KV.
        return False

    # ================================================================ scheduler

    @staticmethod
    def _params(request: "Request") -> dict[str, Any]:
        p = request.kv_transfer_params
        return p if isinstance(p, dict) else {}

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        params = self._params(request)
        name = params.get(LOAD)
        by_prefix = name is None and bool(params.get(PREFIX, self.prefix_all))
        if name is None and not by_prefix:
            return 0, False
        plan = self._plans.get(request.request_id)
        gone = self._mount_gone() if plan is None else None
        if gone:
            plan = self._plans[request.request_id] = LoadPlan(str(name), error=f"{LOAD if name else PREFIX}: {gone}")
            log.warning("request %s: %s", request.request_id, plan.error)
        if plan is None:
            prompt = list(request.prompt_token_ids or ())
            if by_prefix:
                plan = plan_prefix(self._prefix_index(), self.space, prompt, self.block_size,
                                   inputs_of(request), window=self.window)
            else:
                plan = plan_load(self.root, name, params, prompt, self.block_size, self.geometry,
                                 self.model, inputs_of(request), kv=self.kv)
            self._plans[request.request_id] = plan
            if plan.error:
                log.warning("request %s: %s", request.request_id, plan.error)
        plan.admitting = True
        first = num_computed_tokens // self.block_size
        # (A load that failed is not tried again: vLLM computes those tokens.)
        if plan.error is not None or plan.failed or len(plan.pages) <= first:
            return 0, False
        return (len(plan.pages) - first) * self.block_size, True

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None or not plan.admitting:
            return      # (not an admission: a load's request scheduled once its KV is in)
        # Each admission (a preempted request is admitted again) loads anew.
        plan.admitting = False
        n = num_external_tokens // self.block_size
        plan.loaded = n * self.block_size
        if n <= 0:
            return
        first = len(plan.pages) - n
        table = [list(g[first:first + n]) for g in blocks.get_block_ids()]
        ids = table[0] if len(table) == 1 else \
            [b for g, w in zip(table, self.windowed) for b in g if not (w and b == NULL_BLOCK)]
        job = LoadJob(request.request_id, plan.name, plan.pages[first:], ids, plan.digests, plan.trust,
                      groups=table if len(table) > 1 or self.window else None)
        self._to_load.append(job)
        self._loading[request.request_id] = job

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = PffsConnectorMetadata(saves=self._to_save, loads=self._to_load,
                                     idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._to_save, self._to_load = [], []
        return meta

    def update_connector_output(self, connector_output) -> None:
        bad = set(connector_output.invalid_block_ids or ())
        if bad:
            for rid, job in self._loading.items():
                failed = len(bad.intersection(job.block_ids))
                plan = self._plans.get(rid)
                if failed and plan is not None:
                    plan.failed = len(job.block_ids)
                    plan.loaded = 0
        for rid in connector_output.finished_recving or ():
            self._loading.pop(rid, None)
        for rid in connector_output.finished_sending or ():
            self._saving.pop(rid, None)

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        plan = self._plans.pop(rid, None)
        out: dict[str, Any] = {}
        if plan is not None and plan.error:
            out["pffs_error"] = plan.error
        elif plan is not None and plan.failed:
            out["pffs_loaded"] = 0
            out["pffs_error"] = (f"{LOAD} {plan.name!r}: {plan.failed} page(s) failed to load and "
                                 "were computed instead")
        elif plan is not None:
            out["pffs_loaded"] = plan.loaded
        name = self._params(request).get(SAVE)
        if name is None:
            return False, out or None
        n = min(request.num_computed_tokens, max(0, request.num_tokens - 1))
        try:
            gone = self._mount_gone()
            if gone:
                raise ValueError(gone)
            path = save_place(self.root, name)
            if n <= 0 or not block_ids or not block_ids[0]:
                raise ValueError("the request has no computed tokens")
            if path in (session_path(self.root, s) for s in self._saving.values()) \
                    or os.path.lexists(path):
                raise FileExistsError(f"a session named {name!r} exists")
            if not path.parent.is_dir():
                raise FileNotFoundError(f"no folder {str(path.parent)!r} to save it in")
            stale = failure_record(path)
            if os.path.lexists(stale):
                os.unlink(stale)    # (an earlier save's failure: this one's outcome is to come)
            forget_failure(path)
        except (OSError, ValueError) as e:
            msg = f"{SAVE} {name!r}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
            out["pffs_error"] = out["pffs_error"] + "; " + msg if "pffs_error" in out else msg
            log.warning("request %s: %s", rid, msg)
            return False, out
        table = [list(g[:-(-n // self.block_size)]) for g in block_ids]
        tokens = [int(t) for t in request.all_token_ids[:n]] if self.store_tokens else None
        job = SaveJob(rid, name, table[0], n, tokens, inputs_of(request),
                      groups=table if len(table) > 1 or self.window else None)
        self._saving[rid] = name
        worker = _LOCAL_WORKERS.get(self._engine_key())
        if worker is not None:
            worker.submit_save(job)     # (the worker is in this process: no step needed)
        else:
            self._to_save.append(job)
        out.update({SAVE: name, "pffs_save_scheduled": n})
        return True, out

    # =================================================================== worker

    def kv_pool(self) -> KVPool:
        """This rank's KV pool (its heads), as the bridge sees it."""
        if self._pool is None:
            raise RuntimeError("PffsConnector: register_kv_caches was not called")
        return self._pool

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        order = self._vllm_config.cache_config.get_resolved_kv_cache_layout().name
        views = [kv_caches[n] for n in self.layer_names]
        if self.mla:
            self._register_latent(views)
            return
        packing = engine_packing(self._vllm_config, self.layer_names, views[0].shape[2],
                                 views[0].shape[3] // 2, views[0].dtype)
        # An fp8 cache's uint8 as the bytes of its fp8 dtype; its scales now the weights are in.
        fp8 = page_dtype(self._vllm_config.cache_config.cache_dtype, views[0].dtype)
        views = [v.view(fp8) for v in views]
        self.kv["scales"] = kv_scales(self._vllm_config, self.layer_names)
        nblocks = self._kv_cache_config.num_blocks
        pool: KVPool
        save_pool: KVPool
        if len(self.group_layers) == 1 and not self.window:
            pool = VllmKVPool(views, order, nblocks, kv=self.kv, packing=packing)
            save_pool = pool
        else:       # (cache groups, each with its blocks: a pool per lane, each with its page table)
            parts = [(VllmKVPool([views[i] for i in layers], order, nblocks, kv=self.kv, packing=packing),
                      layers) for layers in self.group_layers]
            pool, save_pool = WindowedPool(parts, self.kv), WindowedPool(parts, self.kv)
            log.info("pffs: %d cache groups (%s)%s", len(parts), ", ".join(
                f"{'window' if w else 'full'} {layers}" for (_, layers), w in zip(parts, self.windowed)),
                f"; window of {self.window} tokens" if self.window else "")
        self._pool = pool
        log.info("pffs: KV pages converted from vLLM's %s packing (%s)", packing.name, order)
        load_pool: KVPool = pool
        if self.tp > 1:
            import torch.distributed as dist
            from vllm.distributed import get_tp_group
            tp = get_tp_group()
            self._rank = tp.rank_in_group
            # A group of the connector's own: its sends run on the save lane,
            # beside the engine's collectives on its groups.
            group = dist.new_group(ranks=list(tp.ranks), backend="gloo")
            self._joined = JoinedPool(save_pool, group, self.tp, self._rank)
            load_pool = HeadSlicePool(pool, self.n_heads, self._rank * pool.n_heads)
        workers = os.cpu_count() or 1
        # At tensor parallel, one save bridge over the joined pages for every save.
        self._save_bridge = Bridge(self._joined or save_pool, None, engine_name=self.engine,
                                   model=self.model, io_workers=min(4, workers))
        self._load_bridge = Bridge(load_pool, None, engine_name=self.engine, model=self.model,
                                   io_workers=min(4, workers))
        self._lanes = (Lane("save", self.nice[0]), Lane("load", self.nice[1]))
        if self.tp == 1:
            _LOCAL_WORKERS[self._engine_key()] = self

    def _register_latent(self, views: list[torch.Tensor]) -> None:
        """The worker's pool of an MLA engine: its latent caches, the same whole
        latent on every rank (no gather; the first rank writes, every rank loads)."""
        assert self.mla is not None
        backend = check_latent_rows(self._vllm_config, self.layer_names, views[0], self.mla[0])
        check_latent_rope(self._vllm_config, *self.mla, 4, views[0].dtype)
        pool = self._pool = MlaKVPool(views, self._kv_cache_config.num_blocks, kv_lora_rank=self.mla[0],
                                      qk_rope_head_dim=self.mla[1])
        log.info("pffs: latent (MLA) pages of vLLM's %s cache, %s", backend, tuple(views[0].shape))
        if self.tp > 1:
            from vllm.distributed import get_tp_group
            self._rank = get_tp_group().rank_in_group
        workers = min(4, os.cpu_count() or 1)
        self._save_bridge = Bridge(pool, None, engine_name=self.engine, model=self.model, io_workers=workers)
        self._load_bridge = Bridge(pool, None, engine_name=self.engine, model=self.model, io_workers=workers)
        self._lanes = (Lane("save", self.nice[0]), Lane("load", self.nice[1]))
        if self.tp == 1:
            _LOCAL_WORKERS[self._engine_key()] = self

    def _need_lanes(self) -> tuple[Lane, Lane]:
        if self._lanes is None:
            raise RuntimeError("PffsConnector: register_kv_caches was not called")
        return self._lanes

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PffsConnectorMetadata)
        save_lane, load_lane = self._need_lanes()
        for job in meta.loads:
            load_lane.submit(job.req_id, functools.partial(self._load, job))
        for sjob in meta.saves:
            save_lane.submit(sjob.req_id, functools.partial(self._save, sjob))

    def _prefix_index(self) -> Any:
        """The mount's token-chain index (scheduler side; opened at the first prefix load)."""
        if self._index is None:
            self._index = PrefixIndex(self._store().mountpoint)
        return self._index

    def _store(self) -> StoreAccess:
        if self._access is None:
            access = store_access(self.root)
            if access is None:
                raise ValueError(f"{self.root} is not in a pffs mount whose store this host may read: "
                                 "no prefix loads")
            self._access = access
        return self._access

    def _load(self, job: LoadJob) -> None:
        bridge = self._load_bridge
        assert bridge is not None
        try:
            t0 = time.perf_counter()
            gone = self._mount_gone()
            if gone:
                raise ValueError(gone)
            if job.digests is None:
                src: Any = session_path(self.root, job.name)
            else:       # (a prefix found by tokens: its blobs read by digest)
                manifest = prefix_manifest(self.geometry, self.model, job.digests, self.kv)
                nbytes = parse(manifest).page_bytes
                src = BlobSource(manifest, [nbytes] * len(job.digests), self._store())
            blocks = job.block_ids
            if job.groups is not None:      # (cache groups: page i into each group's block, if any)
                self._windowed_pool(bridge.pool).set_pages(
                    [[None if w and b == NULL_BLOCK else b for b in g] for g, w in zip(job.groups, self.windowed)])
                blocks = list(range(len(job.page_ixs)))
            bridge.load_into(src, job.page_ixs, blocks, trust_unfingerprinted=job.trust)
            log.info("request %s: loaded %d pages (%d bytes) of %r in %.3f s", job.req_id,
                     len(job.page_ixs), len(job.page_ixs) * bridge.pool.page_bytes, job.name,
                     time.perf_counter() - t0)
        except (BridgeError, OSError, ValueError) as e:
            log.error("request %s: %s %r: %s; its %d blocks are computed instead",
                      job.req_id, LOAD, job.name, e, len(job.block_ids))
            with self._lock:
                self._load_errors.update(job.block_ids)

    def _save(self, job: SaveJob) -> None:
        bridge = self._save_bridge
        assert bridge is not None
        blocks = [BlockId(int(b)) for b in job.block_ids]
        path = session_path(self.root, job.name)
        try:
            t0 = time.perf_counter()
            gone = self._mount_gone()
            if gone:
                raise ValueError(gone)
            save_place(self.root, job.name)     # (again: a link put on the way since it was scheduled)
            if self.mla and self._rank:
                return      # (every rank holds the whole latent: the first writes the session)
            if job.groups is not None:
                self._windowed_pool(self._joined.slices if self._joined else bridge.pool).set_pages(
                    self._save_table(job))
                blocks = [BlockId(i) for i in range(len(blocks))]
            if self._joined is not None:
                if not self._joined.join(blocks):
                    return      # (the group's first rank writes the session)
                blocks = [BlockId(i) for i in range(len(blocks))]
            seq = SeqBlocks(job.req_id, blocks, job.n_tokens, job.token_ids)
            m = bridge.page_out([seq], path, include_token_ids=self.store_tokens,
                                extra={INPUTS: job.inputs} if job.inputs else None)
            log.info("request %s: saved %d pages (%d bytes) as %r in %.3f s", job.req_id,
                     len(m.pages), len(m.pages) * bridge.pool.page_bytes, job.name,
                     time.perf_counter() - t0)
        except Exception as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
            line = f"{SAVE} {job.name!r}: {why}"
            log.error("request %s: %s", job.req_id, line)
            self._record_failure(job.name, path, line)

    @staticmethod
    def _windowed_pool(pool: KVPool) -> WindowedPool:
        inner = getattr(pool, "inner", pool)      # (a HeadSlicePool's)
        assert isinstance(inner, WindowedPool)
        return inner

    def _save_table(self, job: SaveJob) -> list[list[int | None]]:
        """Each cache group's block of each page of a save: a windowed group's
        only where the page keeps its window layers (engine_bridge.vllm.windows)."""
        assert job.groups is not None
        table: list[list[int | None]] = []
        for g, w in zip(job.groups, self.windowed):
            row: list[int | None] = []
            for j, b in enumerate(g):
                if w and self.window and not kept(j, job.n_tokens, self.window, self.block_size):
                    row.append(None)
                elif w and b == NULL_BLOCK:
                    raise ValueError(f"vLLM freed page {j}'s windowed blocks before the save")
                else:
                    row.append(b)
            table.append(row)
        return table

    def _record_failure(self, name: str, path: Path, line: str) -> None:
        """``NAME.save-failed`` beside where the session was to be: *line*; where
        the mount went away, or its folder is no longer reached beneath the root
        without a link, the record kept outside it (pffs.client.wait)."""
        try:
            try:
                here = self._mount_gone() is None and bool(save_place(self.root, name))
            except (OSError, ValueError):
                here = False
            record_failure(path, line, in_place=here)
        except (OSError, ValueError) as e:
            log.error("%s: cannot record the failure: %s", path, getattr(e, "strerror", None) or e)

    def _bind_mount(self) -> tuple[str, str] | None:
        """The pffs mount (and store) of the root at start; None: a plain folder."""
        try:
            home = mounted_store(self.root)
        except OSError as e:
            raise ValueError(f"PffsConnector: the pffs mount of {self.root} does not answer: "
                             f"{e.strerror or e}") from None
        if home is None:
            log.warning("pffs: %s is in no pffs mount: sessions are plain folders there", self.root)
        return home

    def _mount_gone(self) -> str | None:
        """Why the root is no longer in the pffs mount of the store it was in at start, or None."""
        if self._home is None:
            return None
        try:
            now = mounted_store(self.root)
        except OSError as e:
            return f"the pffs mount at {self._home[0]} does not answer ({e.strerror or e})"
        if now is None:
            return f"{self.root} is no longer in a pffs mount (unmounted)"
        if now[1] != self._home[1]:
            return f"{self.root} is now in a pffs mount of another store"
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        save_lane, load_lane = self._need_lanes()
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, PffsConnectorMetadata) and meta.idle:
            wait_lanes((save_lane, load_lane), IDLE_WAIT)
        sent, recvd = save_lane.take_done(), load_lane.take_done()
        return (sent or None), (recvd or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._load_errors = self._load_errors, set()
        return bad

    def shutdown(self) -> None:
        # Worker: every job handed to a lane runs to its end (saved, or its
        # failure recorded).  Scheduler: a save the workers never got is recorded.
        if self._lanes is not None:
            if _LOCAL_WORKERS.get(self._engine_key()) is self:
                del _LOCAL_WORKERS[self._engine_key()]
            for lane in self._lanes:
                lane.close()
        pending, self._to_save = self._to_save, []
        for job in pending:
            line = f"{SAVE} {job.name!r}: the engine shut down before the save started"
            log.error("request %s: %s", job.req_id, line)
            self._record_failure(job.name, session_path(self.root, job.name), line)

    def _engine_key(self) -> str:
        return str(self._kv_transfer_config.engine_id)

    def submit_save(self, job: SaveJob) -> None:
        """Start *job* on this worker's save lane now (a scheduler in the same
        process hands it over at once: an engine run in-process, as offline
        scripts run it, may not step again for a long time)."""
        save_lane, _ = self._need_lanes()
        save_lane.submit(job.req_id, functools.partial(self._save, job))


#: Worker-side connectors of engines whose scheduler runs in this process
#: (tensor parallel 1: vLLM's engine core steps its one worker in-process),
#: by engine id: a finished request's save goes straight to the worker's lane.
_LOCAL_WORKERS: dict[str, PffsConnector] = {}
