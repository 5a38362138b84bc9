"""SGLang's MLA host pool (``MLATokenToKVPoolHost``) as SPEC §1.1 latent pages.

A model with multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2) caches
one latent row a token and layer: ``kv_lora_rank`` compressed values, then the
``qk_rope_head_dim`` rotary ones (SGLang's ``MLATokenToKVPool`` keeps the row
so: its ``get_value_buffer`` is the row's first ``kv_lora_rank`` values).  The
pffs page of ``page_size`` tokens is one C-ordered ``[n_layers, page_size,
latent]`` array (no K/V pair, no heads).  SGLang's host pool holds it as

- ``page_first_direct``: ``kv_buffer[page]``, ``(layers, page_size, 1, latent)``:
  the page itself, contiguous;
- ``page_first``: ``kv_buffer[tokens]``, ``(page_size, layers, 1, latent)``:
  token-major, transposed on the way;
- ``layer_first``: ``kv_buffer[:, tokens]``, ``(layers, page_size, 1, latent)``:
  a strided view of the page.

Every view here is ``(layers, page_size, 1, latent)``: copying it into (or out
of) a buffer of that shape gives (or takes) the page's bytes.  Every
tensor-parallel rank holds the whole latent: one rank writes, every rank reads.
"""

from __future__ import annotations

from typing import Any

import torch

from engine_bridge.core.pool import mla_kv


def latent_geometry(host: Any) -> tuple[int, int, dict[str, Any]]:
    """(layers, latent values a row, the manifest's ``kv`` of its pages) of the MLA host
    pool *host*; ValueError, in one line, for a pool whose rows are not plain latents."""
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    if not isinstance(host, MLATokenToKVPoolHost):
        raise ValueError(f"pffs HiCache storage: SGLang says the model is MLA but its host pool is "
                         f"a {type(host).__name__}, not an MLATokenToKVPoolHost")
    if getattr(host, "kv_buffer", None) is None:
        raise ValueError("pffs HiCache storage: an MLA host pool without a buffer (allocator-only) "
                         "is not supported")
    rank, rope = int(host.kv_lora_rank), int(host.qk_rope_head_dim)
    latent = rank + rope
    if int(host.kv_cache_dim) != latent or getattr(host, "dsa_kv_cache_store_fp8", False):
        raise ValueError(f"pffs HiCache storage: MLA rows of {host.kv_cache_dim} values packed other "
                         f"than kv_lora_rank {rank} + qk_rope_head_dim {rope} (DSA fp8) are not supported")
    layers = int(host.layer_num)
    if layers != int(getattr(host, "target_layer_num", layers)):
        raise ValueError(f"pffs HiCache storage: an MLA host pool with draft layers ({layers} for "
                         f"{host.target_layer_num} model layers) is not supported")
    return layers, latent, mla_kv(rank, rope)


def page_shape(n_layers: int, page_size: int, latent: int) -> tuple[int, int, int, int]:
    """A page as every view here has it: ``(layers, tokens, 1, latent)``."""
    return (n_layers, page_size, 1, latent)


def page_view(host: Any, index: int, page_size: int) -> torch.Tensor:
    """The host pool's page starting at host token *index* (a view, no copy)."""
    buf = host.kv_buffer
    if host.layout == "page_first_direct":
        return buf[index // page_size]
    if host.layout == "page_first":
        return buf[index:index + page_size].transpose(0, 1)
    return buf[:, index:index + page_size]


def flat_page_view(host: Any, flat: torch.Tensor, n_layers: int, page_size: int) -> torch.Tensor:
    """A flat page as SGLang's legacy interface hands it (``get_data_page`` /
    ``set_from_flat_data_page`` order of the host layout)."""
    latent = int(host.kv_cache_dim)
    if host.layout == "page_first":
        return flat.view(page_size, n_layers, 1, latent).transpose(0, 1)
    return flat.view(n_layers, page_size, 1, latent)
