"""What the Mooncake master says the pool holds, read from its Prometheus endpoint
(`mooncake_master --metrics_port`, `[remote.mooncake] master_metrics_url`).

The Mooncake client (`mooncake.store`) reports nothing of the pool's size or contents, so
/v1/cluster and `kvstore status` ask the master's /metrics page. Its figures are the whole
pool's, every client and tenant together, not this daemon's share.
"""

from __future__ import annotations

import asyncio

# The master's gauges, under the names /v1/cluster gives them.
GAUGES = {
    "master_allocated_bytes": "allocated_bytes",
    "master_total_capacity_bytes": "capacity_bytes",
    "master_key_count": "keys",
    "master_soft_pin_key_count": "soft_pinned_keys",
    "master_active_clients": "clients",
}
# An admin request waits at most this long for the master: a master that is down answers
# nothing at all, and the operator asking /v1/cluster should learn that quickly.
READ_TIMEOUT_S = 1.0


def parse_master_metrics(text: str) -> dict[str, int]:
    """The GAUGES found in a Prometheus text page (names without labels)."""
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in GAUGES:
            try:
                found[GAUGES[name]] = int(float(value))
            except ValueError:
                continue
    return found


async def read_master_metrics(url: str, timeout_s: float = READ_TIMEOUT_S) -> tuple[dict[str, int] | None, str | None]:
    """(the pool's gauges, None), or (None, why not)."""
    import aiohttp
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(url) as response:
                if response.status != 200:
                    return None, f"{url} answered HTTP {response.status}"
                return parse_master_metrics(await response.text()), None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return None, f"{url} unreachable: {type(exc).__name__} {exc}".strip()
