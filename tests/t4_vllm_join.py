"""Level t4, engines: a real engine (the reference engine, transformers or vLLM).
A tensor-parallel save's joining, without the engine: two processes in a
gloo group, each holding two of four KV heads in a vLLM pool.

The first rank's :class:`JoinedPool` holds the whole-head pages of each
save, equal to pages built by hand from the whole-head pool; one bridge
pages out of it save after save while its buffers grow and are reused.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import torch

N_BLOCKS, BLOCK, LAYERS, HEADS, DIM = 9, 16, 3, 4, 8
SAVES = [[5, 2, 7], [1, 3, 4, 6, 0, 8], [2]]     # (the second grows the buffers, the third reuses them)


def whole_pool():
    """The whole-head pool both ranks slice (the same on each: one seed)."""
    from engine_bridge.core.pool import VllmKVPool
    pool = VllmKVPool.allocate_vllm(num_blocks=N_BLOCKS, block_size=BLOCK, n_layers=LAYERS,
                                    n_heads=HEADS, head_dim=DIM, dtype=torch.bfloat16, order="LBHNC")
    g = torch.Generator().manual_seed(7)
    for t in pool.layers:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


def page_by_hand(pool, b: int, fill: int = BLOCK) -> bytes:
    """SPEC §1 page of block *b*: K then V, each [layers, tokens, heads, dim], element by element."""
    halves = []
    for kv in (0, 1):
        rows = torch.stack([t[b, :, :, kv * DIM:(kv + 1) * DIM].transpose(0, 1) for t in pool.layers])
        rows = rows.clone()
        rows[:, fill:] = 0
        halves.append(rows.contiguous().view(torch.uint8).numpy().tobytes())
    return halves[0] + halves[1]


def _rank(rank: int, store: str, out: str, errors) -> None:
    try:
        import torch.distributed as dist

        from engine_bridge.core.bridge import Bridge, SeqBlocks
        from engine_bridge.core.pool import BlockId, VllmKVPool
        from engine_bridge.transport.choose import as_source
        from engine_bridge.vllm.lanes import JoinedPool
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        group = dist.new_group(ranks=[0, 1], backend="gloo")
        whole = whole_pool()
        mine = VllmKVPool.allocate_vllm(num_blocks=N_BLOCKS, block_size=BLOCK, n_layers=LAYERS,
                                        n_heads=HEADS // 2, head_dim=DIM, dtype=torch.bfloat16,
                                        order="LBNHC")
        for t, w in zip(mine.layers, whole.layers):
            t.copy_(w[:, 2 * rank:2 * rank + 2])
        joined = JoinedPool(mine, group, 2, rank)
        bridge = Bridge(joined, None, engine_name="vllm")
        assert joined.page_bytes == whole.page_bytes and joined.geometry == whole.geometry
        assert joined.engine_info("vllm") == mine.engine_info("vllm")
        for s, blocks in enumerate(SAVES):
            if not joined.join(blocks):
                assert rank == 1
                continue
            n = len(blocks)
            got = torch.empty((n, joined.page_bytes), dtype=torch.uint8)
            joined.gather(list(range(n)), got)
            for i, b in enumerate(blocks):
                assert bytes(got[i].numpy()) == page_by_hand(whole, b), (s, i, b)
            # The page-out of one bridge, save after save (the last page part filled).
            n_tokens = n * BLOCK - 3
            path = f"{out}/save{s}"
            bridge.page_out([SeqBlocks("s", [BlockId(i) for i in range(n)], n_tokens)], path)
            src = as_source(path)
            for i, b in enumerate(blocks):
                fill = BLOCK - 3 if i == n - 1 else BLOCK
                assert src.read_page(i) == page_by_hand(whole, b, fill), (s, i, b)
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def test_the_first_rank_joins_every_ranks_heads_into_whole_pages(tmp_path):
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), str(tmp_path), errors))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
    failed = [] if errors.empty() else [errors.get() for _ in range(errors.qsize())]
    assert not failed, "\n".join(failed)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [sorted(x.name for x in tmp_path.glob("save*"))] == [["save0", "save1", "save2"]]
