"""Batched I/O: put_many and get_many of 1,000 objects against memcpy and Redis pipelines.

    .venv/bin/python bench/batched.py [--count 1000] [--reps 7]

One daemon (host tier only, no admin API) and one client in this process; Redis
(redis-server on loopback, no persistence) with redis-py in the same process. Per rep, with
fresh keys each time:

    put_many       client.put_many of `count` objects from caller buffers
    get_many_into  client.get_many_into the same objects into caller buffers (slices of one
                   numpy array, which starts 16 bytes past a page boundary)
    get_many_into page-aligned
                   the same into slices of a page-aligned array, as an engine's pinned or
                   KV-page buffers are: a 64 KiB copy from the page-aligned arena into a
                   buffer 16 bytes past a page boundary costs ~1.6x one at another offset here
    get_many       client.get_many: a read lease per object, then all released
    memcpy         np.copyto of the same bytes, one contiguous copy (64 KiB case)
    Redis MSET     redis-py mset of the same `count` values (one command: Redis's fastest path)
    Redis MGET     redis-py mget of their keys

Figures are throughput (GB/s, 1e9 bytes) of the median rep; the ratios are against the
baseline in the same run. Targets: 64 KiB put_many and get_many_into at least 0.5x memcpy
(either buffer alignment), get_many 0.3x; 4 KiB put_many / get_many_into / get_many at least
3x Redis MSET / MGET. Writes bench/results/batched.json.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from bench.baselines import redis_server  # noqa: E402
from bench.common import (KiB, MiB, BaselineUnavailable, Row, Target, gb_per_s, median, page_aligned,  # noqa: E402
                          report, scratch_dir, size_label, touched)

SUITE = "batched"
SIZES = (64 * KiB, 4 * KiB)


def keys_for(tag: str, count: int):
    from kvstore.identity import ObjectId
    return [ObjectId(hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest()) for i in range(count)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Ours:
    """The daemon and a client; each rep stores `count` fresh objects, reads them, drops them."""

    def __init__(self, workdir: str, count: int, size: int):
        from kvstore.client import Client
        from kvstore.commands.smoke import start_daemon
        config = os.path.join(workdir, "batched.toml")
        with open(config, "w") as f:
            f.write("[admin]\nenabled = false\n")
        arena = max(256 * MiB, 4 * count * max(size, 4 * KiB))
        self.daemon = start_daemon(os.path.join(workdir, "batched.sock"), str(arena),
                                   extra=("--config", config, "--data-dir", os.path.join(workdir, "data")))
        self.client = Client.connect(os.path.join(workdir, "batched.sock"), timeout_s=120)
        self.count, self.size = count, size
        block = touched(count * size, seed=3)
        self.sources = [block[i * size:(i + 1) * size] for i in range(count)]
        outs = touched(count * size, seed=4)
        self.outs = [outs[i * size:(i + 1) * size] for i in range(count)]
        aligned = page_aligned(count * size, seed=8)
        self.aligned_outs = [aligned[i * size:(i + 1) * size] for i in range(count)]

    def rep(self, rep: int) -> dict:
        keys = keys_for(f"{self.size}/{rep}", self.count)
        items = list(zip(keys, self.sources))
        out = {}
        results = []
        out["put_many"] = timed(lambda: results.extend(self.client.put_many(items)))
        failed = [r.error for r in results if r.error is not None]
        if failed:
            raise RuntimeError(f"put_many failed: {failed[0]}")
        for case, outs in (("get_many_into", self.outs), ("get_many_into page-aligned", self.aligned_outs)):
            sizes = []
            out[case] = timed(lambda: sizes.extend(self.client.get_many_into(list(zip(keys, outs)))))
            if sizes.count(self.size) != self.count:
                raise RuntimeError(f"{case} found {sizes.count(self.size)} of {self.count} objects")
            if not all(np.array_equal(a, b) for a, b in zip(outs[:8], self.sources[:8])):
                raise RuntimeError(f"{case} read other bytes than were put")

        def leases():
            got = self.client.get_many(keys)
            if sum(lease is not None for lease in got) != self.count:
                raise RuntimeError("get_many missed objects that were just put")
            self.client.release_many(got)
        out["get_many"] = timed(leases)
        self.client.delete(keys)
        return out

    def close(self) -> None:
        self.client.close()
        self.daemon.terminate()
        self.daemon.wait(30)


class Memcpy:
    def __init__(self, count: int, size: int):
        self.src, self.dst = touched(count * size, seed=5), touched(count * size, seed=6)

    def rep(self, rep: int) -> dict:
        return {"memcpy": timed(lambda: np.copyto(self.dst, self.src))}


class Redis:
    def __init__(self, port: int, count: int, size: int):
        import redis
        self.r = redis.Redis(port=port)
        self.count, self.size = count, size
        self.values = [touched(size, seed=7 + i % 16).tobytes() for i in range(count)]

    def rep(self, rep: int) -> dict:
        keys = [f"{self.size}/{rep}/{i}".encode() for i in range(self.count)]
        mapping = dict(zip(keys, self.values))
        out = {"Redis MSET": timed(lambda: self.r.mset(mapping))}
        got = []
        out["Redis MGET"] = timed(lambda: got.extend(self.r.mget(keys)))
        if sum(v is not None for v in got) != self.count:
            raise RuntimeError("Redis MGET missed keys just set")
        self.r.delete(*keys)
        return out

    def close(self) -> None:
        self.r.close()


def measure(size: int, count: int, reps: int, workdir: str, redis_port: int | None) -> dict[str, float]:
    sides = [Ours(workdir, count, size), Memcpy(count, size)]
    if redis_port is not None:
        sides.append(Redis(redis_port, count, size))
    try:
        times: dict[str, list[float]] = {}
        for rep in range(reps + 1):  # rep 0 warms up: faults pages in, opens the namespace
            for side in sides:
                for name, seconds in side.rep(rep).items():
                    if rep:
                        times.setdefault(name, []).append(seconds)
    finally:
        for side in sides:
            with contextlib.suppress(Exception):
                side.close() if hasattr(side, "close") else None
    return {name: gb_per_s(count * size, median(values)) for name, values in times.items()}


def build_rows(size: int, rates: dict[str, float]) -> list[Row]:
    label, rows = size_label(size), []
    pairs = (("put_many", "memcpy"), ("get_many_into", "memcpy"), ("get_many_into page-aligned", "memcpy"),
             ("get_many", "memcpy"), ("put_many", "Redis MSET"), ("get_many_into", "Redis MGET"),
             ("get_many_into page-aligned", "Redis MGET"), ("get_many", "Redis MGET"))
    for ours, baseline in pairs:
        if ours in rates and baseline in rates:
            rows.append(Row(SUITE, f"{ours} {label}", "throughput", "GB/s", rates[ours], baseline, rates[baseline]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000, help="objects per batch (default 1000)")
    parser.add_argument("--reps", type=int, default=7, help="timed reps per size (default 7)")
    args = parser.parse_args(argv)
    if args.count < 1 or args.reps < 1:
        parser.error("--count and --reps take positive integers")
    rows, skipped = [], {}
    with scratch_dir("kvs-batched-") as workdir, contextlib.ExitStack() as stack:
        try:
            port = stack.enter_context(redis_server(workdir))
        except BaselineUnavailable as exc:
            port, skipped["Redis"] = None, str(exc)
        for size in SIZES:
            print(f"batched: {args.count:,} x {size_label(size)}", flush=True)
            rows += build_rows(size, measure(size, args.count, args.reps, workdir, port))
    targets = [Target(f"{op} 64KiB", "throughput", "memcpy", ">=", 0.5)
               for op in ("put_many", "get_many_into", "get_many_into page-aligned")]
    targets.append(Target("get_many 64KiB", "throughput", "memcpy", ">=", 0.3))
    targets += [Target("put_many 4KiB", "throughput", "Redis MSET", ">=", 3.0),
                Target("get_many_into 4KiB", "throughput", "Redis MGET", ">=", 3.0),
                Target("get_many 4KiB", "throughput", "Redis MGET", ">=", 3.0)]
    report(SUITE, rows, targets, skipped, {"count": args.count, "reps": args.reps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
