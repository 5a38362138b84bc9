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


def engine_packing(vllm_config: Any, layer_names: Sequence[str], kernel_block: int,
                   head_dim: int, dtype: torch.dtype) -> BlockPacking:
    """The packing of the attention layers *layer_names* of a running vLLM engine
    (ValueError naming the backend when pffs does not know its packing)."""
    ctx = vllm_config.compilation_config.static_forward_context
    layers = [ctx[n] for n in layer_names if n in ctx]
    if not layers:
        raise ValueError("PffsConnector: vLLM registered no attention layer "
                         f"{layer_names[0]!r}: its KV packing is unknown")
    names = {layer.attn_backend.get_name() for layer in layers}
    if len(names) != 1:
        raise ValueError(f"PffsConnector: layers use several attention backends ({', '.join(sorted(names))})")
    backend = names.pop()
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
    return cpu_packing(str(isa), dtype, kernel_block, head_dim)


def cpu_packing(isa: str, dtype: torch.dtype, kernel_block: int, head_dim: int) -> BlockPacking:
    """The packing vLLM's CPU kernel for *isa* writes: one head's block filled
    by ``cpu_attn_reshape_and_cache`` with each element's index, a base-200
    digit at a time, and read back."""
    from vllm import _custom_ops as ops
    n, d = kernel_block, head_dim
    cache = torch.zeros((1, 1, n, 2 * d), dtype=dtype)       # one kernel block of one head
    k_cache, v_cache = cache.view(1, 1, 2 * n, d).chunk(2, dim=2)   # (as CPUAttentionBackendImpl splits it)
    index = torch.arange(n * d).view(n, 1, d)
    found = np.zeros(2 * n * d, dtype=np.int64)
    scale = 1
    while scale < n * d:
        digit = (index // scale % _BASE + 1).to(dtype)
        cache.zero_()
        ops.cpu_attn_reshape_and_cache(digit, digit, k_cache, v_cache, torch.arange(n), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        got = cache.view(-1).float().numpy().astype(np.int64)
        if got.min() < 1 or got.max() > _BASE:
            raise ValueError(f"vLLM's {isa} kernel did not write a {n}-token block of head size {d} "
                             "as a permutation of its elements")
        found += (got - 1) * scale
        scale *= _BASE
    where = np.arange(2 * n * d)
    pos = np.empty((2, n, d), dtype=np.int64)
    pos[where // (n * d), found // d, found % d] = where
    return BlockPacking(f"cpu {isa}", pos)
