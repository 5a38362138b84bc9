"""Long-lived worker threads taking calls from one queue: the namespace's writer
(pffs.fs.db), the commit threads (pffs.fs.content) and the prefetch threads
(pffs.fs.prefetch).  See docs/concurrency.md.
"""

from __future__ import annotations

import functools
import queue
import threading
from typing import Any, Callable

import outcome
import trio


class WorkerPool:
    """Long-lived threads taking calls from one queue; a cheaper hop than trio.to_thread.

    Calls are not cancellable once queued (commits must run to the end).
    At most ``size`` run at once; more wait in the queue.
    """

    def __init__(self, size: int, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
                         for i in range(size)]
        for t in self._threads:
            t.start()

    @property
    def size(self) -> int:
        return len(self._threads)

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            fn, args, token, deliver = job
            result = outcome.capture(fn, *args)
            try:
                token.run_sync_soon(deliver, result)
            except trio.RunFinishedError:
                pass

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        await trio.lowlevel.checkpoint_if_cancelled()
        task = trio.lowlevel.current_task()
        self._q.put((fn, args, trio.lowlevel.current_trio_token(),
                     functools.partial(trio.lowlevel.reschedule, task)))
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    def submit(self, done: Callable[[outcome.Outcome], Any], fn: Callable[..., Any], *args: Any) -> None:
        """From the trio thread, without waiting: ``done(outcome of fn(*args))``
        runs on the trio thread once a worker has run it."""
        self._q.put((fn, args, trio.lowlevel.current_trio_token(), done))

    def stop(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(10)
