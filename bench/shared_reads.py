"""4 KiB reads resolved from the shared index, against the round trip and Redis GET.

    .venv/bin/python bench/shared_reads.py [--iters 20000]

One daemon (64 MiB arena, admin API off), one Redis, and three client processes driven in
lockstep from this one: a kvstore client reading through the shared index (the default), a
kvstore client with `shared_index=False` (every get a round trip to the daemon), and
redis-py. Each times one call at a time on one 4 KiB object it put first:

    get_into     Client.get_into into a pre-touched numpy buffer
    get          Client.get, its lease released at once (from the index: a private copy)
    redis GET    r.get(key), which returns a new bytes object

Calls are taken in blocks that alternate between the sides (block 0 warms up), so load from
other users of a shared machine hits every side alike. Reports p50 and p99 in microseconds,
the issue's target (4 KiB get_into and get p50 <= 0.5x Redis GET p50, same run), and writes
bench/results/shared_reads.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.baselines import redis_server  # noqa: E402
from bench.common import BaselineUnavailable, Row, Target, Worker, percentile, report, scratch_dir  # noqa: E402
from bench.local_sides import KVStoreSide, RedisSide  # noqa: E402

SUITE = "shared_reads"
BLOCKS = 20  # calls are taken in this many blocks per side, alternating sides
TARGETS = [
    Target("get_into 4KiB", "p50", "redis GET", "<=", 0.5),
    Target("get 4KiB", "p50", "redis GET", "<=", 0.5),
]


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def measure(sides: dict[str, Worker], iters: int) -> dict:
    runs = [("shared", "get_into"), ("shared", "get"), ("round trip", "get_into"), ("round trip", "get")]
    runs += [("redis", "get")] * ("redis" in sides)
    samples = {run: [] for run in runs}
    per_block = max(1, iters // BLOCKS)
    for block in range(BLOCKS + 1):  # block 0 warms up
        for k in range(len(runs)):
            run = runs[(block + k) % len(runs)]
            got = sides[run[0]].call("latency", run[1], per_block)
            if block:
                samples[run].extend(got)
    return {run: (percentile(s, 50), percentile(s, 99)) for run, s in samples.items()}


def build_rows(out: dict) -> list[Row]:
    redis = out.get(("redis", "get"))
    rows = []
    for side, label in (("shared", ""), ("round trip", " round trip")):
        for kind in ("get_into", "get"):
            for metric, i in (("p50", 0), ("p99", 1)):
                rows.append(Row(SUITE, f"{kind} 4KiB{label}", metric, "us", out[(side, kind)][i],
                                "redis GET" if redis else None, redis[i] if redis else None, higher_is_better=False))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20000, help="timed calls per side and kind")
    args = parser.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    from kvstore.commands.smoke import start_daemon
    skipped: dict[str, str] = {}
    started = time.perf_counter()
    with scratch_dir("kvstore-bench-") as workdir, contextlib.ExitStack() as stack:
        socket_path, config_path = os.path.join(workdir, "kvstore.sock"), os.path.join(workdir, "kvstore.toml")
        with open(config_path, "w") as f:
            f.write("[admin]\nenabled = false\n")
        daemon = start_daemon(socket_path, "64MiB", extra=("--config", config_path, "--data-dir",
                                                           os.path.join(workdir, "data")))
        stack.callback(lambda: (daemon.terminate(), daemon.wait(10)))
        sides = {"shared": stack.enter_context(Worker("shared", KVStoreSide, socket_path, 1, True)),
                 "round trip": stack.enter_context(Worker("round trip", KVStoreSide, socket_path, 1, False))}
        try:
            port = stack.enter_context(redis_server(workdir))
            sides["redis"] = stack.enter_context(Worker("redis", RedisSide, port, 1))
        except BaselineUnavailable as exc:
            skipped["redis"] = str(exc)
            progress(f"redis SKIPPED: {exc}")
        progress(f"{args.iters} calls per side and kind, in {BLOCKS} blocks")
        out = measure(sides, args.iters)
    settings = {"iters": args.iters, "blocks": BLOCKS, "arena": "64MiB",
                "elapsed_s": round(time.perf_counter() - started, 1)}
    report(SUITE, build_rows(out), TARGETS, skipped, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
