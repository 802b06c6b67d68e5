"""Re-homing benchmark: how fast a joining node receives the objects it is now home to.

    .venv/bin/python bench/rehome.py [--quick]

A real etcd and real daemons (`kvstore serve`, TCP peers, etcd membership) on loopback.
Daemon A holds N objects of 4 MiB, put while it was alone (so it is home to all). Each rep,
a new node b<rep> joins; A's re-homing pass copies b<rep>'s share (about half: one batched
lookup, then verified 4 MiB sends from A's arena into b<rep>'s), and b<rep> leaves again.
Timed: A's own account of the pass (`stats()["tiers"]["remote"]["rehome"]["last_pass"]`:
seconds from plan to last send, bytes sent).

Baseline, same run: the same number of 4 MiB messages sendall()/recv_into() over one
loopback TCP connection between two processes (bench/remote.py's socket pair).
Writes bench/results/rehome.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.baselines import etcd_server, free_port  # noqa: E402
from bench.common import MiB, Row, Worker, gb_per_s, median, report, scratch_dir, touched  # noqa: E402
from bench.remote import SocketClientSide, SocketServerSide  # noqa: E402
from kvstore.identity import ObjectId  # noqa: E402

SUITE = "rehome"
SIZE = 4 * MiB
SECRET = "bench-rehome-secret-0000"
WAIT_S = 120.0  # a liveness bound on each pass, not a measurement


@dataclass(frozen=True, slots=True)
class Plan:
    objects: int  # 4 MiB objects on A
    reps: int  # joins timed (median reported)


FULL = Plan(objects=64, reps=5)
QUICK = Plan(objects=24, reps=2)


class Node:
    """One `kvstore serve` with etcd membership, its socket and config under `root`."""

    def __init__(self, root: str, name: str, etcd: str, arena: str):
        from kvstore.commands.smoke import start_daemon
        os.makedirs(root, exist_ok=True)
        self.socket, config = os.path.join(root, "s"), os.path.join(root, "kvstore.toml")
        with open(config, "w") as f:
            f.write(f'data_dir = "{root}/data"\n[admin]\nport = 0\n[cluster]\nenabled = true\n'
                    f'node_id = "{name}"\nlisten = "127.0.0.1:{free_port()}"\nsecret = "{SECRET}"\n'
                    f'membership = "etcd"\netcd_endpoint = "{etcd}"\nlease_ttl_s = 2.0\nrehome_delay_s = 0.2\n')
        self.proc = start_daemon(self.socket, arena, extra=["--config", config])

    def client(self):
        from kvstore.client import Client
        return Client.connect(self.socket, timeout_s=30)

    def remote_stats(self) -> dict:
        with self.client() as c:
            return c.stats()["tiers"]["remote"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # leaves etcd at once (lease revoked)
            self.proc.wait(30)


def wait_for(predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {WAIT_S:g} s")
        time.sleep(0.05)


def rehome_runs(plan: Plan, workdir: str, stack: ExitStack) -> list[dict]:
    etcd = stack.enter_context(etcd_server(workdir))
    arena = f"{plan.objects * SIZE // MiB + 64}MiB"
    a = Node(os.path.join(workdir, "a"), "a", etcd, arena)
    stack.callback(a.stop)
    data = touched(SIZE, seed=3)
    with a.client() as c:
        for i in range(plan.objects):
            c.put(ObjectId(i.to_bytes(4, "little") * 8), data)
    passes = []
    for rep in range(plan.reps):
        before = a.remote_stats()["rehome"]["passes"]
        b = Node(os.path.join(workdir, f"b{rep}"), f"b{rep}", etcd, arena)
        try:
            wait_for(lambda: len(a.remote_stats()["members"]) == 2, f"A sees b{rep}")
            stats = wait_for(lambda: (s := a.remote_stats()["rehome"])["passes"] > before and not s["running"]
                             and s["last_pass"].get("members", [])[-1:] == [f"b{rep}"] and s, f"A's pass for b{rep}")
            last = stats["last_pass"]
            if last["failures"] or last["objects_sent"] != last["planned"]:
                raise RuntimeError(f"pass for b{rep} did not send its plan: {last}")
            with b.client() as cb:
                held = cb.stats()["namespaces"]["default"]["objects"]
            if held != last["objects_sent"]:
                raise RuntimeError(f"b{rep} holds {held} objects, A sent {last['objects_sent']}")
            passes.append(last)
            print(f"[{time.strftime('%H:%M:%S')}] b{rep}: {last['objects_sent']} objects, "
                  f"{last['bytes_sent'] / MiB:.0f} MiB in {last['seconds']:.3f} s", flush=True)
        finally:
            b.stop()
        wait_for(lambda: len(a.remote_stats()["members"]) == 1, f"A sees b{rep} leave")
    return passes


def socket_runs(counts: list[int], stack: ExitStack) -> list[float]:
    server = stack.enter_context(Worker("socket-server", SocketServerSide))
    client = stack.enter_context(Worker("socket-client", SocketClientSide, server.call("address")))
    client.call("get", 0)  # warm-up
    return [sum(client.call("get", i) for i in range(n)) for n in counts]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.objects} objects, {QUICK.reps} joins")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    started = time.perf_counter()
    with scratch_dir("kvstore-bench-rehome-") as workdir, ExitStack() as stack:
        passes = rehome_runs(plan, workdir, stack)
        baseline = socket_runs([p["objects_sent"] for p in passes], stack)
    ours = median([gb_per_s(p["bytes_sent"], p["seconds"]) for p in passes])
    base = median([gb_per_s(p["bytes_sent"], s) for p, s in zip(passes, baseline)])
    rows = [Row(SUITE, "rehome to a joining node, 4MiB objects", "throughput", "GB/s", ours, "socket recv_into", base),
            Row(SUITE, "rehome pass (plan + lookup + sends)", "median", "s", median([p["seconds"] for p in passes]),
                higher_is_better=False)]
    settings = {**asdict(plan), "mode": "quick" if args.quick else "full", "object_bytes": SIZE,
                "sent_per_pass": [p["objects_sent"] for p in passes],
                "elapsed_s": round(time.perf_counter() - started, 1)}
    report(SUITE, rows, [], {}, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
