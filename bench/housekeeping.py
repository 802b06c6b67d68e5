"""Housekeeping: what the daemon's once-a-second expiry costs its event loop as the index grows.

    .venv/bin/python bench/housekeeping.py [--counts 100000,1000000] [--ttl-share 0.01]

The real tier manager (in process: housekeeping runs on the daemon's loop, so its cost is
time the loop cannot serve), `count` objects indexed of which `--ttl-share` carry a TTL.
Measured, per count, the median of 7 calls:

    expire()      TierManager.expire: leases past their TTL, objects due (the expiry heap,
                  server/tiering/expiry.py), table compaction
    scan          the baseline in the same run: one pass over every indexed entry asking
                  `is_live(now)`, what expiry did before the heap (and what any store that
                  scans for expired keys pays)

Reaches inside: the expiry pass is a call on the daemon's loop with no client-visible op, so it
is timed on the tier manager itself.

Nothing is due during the measurement (TTLs are an hour), so both find nothing to drop: the
ratio is the cost of looking. Writes bench/results/housekeeping.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import Row, report  # noqa: E402
from kvstore.config import HostTierConfig  # noqa: E402
from kvstore.hints import Hints  # noqa: E402
from kvstore.identity import ObjectId, StateDescriptor  # noqa: E402
from kvstore.server.tiering.chain import compose  # noqa: E402
from kvstore.server.tiering.host import HostTier  # noqa: E402
from kvstore.server.tiering.manager import TierManager  # noqa: E402

SUITE = "housekeeping"
SIZE = 64  # bytes per object; each takes one 4 KiB unit of the (lazily touched) arena


def indexed(count: int, ttl_share: float) -> tuple[TierManager, HostTier]:
    """The tier manager over `count` objects in namespace "bench", and its host tier."""
    chain = compose(HostTierConfig(arena_bytes=count * 4096 + (1 << 20), prefault=False))
    every = max(1, round(1 / ttl_share)) if ttl_share > 0 else 0
    desc, plain, timed = StateDescriptor("bench", "m", "r"), Hints(), Hints(ttl_s=3600.0)
    host = chain.host

    async def fill():
        ns = await host.open_namespace("bench")
        for i in range(count):
            host.publish(ns, ObjectId(i.to_bytes(32, "little")), ns.arena.alloc(SIZE), SIZE, b"\0" * 16, desc,
                         timed if every and i % every == 0 else plain)
    asyncio.run(fill())
    return TierManager(chain), host


def median_ms(fn, reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="100000,1000000")
    parser.add_argument("--ttl-share", type=float, default=0.01, help="share of objects put with a TTL")
    args = parser.parse_args()
    rows = []
    for count in [int(c) for c in args.counts.split(",")]:
        start = time.perf_counter()
        manager, host = indexed(count, args.ttl_share)
        print(f"[{time.strftime('%H:%M:%S')}] {count} objects indexed in {time.perf_counter() - start:.1f} s", flush=True)
        entries = host.namespaces["bench"].objects

        def scan():
            now = host.clock()
            return [e for e in entries.values() if not e.is_live(now)]
        ours, base = median_ms(manager.expire), median_ms(scan)
        rows.append(Row(SUITE, f"expire() at {count:,} objects", "median", "ms", ours, "scan of every entry", base,
                        higher_is_better=False))
        manager.close()
    report(SUITE, rows, [], {}, {"counts": args.counts, "ttl_share": args.ttl_share})


if __name__ == "__main__":
    main()
