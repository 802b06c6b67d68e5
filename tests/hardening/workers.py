"""Client processes for the hardening tests: `python workers.py <role> <socket> [args]`.

    hoard  SOCKET N           reserve until the in-flight limit refuses, then take read leases
                              on objects key("hoard", 0..N-1) until the lease limit refuses;
                              print what it holds as JSON and sleep (until killed)
    mixed  SOCKET SEED SECONDS N RESULT [NS]
                              a random mix of put, get, lookup, delete, pin, unpin, prefetch,
                              held leases and abandoned reservations over key("soak", 0..N-1);
                              every read is checked bit-exact; wrong bytes are appended to
                              RESULT.bad at once (the process may be SIGKILLed), a summary
                              goes to RESULT at the end
    writer SOCKET ACKS        write-through puts of key("storm", i), i = 0, 1, ...; each acked
                              put appends "i durability" to ACKS
    reader SOCKET ACKS BAD    reads random acked objects until the daemon goes away; wrong
                              bytes are appended to BAD, then "reads N" (bit-exact ones)

Object bytes follow from the id (hardening_support.content), so every process agrees.
"""

from __future__ import annotations

import collections
import json
import random
import sys
import time

from kvstore.client import Client
from hardening_support import content, key, read_state, size_of
from kvstore import Hints, StateDescriptor
from kvstore import messages as m
from kvstore.errors import DaemonUnavailable, KVStoreError, LimitExceeded

SOAK_MAX_BYTES = 512 * 1024


def hoard(socket_path: str, n: int) -> None:
    c = Client.connect(socket_path)
    c._run(c.core.op_open("default"))
    desc = StateDescriptor("default", "m", "r")
    held = {"reserved": 0, "read_leases": 0}
    try:
        for i in range(10_000):
            c._run(c.core.op_simple(m.Reserve("default", key("hoard-put", i), 1 << 20, desc)))
            held["reserved"] += 1
    except LimitExceeded as exc:
        held["reserve_error"] = exc.message
    leases = []
    try:
        for i in range(10_000):
            lease = c.get(key("hoard", i % n))
            assert lease is not None
            leases.append(lease)
            held["read_leases"] += 1
    except LimitExceeded as exc:
        held["lease_error"] = exc.message
    print(json.dumps(held), flush=True)
    time.sleep(600)


def mixed(socket_path: str, seed: int, seconds: float, n: int, result: str, namespace: str = "default") -> None:
    rng = random.Random(seed)
    c = Client.connect(socket_path, namespace=namespace, timeout_s=60)
    desc = StateDescriptor(namespace, "m", "r")
    ops, errors, held, dangling = collections.Counter(), collections.Counter(), [], []
    bad = open(result + ".bad", "a", buffering=1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        keys = [key("soak", rng.randrange(n)) for _ in range(rng.randint(1, 6))]
        op = rng.choices(["put", "get", "lookup", "delete", "pin", "unpin", "prefetch", "hold", "reserve"],
                         [30, 35, 8, 4, 4, 3, 8, 4, 4])[0]
        ops[op] += 1
        try:
            if op == "put":
                sizes = [size_of(k, 4096, SOAK_MAX_BYTES) for k in keys]
                results = c.put_many([(k, content(k, s)) for k, s in zip(keys, sizes)], desc,
                                     Hints(priority=rng.randint(-2, 2)))
                errors.update(r.error.code for r in results if r.error is not None)
            elif op == "get":
                for k in keys:
                    state = read_state(c, k, size_of(k, 4096, SOAK_MAX_BYTES))
                    ops["get_" + state] += 1
                    if state == "WRONG":
                        bad.write(f"{k.hex}\n")
            elif op == "lookup":
                c.lookup(keys)
            elif op == "delete":
                c.delete(keys[:1])
            elif op == "pin":
                c.pin(keys[:2], ttl_s=rng.uniform(0.2, 2.0))
            elif op == "unpin":
                c.unpin(keys)
            elif op == "prefetch":
                c.prefetch(keys, policy=rng.choice(["best_effort", "wait", "timeout"]), timeout_s=0.5)
            elif op == "hold":  # keep a read lease a while, as an engine mid-step does
                lease = c.get(keys[0])
                if lease is not None:
                    held.append(lease)
            else:  # a reservation left uncommitted a while (what a killed writer leaves behind);
                # at the id's own size: an id is one state, another size is a Conflict
                size = size_of(keys[0], 4096, SOAK_MAX_BYTES)
                r = c._run(c.core.op_simple(m.Reserve(namespace, keys[0], size, desc)))
                if r.lease is not None:
                    dangling.append(r.lease)
            while len(held) > 3 or (held and rng.random() < 0.3):
                held.pop(0).release()
            while len(dangling) > 3 or (dangling and rng.random() < 0.2):
                c._run(c.core.op_simple(m.Abort(dangling.pop(0))))
        except DaemonUnavailable:
            raise
        except KVStoreError as exc:
            errors[exc.code] += 1
    for lease in held:
        lease.release()
    with open(result, "w") as f:
        json.dump({"ops": ops, "errors": errors}, f)


def writer(socket_path: str, acks_path: str) -> None:
    c = Client.connect(socket_path, timeout_s=10)
    acks = open(acks_path, "a", buffering=1)
    for i in range(1_000_000):
        k = key("storm", i)
        r = c.put(k, content(k, size_of(k)))
        acks.write(f"{i} {r.durability}\n")


def reader(socket_path: str, acks_path: str, bad_path: str) -> None:
    c = Client.connect(socket_path, timeout_s=10)
    bad = open(bad_path, "a", buffering=1)
    rng = random.Random()
    good = 0
    try:
        while True:
            with open(acks_path) as f:
                acked = [int(line.split()[0]) for line in f if line.endswith("\n")]
            for i in rng.sample(acked, min(len(acked), 20)):
                k = key("storm", i)
                state = read_state(c, k, size_of(k))
                good += state == "ok"
                if state == "WRONG":
                    bad.write(f"{i}\n")
                if good == 1 and state == "ok":  # the test kills the daemon only once every reader reads
                    with open(bad_path + ".ready", "a") as ready:
                        ready.write("1\n")
            time.sleep(0.005)
    except DaemonUnavailable:
        bad.write(f"reads {good}\n")


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    if role == "hoard":
        hoard(args[0], int(args[1]))
    elif role == "mixed":
        mixed(args[0], int(args[1]), float(args[2]), int(args[3]), args[4], *args[5:])
    elif role == "writer":
        writer(args[0], args[1])
    elif role == "reader":
        reader(args[0], args[1], args[2])
    else:
        raise SystemExit(f"unknown role {role!r}")
