"""Scale: what the daemon's index costs per object, and whether lookups stay flat as it grows.

    .venv/bin/python bench/scale.py [--counts 10000,100000,1000000] [--size 64]

For each count a fresh daemon (host tier only, no admin API, arena sized for the objects'
size-class slots with a quarter to spare: arena_bytes) gets `count` objects of `--size` bytes through
`put_many` (batches of 1,000), then the suite measures:

    index bytes/object   growth of the daemon's anonymous memory (RssAnon, /proc) from just
                         before the first put to after the last, per object: index, policy
                         and bookkeeping, not the payload (that lives in the memfd arena)
    lookup 1 key         p50 of single-key lookups of stored ids (one round trip each)
    lookup 4096 keys     median of lookups of 4,096 stored ids (one batched round trip)
    memory kept          RssAnon after deleting every object, over RssAnon before the puts
                         (1.0: everything given back)

Issue 43's goals are the targets (issue 15's were 200 B and 1.5x): at most 128 B per indexed
object at 10 M, the eviction policy's state included; lookup p50 at the largest count within
1.2x of the smallest (the ratio's baseline is the smallest count, same run); a 4,096-key lookup
under 1 ms; RssAnon after deleting everything at most 1.2x the empty daemon's. Writes
bench/results/scale.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from bench.common import Row, Target, host_only_daemon, median, percentile, report, scratch_dir  # noqa: E402

SUITE = "scale"
BATCH = 1000
PAGE = 4096


def arena_bytes(count: int, size: int) -> int:
    """Room for `count` objects of `size` bytes and to spare: each in a slot of its size class
    (64 B steps, at most 1.25x apart: tiers/slabs.py) with a quarter more, or whole pages
    above 3.5 KiB; not a page each, which at 10 M objects asks more than the machine has."""
    slot = -(-size // 64) * 64 * 5 // 4 if size <= 3584 else -(-size // PAGE) * PAGE
    return -(-count * slot // PAGE) * PAGE + (64 << 20)
SINGLE_LOOKUPS = 300
BATCH_LOOKUPS = 15
LOOKUP_KEYS = 4096


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


def ids(count: int):
    from kvstore.identity import ObjectId
    base = np.arange(count, dtype=np.uint64)
    raw = np.zeros((count, 4), dtype=np.uint64)
    raw[:, 0], raw[:, 1] = base, base * np.uint64(0x9E3779B97F4A7C15)
    return [ObjectId(row.tobytes()) for row in raw]


def measure(count: int, size: int, workdir: str) -> dict:
    from kvstore.client import Client
    arena = arena_bytes(count, size)
    daemon, socket_path = host_only_daemon(workdir, f"scale-{count}", arena)
    try:
        keys = ids(count)
        data = np.full(size, 7, dtype=np.uint8)
        with Client.connect(socket_path, timeout_s=120) as c:
            c.put_many([(keys[0], data)])  # the namespace's arena exists before the baseline
            c.delete([keys[0]])
            before = rss_anon(daemon.pid)
            start = time.perf_counter()
            for i in range(0, count, BATCH):
                results = c.put_many([(k, data) for k in keys[i:i + BATCH]])
                failed = [r for r in results if r.error is not None]
                if failed:
                    raise RuntimeError(f"put_many failed at object {i}: {failed[0].error}")
                if i and i % (BATCH * 100) == 0:
                    print(f"  {count}: {i} objects stored ({i / (time.perf_counter() - start):.0f}/s)", flush=True)
            put_s = time.perf_counter() - start
            after = rss_anon(daemon.pid)
            rng = np.random.default_rng(count)
            single = []
            for index in rng.integers(0, count, SINGLE_LOOKUPS):
                t0 = time.perf_counter_ns()
                c.lookup([keys[index]])
                single.append((time.perf_counter_ns() - t0) / 1e3)
            batched = []
            for _ in range(BATCH_LOOKUPS):
                picked = [keys[i] for i in rng.integers(0, count, min(LOOKUP_KEYS, count))]
                t0 = time.perf_counter()
                c.lookup(picked)
                batched.append((time.perf_counter() - t0) * 1e3)
            for i in range(0, count, BATCH):
                c.delete(keys[i:i + BATCH])
            time.sleep(2.5)  # housekeeping (every second) compacts the emptied tables
            emptied = rss_anon(daemon.pid)
    finally:
        daemon.terminate()
        daemon.wait(30)
    return {"count": count, "bytes_per_object": (after - before) / count, "lookup_p50_us": percentile(single, 50),
            "lookup_batch_ms": median(batched), "kept_ratio": emptied / before, "puts_per_s": count / put_s,
            "rss_before": before, "rss_after": after, "rss_emptied": emptied}


def build_rows(results: list[dict]) -> list[Row]:
    rows = []
    smallest = results[0]
    for r in results:
        n = f"{r['count']:,}"
        rows.append(Row(SUITE, f"index @{n}", "bytes/object", "B", r["bytes_per_object"], higher_is_better=False))
        rows.append(Row(SUITE, f"lookup 1 key @{n}", "p50", "us", r["lookup_p50_us"],
                        f"@{smallest['count']:,}", smallest["lookup_p50_us"], higher_is_better=False))
        rows.append(Row(SUITE, f"lookup {LOOKUP_KEYS} keys @{n}", "median", "ms", r["lookup_batch_ms"],
                        higher_is_better=False))
        rows.append(Row(SUITE, f"memory kept after delete @{n}", "ratio", "x", r["kept_ratio"], higher_is_better=False))
        rows.append(Row(SUITE, f"put_many @{n}", "throughput", "obj/s", r["puts_per_s"]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="10000,100000,1000000",
                        help="object counts, comma-separated, smallest first (default 10000,100000,1000000)")
    parser.add_argument("--size", type=int, default=64, help="bytes per object (default 64)")
    args = parser.parse_args(argv)
    try:
        counts = sorted(int(c) for c in args.counts.split(","))
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        parser.error(f"--counts takes positive integers, comma-separated; got {args.counts!r}")
    if args.size < 1:
        parser.error(f"--size takes a positive number of bytes; got {args.size}")
    results = []
    with scratch_dir("kvs-scale-") as workdir:
        for count in counts:
            print(f"scale: {count:,} objects of {args.size} B", flush=True)
            results.append(measure(count, args.size, workdir))
    largest = f"{counts[-1]:,}"
    targets = [Target(f"index @{largest}", "bytes/object", None, "<=", 128),
               Target(f"lookup 1 key @{largest}", "p50", f"@{counts[0]:,}", "<=", 1.2),
               Target(f"lookup {LOOKUP_KEYS} keys @{largest}", "median", None, "<=", 1.0),
               Target(f"memory kept after delete @{largest}", "ratio", None, "<=", 1.2)]
    report(SUITE, build_rows(results), targets, {}, {"counts": counts, "size": args.size, "raw": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
