"""Level t4, engines: the vLLM connector refuses, at start and in one line naming
the kind of model, the caches its pages cannot hold (latent attention, fp8,
sliding windows, linear-attention and state-space layers), with vLLM's own
KV cache specs and config classes."""

from __future__ import annotations

import pytest
import torch

from vllm_helpers import BLOCK, D, H, LAYERS, vllm_config


def connector_with(tmp_path, specs, cache_dtype: str = "auto"):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from engine_bridge.vllm import PffsConnector
    cfg = vllm_config(tmp_path, extra={"root": str(tmp_path)})
    cfg.cache_config.cache_dtype = cache_dtype
    groups = [KVCacheGroupSpec(names, spec) for names, spec in specs]
    return PffsConnector(cfg, KVConnectorRole.SCHEDULER, KVCacheConfig(64, [], groups))


def full(**kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=H, head_size=D,
                             dtype=kw.pop("dtype", torch.bfloat16), **kw)


def test_a_plain_model_is_served(tmp_path):
    c = connector_with(tmp_path, [(LAYERS, full())])
    assert c.geometry["n_heads"] == H


@pytest.mark.parametrize("case, why", [
    ("mla", "multi-head latent attention (DeepSeek-style MLA"),
    ("fp8", "an fp8 KV cache (kv_cache_dtype fp8_e4m3)"),
    ("sliding", "a sliding window on every layer (4096 tokens)"),
    ("mixed", "a sliding window on some layers (512 tokens)"),
    ("chunked", "chunked local attention on every layer (8192 tokens)"),
    ("mamba", "hybrid models with linear-attention or state-space layers (MambaSpec)"),
])
def test_models_pages_cannot_hold_are_refused_by_kind(tmp_path, case, why):
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, MambaSpec, MLAAttentionSpec,
                                            SlidingWindowSpec)
    win = dict(block_size=BLOCK, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    specs = {
        "mla": [(LAYERS, MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                                          dtype=torch.bfloat16))],
        "fp8": [(LAYERS, full(dtype=torch.uint8))],
        "sliding": [(LAYERS, SlidingWindowSpec(sliding_window=4096, **win))],
        "mixed": [(LAYERS[:1], full()), (LAYERS[1:], SlidingWindowSpec(sliding_window=512, **win))],
        "chunked": [(LAYERS, ChunkedLocalAttentionSpec(attention_chunk_size=8192, **win))],
        "mamba": [(LAYERS[:1], full()),
                  (LAYERS[1:], MambaSpec(block_size=BLOCK, shapes=((4, 64),), dtypes=(torch.bfloat16,)))],
    }[case]
    with pytest.raises(ValueError) as e:
        connector_with(tmp_path, specs, "fp8_e4m3" if case == "fp8" else "auto")
    msg = str(e.value)
    assert msg.startswith("PffsConnector: " + why), msg
    assert "\n" not in msg
