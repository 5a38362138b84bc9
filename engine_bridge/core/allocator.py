"""A reference-counted block allocator with an exact undo.

Free blocks are kept on a stack: ``allocate(n)`` pops *n* of them and
``free`` pushes blocks back in reverse order, so freeing what an allocation
just returned leaves the free list exactly as it was (the bridge's rollback
contract).  Blocks shared by several sequences (forks, restored shared pages)
carry one reference per holder and return to the free list at the last free.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from engine_bridge.core.pool import BlockId
from engine_bridge.errors import NoFreeBlocks


class RefCountingAllocator:
    """Hands out block ids ``0..num_blocks-1``; deterministic order (lowest first)."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        # The top of the stack is the end of the list: block 0 is handed out first.
        self._free: list[BlockId] = [BlockId(b) for b in range(num_blocks - 1, -1, -1)]
        self._refs: dict[BlockId, int] = {}

    def num_free(self) -> int:
        return len(self._free)

    def free_list(self) -> list[BlockId]:
        """The free stack, bottom first (a copy; for checks and tests)."""
        return list(self._free)

    def refcount(self, block: BlockId) -> int:
        return self._refs.get(block, 0)

    def allocate(self, n: int) -> list[BlockId]:
        """*n* fresh blocks with one reference each, or NoFreeBlocks taking none."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > len(self._free):
            raise NoFreeBlocks(n, len(self._free))
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        for b in taken:
            self._refs[b] = 1
        return taken

    def incref(self, blocks: Iterable[BlockId]) -> None:
        """Add one reference to each block (a new holder shares it)."""
        blocks = list(blocks)
        for b in blocks:
            if b not in self._refs:
                raise ValueError(f"block {b} is not allocated")
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: Sequence[BlockId]) -> None:
        """Drop one reference to each block; blocks reaching zero become free.

        Checked before anything changes: freeing a block that is not
        allocated (or more times than it is held) raises ValueError.
        """
        need: dict[BlockId, int] = {}
        for b in blocks:
            need[b] = need.get(b, 0) + 1
        for b, k in need.items():
            if self._refs.get(b, 0) < k:
                raise ValueError(f"block {b} is freed {k} times but held {self._refs.get(b, 0)}")
        released = []
        for b in blocks:
            r = self._refs[b] - 1
            if r:
                self._refs[b] = r
            else:
                del self._refs[b]
                released.append(b)
        released.reverse()
        self._free.extend(released)
