"""Remote benchmark: one object fetched from a peer daemon over loopback, against baselines.

    .venv/bin/python bench/remote.py [--quick] [--transports tcp,ucx] [--parts peer,pool]

Reaches inside: the peer transport (server/peer, tiers/remote) is timed alone against raw TCP;
the pool part (`--parts pool`) runs daemons through `kvstore serve` and the client, as a user.

The real peer service (`bench/peer_service.py`: the daemon's PeerService over a dict, uvloop) serves
from its own process; a RemoteTier fetches from another. A timed get is one `get_into` of a
4 MiB object into a pre-touched buffer, xxh3-128 check included; `transfer` is the same fetch
without the check; `lookup` is one key, one round trip; `sparse` is a ranged get of 1/8 of
the object's 16 KiB pages (a sparse decode step's read), against the whole-object get: once
from a home whose whole-copy check is fresh (as within a decode step), once from a second
home started with --recheck-s 0 (it hashes its whole copy before every ranged read).

Baselines, each a pair of processes in the same run, reps interleaved (bench/baselines.py):
  socket     a blocking client sends 1 byte; the server sendall()s the same 4 MiB, which the
             client recv_into()s a pre-touched buffer: the floor for TCP
  mooncake   Mooncake Store get_into over TCP, the object held by another process
The pool part (bench/remote_pool.py) measures daemons whose remote tier is a Mooncake Store
pool against Mooncake's own client and against the peer tier.
Writes bench/results/remote.json; UCX settings come from the environment (see server/peer/ucx.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import xxhash  # noqa: E402

from bench import remote_pool  # noqa: E402
from bench.baselines import mooncake_master, mooncake_store  # noqa: E402
from bench.common import (  # noqa: E402
    MiB, BaselineUnavailable, Row, Target, Worker, gb_per_s, median, percentile, report, scratch_dir, touched,
)
from kvstore.identity import ObjectId, StateDescriptor  # noqa: E402
from kvstore.peer_messages import PeerGet, RemoteMeta  # noqa: E402
from kvstore.server.peer.client import connect_peer  # noqa: E402
from kvstore.server.peer.service import RANGED_RECHECK_S  # noqa: E402
from kvstore.server.peer.transports import make_transport  # noqa: E402
from kvstore.tiers.remote import RemoteTier  # noqa: E402

SUITE = "remote"
SIZE = 4 * MiB
SECRET = b"bench-remote-secret-000"
# A sparse decode step's read of one chunk: 1/8 of its 16 KiB pages, scattered (fixed seed).
PAGE = 16 * 1024
SPARSE_RANGES = tuple((p * PAGE, PAGE) for p in sorted(random.Random(3).sample(range(SIZE // PAGE), SIZE // PAGE // 8)))
SPARSE_BYTES = sum(n for _, n in SPARSE_RANGES)


@dataclass(frozen=True, slots=True)
class Plan:
    reps: int  # timed 4 MiB gets per case (median reported)
    lookup_iters: int  # one-key lookups (p50, p99 reported)


FULL = Plan(reps=41, lookup_iters=3000)
QUICK = Plan(reps=15, lookup_iters=500)

TARGETS = [
    Target("get_into 4MiB tcp", "throughput", "socket recv_into", ">=", 0.8),
    Target("get_into 4MiB tcp", "throughput", "mooncake get_into", ">=", 2.0),
    Target("lookup 1 key tcp", "p50", None, "<", 200.0),
    *remote_pool.TARGETS,
]


def _object():
    """The benchmarked object: 4 MiB of random bytes with its id and metadata."""
    data = touched(SIZE, seed=7)
    meta = RemoteMeta(SIZE, xxhash.xxh3_128_digest(data), StateDescriptor("bench", "m", "r"))
    return ObjectId(bytes(range(32))), meta, data


class PeerClientSide:
    """A RemoteTier in its own process and event loop, fetching from one peer node."""

    def __init__(self, transport: str, address: str):
        try:
            import uvloop
            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.transport = make_transport(transport)
        except ImportError as exc:
            raise BaselineUnavailable(f"ucxx does not load: {exc}") from None
        self.tier = RemoteTier("bench-client", lambda: {"server": address},
                               lambda a: connect_peer(self.transport, a, SECRET, "bench-client", 5.0), timeout_s=5.0)
        self.oid, self.meta, data = _object()
        self.get_args = PeerGet("bench", self.oid).to_args()
        self.out = touched(SIZE, seed=1)
        if self.loop.run_until_complete(self.tier.put("bench", self.oid, self.meta, data)) != ["server"]:
            raise RuntimeError("the peer did not store the benchmark object")
        self.link = self.loop.run_until_complete(connect_peer(self.transport, address, SECRET, "bench-raw", 5.0))

    def get(self, rep: int) -> float:
        start = time.perf_counter()
        got = self.loop.run_until_complete(self.tier.get_into("bench", self.oid, lambda m: self.out))
        elapsed = time.perf_counter() - start
        if got != self.meta:
            raise RuntimeError(f"remote get_into missed: {self.tier.stats()}")
        return elapsed

    def sparse(self, rep: int) -> float:
        """A sparse step's read: 1/8 of the object's 16 KiB pages, as ranges. The home checked
        its whole copy moments ago (the other cases read it too), as within a decode step."""
        start = time.perf_counter()
        got = self.loop.run_until_complete(
            self.tier.get_ranges_into("bench", self.oid, SPARSE_RANGES, lambda meta: self.out[:SPARSE_BYTES]))
        elapsed = time.perf_counter() - start
        if got is None or got[0] != self.meta:
            raise RuntimeError(f"remote ranged get missed: {self.tier.stats()}")
        return elapsed

    def transfer(self, rep: int) -> float:
        """The same fetch through one link without the checksum pass."""
        start = time.perf_counter()
        self.loop.run_until_complete(self.link.call("peer_get", self.get_args, into=lambda r: self.out))
        return time.perf_counter() - start

    def lookup(self, iters: int) -> list[float]:
        async def run():
            samples = []
            for _ in range(iters):
                start = time.perf_counter_ns()
                found = await self.tier.lookup("bench", [self.oid])
                samples.append((time.perf_counter_ns() - start) / 1e3)
                if found != [self.meta]:
                    raise RuntimeError("lookup missed the stored object")
            return samples
        return self.loop.run_until_complete(run())

    def close(self) -> None:
        self.loop.run_until_complete(self.link.close())
        self.loop.run_until_complete(self.tier.close())
        self.loop.close()


class SocketServerSide:
    """Answers every byte it receives with sendall() of the 4 MiB object (blocking, one thread)."""

    def __init__(self):
        self.data = _object()[2]
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while conn.recv(1):
            conn.sendall(self.data)

    def address(self) -> int:
        return self.port


def _closed() -> int:
    raise RuntimeError("the socket server closed")


class SocketClientSide:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.view = memoryview(touched(SIZE, seed=1))

    def get(self, rep: int) -> float:
        start = time.perf_counter()
        self.sock.sendall(b"g")
        got = 0
        while got < SIZE:
            got += self.sock.recv_into(self.view[got:]) or _closed()
        return time.perf_counter() - start

    def close(self) -> None:
        self.sock.close()


class MooncakeHolder:
    """Holds the Mooncake segment the object lives in: another process, as our peer is."""

    def __init__(self, rpc_port: int, meta_port: int, log_path: str):
        self.store = mooncake_store(rpc_port, meta_port, 64 * MiB, 16 * MiB, log_path)

    def close(self) -> None:
        self.store.close()


class MooncakeClientSide:
    def __init__(self, rpc_port: int, meta_port: int, log_path: str):
        self.store = mooncake_store(rpc_port, meta_port, 0, 16 * MiB, log_path)  # no segment of its own
        self.src, self.out = _object()[2], touched(SIZE, seed=1)
        for buf in (self.src, self.out):
            if self.store.register_buffer(buf.ctypes.data, SIZE) != 0:
                raise BaselineUnavailable("mooncake register_buffer failed")
        if self.store.put_from("obj", self.src.ctypes.data, SIZE) != 0:
            raise BaselineUnavailable("mooncake put_from failed")

    def get(self, rep: int) -> float:
        start = time.perf_counter()
        n = self.store.get_into("obj", self.out.ctypes.data, SIZE)
        elapsed = time.perf_counter() - start
        if n != SIZE:
            raise RuntimeError(f"mooncake get_into returned {n}")
        return elapsed

    def close(self) -> None:
        self.store.remove("obj", True)  # force: a get's lease would hold it for seconds
        self.store.close()


def peer_server(transport: str, workdir: str, recheck_s: float = RANGED_RECHECK_S) -> tuple[subprocess.Popen, str]:
    secret_file = os.path.join(workdir, "secret")
    with open(secret_file, "wb") as f:
        f.write(SECRET)
    log = open(os.path.join(workdir, f"peer-{transport}-{recheck_s}.log"), "w")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "peer_service.py"), "--listen", "127.0.0.1:0", "--secret-file",
                             secret_file, "--transport", transport, "--node-id", "server", "--timeout-s", "5",
                             "--recheck-s", str(recheck_s)],
                            stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    if not line.startswith("listening "):
        proc.kill()
        raise BaselineUnavailable(f"peer service ({transport}) did not start; see {log.name}")
    return proc, line.split()[1]


def interleave(cases: dict[str, tuple[Worker, str]], reps: int) -> dict[str, list[float]]:
    """Seconds of each case's `worker.method(rep)`; rep 0 is a warm-up; cases take turns,
    starting one further along each rep, so load from elsewhere hits all alike."""
    names, times = list(cases), {name: [] for name in cases}
    for rep in range(reps + 1):
        for k in range(len(names)):
            name = names[(rep + k) % len(names)]
            worker, method = cases[name]
            elapsed = worker.call(method, rep)
            if rep:
                times[name].append(elapsed)
    return times


def start_sides(transports: list[str], workdir: str, skipped: dict[str, str], stack: ExitStack) -> dict[str, Worker]:
    """Every measured side in its own process, serving sides first; what cannot run is skipped."""
    sides: dict[str, Worker] = {}
    for transport in transports:
        try:
            for name, recheck_s in ((f"ours {transport}", RANGED_RECHECK_S), (f"hashing {transport}", 0.0)):
                proc, address = peer_server(transport, workdir, recheck_s)
                stack.callback(lambda proc=proc: (proc.terminate(), proc.wait(10)))
                sides[name] = stack.enter_context(Worker(f"client-{name}", PeerClientSide, transport, address))
        except BaselineUnavailable as exc:
            skipped[f"ours {transport}"] = str(exc)
    server = stack.enter_context(Worker("socket-server", SocketServerSide))
    sides["socket recv_into"] = stack.enter_context(Worker("socket-client", SocketClientSide, server.call("address")))
    try:
        rpc, meta = stack.enter_context(mooncake_master(workdir))
        log_path = os.path.join(workdir, "mooncake.log")
        stack.enter_context(Worker("mooncake-holder", MooncakeHolder, rpc, meta, log_path))
        sides["mooncake get_into"] = stack.enter_context(
            Worker("mooncake-client", MooncakeClientSide, rpc, meta, log_path))
    except BaselineUnavailable as exc:
        skipped["mooncake get_into"] = str(exc)
    return sides


def run(plan: Plan, transports: list[str], workdir: str, skipped: dict[str, str]) -> list[Row]:
    rows: list[Row] = []
    with ExitStack() as stack:
        sides = start_sides(transports, workdir, skipped, stack)
        cases = {name: (worker, "get") for name, worker in sides.items() if not name.startswith("hashing ")}
        cases.update({f"transfer {k.split()[1]}": (w, "transfer") for k, w in sides.items() if k.startswith("ours ")})
        cases.update({f"sparse {k.split()[1]}": (w, "sparse") for k, w in sides.items() if k.startswith("ours ")})
        cases.update({f"sparse-cold {k.split()[1]}": (w, "sparse") for k, w in sides.items()
                      if k.startswith("hashing ")})
        times = interleave(cases, plan.reps)
        speed = {k: gb_per_s(SIZE, median(v)) for k, v in times.items()}
        for key in [k for k in sides if k.startswith("ours ")]:
            transport = key.split()[1]
            for base in ("socket recv_into", "mooncake get_into"):
                if base in speed:
                    rows.append(Row(SUITE, f"get_into 4MiB {transport}", "throughput", "GB/s", speed[key],
                                    base, speed[base]))
            rows.append(Row(SUITE, f"transfer 4MiB {transport}", "throughput", "GB/s", speed[f"transfer {transport}"],
                            "socket recv_into", speed["socket recv_into"]))
            for case, label in ((f"sparse {transport}", "checked copy"), (f"sparse-cold {transport}", "copy hashed")):
                rows.append(Row(SUITE, f"sparse read 1/8 of 4MiB {transport}, {label}", "median", "ms",
                                median(times[case]) * 1e3, "whole-object get_into", median(times[key]) * 1e3,
                                higher_is_better=False))
            print(f"[{time.strftime('%H:%M:%S')}] lookup 1 key over {transport}: {plan.lookup_iters} calls", flush=True)
            samples = sides[key].call("lookup", plan.lookup_iters)
            for q in (50, 99):
                rows.append(Row(SUITE, f"lookup 1 key {transport}", f"p{q}", "us", percentile(samples, q),
                                higher_is_better=False))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 1 min)")
    parser.add_argument("--transports", default="tcp,ucx", help="comma-separated: tcp, ucx")
    parser.add_argument("--parts", default="peer,pool",
                        help="comma-separated: peer (one object from a peer service), pool (a Mooncake pool)")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    plan = QUICK if args.quick else FULL
    pool_plan = remote_pool.POOL_QUICK if args.quick else remote_pool.POOL_FULL
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    started = time.perf_counter()
    skipped: dict[str, str] = {}
    with scratch_dir("kvstore-bench-remote-") as workdir:
        rows = run(plan, args.transports.split(","), workdir, skipped) if "peer" in parts else []
        if "pool" in parts:
            rows += remote_pool.run(pool_plan, workdir, skipped)
    from kvstore.server.peer.ucx import UCX_ENV_DEFAULTS
    ucx_env = {k: os.environ.get(k, v) for k, v in UCX_ENV_DEFAULTS.items()}
    settings = {**asdict(plan), "mode": "quick" if args.quick else "full", "object_bytes": SIZE,
                "ucx_env": ucx_env, "parts": sorted(parts),
                "pool": {**asdict(pool_plan), "sizes": list(remote_pool.SIZES)},
                "elapsed_s": round(time.perf_counter() - started, 1)}
    report(SUITE, rows, TARGETS, skipped, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
