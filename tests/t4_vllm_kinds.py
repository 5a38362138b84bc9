"""Level t4, engines: the vLLM connector refuses, at start and in one line naming
the kind of model, the caches its pages cannot hold (caches quantized other
than fp8, sliding windows, linear-attention and state-space layers), with
vLLM's own KV cache specs and config classes; an fp8 cache is served as fp8
pages with its layers' scales."""

from __future__ import annotations

import pytest
import torch

from vllm_helpers import BLOCK, D, H, LAYERS, vllm_config


def connector_with(tmp_path, specs, cache_dtype: str = "auto", layers: dict | None = None,
                   quantization: str | None = None):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from engine_bridge.vllm import PffsConnector
    cfg = vllm_config(tmp_path, extra={"root": str(tmp_path)})
    cfg.cache_config.cache_dtype = cache_dtype
    cfg.compilation_config.static_forward_context.update(layers or {})     # (the engine's attention layers)
    cfg.model_config.quantization = quantization
    groups = [KVCacheGroupSpec(names, spec) for names, spec in specs]
    return PffsConnector(cfg, KVConnectorRole.SCHEDULER, KVCacheConfig(64, [], groups))


def full(**kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=H, head_size=D,
                             dtype=kw.pop("dtype", torch.bfloat16), **kw)


def test_a_plain_model_is_served(tmp_path):
    c = connector_with(tmp_path, [(LAYERS, full())])
    assert c.geometry["n_heads"] == H


@pytest.mark.parametrize("case, windowed", [("every layer", [0, 1]), ("some layers", [1])])
def test_sliding_windows_are_served_with_their_layers_named(tmp_path, case, windowed):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    win = SlidingWindowSpec(sliding_window=512, block_size=BLOCK, num_kv_heads=H, head_size=D,
                            dtype=torch.bfloat16)
    groups = [(LAYERS, win)] if case == "every layer" else [(LAYERS[:1], full()), (LAYERS[1:], win)]
    c = connector_with(tmp_path, groups)
    assert c.kv["window"] == {"tokens": 512, "layers": windowed}
    assert c.layer_names == LAYERS and c.geometry["n_layers"] == len(LAYERS)


@pytest.mark.parametrize("case, why", [
    ("quantized", "a KV cache quantized as fp8_inc is not supported"),
    ("fp8 elsewhere", "an fp8 KV cache of a fp8-quantized checkpoint whose attention layers"),
    ("mla-v4", "a compressed or sparse latent cache (deepseek_v4 MLA)"),
    ("two windows", "sliding windows of different sizes (512, 4096 tokens)"),
    ("chunked", "chunked local attention (8192 tokens) is not supported"),
    ("mamba", "hybrid models with linear-attention or state-space layers (MambaSpec)"),
])
def test_models_pages_cannot_hold_are_refused_by_kind(tmp_path, case, why):
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, MambaSpec, MLAAttentionSpec,
                                            SlidingWindowSpec)
    win = dict(block_size=BLOCK, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    specs = {
        "mla-v4": [(LAYERS, MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                                             dtype=torch.bfloat16, model_version="deepseek_v4"))],
        "quantized": [(LAYERS, full(dtype=torch.uint8))],
        "fp8 elsewhere": [(LAYERS, full(dtype=torch.uint8))],
        "two windows": [(LAYERS[:1], SlidingWindowSpec(sliding_window=4096, **win)),
                        (LAYERS[1:], SlidingWindowSpec(sliding_window=512, **win))],
        "chunked": [(LAYERS, ChunkedLocalAttentionSpec(attention_chunk_size=8192, **win))],
        "mamba": [(LAYERS[:1], full()),
                  (LAYERS[1:], MambaSpec(block_size=BLOCK, shapes=((4, 64),), dtypes=(torch.bfloat16,)))],
    }[case]
    with pytest.raises(ValueError) as e:
        connector_with(tmp_path, specs, {"quantized": "fp8_inc", "fp8 elsewhere": "fp8_e4m3"}.get(case, "auto"),
                       quantization="fp8" if case == "fp8 elsewhere" else None)
    msg = str(e.value)
    assert msg.startswith("PffsConnector: " + why), msg
    assert "\n" not in msg


class _Layer:
    def __init__(self, k: float, v: float):
        self._k_scale_float, self._v_scale_float = k, v


@pytest.mark.parametrize("cache_dtype, page", [("fp8", "fp8e4m3"), ("fp8_e4m3", "fp8e4m3"),
                                               ("fp8_e5m2", "fp8e5m2")])
def test_an_fp8_cache_is_served_as_fp8_pages_with_its_layers_scales(tmp_path, cache_dtype, page):
    """vLLM keeps an fp8 cache as uint8: its pages are the fp8 dtype kv_cache_dtype
    names, and kv.scales are the scales the attention layers quantize with (null
    when all are 1.0), which also name the key namespace."""
    plain = connector_with(tmp_path, [(LAYERS, full(dtype=torch.uint8))], cache_dtype,
                           {n: _Layer(1.0, 1.0) for n in LAYERS})
    assert plain.geometry["dtype"] == page and plain.kv["scales"] is None
    scaled = connector_with(tmp_path, [(LAYERS, full(dtype=torch.uint8))], cache_dtype,
                            {n: _Layer(0.5 + i, 2.0) for i, n in enumerate(LAYERS)})
    assert scaled.kv["scales"] == {"k": [0.5 + i for i in range(len(LAYERS))], "v": [2.0] * len(LAYERS)}
    assert scaled.space != plain.space


def test_a_latent_attention_model_is_served_as_one_latent_head(tmp_path, monkeypatch):
    """DeepSeek-style MLA (SPEC §1.1): one head of kv_lora_rank + qk_rope_head_dim values."""
    import vllm_helpers
    made = vllm_helpers.vllm_config

    def with_latent(*a, **kw):
        cfg = made(*a, **kw)
        cfg.model_config.hf_text_config.kv_lora_rank = 512
        cfg.model_config.hf_text_config.qk_rope_head_dim = 64
        return cfg
    monkeypatch.setitem(globals(), "vllm_config", with_latent)
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    spec = dict(block_size=BLOCK, num_kv_heads=1, dtype=torch.bfloat16)
    c = connector_with(tmp_path, [(LAYERS, MLAAttentionSpec(head_size=576, **spec))])
    assert c.geometry == {"page_size_tokens": BLOCK, "n_layers": len(LAYERS), "n_heads": 1,
                          "head_dim": 576, "dtype": "bf16", "attention": "mla"}
    assert (c.kv["kv_lora_rank"], c.kv["qk_rope_head_dim"]) == (512, 64)
    with pytest.raises(ValueError, match="kv_lora_rank 512 and qk_rope_head_dim 64 do not make up"):
        connector_with(tmp_path, [(LAYERS, MLAAttentionSpec(head_size=640, **spec))])
