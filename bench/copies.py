"""How a verified read from the shared index should copy and hash, against memcpy in the same run.

A hit read from the shared index (kvstore/client/shared_reads.py) is copied out of the arena
into the caller's buffer and hashed (xxh3-128 of what landed) before it is accepted. Which
way is quicker depends on the machine's caches, so this probe times each way on the machine
at hand, in one process, over distinct source slots (as reads of different objects are):

    whole    copy the object in one call (on two threads from 4 MiB: copies.copy), then hash it
    blocks   copies.copy_and_hash: 256 KiB blocks, each hashed while in cache (on two threads
             from 8 MiB); what a hit over WHOLE_COPY_MAX_BYTES uses
    behind   a helper thread copies 256 KiB blocks in order, the caller hashes each behind it
    halves   copies.copy_and_hash_in_halves: the caller copies and hashes half by blocks while a
             helper copies the other half, then hashes that half (copy_and_hash's way from 8 MiB)
    memcpy   np.copyto of the same bytes into distinct slots (the baseline)

Every way's digest is checked against the object's. Reps alternate the ways. Prints each
way's median and its ratio to memcpy (higher is better).

    .venv/bin/python bench/copies.py [--reps 15] [--sizes 1,2,4,8] [--total-mib 256]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kvstore.checksums import HASH_BLOCK_BYTES  # noqa: E402
from kvstore.client import copies  # noqa: E402
from kvstore.client.shared_reads import WHOLE_COPY_MAX_BYTES  # noqa: E402

MiB = 1 << 20
HELPER = ThreadPoolExecutor(1, thread_name_prefix="bench-copy")  # `behind`'s helper, as copies.py has one


def whole(dst: np.ndarray, src: np.ndarray) -> bytes:
    copies.copy(dst, src)
    return xxhash.xxh3_128_digest(dst)


def behind(dst: np.ndarray, src: np.ndarray) -> bytes:
    landed: queue.SimpleQueue = queue.SimpleQueue()

    def copy_in_order() -> None:
        for start in range(0, src.size, HASH_BLOCK_BYTES):
            np.copyto(dst[start:start + HASH_BLOCK_BYTES], src[start:start + HASH_BLOCK_BYTES])
            landed.put(start)

    helper = HELPER.submit(copy_in_order)
    hasher = xxhash.xxh3_128()
    for _ in range(0, src.size, HASH_BLOCK_BYTES):
        start = landed.get()
        hasher.update(dst[start:start + HASH_BLOCK_BYTES])
    helper.result()
    return hasher.digest()


WAYS = {"whole": whole, "blocks": copies.copy_and_hash, "behind": behind, "halves": copies.copy_and_hash_in_halves}


def measure(size: int, total: int, reps: int) -> dict[str, float]:
    """Median seconds per object of each way and of memcpy, for objects of `size` bytes."""
    count = max(2, total // size)
    rng = np.random.default_rng(size)
    arena = rng.integers(0, 256, count * size, dtype=np.uint8)
    spare = np.zeros_like(arena)
    dst = np.zeros(size, np.uint8)
    want = [xxhash.xxh3_128_digest(arena[i * size:(i + 1) * size]) for i in range(count)]
    order = ["memcpy", *WAYS]
    times: dict[str, list[float]] = {name: [] for name in order}
    for rep in range(reps + 1):  # rep 0 warms up
        turn = order[rep % len(order):] + order[:rep % len(order)]
        for name in turn:
            began = time.perf_counter()
            for i in range(count):
                src = arena[i * size:(i + 1) * size]
                if name == "memcpy":
                    np.copyto(spare[i * size:(i + 1) * size], dst)
                elif WAYS[name](dst, src) != want[i]:
                    raise SystemExit(f"{name}: wrong digest at {size} bytes, object {i}")
            if rep:
                times[name].append((time.perf_counter() - began) / count)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="timed passes over all objects per way")
    parser.add_argument("--sizes", default="0.5,1,2,4,8", help="object sizes in MiB, comma-separated")
    parser.add_argument("--total-mib", type=int, default=256, help="distinct source bytes per size")
    args = parser.parse_args(argv)
    try:
        sizes = [int(float(text) * MiB) for text in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: numbers of MiB separated by commas, got {args.sizes!r}")
    if args.reps < 1 or args.total_mib < 1 or any(size < 1 for size in sizes):
        parser.error("--reps, --total-mib and every size must be positive")
    print(f"shared-index reads copy whole up to {WHOLE_COPY_MAX_BYTES / MiB:g} MiB, by blocks above", flush=True)
    print(f"{'size':>9}  {'memcpy us':>9}  " + "  ".join(f"{name:>7}" for name in WAYS) + "   (x memcpy)")
    for size in sizes:
        median = measure(size, args.total_mib * MiB, args.reps)
        base = median["memcpy"]
        print(f"{size / MiB:7.2f}Mi  {base * 1e6:9.1f}  "
              + "  ".join(f"{base / median[name]:6.2f}x" for name in WAYS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
