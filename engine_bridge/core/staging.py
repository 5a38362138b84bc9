"""Bounded, reusable host staging buffers and the copy stream that fills them.

Page bytes cross between the engine's device and files through two halves
of host memory (double buffering): while the CPU hashes and writes one half,
the device fills the other.  The host halves are pinned whenever CUDA is
available, and on a CUDA pool every device-side gather, scatter and copy runs
on a side stream ordered by events.  On a CPU pool the very same sequence of
calls runs synchronously and the device-side buffer *is* the host buffer.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

DEFAULT_STAGING_BYTES = 128 << 20


class Staging:
    """Two halves of at most ``budget_bytes / 2`` host bytes each, grown on demand.

    ``max_batch`` pages fit in one half; a budget that holds fewer than two
    pages is refused.  On a CUDA device an equal amount of device scratch is
    kept beside the host halves.  One user at a time (the bridge holds a lock).
    """

    def __init__(self, device: torch.device | str, page_bytes: int,
                 budget_bytes: int = DEFAULT_STAGING_BYTES):
        self.device = torch.device(device)
        self.page_bytes = page_bytes
        self.budget_bytes = budget_bytes
        self.max_batch = budget_bytes // (2 * page_bytes)
        if self.max_batch < 1:
            raise ValueError(f"a staging budget of {budget_bytes} bytes holds fewer than two "
                             f"pages of {page_bytes} bytes")
        self.pinned = torch.cuda.is_available()
        self.on_cuda = self.device.type == "cuda"
        self._rows = 0
        self._host: list[torch.Tensor] = []
        self._host_np: list[np.ndarray] = []
        self._dev: list[torch.Tensor] = []
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self._events: list[torch.cuda.Event | None] = [None, None]

    @property
    def capacity(self) -> int:
        """Pages the two halves hold together at the budget."""
        return 2 * self.max_batch

    @property
    def allocated_bytes(self) -> int:
        """Host bytes currently held (never above the budget)."""
        return 2 * self._rows * self.page_bytes

    def reserve(self, rows: int) -> None:
        """Make each half hold at least *rows* pages (at most ``max_batch``)."""
        if rows > self.max_batch:
            raise ValueError(f"{rows} pages per half exceed the staging budget ({self.max_batch})")
        if rows <= self._rows:
            return
        self.synchronize()
        shape = (rows, self.page_bytes)
        self._host = [torch.empty(shape, dtype=torch.uint8, pin_memory=self.pinned)
                      for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        if self.on_cuda:
            with torch.cuda.stream(self.stream):
                self._dev = [torch.empty(shape, dtype=torch.uint8, device=self.device)
                             for _ in range(2)]
        else:
            self._dev = self._host
        self._rows = rows

    def host(self, half: int, n: int) -> torch.Tensor:
        return self._host[half][:n]

    def host_row(self, half: int, row: int) -> np.ndarray:
        """One page of a host half as a numpy row (buffer protocol, no copy)."""
        return self._host_np[half][row]

    def dev(self, half: int, n: int) -> torch.Tensor:
        """The device-side buffer of a half (the host half itself on a CPU pool)."""
        return self._dev[half][:n]

    def on_stream(self):
        """Context in which device work of the bridge is issued."""
        return torch.cuda.stream(self.stream) if self.on_cuda else contextlib.nullcontext()

    def begin(self) -> None:
        """Order the side stream after everything the engine has issued so far."""
        if self.stream is not None:  # on CUDA
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def to_host(self, half: int, n: int) -> None:
        """Start the copy of a half's device buffer into its host buffer."""
        if self.on_cuda:
            self._host[half][:n].copy_(self._dev[half][:n], non_blocking=True)

    def to_device(self, half: int, n: int) -> None:
        """Start the copy of a half's host buffer into its device buffer."""
        if self.on_cuda:
            self._dev[half][:n].copy_(self._host[half][:n], non_blocking=True)

    def mark(self, half: int) -> None:
        """Record that the work issued so far for *half* is what ``wait`` waits for."""
        if self.on_cuda:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self._events[half] = ev

    def wait(self, half: int) -> None:
        """Block until the device work recorded for *half* has finished."""
        ev = self._events[half]
        if ev is not None:
            ev.synchronize()
            self._events[half] = None

    def synchronize(self) -> None:
        """Finish all device work and let the engine's stream see its results."""
        if self.stream is not None:  # on CUDA
            self.stream.synchronize()
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._events = [None, None]


def batches(n: int, size: int) -> Iterator[tuple[int, int, int]]:
    """(batch number, start, stop) over ``range(n)`` in batches of *size*."""
    for j, start in enumerate(range(0, n, size)):
        yield j, start, min(n, start + size)
