"""When clients last asked something of the daemon: background work waits for a pause.

The local service notes each read off a client socket (`heard`), and each report of hits a
client read from the shared index by itself (`reading`: such reads send nothing while they
run; their report comes up to TOUCH_WITHIN_S later, so the clients count as busy that long
after it). A background copy that
yields to clients (the pool's write_through copies, server/pool/link.py) awaits `pause`
before each batch: it goes once no client has sent anything for `quiet_s`, or once it
has waited `at_most_s`, whichever comes first, so copies behind a steady stream of
requests are late by at most that bound, never starved.

On a node whose cores the engine, the daemon and the pool's own processes share, a copy
running beside a client's lookups and loads takes their CPU and their memory bandwidth;
the copy can wait, the client cannot.
"""

from __future__ import annotations

import asyncio
import time

from kvstore.messages import TOUCH_WITHIN_S


class Traffic:
    """The time of the last client request (`last`, by `clock`). Loop thread only."""

    __slots__ = ("last", "_clock", "_sleep")

    def __init__(self, clock=time.monotonic, sleep=asyncio.sleep):
        self._clock, self._sleep = clock, sleep
        self.last = float("-inf")

    def heard(self) -> None:
        """A client sent something."""
        self.last = max(self.last, self._clock())

    def reading(self) -> None:
        """A client reported shared-index hits: it may go on reading for TOUCH_WITHIN_S
        before the daemon hears of it again."""
        self.last = self._clock() + TOUCH_WITHIN_S

    async def pause(self, quiet_s: float, at_most_s: float) -> None:
        """Return once no client sent anything for `quiet_s`, or after `at_most_s`."""
        deadline = self._clock() + at_most_s
        while True:
            now = self._clock()
            wait = min(self.last + quiet_s, deadline) - now
            if wait <= 0:
                return
            await self._sleep(wait)
