"""A clean stop's flush: the host objects NVMe lacks written into its free room, most valuable
first, never evicting (TierMover.flush_host), so what was durable before the stop stays durable."""

from __future__ import annotations

import asyncio
import logging

from kvstore.server.tiering.objects import ObjectEntry

log = logging.getLogger("kvstore.movement")


def plan_flush(entries: list[ObjectEntry], free_bytes: int, now: float) -> tuple[list[ObjectEntry], int]:
    """What a clean stop writes to NVMe: (the entries that fit in `free_bytes`, pinned first,
    then most read, then newest; how many do not fit)."""
    planned, no_room = [], 0
    for entry in sorted(entries, key=lambda e: (e.is_pinned(now), e.num_hits, e.created_at), reverse=True):
        if entry.size <= free_bytes:
            planned.append(entry)
            free_bytes -= entry.size
        else:
            no_room += 1
    return planned, no_room


async def flush_host(host, nvme) -> int:
    """On a clean stop, write the host objects NVMe lacks into its free room: most valuable
    first (plan_flush), as many as fit, never evicting, so what was durable before the
    stop stays durable. What does not fit is counted and logged. How many landed."""
    entries = [e for ns in host.namespaces.values() for e in ns.objects.values()
               if not e.on_nvme and not e.deleted and not nvme.holds(e.namespace, e.object_id)]
    if not entries:
        return 0
    planned, no_room = plan_flush(entries, nvme.config.capacity_bytes - nvme.used_bytes, host.clock())
    log.info("event=flush_start objects=%d bytes=%d planned=%d no_room=%d", len(entries),
             sum(e.size for e in entries), len(planned), no_room)
    gate = asyncio.Semaphore(max(1, nvme.config.io_threads))

    async def one(entry):
        async with gate:
            return await nvme.write(entry, displace=None)

    sizes = [e.size for e in planned]  # read now: an entry's row may be reused once it left
    results = await asyncio.gather(*(one(e) for e in planned))
    written = sum(r is not None for r in results)
    log.log(logging.WARNING if written < len(entries) else logging.INFO,
            "event=flush_done written=%d not_written=%d no_room=%d bytes_written=%d",
            written, len(entries) - written, no_room,
            sum(size for size, r in zip(sizes, results) if r is not None))
    return written
