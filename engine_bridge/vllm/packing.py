"""How vLLM's attention kernels keep K and V in a block, asked of the running engine.

vLLM hands a connector each layer as ``[B, H, N, C]``; the attention
backend decides what ``C`` holds.  The GPU backends below keep token *n*'s K
then V in row *n*.  vLLM's CPU backend keeps a head's block as a K region
then a V region, each packed for the kernel its metadata builder chose
(``layer.isa``: ``amx``, ``vec``, ``vec16``, ``neon``, ...): with AMX, K as
``[N/16][D/2][16][2]`` and V as ``[D/16][N/2][16][2]``; with the vector
kernels, K column-major and V row-major.  Rather than copy those rules, the
connector writes one probe block with the engine's own
``cpu_attn_reshape_and_cache`` for the engine's ISA and reads where each
element landed, so a session holds the model's K and V (SPEC §1) whichever
kernel wrote them, and loads into any other.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from engine_bridge.core.pool import BlockPacking, token_packing

#: Attention backends whose kernels read token n's K then V from row n of a
#: head's ``[N, 2D]`` (their ``forward`` splits the content dimension at
#: head_size).
TOKEN_ROW_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")

#: Digits of a probe: every float dtype holds integers 1..200 exactly.
_BASE = 200
#: Digits of an fp8 cache's probe: the 64 fp8 values from 1.0 up (e4m3: 1.0 to
#: 240, e5m2: 1.0 to 57344), exact in fp8 and in every model dtype, so the
#: kernel's quantization at scale 1.0 writes each as its own byte.
_FP8_BASE = 64


def _backend_of(vllm_config: Any, layer_names: Sequence[str], what: str) -> tuple[list[Any], str]:
    """The attention layers *layer_names* of a running vLLM engine and the one backend
    they use (ValueError when vLLM registered none, or they use several)."""
    ctx = vllm_config.compilation_config.static_forward_context
    layers = [ctx[n] for n in layer_names if n in ctx]
    if not layers:
        raise ValueError("PffsConnector: vLLM registered no attention layer "
                         f"{layer_names[0]!r}: its {what} is unknown")
    names = {layer.attn_backend.get_name() for layer in layers}
    if len(names) != 1:
        raise ValueError(f"PffsConnector: layers use several attention backends ({', '.join(sorted(names))})")
    return layers, names.pop()


def engine_packing(vllm_config: Any, layer_names: Sequence[str], kernel_block: int,
                   head_dim: int, dtype: torch.dtype) -> BlockPacking:
    """The packing of the attention layers *layer_names* of a running vLLM engine
    (ValueError naming the backend when pffs does not know its packing)."""
    layers, backend = _backend_of(vllm_config, layer_names, "KV packing")
    if backend in TOKEN_ROW_BACKENDS:
        return token_packing(kernel_block, head_dim)
    if backend != "CPU_ATTN":
        raise ValueError(f"PffsConnector: the {backend} attention backend keeps K and V in a "
                         f"packing pffs does not know (known: CPU_ATTN, {', '.join(TOKEN_ROW_BACKENDS)})")
    isas = {getattr(layer, "isa", None) for layer in layers}
    isa = isas.pop() if len(isas) == 1 else None
    if isa is None:
        # (No metadata builder set it yet: the ISA vLLM's builder will choose.)
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        cc = vllm_config.cache_config
        isa = _get_attn_isa(vllm_config.model_config.dtype, cc.block_size, head_dim, cc.cache_dtype)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    return cpu_packing(str(isa), dtype, kernel_block, head_dim, cache_dtype, vllm_config.model_config.dtype)


def cpu_packing(isa: str, dtype: torch.dtype, kernel_block: int, head_dim: int,
                kv_cache_dtype: str = "auto", model_dtype: torch.dtype = torch.float32) -> BlockPacking:
    """The packing vLLM's CPU kernel for *isa* writes: one head's block filled
    by ``cpu_attn_reshape_and_cache`` with each element's index, a base-200
    digit at a time, and read back.  An fp8 cache (*kv_cache_dtype* fp8,
    fp8_e4m3 or fp8_e5m2; *dtype* uint8) is written as the engine writes it,
    quantizing *model_dtype* values at scale 1.0: its digits are fp8 values,
    read back by their bytes."""
    from vllm import _custom_ops as ops

    from engine_bridge.vllm.kinds import FP8_CACHE_DTYPES
    n, d = kernel_block, head_dim
    fp8 = FP8_CACHE_DTYPES.get(kv_cache_dtype)
    if fp8 is None:
        base, first, values = _BASE, 1, (torch.arange(_BASE) + 1).to(dtype)
    else:
        base, first = _FP8_BASE, int(torch.tensor(1.0, dtype=fp8).view(torch.uint8))
        values = torch.arange(first, first + base, dtype=torch.uint8).view(fp8).to(model_dtype)
    cache = torch.zeros((1, 1, n, 2 * d), dtype=dtype)       # one kernel block of one head
    k_cache, v_cache = cache.view(1, 1, 2 * n, d).chunk(2, dim=2)   # (as CPUAttentionBackendImpl splits it)
    index = torch.arange(n * d).view(n, 1, d)
    found = np.zeros(2 * n * d, dtype=np.int64)
    scale = 1
    while scale < n * d:
        digit = values[index // scale % base]
        cache.zero_()
        ops.cpu_attn_reshape_and_cache(digit, digit, k_cache, v_cache, torch.arange(n), isa,
                                       k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto" if fp8 is None else kv_cache_dtype)
        written = cache.view(-1).numpy() if fp8 is not None else cache.view(-1).float().numpy()
        got = written.astype(np.int64) - first
        if got.min() < 0 or got.max() >= base:
            raise ValueError(f"vLLM's {isa} kernel did not write a {n}-token block of head size {d} "
                             "as a permutation of its elements")
        found += got * scale
        scale *= base
    where = np.arange(2 * n * d)
    pos = np.empty((2, n, d), dtype=np.int64)
    pos[where // (n * d), found // d, found % d] = where
    return BlockPacking(f"cpu {isa}", pos)


def check_latent_rows(vllm_config: Any, layer_names: Sequence[str], view: torch.Tensor,
                      kv_lora_rank: int) -> str:
    """The name of the MLA backend of a running vLLM engine's layers *layer_names*, once
    its own cache writer (the layer's ``do_kv_cache_update``) wrote one probe block of
    *view*'s shape as token rows (each token's compressed values, then its rotary part,
    in one row: SPEC §1.1's order); ValueError naming the backend when it did not."""
    layers, backend = _backend_of(vllm_config, layer_names, "latent cache's packing")
    n, d = view.shape[-2], view.shape[-1]
    cache = torch.zeros((1, *view.shape[1:]), dtype=view.dtype, device=view.device)
    index = torch.arange(n * d, device=view.device).view(n, d)
    scale, found = 1, torch.zeros(n * d, dtype=torch.long)
    try:
        while scale < n * d:
            digit = (index // scale % _BASE + 1).to(view.dtype)
            cache.zero_()
            layers[0].impl.do_kv_cache_update(digit[:, :kv_lora_rank].contiguous(),
                                              digit[:, kv_lora_rank:].unsqueeze(1).contiguous(), cache,
                                              torch.arange(n, device=view.device), "auto",
                                              torch.ones((), device=view.device))
            found += (cache.reshape(-1).to("cpu", torch.float32).long() - 1) * scale
            scale *= _BASE
    except Exception as e:      # (a writer that cannot take the probe: packing unknown)
        raise ValueError(f"PffsConnector: the {backend} latent cache could not be probed ({e})") from None
    if not torch.equal(found, torch.arange(n * d)):
        raise ValueError(f"PffsConnector: the {backend} attention backend packs its latent cache "
                         "in blocks pffs does not know (known: one row a token)")
    return backend


def check_latent_rope(vllm_config: Any, kv_lora_rank: int, rope_dim: int, n_heads: int,
                      dtype: torch.dtype) -> None:
    """ValueError when vLLM's rotary embedding, as this platform runs it, does not
    rotate latent keys as its own reference code (``forward_native``) does.

    An MLA layer hands the rotary embedding each token's rotary part as a view
    ``[T, 1, rope_dim]`` into the latent row ``[T, kv_lora_rank + rope_dim]``
    (and the queries' rotary part as a slice of theirs), and caches what it
    gives back: pages of a rotary embedding that mistakes the view's strides
    (vLLM 0.32's CPU kernel takes the key's head stride for its token stride)
    hold latents that are not the model's, which no engine could continue from.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    t, nope = 24, 16
    with set_current_vllm_config(vllm_config):
        rope = RotaryEmbedding(rope_dim, rope_dim, 4096, 10000.0, False, dtype)
    gen = torch.Generator().manual_seed(0)
    latent = torch.randn((t, kv_lora_rank + rope_dim), generator=gen).to(dtype)
    q = torch.randn((t, n_heads, nope + rope_dim), generator=gen).to(dtype)
    positions = torch.arange(t) * 3 + 1
    want_q, want_k = rope.forward_native(positions, q[..., nope:].clone(),
                                         latent[:, kv_lora_rank:].unsqueeze(1).clone())
    k_pe = latent.split([kv_lora_rank, rope_dim], dim=-1)[1].unsqueeze(1)
    got_q, got_k = rope(positions, q[..., nope:], k_pe)
    assert got_k is not None and want_k is not None
    if not (torch.allclose(got_k.float(), want_k.float(), atol=0.05, rtol=0.02)
            and torch.allclose(got_q.float(), want_q.float(), atol=0.05, rtol=0.02)):
        raise ValueError("vLLM's rotary embedding on this platform rotates latent-attention keys "
                         "other than its reference code does (its CPU kernel mistakes the strides "
                         "of the key view MLA hands it): the latents it caches are not the model's")
