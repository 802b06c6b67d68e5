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
  put wait=False  (64 KiB) put(wait=False) of each object then flush(), against redis SET
               in the same reps: every object is stored when the clock stops
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
import importlib.util
import os
import sys
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.baselines import mooncake_master, redis_server  # noqa: E402
from bench.common import (  # noqa: E402
    KiB, MiB, BaselineUnavailable, Row, Target, Worker, gb_per_s, median, percentile, report, scratch_dir,
    size_label,
)
from bench.local_sides import (  # noqa: E402
    LOOKUP_KEYS, MOONCAKE_SEGMENT_BYTES, SMALL, KVStoreSide, MemcpySide, MooncakeSegment, MooncakeSide, RedisSide,
)

SUITE = "local"
SIZES = (64 * KiB, 1 * MiB, 4 * MiB, 32 * MiB)
ARENA = "1GiB"  # one rep of the largest size plus the small keys, with room to spare
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

TARGETS = [  # the write path's and 4 MiB get_into's from issue 29
    Target("get_into 4MiB", "throughput", "memcpy", ">=", 0.7),
    Target("get_into 4MiB", "throughput", "redis GET", ">=", 8.0),
    Target("get_into 4MiB", "throughput", "mooncake get_into", ">=", 5.0),
    Target("put 64KiB", "throughput", "redis SET", ">=", 3.0),
    Target("put 64KiB wait=False", "throughput", "redis SET", ">=", 3.0),
    Target("put 4MiB", "throughput", "memcpy", ">=", 0.6),
    Target("put 32MiB", "throughput", "memcpy", ">=", 0.8),
    Target("get 4KiB", "p50", "redis GET", "<=", 0.5),
    Target("get_into 4KiB", "p50", "redis GET", "<=", 0.5),
    Target(f"lookup {LOOKUP_KEYS}", "median", None, "<", 1.0),
]


def progress(who: str, text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {who}: {text}", flush=True)


def interleave(sides: dict[str, Worker], method: str | dict[str, str], reps: int,
               after: str | None = None) -> dict[str, float]:
    """Median seconds of `method(rep)` per side (a dict: each side's own method); rep 0 is
    a warm-up. Each rep visits every side once, starting one further along each time."""
    names = list(sides)
    times = {name: [] for name in names}
    for rep in range(reps + 1):
        for k in range(len(names)):
            name = names[(rep + k) % len(names)]
            elapsed = sides[name].call(method if isinstance(method, str) else method[name], rep)
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
    out = {"put": {}, "get": {}, "put_many": {}, "put_deferred": {}}
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
            deferred_sides = {n: sides[n] for n in ("kvstore", "redis") if n in sides}
            seconds = interleave(deferred_sides, {"kvstore": "put_deferred", "redis": "put"}, plan.reps, after="drop")
            out["put_deferred"][size] = {n: gb_per_s(count * size, s) for n, s in seconds.items()}
            progress("kvstore", f"{size_label(size)} put(wait=False) of {count}, flushed: "
                     + ", ".join(f"{n} {v:.2f} GB/s" for n, v in out["put_deferred"][size].items()))
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
    for size, rates in out["put_deferred"].items():
        against(f"put {size_label(size)} wait=False", rates["kvstore"], rates, 0)
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
    from kvstore.commands.smoke import start_daemon
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
    # The daemon runs as `python -m kvstore.commands.cli`: let it import this repo from any cwd.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    started = time.perf_counter()
    progress("bench", f"{'quick' if args.quick else 'full'} run: {plan.reps} reps of {size_label(plan.rep_bytes)} "
                      f"per case, {os.cpu_count()} cores")
    skipped: dict[str, str] = {}
    with scratch_dir("kvstore-bench-") as workdir:
        out = run(plan, workdir, skipped)
    settings = {**asdict(plan), "mode": "quick" if args.quick else "full", "arena": ARENA, "pages": out["pages"],
                "lookup_round_trips": out["lookup_round_trips"], "elapsed_s": round(time.perf_counter() - started, 1)}
    report(SUITE, build_rows(out), TARGETS, skipped, settings)
    progress("bench", f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
