"""Worker threads for blocking calls, as daemon threads.

Not a ThreadPoolExecutor: Python joins every executor thread at exit, and a Mooncake call
may block for its own retries (a setup against a master that is down takes seconds each);
a daemon that is asked to stop must not wait for them. A call still running at stop is
abandoned with its thread, which ends with the process. The caller keeps what a running
call reads or writes alive until the call returns (the pool only hands out its own memory).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Callable


class Workers:
    """`await workers.run(fn, *args)` runs fn(*args) on one of `count` threads. Loop thread only."""

    def __init__(self, count: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(count)]
        for thread in self._threads:
            thread.start()
        self._closed = False

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, future, fn, args = job
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the awaiting task
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        if self._closed:
            raise RuntimeError("workers are closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        # A cancelled caller still waits for the call to end: it may be reading or writing the
        # caller's memory (an arena extent that the caller would give back at once).
        cancelled = False
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    break
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError()
        return future.result()

    def close(self) -> None:
        """No new calls; idle threads end, busy ones end after their call (not waited for)."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)


def _settle(future: asyncio.Future, result, exc) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
