"""What NVMe kept over a restart, told to the KV event stream (`[events]` and `[nvme]` on).

The last daemon's events told routers what it held; after a restart that is stale (a
SIGKILL never sent its AllBlocksCleared), and what NVMe kept is held again. So, at start:

    TierMover.open() -> start()   AllBlocksCleared in each namespace NVMe holds objects of:
                                  a router drops what the last daemon told it, and asks for a
                                  snapshot; snapshots asked from here on wait
    a task                        reads the index's records in a worker thread, READ_CHUNK at
                                  a time; the loop adds each object the NVMe table still holds
                                  to the stream's holdings as STORAGE, with the route,
                                  chunk_tokens and session its record keeps (EventStream.kept)
    the last chunk                the snapshots that waited are taken (EventStream.restored)

No BlockStored is published per kept object: a router learns them from the snapshot it asks
for (docs/architecture.md, "Events for routers", says why). The scan does not hold up the
daemon's start: clients are served meanwhile. Checking the table on the loop, when a chunk
arrives, keeps out what was evicted or deleted since the scan read it; what was written
again since is in the holdings already (its own BlockStored), and stays as published.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from kvstore.errors import InvalidArgument
from kvstore.identity import DEFAULT_CHUNK_TOKENS, Kind
from kvstore.route import packed_route
from kvstore.server.events import MEDIUM_STORAGE
from kvstore.tiers.nvme.index import NvmeRecord, split_key

log = logging.getLogger("kvstore.events")
# Records decoded per trip to the worker thread (measured here ~19 us each with a 256-token
# route, ~6 us without). The loop then checks and adds them, ~23 us each with such a route
# (the holdings index its 16 hashes): ~12 ms between clients' requests, not a stall.
READ_CHUNK = 500


class KeptHoldings:
    """Made by the NVMe mover when the event stream is on; started once NVMe is open and
    indexed, stopped before it closes. Event loop thread."""

    def __init__(self, mover, events):
        self.mover = mover
        self.events = events
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        for prefix in self.mover.policy.prefixes:  # u16 length, then the name (tiers/nvme/index.py)
            self.events.cleared(prefix[2:].decode())
        self.events.restoring()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop reading (the chunk in the worker thread is finished first: it reads the index)."""
        self._stopping = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        records = self.mover.nvme.raw_records()
        num_read = num_unreadable = 0
        try:
            while not self._stopping:
                chunk, read, unreadable = await loop.run_in_executor(None, read_chunk, records, READ_CHUNK)
                num_read, num_unreadable = num_read + read, num_unreadable + unreadable
                for namespace, digest, route, block_size, session_id in chunk:
                    if self.mover.holds(namespace, digest):
                        self.events.kept(namespace, digest, MEDIUM_STORAGE, route, block_size, session_id)
                if read < READ_CHUNK:
                    break
        except Exception:  # the holdings lack what was not read; snapshots say less, never more
            log.exception("event=events_nvme_kept_failed")
        finally:
            self.events.restored()
        log.info("event=events_nvme_kept records=%d unreadable=%d seconds=%.2f stopped=%s",
                 num_read, num_unreadable, time.monotonic() - started, self._stopping)


def read_chunk(records, n: int) -> tuple[list[tuple], int, int]:
    """Up to n records of the index iterator, described for the holdings: (namespace, digest,
    packed route or None, block size, session id) of each object but a store group's manifest
    (never published); with the number of records read and of those unreadable (left out).
    Worker thread."""
    out, read, unreadable = [], 0, 0
    for key, value in itertools.islice(records, n):
        read += 1
        parts = split_key(key)
        try:
            if parts is None:
                raise ValueError("not an object's key")
            record = NvmeRecord.decode(value)
            descriptor, hints = record.descriptor, record.hints
            if descriptor.get("kind") == Kind.GROUP.value:
                continue
            block_size = descriptor.get("chunk_tokens", DEFAULT_CHUNK_TOKENS)
            if type(block_size) is not int or block_size <= 0:
                raise ValueError(f"chunk_tokens {block_size!r}")
            route = hints.get("route")
            session_id = hints.get("session_id")
            out.append((parts[0], parts[1].digest, None if route is None else packed_route(route), block_size,
                        session_id if isinstance(session_id, str) else None))
        except (ValueError, InvalidArgument):
            unreadable += 1
    return out, read, unreadable
