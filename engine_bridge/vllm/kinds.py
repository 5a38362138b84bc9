"""Which vLLM models the connector serves, and a refusal naming the kind of those it does not.

A session page is SPEC §1's: K and V of every head of every layer, for
every token of the page.  Models whose cache is something else are refused
at start with one line that names what they are, not a symptom (a head
size of 0, a dtype of uint8, a count of cache groups).
"""

from __future__ import annotations

from typing import Any

from engine_bridge.core.pool import DTYPE_NAMES


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
    if any(isinstance(s, MLAAttentionSpec) for s in specs) or \
            getattr(vllm_config.model_config, "use_mla", False):
        return ("multi-head latent attention (DeepSeek-style MLA: one latent vector a token "
                "instead of K and V heads) is not supported")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype.startswith("fp8"):
        return f"an fp8 KV cache (kv_cache_dtype {cache_dtype}) is not supported"
    windowed = [s for s in specs if isinstance(s, (SlidingWindowSpec, ChunkedLocalAttentionSpec))]
    if windowed:
        w = windowed[0]
        size = getattr(w, "sliding_window", None) or getattr(w, "attention_chunk_size", None)
        what = "a sliding window" if isinstance(w, SlidingWindowSpec) else "chunked local attention"
        where = "every layer" if len(windowed) == len(specs) else "some layers"
        return (f"{what} on {where} ({size} tokens) is not supported: such layers keep only "
                "their window's KV")
    if len(specs) != 1 or not isinstance(specs[0], FullAttentionSpec):
        return (f"{len(specs)} KV cache groups "
                f"({', '.join(type(s).__name__ for s in specs)}); pages need one group of full attention")
    spec = specs[0]
    if spec.head_size_v != spec.head_size:
        return f"K and V head sizes differ ({spec.head_size}/{spec.head_size_v}): pages need one head_dim"
    if spec.dtype not in DTYPE_NAMES:
        return f"a KV cache of {spec.dtype} has no page dtype"
    return None
