"""Local benchmark: one node, a real daemon, clients in other processes, and baselines.

    .venv/bin/python bench/local.py [--quick]

Measures put and get_into throughput (64 KiB .. 32 MiB), 4 KiB get latency and a
1,024-key lookup against numpy memcpy, Redis (redis-py) and Mooncake Store (TCP). Every
store runs in its own process and every client ("side") in another, driven in lockstep
from this one: repetitions of the sides are interleaved (rep 1 of each side, then rep 2,
starting with a different side each time), so load from other users of a shared machine
hits all of them alike and the ratios stay fair. Prints a table with the issue's targets
and writes bench/results/local.json.

How each number is taken (median over the reps; one warm-up rep first):
  put          distinct keys every rep (nothing dedups), deleted after the rep, untimed
  get_into     the last put rep's objects, copied into one pre-touched buffer
  memcpy       np.copyto between one buffer and distinct slots of a pre-touched one
  redis        SET of the same bytes under distinct keys; GET returns a new bytes object
  mooncake     put_from a registered buffer once (untimed), get_into a registered buffer
  latency      4 KiB, one call at a time, blocks of calls interleaved across sides;
               `get` takes a read lease and releases it
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import sys
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import (  # noqa: E402
    KiB, MiB, BaselineUnavailable, Row, Target, Worker, gb_per_s, median, mooncake_master, mooncake_store,
    percentile, redis_server, report, scratch_dir, size_label, touched,
)

SUITE = "local"
SIZES = (64 * KiB, 1 * MiB, 4 * MiB, 32 * MiB)
SMALL = 4 * KiB
LOOKUP_KEYS = 1024
ARENA = "1GiB"  # one rep of the largest size plus the small keys, with room to spare
MOONCAKE_SEGMENT_BYTES = 512 * MiB  # one size's objects at a time (removed after each size)
LATENCY_BLOCKS = 10  # latency calls are taken in this many blocks, alternating sides


@dataclass(frozen=True, slots=True)
class Plan:
    reps: int  # timed repetitions per throughput case (median reported)
    rep_bytes: int  # bytes moved per repetition (at least one object)
    latency_iters: int
    lookup_iters: int

    def count(self, size: int) -> int:
        return max(1, self.rep_bytes // size)


FULL = Plan(reps=11, rep_bytes=128 * MiB, latency_iters=5000, lookup_iters=300)
QUICK = Plan(reps=5, rep_bytes=32 * MiB, latency_iters=1000, lookup_iters=50)

TARGETS = [
    Target("get_into 4MiB", "throughput", "memcpy", ">=", 0.6),
    Target("get_into 4MiB", "throughput", "redis GET", ">=", 8.0),
    Target("get_into 4MiB", "throughput", "mooncake get_into", ">=", 5.0),
    Target("put 4MiB", "throughput", "memcpy", ">=", 0.5),
    Target("get 4KiB", "p50", "redis GET", "<=", 0.5),
    Target(f"lookup {LOOKUP_KEYS}", "median", None, "<", 1.0),
]


def progress(who: str, text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {who}: {text}", flush=True)


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


# --- sides: each lives in its own process (a Worker) ------------------------------------
#
# prepare(size, count), put(rep) -> s, drop(rep), get(rep) -> s, finish(): the throughput
# protocol; latency(kind, n) -> [us]. `put` of rep i uses keys no other rep uses; `get`
# reads the objects of the last put rep.


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
    def __init__(self, socket_path: str, reps: int):
        from client import Client
        self.reps = reps
        self.client = Client.connect(socket_path, namespace="bench")
        start = time.perf_counter()
        self.client.lookup([])  # opens the namespace: the daemon creates and pre-faults its arena
        self.open_ms = (time.perf_counter() - start) * 1e3
        self.small_key = keys_for("small", 1)[0]
        self.client.put(self.small_key, touched(SMALL))
        self.small_out = touched(SMALL, seed=1)

    def info(self) -> dict:
        return {"open_ms": self.open_ms}

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
        failed = [r.error for r in results if r.error]
        if failed:
            raise RuntimeError(f"put_many: {len(failed)} of {len(items)} failed, first: {failed[0]}")
        return elapsed

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


def interleave(sides: dict[str, Worker], method: str, reps: int, after: str | None = None) -> dict[str, float]:
    """Median seconds of `method(rep)` per side; rep 0 is a warm-up. Each rep visits every
    side once, starting one further along each time."""
    names = list(sides)
    times = {name: [] for name in names}
    for rep in range(reps + 1):
        for k in range(len(names)):
            name = names[(rep + k) % len(names)]
            elapsed = sides[name].call(method, rep)
            if rep:
                times[name].append(elapsed)
            if after:
                sides[name].call(after, rep)
    return {name: median(t) for name, t in times.items()}


def prepare_all(sides: dict[str, Worker], size: int, count: int, skipped: dict[str, str]) -> None:
    """Prepare every side for `size`; a baseline that fails here is dropped, not fatal."""
    for name, worker in list(sides.items()):
        try:
            worker.call("prepare", size, count)
        except BaselineUnavailable as exc:
            skipped[name] = f"{exc} (at {size_label(size)}; earlier sizes kept)"
            progress(name, f"SKIPPED from here: {exc}")
            sides.pop(name).close()


def measure(sides: dict[str, Worker], plan: Plan, skipped: dict[str, str]) -> dict:
    out = {"put": {}, "get": {}, "put_many": {}}
    for size in SIZES:
        count = plan.count(size)
        progress("bench", f"{size_label(size)}: {plan.reps} reps of {count} objects on {', '.join(sides)}")
        prepare_all(sides, size, count, skipped)
        put_sides = {n: w for n, w in sides.items() if n != "mooncake"}
        seconds = interleave(put_sides, "put", plan.reps, after="drop")
        out["put"][size] = {n: gb_per_s(count * size, s) for n, s in seconds.items()}
        seconds = interleave(sides, "get", plan.reps)
        out["get"][size] = {n: gb_per_s(count * size, s) for n, s in seconds.items()}
        if size == SIZES[0]:  # small objects are what put_many is for
            sides["kvstore"].call("finish")
            seconds = interleave({"kvstore": sides["kvstore"]}, "put_many", plan.reps, after="drop")
            out["put_many"][size] = gb_per_s(count * size, seconds["kvstore"])
            progress("kvstore", f"{size_label(size)} put_many of {count}: {out['put_many'][size]:.2f} GB/s")
        for worker in sides.values():
            worker.call("finish")
        progress("bench", f"{size_label(size)} x{count} put GB/s " + ", ".join(f"{n} {v:.2f}" for n, v in out["put"][size].items())
                 + " | get GB/s " + ", ".join(f"{n} {v:.2f}" for n, v in out["get"][size].items()))

    latency_sides = [("kvstore", "get"), ("kvstore", "get_into")] + [("redis", "get")] * ("redis" in sides)
    samples = {side: [] for side in latency_sides}
    per_block = max(1, plan.latency_iters // LATENCY_BLOCKS)
    for block in range(LATENCY_BLOCKS + 1):  # block 0 warms up
        for name, kind in latency_sides:
            got = sides[name].call("latency", kind, per_block)
            if block:
                samples[(name, kind)].extend(got)
    out["latency"] = {side: (percentile(s, 50), percentile(s, 99)) for side, s in samples.items()}
    progress("bench", f"{size_label(SMALL)} p50 us " + ", ".join(f"{n} {k} {v[0]:.0f}" for (n, k), v in out["latency"].items()))

    out["lookup_ms"], out["lookup_round_trips"] = sides["kvstore"].call("lookup", plan.lookup_iters)
    progress("kvstore", f"lookup {LOOKUP_KEYS}: median {out['lookup_ms']:.3f} ms, {out['lookup_round_trips']} round trip")
    out.update(sides["kvstore"].call("info"))
    return out


def build_rows(out: dict) -> list[Row]:
    rows = []
    names = {"memcpy": ("memcpy", "memcpy"), "redis": ("redis SET", "redis GET"), "mooncake": (None, "mooncake get_into")}

    def against(case, ours, others, which):
        for side, value in others.items():
            if side != "kvstore" and names[side][which]:
                rows.append(Row(SUITE, case, "throughput", "GB/s", ours, names[side][which], value))

    for size in SIZES:
        against(f"put {size_label(size)}", out["put"][size]["kvstore"], out["put"][size], 0)
    for size, rate in out["put_many"].items():
        rows.append(Row(SUITE, f"put_many {size_label(size)}", "throughput", "GB/s", rate, "memcpy", out["put"][size]["memcpy"]))
    for size in SIZES:
        against(f"get_into {size_label(size)}", out["get"][size]["kvstore"], out["get"][size], 1)
    redis = out["latency"].get(("redis", "get"))
    for kind in ("get", "get_into"):
        for metric, index in (("p50", 0), ("p99", 1)):
            rows.append(Row(SUITE, f"{kind} {size_label(SMALL)}", metric, "us", out["latency"][("kvstore", kind)][index],
                            "redis GET" if redis else None, redis[index] if redis else None, higher_is_better=False))
    rows.append(Row(SUITE, f"lookup {LOOKUP_KEYS}", "median", "ms", out["lookup_ms"], higher_is_better=False))
    rows.append(Row(SUITE, f"open namespace {ARENA}", "first", "ms", out["open_ms"], higher_is_better=False))
    return rows


def start_kvstore(stack: contextlib.ExitStack, plan: Plan, workdir: str) -> Worker:
    from server.smoke import start_daemon
    socket_path = os.path.join(workdir, "kvstore.sock")
    config_path = os.path.join(workdir, "kvstore.toml")
    with open(config_path, "w") as f:
        f.write("[admin]\nenabled = false\n")  # its fixed port could clash with another daemon here
    progress("kvstore", f"starting a daemon with a {ARENA} arena")
    daemon = start_daemon(socket_path, ARENA, extra=("--config", config_path, "--data-dir", os.path.join(workdir, "data")))
    stack.callback(lambda: (daemon.terminate(), daemon.wait(10)))
    side = stack.enter_context(Worker("kvstore", KVStoreSide, socket_path, plan.reps))
    progress("kvstore", f"client connected; the first open of the namespace took {side.call('info')['open_ms']:.0f} ms")
    return side


def start_redis(stack: contextlib.ExitStack, plan: Plan, workdir: str) -> Worker:
    port = stack.enter_context(redis_server(workdir))
    progress("redis", f"redis-server on 127.0.0.1:{port}")
    return stack.enter_context(Worker("redis", RedisSide, port, plan.reps))


def start_mooncake(stack: contextlib.ExitStack, plan: Plan, workdir: str) -> Worker:
    if importlib.util.find_spec("mooncake") is None:
        raise BaselineUnavailable("mooncake is not installed (pip install mooncake-transfer-engine-non-cuda)")
    rpc_port, meta_port = stack.enter_context(mooncake_master(workdir))
    stack.enter_context(Worker("mooncake segment", MooncakeSegment, rpc_port, meta_port,
                               os.path.join(workdir, "mooncake-segment.log")))
    progress("mooncake", f"master on 127.0.0.1:{rpc_port}, {size_label(MOONCAKE_SEGMENT_BYTES)} segment in its own process")
    return stack.enter_context(Worker("mooncake", MooncakeSide, rpc_port, meta_port,
                                      os.path.join(workdir, "mooncake-client.log")))


def run(plan: Plan, workdir: str, skipped: dict[str, str]) -> dict:
    with contextlib.ExitStack() as stack:
        sides = {"kvstore": start_kvstore(stack, plan, workdir),
                 "memcpy": stack.enter_context(Worker("memcpy", MemcpySide))}
        for name, start in (("redis", start_redis), ("mooncake", start_mooncake)):
            try:
                with contextlib.ExitStack() as own:  # a half-started baseline is torn down here
                    sides[name] = start(own, plan, workdir)
                    stack.push(own.pop_all())
            except BaselineUnavailable as exc:
                skipped[name] = str(exc)
                progress(name, f"SKIPPED: {exc}")
        return measure(sides, plan, skipped)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer and smaller repetitions (< 60 s)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    # The daemon runs as `python -m server.cli`: let it import this repo from any cwd.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    started = time.perf_counter()
    progress("bench", f"{'quick' if args.quick else 'full'} run: {plan.reps} reps of {size_label(plan.rep_bytes)} "
                      f"per case, {os.cpu_count()} cores")
    skipped: dict[str, str] = {}
    with scratch_dir("kvstore-bench-") as workdir:
        out = run(plan, workdir, skipped)
    settings = {**asdict(plan), "mode": "quick" if args.quick else "full", "arena": ARENA,
                "lookup_round_trips": out["lookup_round_trips"], "elapsed_s": round(time.perf_counter() - started, 1)}
    report(SUITE, build_rows(out), TARGETS, skipped, settings)
    progress("bench", f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
