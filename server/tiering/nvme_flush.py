"""The NVMe tier's flush at a clean stop: host objects NVMe lacks go into its free room.

Most valuable first (pinned, then most read, then newest), as many as fit, never evicting:
what was durable before the stop stays durable. What does not fit is counted and logged.
"""

from __future__ import annotations

import asyncio
import logging

from kvstore.server.tiering.objects import ObjectEntry

log = logging.getLogger("kvstore.movement")


def plan_flush(entries: list[ObjectEntry], free_bytes: int, now: float) -> tuple[list[ObjectEntry], int]:
    """(the entries to write, most valuable first, that fit in `free_bytes`; how many do not)."""
    planned, no_room = [], 0
    for entry in sorted(entries, key=lambda e: (e.is_pinned(now), e.num_hits, e.created_at), reverse=True):
        if entry.size <= free_bytes:
            planned.append(entry)
            free_bytes -= entry.size
        else:
            no_room += 1
    return planned, no_room


async def flush_host(mover) -> int:
    """Write what `mover` (server.tiering.nvme_mover.TierMover) lacks of the host tier into
    NVMe's free room; how many objects landed."""
    entries = [e for ns in mover.host.namespaces.values() for e in ns.objects.values()
               if not e.on_nvme and not e.deleted and not mover.holds(e.namespace, e.object_id)]
    if not entries:
        return 0
    planned, no_room = plan_flush(entries, mover.config.capacity_bytes - mover.used_bytes, mover.host.clock())
    log.info("event=flush_start objects=%d bytes=%d planned=%d no_room=%d", len(entries),
             sum(e.size for e in entries), len(planned), no_room)
    gate = asyncio.Semaphore(max(1, mover.config.io_threads))

    async def one(entry):
        async with gate:
            return await mover.write(entry, displace=None)

    results = await asyncio.gather(*(one(e) for e in planned))
    written = sum(r is not None for r in results)
    log.log(logging.WARNING if written < len(entries) else logging.INFO,
            "event=flush_done written=%d not_written=%d no_room=%d bytes_written=%d",
            written, len(entries) - written, no_room,
            sum(e.size for e, r in zip(planned, results) if r is not None))
    return written
