"""``PffsConnector``: vLLM requests save their KV as pffs sessions, and start from them.

A request names what it wants in ``kv_transfer_params``:

- ``{"pffs_save": NAME}``: when it finishes, the KV of its computed tokens
  (prompt and output) is paged out as the session ``ROOT/NAME`` (token ids,
  model identity and layout in the manifest).  Its blocks stay held until
  the page-out is done, then vLLM frees them.  An existing name is refused.
- ``{"pffs_load": NAME}``: the full pages of session ``ROOT/NAME`` whose
  tokens the prompt starts with (at most the prompt less its last token,
  which vLLM computes) are loaded into the blocks vLLM allocated, after
  vLLM's own prefix cache: a local hit comes first.

What the connector did comes back in the request's output
``kv_transfer_params``: ``pffs_saved``/``pffs_loaded`` (token counts) or
``pffs_error`` (one line: why nothing was saved or loaded).  A refusal
never costs a block: the request then computes its prompt itself.

The scheduler half decides and plans (it reads manifests and names in the
mount); the worker half moves the bytes with the engine bridge, by the direct
store path where the mount offers it.  One KV cache group of full attention
(vLLM turns its hybrid allocator off for connectors without ``SupportsHMA``);
one session per tensor-parallel rank is not supported yet: the worker needs
the whole of each layer's heads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from engine_bridge.core.bridge import (
    Bridge,
    SeqBlocks,
    check_manifest,
    check_present,
    hf_config_sha256,
    read_manifest,
)
from engine_bridge.core.pool import DEFAULT_KV, DTYPE_NAMES, BlockId, VllmKVPool
from engine_bridge.errors import BridgeError
from engine_bridge.transport.choose import as_source
from pffs.manifest import Manifest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("pffs.vllm")

SAVE, LOAD = "pffs_save", "pffs_load"


@dataclass
class SaveJob:
    req_id: str
    name: str
    block_ids: list[int]
    n_tokens: int
    token_ids: list[int] | None


@dataclass
class LoadJob:
    req_id: str
    name: str
    page_ixs: list[int]
    block_ids: list[int]


@dataclass
class PffsConnectorMetadata(KVConnectorMetadata):
    """What the scheduler asks the workers to do this step."""

    saves: list[SaveJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)


@dataclass
class _LoadPlan:
    name: str
    page_ixs: list[int] = field(default_factory=list)   # the session's pages, one per block
    error: str | None = None


class PffsConnector(KVConnectorBase_V1):
    """A vLLM KV connector over a folder of a pffs mount (``extra_config["root"]``).

    ``kv_connector_extra_config``: ``root`` (required), ``engine`` (the
    manifest's engine name, default ``vllm``), ``token_ids`` (store the
    tokens, default true; without them a session cannot be loaded by
    prompt), ``model_name`` (default the model vLLM serves).
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
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
            raise ValueError("PffsConnector supports models with one KV cache group of full "
                             f"attention, not {len(groups)} group(s)")
        spec = groups[0].kv_cache_spec
        if spec.head_size_v != spec.head_size or spec.dtype not in DTYPE_NAMES:
            raise ValueError(f"PffsConnector: K and V head sizes {spec.head_size}/{spec.head_size_v} "
                             f"and dtype {spec.dtype} do not make contract pages")
        self.layer_names = list(groups[0].layer_names)
        self.block_size = spec.block_size
        self.geometry = {"page_size_tokens": spec.block_size, "n_layers": len(self.layer_names),
                         "n_heads": spec.num_kv_heads, "head_dim": spec.head_size,
                         "dtype": DTYPE_NAMES[spec.dtype]}
        mc = vllm_config.model_config
        self.model = {"name": str(extra.get("model_name") or mc.served_model_name or mc.model),
                      "revision": mc.revision or getattr(mc.hf_config, "_commit_hash", None),
                      "config_sha256": hf_config_sha256(mc.hf_config)}
        # Scheduler side.
        self._plans: dict[str, _LoadPlan] = {}
        self._to_load: dict[str, tuple[_LoadPlan, int, int]] = {}  # req -> (plan, first block, blocks)
        self._to_save: list[SaveJob] = []
        self._saving: dict[str, str] = {}       # req -> name being saved
        self._said: dict[str, dict[str, Any]] = {}
        # Worker side.
        self._bridge: Bridge | None = None
        self._saves: dict[str, Future] = {}
        self._load_errors: set[int] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # ================================================================ scheduler

    def _params(self, request: "Request") -> dict[str, Any]:
        p = request.kv_transfer_params
        return p if isinstance(p, dict) else {}

    def _session(self, name: Any) -> Path:
        if not isinstance(name, str) or not name or name.startswith("/") \
                or any(part in ("", ".", "..") for part in name.split("/")):
            raise ValueError(f"{name!r} is not a session name (a relative path under the root)")
        return self.root / name

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        name = self._params(request).get(LOAD)
        if name is None:
            return 0, False
        plan = self._plans.get(request.request_id)
        if plan is None:
            plan = self._plans[request.request_id] = self._plan_load(request, name)
        first = num_computed_tokens // self.block_size
        if plan.error is not None or len(plan.page_ixs) <= first:
            return 0, False
        return (len(plan.page_ixs) - first) * self.block_size, False

    def _plan_load(self, request: "Request", name: Any) -> _LoadPlan:
        plan = _LoadPlan(str(name))
        try:
            folder = self._session(name)
            if not folder.is_dir():
                raise ValueError(f"{folder}: no such file or folder")
            source = as_source(folder)
            manifest = read_manifest(source)
            check_manifest(manifest, self.geometry, DEFAULT_KV, self.model)
            seq = self._seq_of(manifest, self._params(request).get("pffs_seq"))
            if seq.token_ids is None:
                raise ValueError("the session holds no token ids, so no prompt can be matched to it")
            prompt = list(request.prompt_token_ids or ())
            n = 0
            limit = min(len(seq.token_ids), len(prompt) - 1)
            while n < limit and seq.token_ids[n] == prompt[n]:
                n += 1
            pages = list(seq.page_ixs[:n // self.block_size])
            check_present(source, manifest)
            if len(set(pages)) != len(pages):
                raise ValueError("the sequence lists a page twice")
            plan.page_ixs = pages
        except (OSError, ValueError, BridgeError) as e:
            plan.error = f"{LOAD} {name!r}: {e}"
        if plan.error:
            log.warning("request %s: %s", request.request_id, plan.error)
        return plan

    @staticmethod
    def _seq_of(manifest: Manifest, seq_id: Any):
        seqs = manifest.logical_seqs
        if seq_id is None:
            if len(seqs) != 1:
                raise ValueError(f"the session holds {len(seqs)} sequences: name one with pffs_seq")
            return seqs[0]
        for s in seqs:
            if s.id == seq_id:
                return s
        raise ValueError(f"the session has no sequence {seq_id!r}")

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        plan = self._plans[request.request_id]
        n = num_external_tokens // self.block_size
        first = len(plan.page_ixs) - n
        self._to_load[request.request_id] = (plan, first, n)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = PffsConnectorMetadata(saves=self._to_save)
        self._to_save = []
        for new in scheduler_output.scheduled_new_reqs:
            got = self._to_load.pop(new.req_id, None)
            if got is None:
                continue
            plan, first, n = got
            blocks = list(new.block_ids[0][first:first + n])
            meta.loads.append(LoadJob(new.req_id, plan.name, plan.page_ixs[first:first + n], blocks))
            self._said.setdefault(new.req_id, {})["pffs_loaded"] = (first + n) * self.block_size
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        plan = self._plans.pop(rid, None)
        self._to_load.pop(rid, None)
        out = self._said.pop(rid, {})
        if plan is not None and plan.error:
            out["pffs_error"] = plan.error
        elif plan is not None:
            out.setdefault("pffs_loaded", 0)   # (no page matched, or vLLM's prefix cache held them)
        name = self._params(request).get(SAVE)
        if name is None:
            return False, out or None
        n = min(request.num_computed_tokens, max(0, request.num_tokens - 1))
        try:
            path = self._session(name)
            if n <= 0:
                raise ValueError("the request has no computed tokens")
            if name in self._saving.values() or os.path.lexists(path):
                raise FileExistsError(f"a session named {name!r} exists")
            if not path.parent.is_dir():
                raise FileNotFoundError(f"no folder {str(path.parent)!r} to save it in")
        except (OSError, ValueError) as e:
            out["pffs_error"] = f"{SAVE} {name!r}: {e}"
            log.warning("request %s: %s", rid, out["pffs_error"])
            return False, out
        blocks = list(block_ids[:-(-n // self.block_size)])
        tokens = [int(t) for t in request.all_token_ids[:n]] if self.store_tokens else None
        self._to_save.append(SaveJob(rid, name, blocks, n, tokens))
        self._saving[rid] = name
        out.update({SAVE: name, "pffs_saved": n})
        return True, out

    def update_connector_output(self, connector_output) -> None:
        for rid in connector_output.finished_sending or ():
            self._saving.pop(rid, None)

    # =================================================================== worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        order = self._vllm_config.cache_config.get_resolved_kv_cache_layout().name
        views = [kv_caches[n] for n in self.layer_names]
        pool = VllmKVPool(views, order, self._kv_cache_config.num_blocks)
        self._bridge = Bridge(pool, None, engine_name=self.engine, model=self.model)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pffs-vllm-save")

    def _need_bridge(self) -> Bridge:
        if self._bridge is None:
            raise RuntimeError("PffsConnector: register_kv_caches was not called")
        return self._bridge

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PffsConnectorMetadata)
        for job in meta.loads:
            try:
                t0 = time.perf_counter()
                bridge = self._need_bridge()
                bridge.load_into(self._session(job.name), job.page_ixs, job.block_ids)
                log.info("request %s: loaded %d pages (%d bytes) of %r in %.3f s", job.req_id,
                         len(job.page_ixs), len(job.page_ixs) * bridge.pool.page_bytes, job.name,
                         time.perf_counter() - t0)
            except (BridgeError, OSError, ValueError) as e:
                log.error("request %s: %s %r: %s; its %d blocks are computed instead",
                          job.req_id, LOAD, job.name, e, len(job.block_ids))
                with self._lock:
                    self._load_errors.update(job.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PffsConnectorMetadata)
        bridge = self._need_bridge()
        assert self._pool is not None
        for job in meta.saves:
            self._saves[job.req_id] = self._pool.submit(self._save, bridge, job)

    def _save(self, bridge: Bridge, job: SaveJob) -> None:
        seq = SeqBlocks(job.req_id, [BlockId(int(b)) for b in job.block_ids], job.n_tokens, job.token_ids)
        try:
            t0 = time.perf_counter()
            m = bridge.page_out([seq], self._session(job.name), include_token_ids=self.store_tokens)
            log.info("request %s: saved %d pages (%d bytes) as %r in %.3f s", job.req_id,
                     len(m.pages), len(m.pages) * bridge.pool.page_bytes, job.name,
                     time.perf_counter() - t0)
        except Exception as e:
            log.error("request %s: %s %r failed: %s", job.req_id, SAVE, job.name, e)
            raise

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = {rid for rid, f in self._saves.items() if f.done()}
        for rid in done:
            del self._saves[rid]
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._load_errors = self._load_errors, set()
        return bad

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
