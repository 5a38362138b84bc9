"""vLLM's own config, KV cache allocation and scheduler, built on the CPU.

Nothing here stands in for a vLLM class: the configs, the ``KVCacheConfig``
(``get_kv_cache_configs``), the per-layer views (``allocate_kv_cache``) and the
``Scheduler`` are vLLM's; the model is a small Llama config written to a
folder (no weights: no model runs).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

L, H, D, BLOCK = 2, 2, 32, 16
NUM_BLOCKS = 64
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
EOS = 999
#: The weights fingerprint the connector is given (the model folder holds no weights).
WEIGHTS = "3e" * 32


def model_dir(tmp: Path) -> str:
    from transformers import LlamaConfig
    d = tmp / "tiny-llama"
    if not (d / "config.json").exists():
        LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=L,
                    num_attention_heads=4, num_key_value_heads=H, head_dim=D, vocab_size=1000,
                    max_position_embeddings=1024, eos_token_id=EOS).save_pretrained(d)
    return str(d)


def vllm_config(tmp: Path, *, layout: str = "LBNHC", extra: dict[str, Any] | None = None,
                connector: str = "PffsConnector", module: str | None = "engine_bridge.vllm",
                policy: str = "recompute"):
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                             SchedulerConfig, VllmConfig)
    mc = ModelConfig(model=model_dir(tmp), dtype="bfloat16", seed=0, skip_tokenizer_init=True,
                     max_model_len=512)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                         is_encoder_decoder=False)
    cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                     enable_prefix_caching=True)
    cc.kv_cache_layout = layout
    kt = KVTransferConfig(kv_connector=connector, kv_connector_module_path=module, kv_role="kv_both",
                          kv_connector_extra_config={"weights_sha256": WEIGHTS, **(extra or {})},
                          kv_load_failure_policy=policy)
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                      kv_transfer_config=kt, device_config=DeviceConfig("cpu"))


def kv_cache_config(cfg, num_blocks: int = NUM_BLOCKS):
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    specs = {name: FullAttentionSpec(block_size=BLOCK, num_kv_heads=H, head_size=D,
                                     dtype=torch.bfloat16) for name in LAYERS}
    page = 2 * BLOCK * H * D * 2
    cfg.cache_config.num_gpu_blocks_override = num_blocks
    return get_kv_cache_configs(cfg, [specs], [page * L * (num_blocks + 1)])[0]


def kv_views(cfg, *, layout: str = "LBNHC", kernel_block_size: int | None = None, kcc=None):
    """vLLM's per-layer views (in layer order) of a fresh CPU KV cache."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache
    kcc = kcc or kv_cache_config(cfg)
    caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[layout],
                               [kernel_block_size or BLOCK])
    return [caches[n] for n in LAYERS], kcc


def attention_layers(cfg) -> list:
    """vLLM's own attention layers of the model, registered in *cfg* as a model
    runner registers them (the connector asks them which kernel packs the KV)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    ctx = cfg.compilation_config.static_forward_context
    with set_current_vllm_config(cfg):
        return [ctx[n] if n in ctx else Attention(4, D, D ** -0.5, num_kv_heads=H, prefix=n,
                                                   cache_config=cfg.cache_config) for n in LAYERS]


# ------------------------------------------------------------- an engine loop

def kv_of(layer: int, pos: int, token: int) -> torch.Tensor:
    """The KV this test's model writes for *token* at *pos* in *layer*: [H, 2D] bf16."""
    base = (token * 31 + pos * 7 + layer * 3) % 251
    return ((base + torch.arange(H * 2 * D)) % 97 / 8).to(torch.bfloat16).view(H, 2 * D)


class Engine:
    """vLLM's Scheduler and a worker-side connector, stepped as vLLM's engine core steps them.

    The scheduler, its KV cache manager and block pool, the connector factory
    and the KV views are vLLM's.  The model is this class: each step it writes
    :func:`kv_of` for every token vLLM scheduled to compute into the blocks
    vLLM assigned (never for tokens a connector loaded), and samples token 7.
    """

    def __init__(self, tmp: Path, root: Path, *, layout: str = "LBNHC", kernel: int | None = None,
                 extra: dict[str, Any] | None = None, policy: str = "recompute"):
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        init_none_hash(sha256)
        self.cfg = vllm_config(tmp, layout=layout, extra={"root": str(root), **(extra or {})},
                               policy=policy)
        self.views, self.kcc = kv_views(self.cfg, layout=layout, kernel_block_size=kernel)
        self.cfg.cache_config.num_gpu_blocks = self.kcc.num_blocks
        self.sched = Scheduler(vllm_config=self.cfg, kv_cache_config=self.kcc, log_stats=False,
                               structured_output_manager=StructuredOutputManager(self.cfg),
                               block_size=BLOCK)
        attention_layers(self.cfg)
        self.worker = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER, self.kcc)
        self.worker.register_kv_caches(dict(zip(LAYERS, self.views)))
        self.pool = self.worker.kv_pool()
        self.r = self.views[0].shape[0] // self.kcc.num_blocks
        self.outputs: dict[str, Any] = {}
        self.loads: list = []
        self.computed: dict[str, list[int]] = {}   # positions this model computed, per request
        self._n = 0

    @property
    def free(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(self, prompt: list[int], params: dict[str, Any] | None = None, max_tokens: int = 3,
            **request_kw: Any) -> str:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request
        self._n += 1
        rid = f"req-{self._n}"
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)
        req = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp,
                      pooling_params=None, mm_features=None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256), **request_kw)
        self.sched.add_request(req)
        return rid

    def blocks_of(self, rid: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[0])

    def slot(self, block: int, pos_in_block: int) -> tuple[int, int]:
        nk = BLOCK // self.r
        return block * self.r + pos_in_block // nk, pos_in_block % nk

    def _page(self, block: int) -> torch.Tensor:
        page = torch.empty((1, self.pool.page_bytes), dtype=torch.uint8)
        self.pool.gather([block], page)
        return page

    def kv_at(self, layer: int, block: int, pos_in_block: int) -> torch.Tensor:
        """Token *pos_in_block*'s K then V of every head ([H, 2D]), read through the
        connector's pool (which knows where the attention kernel keeps them)."""
        kv = self._page(block).view(torch.bfloat16).view(2, L, BLOCK, H, D)[:, layer, pos_in_block]
        return torch.cat([kv[0], kv[1]], dim=-1)

    def write_kv(self, layer: int, block: int, pos_in_block: int, kv: torch.Tensor) -> None:
        """Store token *pos_in_block*'s K then V ([H, 2D]) where the kernel keeps them."""
        page = self._page(block)
        view = page.view(torch.bfloat16).view(2, L, BLOCK, H, D)
        view[0, layer, pos_in_block], view[1, layer, pos_in_block] = kv[:, :D], kv[:, D:]
        self.pool.scatter([block], page)

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        out = self.sched.schedule()
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        self.loads.extend(out.kv_connector_metadata.loads)
        w.start_load_kv(None)
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        c = out.scheduled_cached_reqs
        starts.update(zip(c.req_ids, c.num_computed_tokens))
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            blocks = self.blocks_of(rid)
            for pos in range(starts[rid], starts[rid] + n):
                self.computed.setdefault(rid, []).append(pos)
                for layer in range(L):
                    self.write_kv(layer, blocks[pos // BLOCK], pos % BLOCK,
                                  kv_of(layer, pos, req.all_token_ids[pos]))
        w.wait_for_save()
        sending, recving = w.get_finished(out.finished_req_ids)
        bad = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        rids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                sampled_token_ids=[[7] for _ in rids], logprobs=None,
                                prompt_logprobs_dict={}, pooler_output=None,
                                kv_connector_output=KVConnectorOutput(
                                    finished_sending=sending, finished_recving=recving,
                                    invalid_block_ids=bad))
        for eco in self.sched.update_from_output(out, mro).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.outputs[o.request_id] = o.kv_transfer_params or {}

    def until_scheduled(self, rid: str, deadline: float = 60.0) -> None:
        """Step until the model computed something of *rid* (a load it waits
        for runs on the connector's load lane meanwhile)."""
        import time
        end = time.monotonic() + deadline
        while rid not in self.computed and rid not in self.outputs:
            if time.monotonic() > end:
                raise AssertionError(f"{rid} not scheduled in {deadline} s")
            self.step()

    def run(self, rid: str, *, until_idle: bool = True, deadline: float = 60.0) -> dict[str, Any]:
        """Step until *rid* finished (and, with *until_idle*, every held block is back)."""
        import time
        end = time.monotonic() + deadline
        while rid not in self.outputs or (until_idle and self.sched.requests):
            if time.monotonic() > end:
                raise AssertionError(f"{rid} not done in {deadline} s: {self.sched.requests}")
            self.step()
            if not self.sched.running and not self.sched.waiting:
                time.sleep(0.002)  # (a page-out on the connector's thread: poll again)
        return self.outputs[rid]

    def expected_kv(self, layer: int, pos: int, token: int) -> torch.Tensor:
        return kv_of(layer, pos, token)
