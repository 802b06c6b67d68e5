"""The local benchmark's sides (bench/local.py): each store's client, and memcpy, in a
process of its own (a `Worker`), driven in lockstep by the suite.

prepare(size, count), put(rep) -> s, drop(rep), get(rep) -> s, finish(): the throughput
protocol; latency(kind, n) -> [us]. `put` of rep i uses keys no other rep uses; `get` reads
the objects of the last put rep.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.baselines import mooncake_store  # noqa: E402
from bench.common import KiB, MiB, BaselineUnavailable, median, size_label, touched  # noqa: E402

SMALL = 4 * KiB
LOOKUP_KEYS = 1024
MOONCAKE_SEGMENT_BYTES = 512 * MiB  # one size's objects at a time (removed after each size)


def keys_for(tag: str, count: int):
    """Distinct object ids, as ObjectId: what an engine's ChunkKey carries, so no per-call
    conversion is timed (raw 32-byte keys cost about 1 us each to validate)."""
    from kvstore.identity import ObjectId
    return [ObjectId(hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest()) for i in range(count)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def latency_samples_us(call, iters: int) -> list[float]:
    samples = []
    for _ in range(iters):
        start = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return samples


def _all_stored(what: str, results: list, elapsed: float) -> float:
    failed = [r.error for r in results if r.error]
    if failed:
        raise RuntimeError(f"{what}: {len(failed)} of {len(results)} failed, first: {failed[0]}")
    return elapsed


class MemcpySide:
    def prepare(self, size: int, count: int) -> None:
        import numpy as np
        self.np = np
        self.src, self.dst = touched(size), touched(size, seed=1)
        slots = touched(count * size, seed=2)
        self.slots = [slots[i * size:(i + 1) * size] for i in range(count)]

    def put(self, rep: int) -> float:
        return timed(lambda: [self.np.copyto(slot, self.src) for slot in self.slots])

    def get(self, rep: int) -> float:
        return timed(lambda: [self.np.copyto(self.dst, slot) for slot in self.slots])

    def drop(self, rep: int) -> None:
        pass

    def finish(self) -> None:
        self.slots = None


class KVStoreSide:
    def __init__(self, socket_path: str, reps: int, shared_index: bool = True):
        from kvstore.client import Client
        self.reps = reps
        self.client = Client.connect(socket_path, namespace="bench", shared_index=shared_index)
        start = time.perf_counter()
        self.client.lookup([])  # opens the namespace: the daemon creates and pre-faults its arena
        self.open_ms = (time.perf_counter() - start) * 1e3
        self.small_key = keys_for(f"small/{shared_index}", 1)[0]
        self.client.put(self.small_key, touched(SMALL))
        self.small_out = touched(SMALL, seed=1)

    def info(self) -> dict:
        """The first open's time, and what backs the arena (tiers/huge_pages.py)."""
        return {"open_ms": self.open_ms, "pages": self.client.stats()["namespaces"]["bench"].get("pages")}

    def prepare(self, size: int, count: int) -> None:
        self.size = size
        self.src, self.dst = touched(size), touched(size, seed=1)
        self.rep_keys = [keys_for(f"put/{size}/{i}", count) for i in range(self.reps + 1)]

    def put(self, rep: int) -> float:
        put, src = self.client.put, self.src
        return timed(lambda: [put(key, src) for key in self.rep_keys[rep]])

    def put_many(self, rep: int) -> float:
        items = [(key, self.src) for key in self.rep_keys[rep]]
        results = []
        elapsed = timed(lambda: results.extend(self.client.put_many(items)))
        return _all_stored("put_many", results, elapsed)

    def put_deferred(self, rep: int) -> float:
        """put(wait=False) of each object, then flush(): every object stored when timing ends."""
        put, src, results = self.client.put, self.src, []
        elapsed = timed(lambda: ([put(key, src, wait=False) for key in self.rep_keys[rep]],
                                 results.extend(self.client.flush())))
        return _all_stored("put(wait=False)", results, elapsed)

    def drop(self, rep: int) -> None:
        if rep < self.reps:  # the last rep's objects stay for get
            self.client.delete(self.rep_keys[rep])

    def get(self, rep: int) -> float:
        get_into, dst, size = self.client.get_into, self.dst, self.size
        sizes = []
        elapsed = timed(lambda: sizes.extend(get_into(key, dst) for key in self.rep_keys[-1]))
        if any(n != size for n in sizes):
            raise RuntimeError(f"get_into of a {size_label(size)} object missed or came back short")
        return elapsed

    def finish(self) -> None:
        self.client.delete(self.rep_keys[-1])

    def latency(self, kind: str, iters: int) -> list[float]:
        client, key = self.client, self.small_key
        if kind == "get":
            def call():
                with client.get(key):
                    pass
        else:
            def call():
                client.get_into(key, self.small_out)
        return latency_samples_us(call, iters)

    def lookup(self, iters: int) -> tuple[float, int]:
        """Median ms of lookup(1024 keys), and the round trips one lookup takes, counted on
        the client's transport so a change that splits the batch shows up here."""
        keys = keys_for("lookup", LOOKUP_KEYS)
        failed = [r.error for r in self.client.put_many((k, self.small_out) for k in keys) if r.error]
        if failed:
            raise RuntimeError(f"{len(failed)} lookup keys failed to store: {failed[0]}")
        trips = []
        inner = self.client._roundtrip
        self.client._roundtrip = lambda requests: trips.append([r.op for r in requests]) or inner(requests)
        try:
            result = self.client.lookup(keys)
        finally:
            del self.client._roundtrip
        if result.hits != len(keys):
            raise RuntimeError(f"lookup found {result.hits} of {len(keys)} stored keys")
        if len(trips) != 1 or len(trips[0]) != 1:
            raise RuntimeError(f"lookup of {len(keys)} keys took {len(trips)} round trips ({trips}); expected one frame")
        samples = [timed(lambda: self.client.lookup(keys)) * 1e3 for _ in range(iters)]
        return median(samples), len(trips)

    def close(self) -> None:
        self.client.close()


class RedisSide:
    def __init__(self, port: int, reps: int):
        import redis
        self.reps = reps
        self.r = redis.Redis(host="127.0.0.1", port=port)
        self.r.set("small", touched(SMALL).tobytes())

    def prepare(self, size: int, count: int) -> None:
        self.size = size
        self.value = touched(size).tobytes()
        self.rep_keys = [[f"{size}/{i}/{j}" for j in range(count)] for i in range(self.reps + 1)]

    def put(self, rep: int) -> float:
        return timed(lambda: [self.r.set(key, self.value) for key in self.rep_keys[rep]])

    def drop(self, rep: int) -> None:
        if rep < self.reps:
            self.r.delete(*self.rep_keys[rep])

    def get(self, rep: int) -> float:
        values = []
        elapsed = timed(lambda: values.extend(self.r.get(key) for key in self.rep_keys[-1]))
        if any(v is None or len(v) != self.size for v in values):
            raise RuntimeError("redis GET missed or came back short")
        return elapsed

    def finish(self) -> None:
        self.r.delete(*self.rep_keys[-1])

    def latency(self, kind: str, iters: int) -> list[float]:
        return latency_samples_us(lambda: self.r.get("small"), iters)

    def close(self) -> None:
        self.r.close()


class MooncakeSegment:
    """Mounts memory into the Mooncake cluster from its own process, so objects a client
    puts live in another process, as our daemon's do."""

    def __init__(self, rpc_port: int, meta_port: int, log_path: str):
        self.store = mooncake_store(rpc_port, meta_port, MOONCAKE_SEGMENT_BYTES, 16 * MiB, log_path)

    def close(self) -> None:
        self.store.close()


class MooncakeSide:
    def __init__(self, rpc_port: int, meta_port: int, log_path: str):
        # No segment of its own: every object lives in the MooncakeSegment process.
        self.store = mooncake_store(rpc_port, meta_port, 0, 16 * MiB, log_path)

    def prepare(self, size: int, count: int) -> None:
        self.size = size
        self.src, self.dst = touched(size), touched(size, seed=1)
        for buf in (self.src, self.dst):
            if self.store.register_buffer(buf.ctypes.data, size) != 0:
                raise BaselineUnavailable("mooncake register_buffer failed")
        self.keys = [f"{size}/{j}" for j in range(count)]
        for key in self.keys:
            rc = self.store.put_from(key, self.src.ctypes.data, size)
            if rc != 0:
                raise BaselineUnavailable(f"mooncake put_from of {size_label(size)} returned {rc}")

    def get(self, rep: int) -> float:
        get_into, ptr, size = self.store.get_into, self.dst.ctypes.data, self.size
        sizes = []
        elapsed = timed(lambda: sizes.extend(get_into(key, ptr, size) for key in self.keys))
        if any(n != size for n in sizes):
            raise RuntimeError(f"mooncake get_into returned {sizes[:4]}..., expected {size}")
        return elapsed

    def finish(self) -> None:
        for key in self.keys:
            self.store.remove(key, True)  # force: a get's lease would hold it for seconds
        for buf in (self.src, self.dst):
            self.store.unregister_buffer(buf.ctypes.data)

    def close(self) -> None:
        self.store.close()


# --- driving the sides in lockstep -------------------------------------------------------
