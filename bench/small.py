"""Small objects: the host arena bytes each object takes, against its own size (issue 15).

    .venv/bin/python bench/small.py [--count 10000] [--sizes 512,1024,2048,3072,4096,2049,512-4096]

For each size (or range A-B: sizes drawn uniformly from it) a fresh daemon (host tier only,
no admin API, arena large enough that nothing is evicted) gets `count` objects through
`put_many` (batches of 1,000); the suite then reads the namespace's stats:

    arena bytes taken   used_bytes (the slots and pages objects hold) + slab_free_bytes (free
                        slots in their slabs): every page the objects keep from other uses
    waste               arena bytes taken / the objects' bytes - 1

The bytes/object row's baseline is what the same objects took before size classes, one whole
4 KiB page or more each (computed: sizes rounded up to 4 KiB). Issue 15's target: waste under
25% from 512 B to 4 KiB. Writes bench/results/small.json.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from bench.common import Row, Target, host_only_daemon, report, scratch_dir, size_label  # noqa: E402

SUITE = "small"
BATCH = 1000
PAGE = 4096  # the host arena's page (tiers/arena.py PAGE_BYTES): what each object took before
TARGET_WASTE_PCT = 25.0
# Each size class's best case (exact fits), 2049 B (its worst: just above 2048, in the 2560
# class) and sizes drawn uniformly from 512 B to 4 KiB (the typical case).
DEFAULT_SIZES = "512,1024,2048,3072,4096,2049,512-4096"


def ids(count: int, seed: int):
    from kvstore.identity import ObjectId
    raw = np.zeros((count, 4), dtype=np.uint64)
    raw[:, 0], raw[:, 1] = np.arange(count, dtype=np.uint64), np.uint64(seed)
    return [ObjectId(row.tobytes()) for row in raw]


def object_sizes(spec: str, count: int) -> list[int]:
    """"N": count objects of N bytes; "A-B": count sizes drawn uniformly from [A, B]."""
    low, _, high = spec.partition("-")
    if not high:
        return [int(low)] * count
    return [int(n) for n in np.random.default_rng(count).integers(int(low), int(high) + 1, count)]


def measure(count: int, spec: str, workdir: str) -> dict:
    from kvstore.client import Client
    sizes = object_sizes(spec, count)
    paged = sum(-(-n // PAGE) * PAGE for n in sizes)
    name = f"small-{spec}"
    daemon, socket_path = host_only_daemon(workdir, name, -(-int(paged * 1.1) // PAGE) * PAGE + (16 << 20))
    try:
        keys = ids(count, sum(map(ord, spec)))
        data = np.random.default_rng(0).integers(0, 256, max(sizes), dtype=np.uint8)
        with Client.connect(socket_path, timeout_s=120) as c:
            for i in range(0, count, BATCH):
                batch = [(k, data[:n]) for k, n in zip(keys[i:i + BATCH], sizes[i:i + BATCH])]
                failed = [r for r in c.put_many(batch) if r.error is not None]
                if failed:
                    raise RuntimeError(f"put_many failed at object {i}: {failed[0].error}")
            stats = c.stats()["namespaces"]["default"]
            c.check_integrity()
    finally:
        daemon.terminate()
        daemon.wait(30)
    if stats["objects"] != count or stats["num_evictions"]:
        raise RuntimeError(f"{spec} B: {stats['objects']} objects kept of {count}, "
                           f"{stats['num_evictions']} evicted; the arena should hold them all")
    taken = stats["used_bytes"] + stats["slab_free_bytes"]
    return {"sizes": spec, "count": count, "object_bytes": sum(sizes), "used_bytes": stats["used_bytes"],
            "slab_free_bytes": stats["slab_free_bytes"], "taken_bytes": taken, "paged_bytes": paged,
            "waste_pct": 100 * (taken / sum(sizes) - 1), "paged_waste_pct": 100 * (paged / sum(sizes) - 1)}


def label(spec: str) -> str:
    low, _, high = spec.partition("-")
    return size_label(int(low)) + (f"-{size_label(int(high))} mix" if high else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10_000, help="objects per size (default 10000)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"object sizes in bytes, comma-separated; A-B draws sizes from [A, B] (default {DEFAULT_SIZES})")
    args = parser.parse_args(argv)
    specs = args.sizes.split(",")
    try:
        bounds = [int(n) for spec in specs for n in spec.split("-")]
    except ValueError:
        parser.error("--sizes takes positive integers or ranges A-B")
    if args.count < 1 or min(bounds) < 1:
        parser.error("--count and --sizes take positive integers")
    results = []
    with scratch_dir("kvs-small-") as workdir:
        for spec in specs:
            print(f"small: {args.count:,} objects of {spec} B", flush=True)
            results.append(measure(args.count, spec, workdir))
    rows, targets = [], []
    for r, spec in zip(results, specs):
        case = f"arena per {label(spec)}"
        rows.append(Row(SUITE, case, "waste", "%", r["waste_pct"], higher_is_better=False))
        rows.append(Row(SUITE, case, "bytes/obj", "B", r["taken_bytes"] / r["count"], "4KiB pages",
                        r["paged_bytes"] / r["count"], higher_is_better=False))
        if all(512 <= int(n) <= PAGE for n in spec.split("-")):
            targets.append(Target(case, "waste", None, "<", TARGET_WASTE_PCT))
    report(SUITE, rows, targets, {}, {"count": args.count, "sizes": specs, "raw": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
