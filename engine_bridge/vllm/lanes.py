"""The vLLM connector's worker half: two lanes that move pages beside the step.

A *lane* is one thread with a queue of jobs and a bridge of its own (its own
staging and lock), so a load never waits behind a save's page-out and
neither runs on the thread that steps the model.  Jobs end by being put in
the lane's ``done`` list, which the connector hands to vLLM from
``get_finished``.

Tensor parallel: each rank's pool holds a slice of the KV heads, and a session
holds whole-head pages (SPEC §1: sessions do not depend on parallelism).
:class:`HeadSlicePool` scatters a whole-head page's slice into a rank's pool
on a load; :class:`JoinedPool` gathers every rank's slice of the pages of a
save to the first rank of the group, which alone writes the session.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from engine_bridge.core.pool import KVPool

log = logging.getLogger("vllm.pffs")


def widen_thread(nice: int) -> None:
    """Let the calling thread run on every core this process may use, at *nice*.

    vLLM's CPU workers bind themselves to the cores of their OpenMP threads
    (one core per worker with ``VLLM_CPU_OMP_THREADS_BIND``): a lane bound
    there would take its time from the step.  Thread-level on Linux;
    elsewhere it does nothing."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError, ValueError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


@dataclass(eq=False)
class Lane:
    """One thread running jobs in order: ``submit(rid, fn)``; ``take_done()``.

    *fn* runs on the lane's thread; whatever it raises is logged by the
    caller's function itself (a job reports its own failure), and the request
    id is put in ``done`` either way.
    """

    name: str
    nice: int = 0
    done: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = 0
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"pffs-{self.name}", daemon=True)
        self._thread.start()
        _drain_at_exit(self)

    def submit(self, rid: str, fn: Callable[[], None]) -> None:
        with self._cv:
            self._busy += 1
        self._q.put((rid, fn))

    def _run(self) -> None:
        widen_thread(self.nice)
        while True:
            item = self._q.get()
            if item is None:
                return
            rid, fn = item
            try:
                fn()
            except BaseException:   # (the job logged it; the lane goes on)
                log.exception("%s lane: request %s", self.name, rid)
            with self._cv:
                self._busy -= 1
                self.done.add(rid)
                self._cv.notify_all()

    @property
    def busy(self) -> bool:
        return self._busy > 0

    def take_done(self) -> set[str]:
        with self._cv:
            got, self.done = self.done, set()
        return got

    def wait_any(self, timeout: float) -> None:
        """Until a job ends or *timeout* seconds pass (returns at once when idle)."""
        with self._cv:
            if self._busy and not self.done:
                self._cv.wait(timeout)

    def drain(self, timeout: float) -> bool:
        """Until every job submitted so far has ended (False: *timeout* seconds passed first)."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float = 600.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)


#: Lanes whose jobs run to their end when the interpreter exits.
_LANES: "weakref.WeakSet[Lane]" = weakref.WeakSet()
#: How long an exiting interpreter waits for the lanes' jobs.
EXIT_DRAIN = 600.0
_hooked = False


def _drain_at_exit(lane: Lane) -> None:
    """Have *lane*'s jobs end before the interpreter's own exit work.

    An engine run in-process (vLLM's offline LLM) may end its script right
    after the request whose save it handed over: the save must end saved
    or failed, never cut.  The bridge's I/O runs on a ThreadPoolExecutor,
    which refuses work once ``concurrent.futures`` saw the interpreter
    exit; that happens in threading's exit hooks, which run newest first,
    so the lanes' hook, registered after, runs before it."""
    global _hooked
    if not _hooked and hasattr(threading, "_register_atexit"):
        try:
            threading._register_atexit(_drain_lanes)
            _hooked = True
        except RuntimeError:    # (already exiting)
            pass
    _LANES.add(lane)


def _drain_lanes() -> None:
    for lane in list(_LANES):
        if lane.busy:
            log.info("%s lane: the interpreter exits: waiting for its jobs", lane.name)
            if not lane.drain(EXIT_DRAIN):
                log.error("%s lane: jobs still running after %.0f s at exit", lane.name, EXIT_DRAIN)


def wait_lanes(lanes: Sequence[Lane], timeout: float) -> None:
    """Until a job of any of *lanes* ends, or *timeout* seconds pass."""
    end = time.monotonic() + timeout
    busy = [lane for lane in lanes if lane.busy]
    while busy and not any(lane.done for lane in lanes):
        left = end - time.monotonic()
        if left <= 0:
            return
        busy[0].wait_any(min(left, 0.005) if len(busy) > 1 else left)


class HeadSlicePool(KVPool):
    """A rank's pool of heads ``first .. first + inner.n_heads - 1`` of
    *n_heads*, seen as a pool of whole-head pages: a load's page bytes are a
    whole session page and only this rank's heads are scattered."""

    def __init__(self, inner: KVPool, n_heads: int, first: int):
        if not 0 <= first <= n_heads - inner.n_heads:
            raise ValueError(f"heads {first}..{first + inner.n_heads - 1} are not among {n_heads}")
        self.__dict__.update(inner.__dict__)
        self.inner, self.n_heads, self.first = inner, n_heads, first

    def gather(self, index, out: torch.Tensor) -> None:
        # A whole-head page is not this rank's to give: JoinedPool makes it
        # from every rank's heads (what a save does).
        raise TypeError(f"this rank holds heads {self.first}..{self.first + self.inner.n_heads - 1} "
                        f"of {self.n_heads}: a whole page is joined from every rank (JoinedPool)")

    def scatter(self, index, src: torch.Tensor) -> None:
        d = self.head_dim * self.itemsize
        rows = src.view(src.shape[0], 2, self.n_layers, self.block_size, self.n_heads, d)
        mine = rows[:, :, :, :, self.first:self.first + self.inner.n_heads].contiguous()
        self.inner.scatter(index, mine.view(src.shape[0], -1))


class JoinedPool(KVPool):
    """The whole-head pages of a tensor-parallel save, on the group's first rank.

    ``join(blocks)``, called by every rank of *group* with the same blocks,
    sends each rank's slice of their pages (its heads) to the first rank.
    There block *i* of this pool is then page *i* of the save.  The buffers
    are kept from save to save and grow when a save has more pages; one save
    bridge pages out of this pool every time.

    Copies of each byte of a save at tensor-parallel size k (a GPU pool adds
    one device-to-host copy on each rank):

    - before: the rank's pool gather; gloo's gather into a flat buffer of
      its own; gloo's copy of it into the list of parts; ``torch.cat`` into
      whole-head pages; the page-out's gather into staging.  Five.
    - now: the rank's pool gather into its send buffer (the first rank's:
      straight into its part of the receive buffer); gloo's receive into
      that buffer; the page-out's gather, which puts each rank's heads in
      place as it copies a page into staging.  Three (the first rank's own
      heads: two).
    """

    def __init__(self, pool: KVPool, group: Any, n_ranks: int, rank: int):
        self.slices, self.group, self.n_ranks, self.rank = pool, group, n_ranks, rank
        self.layout = pool.layout       # (the engine's, which the manifest names)
        self.layers = []
        self.num_blocks, self.block_size, self.head_dim = 0, pool.block_size, pool.head_dim
        self.n_heads = pool.n_heads * n_ranks
        self.dtype, self.dtype_name, self.itemsize = pool.dtype, pool.dtype_name, pool.itemsize
        self.device, self.n_layers, self.kv = torch.device("cpu"), pool.n_layers, dict(pool.kv)
        # The first rank's: [k, capacity, slice bytes], rank r's slice of page i
        # at [r, i].  Another rank's: [1, capacity, slice bytes], what it sends.
        self._parts = torch.empty((n_ranks if rank == 0 else 1, 0, pool.page_bytes), dtype=torch.uint8)
        self._parts_np = self._parts.numpy()

    def engine_info(self, name: str) -> dict[str, Any]:
        return self.slices.engine_info(name)

    def join(self, blocks: Sequence[int]) -> bool:
        """Every rank's heads of the pages in *blocks* to the first rank; True there.

        Every rank calls it in the same order with the same blocks (one save
        lane a rank).  The buffers are overwritten: the first rank calls it
        again only once the page-out of the pages before has returned."""
        import torch.distributed as dist
        n = len(blocks)
        if n > self._parts.shape[1]:
            self._parts = torch.empty((self._parts.shape[0], n, self.slices.page_bytes), dtype=torch.uint8)
            self._parts_np = self._parts.numpy()
        self.num_blocks = n
        if not n:
            return self.rank == 0
        # (Gloo receives a rank's contiguous slice straight into the buffer
        # given; its gather collective receives into a flat buffer and copies.)
        recvs = [dist.irecv(self._parts[r, :n], group=self.group, group_src=r)
                 for r in range(1, self.n_ranks)] if self.rank == 0 else []
        mine = self._parts[0, :n]
        if self.slices.device.type == "cpu":
            self.slices.gather(self.slices.as_index(list(blocks)), mine)
        else:
            dev = torch.empty(mine.shape, dtype=torch.uint8, device=self.slices.device)
            self.slices.gather(self.slices.as_index(list(blocks)), dev)
            mine.copy_(dev)
        if self.rank:
            dist.send(mine, group=self.group, group_dst=0)
            return False
        for work in recvs:
            assert work is not None
            work.wait()
        return True

    def gather(self, index: torch.Tensor | Sequence[int], out: torch.Tensor) -> None:
        # Page b is [2, L, T, k, h*d]: rank r's slice [2, L, T, h*d] of it goes to head group r.
        blocks = index.tolist() if isinstance(index, torch.Tensor) else list(index)
        k, L, T = self.n_ranks, self.n_layers, self.block_size
        parts = self._parts_np.reshape(k, self._parts.shape[1], 2, L, T, -1)
        o = out.numpy().reshape(out.shape[0], 2, L, T, k, -1)
        for r, b in enumerate(blocks):
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"page {b} is not among the {self.num_blocks} joined")
            o[r] = np.moveaxis(parts[:, b], 0, 3)

    def scatter(self, index: torch.Tensor | Sequence[int], src: torch.Tensor) -> None:
        raise TypeError("joined pages are a save's: nothing is loaded into them")
