"""Sliding-window models under vLLM's hybrid KV cache manager: which page
holds what, and a pool over every cache group's blocks.

vLLM's hybrid manager (the connector declares ``SupportsHMA``) keeps the
layers of a sliding window in cache groups of their own, with only the
blocks their window still reaches: a block whose tokens every later token
no longer sees is freed (its place in the request's block table is vLLM's
null block).  So a finished request holds the full-attention layers' KV of
every token, and the windowed layers' KV of its last ``W - 1`` tokens (to
the blocks around them).

A session of such a model is still SPEC §1 pages, every layer in each page
(``docs/format.md``, "Sliding windows").  Its manifest says
``kv.window = {"tokens": W, "layers": [windowed layer indices]}``, and in a
sequence of ``n`` tokens page ``j`` holds its windowed layers' K/V only when
the window of the sequence's end reaches it: when its last token
``(j + 1) * B - 1 >= n - W + 1`` (:func:`kept`); there the slots of those
layers are zeros, as slots past a sequence's end are.  The bytes are fixed
by the tokens, their count and the model, so pages dedup as before: every
page the window has left is the same bytes whichever longer sequence wrote
it.  A load of the first ``m`` pages needs the windowed layers of the pages
the window of token ``m * B`` reaches, which are those vLLM gives blocks to
(:func:`loadable`): a prompt that stops well inside a longer session loads
the longest run whose window pages the session holds.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engine_bridge.core.pool import KVPool

#: vLLM's null block (its block pool's first block: ``BlockPool.null_block``),
#: the place of a freed block in a windowed group's block table.
NULL_BLOCK = 0


def first_kept(n_tokens: int, window: int, block_size: int) -> int:
    """The first page whose windowed layers a sequence of *n_tokens* holds."""
    return max(0, n_tokens - window + 1) // block_size


def kept(page: int, n_tokens: int, window: int, block_size: int) -> bool:
    """Whether page *page* of a sequence of *n_tokens* holds its windowed layers' K/V."""
    return page >= first_kept(n_tokens, window, block_size)


def loadable(m: int, n_saved: int, window: int, block_size: int) -> int:
    """The most pages, at most *m*, of a sequence saved with *n_saved* tokens
    that continue right: every page the window of their last token reaches
    holds its windowed layers (0 when none do)."""
    # (fewer pages' windows reach further back, to pages the session holds less of)
    return m if first_kept(m * block_size, window, block_size) >= first_kept(n_saved, window, block_size) else 0


def model_order(names: Sequence[str]) -> list[str]:
    """Layer names in the model's order (the number after ``layers.``)."""
    from vllm.model_executor.models.utils import extract_layer_index
    return sorted(names, key=extract_layer_index)


class WindowedPool(KVPool):
    """Pages of every layer over vLLM's cache groups, each with its own blocks.

    *groups* is a list of (a pool of the group's layers, those layers'
    indices in the model).  ``set_pages(table)`` says which blocks page
    ``i`` of the next page-out or page-in is: ``table[g][i]`` the block of
    group ``g`` (None: that group's layers of the page are zeros, and a
    load writes them nowhere).  Block ``i`` of this pool is then page ``i``.
    One pool a lane: the table is the lane's job's.
    """

    def __init__(self, groups: Sequence[tuple[KVPool, list[int]]], kv: dict[str, Any]):
        first = groups[0][0]
        self.__dict__.update(first.__dict__)
        self.groups = list(groups)
        self.n_layers = sum(len(layers) for _, layers in groups)
        if sorted(i for _, layers in groups for i in layers) != list(range(self.n_layers)):
            raise ValueError("the cache groups' layers are not each of the model's once")
        self.kv = dict(kv)
        self.layers = []
        self.num_blocks = 0
        self._table: list[list[int | None]] = [[] for _ in groups]

    def engine_info(self, name: str) -> dict[str, Any]:
        return self.groups[0][0].engine_info(name)

    def set_pages(self, table: Sequence[Sequence[int | None]]) -> None:
        if len(table) != len(self.groups) or len({len(t) for t in table}) > 1:
            raise ValueError(f"a page table of {len(self.groups)} groups with one block each a page")
        self._table = [list(t) for t in table]
        self.num_blocks = len(table[0])

    def _rows(self, index: torch.Tensor | Sequence[int]) -> list[int]:
        rows = index.tolist() if isinstance(index, torch.Tensor) else list(index)
        for r in rows:
            if not 0 <= r < self.num_blocks:
                raise IndexError(f"page {r} is not among the {self.num_blocks} set")
        return rows

    def block_index(self, blocks: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(blocks), dtype=torch.long)

    def gather(self, index: torch.Tensor | Sequence[int], out: torch.Tensor) -> None:
        rows = self._rows(index)
        o = out.view(out.shape[0], 2, self.n_layers, -1)
        for g, (pool, layers) in enumerate(self.groups):
            blocks = [self._table[g][r] for r in rows]
            have = [i for i, b in enumerate(blocks) if b is not None]
            for i, b in enumerate(blocks):
                if b is None:
                    o[i, :, layers] = 0
            if not have:
                continue
            part = torch.empty((len(have), pool.page_bytes), dtype=torch.uint8, device=out.device)
            pool.gather(pool.as_index([int(blocks[i] or 0) for i in have]), part)
            p = part.view(len(have), 2, len(layers), -1)
            at = torch.tensor(have, dtype=torch.long, device=out.device)
            for pos, layer in enumerate(layers):
                o[:, :, layer].index_copy_(0, at, p[:, :, pos])

    def scatter(self, index: torch.Tensor | Sequence[int], src: torch.Tensor) -> None:
        rows = self._rows(index)
        s = src.view(src.shape[0], 2, self.n_layers, -1)
        for g, (pool, layers) in enumerate(self.groups):
            blocks = [self._table[g][r] for r in rows]
            have = [i for i, b in enumerate(blocks) if b is not None]
            if not have:
                continue
            part = s[have][:, :, layers].contiguous()
            pool.scatter(pool.as_index([int(blocks[i] or 0) for i in have]), part.view(len(have), -1))
