"""Which vLLM models the connector serves, and a refusal naming the kind of those it does not.

A session page is SPEC §1's: K and V of every head of every layer, for
every token of the page (a sliding window's layers only for the pages the
window reaches: engine_bridge.vllm.windows); or, for multi-head latent
attention (DeepSeek-V2/V3, Kimi K2: ``MLAAttentionSpec``), §1.1's: one
latent vector a token and layer.
Models whose cache is something else are refused
at start with one line that names what they are, not a symptom (a head
size of 0, a dtype of uint8, a count of cache groups).
"""

from __future__ import annotations

from typing import Any

import torch

from engine_bridge.core.pool import DTYPE_NAMES
from pffs.manifest import plain_scales

#: vLLM's fp8 ``kv_cache_dtype`` names and the dtype whose bytes each keeps
#: (vLLM's cache tensors are uint8 then: a page holds them as that fp8 dtype).
FP8_CACHE_DTYPES: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                                            "fp8_e5m2": torch.float8_e5m2}


def page_dtype(cache_dtype: str, spec_dtype: torch.dtype) -> torch.dtype:
    """The dtype a page of this cache holds: the fp8 one *cache_dtype* names, else the cache's own."""
    return FP8_CACHE_DTYPES.get(str(cache_dtype), spec_dtype)


def kv_scales(vllm_config: Any, layer_names: list[str]) -> dict[str, list[float]] | None:
    """The manifest's ``kv.scales`` of this engine's pages: for an fp8 cache, the
    scales its attention layers quantize K and V with (each layer's
    ``_k_scale_float``/``_v_scale_float``, which vLLM's CPU attention hands
    ``cpu_attn_reshape_and_cache``: final once the weights are loaded), None
    when every one is 1.0 or the cache is not fp8.  Where the layers are in
    other processes (the scheduler's, beside workers of their own), a model
    without a quantization method is quantized at 1.0 by every layer; ValueError
    for one with (its checkpoint may hold scales only the workers read)."""
    if str(vllm_config.cache_config.cache_dtype) not in FP8_CACHE_DTYPES:
        return None
    ctx = vllm_config.compilation_config.static_forward_context
    layers = [ctx.get(n) for n in layer_names]
    if not layers or any(layer is None or not hasattr(layer, "_k_scale_float") for layer in layers):
        quantization = getattr(vllm_config.model_config, "quantization", None)
        if quantization is None:
            return None
        raise ValueError(f"an fp8 KV cache of a {quantization}-quantized checkpoint whose attention "
                         "layers are in other processes is not supported: its scales are not known here")
    scales = {"k": [float(layer._k_scale_float) for layer in layers],
              "v": [float(layer._v_scale_float) for layer in layers]}
    return plain_scales(scales)


def refused_kind(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """Why the connector cannot save this engine's KV as pages, or None when it can."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )
    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    state = [s for s in specs if not isinstance(s, AttentionSpec)]
    if state:
        kinds = ", ".join(sorted({type(s).__name__ for s in state}))
        return ("hybrid models with linear-attention or state-space layers "
                f"({kinds}) are not supported: their state is not K/V pages")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in ("auto", "float16", "bfloat16", *FP8_CACHE_DTYPES):
        return (f"a KV cache quantized as {cache_dtype} is not supported (fp8 caches are: "
                f"{', '.join(FP8_CACHE_DTYPES)})")
    chunked = [s for s in specs if isinstance(s, ChunkedLocalAttentionSpec)
               or (isinstance(s, SlidingWindowSpec) and isinstance(s, MLAAttentionSpec))]
    if chunked:
        c = chunked[0]
        what = ("chunked local attention" if isinstance(c, ChunkedLocalAttentionSpec)
                else "latent attention in a sliding window")
        size = getattr(c, "attention_chunk_size", None) or getattr(c, "sliding_window", None)
        return f"{what} ({size} tokens) is not supported: its blocks are not a window of whole tokens"
    sliding = [s for s in specs if isinstance(s, SlidingWindowSpec)]
    if len({s.sliding_window for s in sliding}) > 1:
        return ("sliding windows of different sizes "
                f"({', '.join(str(w) for w in sorted({s.sliding_window for s in sliding}))} tokens) "
                "are not supported: a session's manifest names one")
    full = [s for s in specs if not isinstance(s, SlidingWindowSpec)]
    if not all(isinstance(s, FullAttentionSpec) for s in full) \
            or (len(specs) > 1 and any(isinstance(s, MLAAttentionSpec) for s in specs)):
        return (f"{len(specs)} KV cache groups "
                f"({', '.join(type(s).__name__ for s in specs)}); pages need full attention "
                "(and sliding windows beside it)")
    shapes = {(s.block_size, s.num_kv_heads, s.head_size, s.dtype) for s in specs}
    if len(shapes) > 1:
        return ("cache groups of other block sizes, heads, head sizes or dtypes "
                f"({len(shapes)} kinds): a page holds every layer alike")
    spec = specs[0]
    if isinstance(spec, MLAAttentionSpec):
        if spec.model_version or spec.alignment:
            return (f"a compressed or sparse latent cache ({spec.model_version or 'aligned'} MLA) "
                    "is not supported: its blocks are not one latent vector a token")
        if spec.num_kv_heads != 1:
            return f"an MLA cache of {spec.num_kv_heads} latent heads; pages hold one"
    elif spec.head_size_v != spec.head_size:
        return f"K and V head sizes differ ({spec.head_size}/{spec.head_size_v}): pages need one head_dim"
    if page_dtype(cache_dtype, spec.dtype) not in DTYPE_NAMES:
        return f"a KV cache of {spec.dtype} has no page dtype"
    return None
