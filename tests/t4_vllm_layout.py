"""Level t4, engines: a real engine (the reference engine, transformers or vLLM).
vLLM's KV layouts as bridge pools: page bytes are contract §1's whatever the order.

The views come from vLLM's own allocator (``allocate_kv_cache`` over a
``KVCacheConfig`` made by ``get_kv_cache_configs``), in each physical order and
with kernel block splitting.
"""

from __future__ import annotations

import pytest
import torch

from engine_bridge.core.pool import VLLM_ORDERS, VllmKVPool

from vllm_helpers import D, H, L, kv_views, vllm_config


def expected_page(views, b: int, r: int, fill: int | None = None) -> bytes:
    """Contract §1 page of scheduler block *b*, built element by element from the views."""
    k, v = [], []
    for t in views:
        Nk = t.shape[2]
        toks = [t[b * r + n // Nk, :, n % Nk, :] for n in range(r * Nk)]  # each [H, 2D]
        lk = torch.stack([x[:, :D] for x in toks])
        lv = torch.stack([x[:, D:] for x in toks])
        if fill is not None:
            lk[fill:] = 0
            lv[fill:] = 0
        k.append(lk)
        v.append(lv)
    return torch.stack(k).contiguous().view(torch.uint8).numpy().tobytes() + \
        torch.stack(v).contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("order", VLLM_ORDERS)
@pytest.mark.parametrize("kernel", [16, 8])
def test_vllm_views_gather_and_scatter_contract_pages(order, kernel, tmp_path):
    cfg = vllm_config(tmp_path, layout=order)
    try:
        views, kcc = kv_views(cfg, layout=order, kernel_block_size=kernel)
    except ValueError as e:  # vLLM refuses to split blocks in layouts whose pages are not dense
        assert kernel != 16 and "kernel blocks" in str(e)
        return  # (vLLM refuses to split blocks in this layout: nothing to page)
    g = torch.Generator().manual_seed(3)
    for t in views:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    pool = VllmKVPool(views, order, kcc.num_blocks)
    r = 16 // kernel
    assert (pool.block_size, pool.n_layers, pool.n_heads, pool.head_dim, pool.kernel_blocks_per_block) \
        == (16, L, H, D, r)
    out = torch.empty((2, pool.page_bytes), dtype=torch.uint8)
    pool.gather(pool.block_index([5, 2]), out)
    assert bytes(out[0].numpy()) == expected_page(views, 5, r)
    assert bytes(out[1].numpy()) == expected_page(views, 2, r)
    pool.zero_tail(out, 1, 7)
    assert bytes(out[1].numpy()) == expected_page(views, 2, r, fill=7)

    # Into another pool of another order: the same pages come back out.
    other = VllmKVPool.allocate_vllm(num_blocks=kcc.num_blocks, block_size=16, n_layers=L, n_heads=H,
                                     head_dim=D, dtype=views[0].dtype, order="BHLNC")
    pool.gather(pool.block_index([5, 2]), out)
    other.scatter(other.block_index([9, 0]), out)
    back = torch.empty_like(out)
    other.gather(other.block_index([9, 0]), back)
    assert torch.equal(back, out)
    assert bytes(back[0].numpy()) == expected_page(views, 5, r)


def or_skip(fn, *args, **kw):
    """``fn(*args, **kw)``, or a skip naming why where vLLM's CPU build has no kernel for
    this configuration on this host (its AMX and fp8 paths need AVX-512)."""
    try:
        return fn(*args, **kw)
    except (RuntimeError, NotImplementedError) as e:
        if "Unsupported CPU attention configuration" in str(e) or "AVX-512" in str(e):
            pytest.skip(f"vLLM's CPU kernel is not available on this host: {e}")
        raise


def write_or_skip(ops, *args, **kw) -> None:
    """vLLM's own cache-writing kernel (or_skip)."""
    or_skip(ops.cpu_attn_reshape_and_cache, *args, **kw)


@pytest.mark.parametrize("isa, dtype", [("vec", torch.bfloat16), ("vec", torch.float16),
                                        ("vec", torch.float32), ("vec16", torch.bfloat16),
                                        ("amx", torch.bfloat16)])
@pytest.mark.parametrize("n_layers", [1, 3])
def test_cpu_kernel_packings_are_converted_exactly(isa, dtype, n_layers):
    """vLLM's CPU kernels keep a head's block as a packed K region then V region:
    blocks written by vLLM's own cache-writing kernel for *isa* gather into
    pages that are exactly the K and V written (SPEC §1), and pages scattered
    into a pool hold exactly what that kernel writes (an AMX packing is
    written by plain stores: it runs on any x86 host)."""
    from vllm import _custom_ops as ops

    from engine_bridge.vllm.packing import cpu_packing
    B, Hh, N, Dd = 6, 2, 32, 64
    packing = or_skip(cpu_packing, isa, dtype, N, Dd)
    assert packing.name == f"cpu {isa}"
    pools = [VllmKVPool.allocate_vllm(num_blocks=B, block_size=N, n_layers=n_layers, n_heads=Hh,
                                      head_dim=Dd, dtype=dtype, order="LBHNC", packing=packing)
             for _ in range(2)]
    assert not pools[0].packing.is_token_rows
    g = torch.Generator().manual_seed(5)
    k = torch.randn((n_layers, B * N, Hh, Dd), generator=g).to(dtype)
    v = torch.randn((n_layers, B * N, Hh, Dd), generator=g).to(dtype)
    for layer, t in enumerate(pools[0].layers):
        kc, vc = t.view(B, Hh, 2 * N, Dd).chunk(2, dim=2)
        write_or_skip(ops, k[layer], v[layer], kc, vc, torch.arange(B * N), isa,
                      k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    out = torch.empty((2, pools[0].page_bytes), dtype=torch.uint8)
    pools[0].gather([4, 1], out)
    for row, b in enumerate([4, 1]):
        want = torch.cat([k[:, b * N:(b + 1) * N].flatten(), v[:, b * N:(b + 1) * N].flatten()])
        assert torch.equal(out[row].view(dtype), want), (isa, b)
    pools[1].scatter([0, 5], out)
    for a, b in zip(pools[0].layers, pools[1].layers):
        assert torch.equal(b[0], a[4]) and torch.equal(b[5], a[1])


def fp8_values(shape, fp8: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random finite fp8 values of *shape* (no NaN, no infinity, no -0)."""
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(fp8)
    keep = torch.isfinite(raw.float()) & (raw.float() != 0)
    return torch.where(keep, raw, torch.ones((), dtype=fp8)).view(fp8)


@pytest.mark.parametrize("kv_cache_dtype, fp8", [("fp8_e4m3", torch.float8_e4m3fn),
                                                 ("fp8_e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_fp8_kernel_packings_are_converted_exactly(isa, kv_cache_dtype, fp8, model_dtype):
    """vLLM's CPU kernels quantize what they write to an fp8 cache (kept as uint8):
    the probe, written as the engine writes (kv_cache_dtype, scale 1.0), finds the
    packing, and blocks that vLLM's own kernel wrote at per-layer scales gather into
    pages holding exactly the fp8 values it quantized to (SPEC §1), which scatter
    back to the bytes it wrote."""
    from vllm import _custom_ops as ops

    from engine_bridge.vllm.packing import cpu_packing
    B, Hh, N, Dd, n_layers = 6, 2, 32, 64, 2
    packing = or_skip(cpu_packing, isa, torch.uint8, N, Dd, kv_cache_dtype, model_dtype)
    pools = [VllmKVPool.allocate_vllm(num_blocks=B, block_size=N, n_layers=n_layers, n_heads=Hh,
                                      head_dim=Dd, dtype=fp8, order="LBHNC", packing=packing)
             for _ in range(2)]
    g = torch.Generator().manual_seed(7)
    k8 = fp8_values((n_layers, B * N, Hh, Dd), fp8, g)
    v8 = fp8_values((n_layers, B * N, Hh, Dd), fp8, g)
    scales = [(0.5, 2.0), (4.0, 0.25)]      # (powers of two: value * scale is exact in the model dtype)
    for layer, t in enumerate(pools[0].layers):
        ks, vs = scales[layer]
        kc, vc = t.view(torch.uint8).view(B, Hh, 2 * N, Dd).chunk(2, dim=2)
        write_or_skip(ops, (k8[layer].to(model_dtype) * ks), (v8[layer].to(model_dtype) * vs),
                      kc, vc, torch.arange(B * N), isa, k_scale=ks, v_scale=vs,
                      kv_cache_dtype=kv_cache_dtype)
    out = torch.empty((2, pools[0].page_bytes), dtype=torch.uint8)
    pools[0].gather([4, 1], out)
    for row, b in enumerate([4, 1]):
        want = torch.cat([k8[:, b * N:(b + 1) * N].flatten(), v8[:, b * N:(b + 1) * N].flatten()])
        assert torch.equal(out[row], want.view(torch.uint8)), (isa, b)
    pools[1].scatter([0, 5], out)
    for a, b in zip(pools[0].layers, pools[1].layers):
        assert torch.equal(b[0].view(torch.uint8), a[4].view(torch.uint8))
        assert torch.equal(b[5].view(torch.uint8), a[1].view(torch.uint8))
