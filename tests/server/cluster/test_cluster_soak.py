"""Cluster soak: three real daemons with etcd membership and two replicas, small
host tiers (one of them write_back, one with NVMe), a client thread per node running a random
mix (put, put tier="remote", get, get of byte ranges, lookup, delete of either scope) over a
shared key space, while nodes are SIGKILLed or SIGTERMed and started again. Every hit is
checked bit-exact as it happens. At the end, with all nodes back: every id reads bit-exact
or cleanly misses on every node, and each daemon's check_integrity passes.

CI runs 25 s; the long version is marked slow:
    pytest -m slow tests/server/cluster/test_cluster_soak.py      # KVSTORE_CLUSTER_SOAK_S, default 300
"""

import os
import random
import signal
import threading
import time
from collections import Counter

import numpy as np
import pytest
from peer_helpers import etcd_server, free_port

from kvstore.errors import KVStoreError
from kvstore.identity import ObjectId
from kvs_testing import wait_for
from test_cluster_daemons import SECRET

SECONDS = float(os.environ.get("KVSTORE_CLUSTER_SOAK_S", "300"))
NUM_IDS = 120
EXPECTED = {"capacity", "unavailable", "service", "timeout"}  # a node restarting, a full arena


def oid_of(i: int) -> ObjectId:
    return ObjectId(f"soak-{i}".encode().ljust(32, b"."))


def data_of(i: int) -> np.ndarray:
    size = 16_384 + (i * 7919) % 240_000
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


class Worker(threading.Thread):
    def __init__(self, daemon, seed: int):
        super().__init__(daemon=True)
        self.node, self.rng = daemon, random.Random(seed)
        self.stop, self.ops, self.errors, self.bad = threading.Event(), Counter(), Counter(), []

    def run(self):
        client = None
        while not self.stop.is_set():
            try:
                if client is None:
                    client = self.node.client(timeout_s=30)
                self.one(client)
            except KVStoreError as exc:
                self.errors[getattr(exc, "code", type(exc).__name__)] += 1
                if client is not None:
                    client.close()
                client = None
                time.sleep(0.1)
            except OSError as exc:  # the socket vanished under a restart
                self.errors[type(exc).__name__] += 1
                client = None
                time.sleep(0.1)
        if client is not None:
            client.close()

    def one(self, client):
        i = self.rng.randrange(NUM_IDS)
        oid, op = oid_of(i), self.rng.choices(["put", "put_remote", "get", "get_ranges", "lookup", "delete"],
                                              [4, 1, 6, 2, 2, 1])[0]
        self.ops[op] += 1
        if op in ("put", "put_remote"):
            client.put(oid, data_of(i), tier="remote" if op == "put_remote" else "host")
        elif op == "get":
            lease = client.get(oid)
            if lease is not None:
                with lease:
                    if not np.array_equal(lease.numpy(), data_of(i)):
                        self.bad.append(i)
        elif op == "get_ranges":  # a sparse reader: whole lease if held here, else just these bytes
            data = data_of(i)
            spans = [(o, self.rng.randint(1, min(data.size // 4, data.size - o)))  # at most the object, in all
                     for o in (self.rng.randrange(data.size) for _ in range(self.rng.randint(1, 4)))]
            lease = client.get(oid, ranges=spans)
            if lease is not None:
                with lease:
                    self.ops[f"ranged_{lease.tier}"] += 1
                    if not all(np.array_equal(lease.read(o, n), data[o:o + n]) for o, n in spans):
                        self.bad.append(i)
        elif op == "lookup":
            client.lookup([oid_of(j) for j in range(i, min(i + 8, NUM_IDS))])
        else:
            client.delete([oid], scope=self.rng.choice(["cluster", "node"]))


@pytest.mark.parametrize("seconds", [pytest.param(25.0, id="ci"),
                                     pytest.param(SECONDS, id="long", marks=pytest.mark.slow)])
def test_cluster_soak(daemon_factory, tmp_path, seconds):
    with etcd_server(str(tmp_path)) as etcd:
        def config(name, extra):
            return {"cluster": {"enabled": True, "node_id": name, "listen": f"127.0.0.1:{free_port()}",
                                "secret": SECRET, "membership": "etcd", "etcd_endpoint": etcd, "lease_ttl_s": 2.0,
                                "replicas": 2, "peer_timeout_s": 1.0, "rehome_delay_s": 0.3, "handover_s": 3.0,
                                **extra.pop("cluster", {})}, **extra}
        nodes = {
            "a": daemon_factory("8MiB", config=config("a", {})),
            "b": daemon_factory("8MiB", config=config("b", {"cluster": {"remote_write": "write_back"}})),
            "c": daemon_factory("6MiB", config=config("c", {"nvme": {"enabled": True, "capacity_bytes": "16MiB",
                                                                      "file_bytes": "16MiB"}})),
        }
        arenas = {"a": "8MiB", "b": "8MiB", "c": "6MiB"}
        workers = [Worker(d, seed) for seed, d in enumerate(nodes.values())]
        for w in workers:
            w.start()
        rng, deadline, chaos = random.Random(99), time.monotonic() + seconds, Counter()
        try:
            while time.monotonic() < deadline:
                time.sleep(rng.uniform(3, 6))
                name = rng.choice("abc")
                sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
                nodes[name].stop(sig, timeout=30)
                chaos[f"{sig.name} {name}"] += 1
                time.sleep(rng.uniform(0.5, 2.5))
                nodes[name].start(arenas[name])
        finally:
            for w in workers:
                w.stop.set()
            for w in workers:
                w.join(60)

        def all_see_three():
            try:
                return all(len(nodes[n].client().stats()["tiers"]["remote"]["members"]) == 3 for n in nodes)
            except KVStoreError:
                return False
        assert wait_for(all_see_three, 30)
        ops = sum((w.ops for w in workers), Counter())
        errors = sum((w.errors for w in workers), Counter())
        bad = [i for w in workers for i in w.bad]
        print(f"\nops {dict(ops)} errors {dict(errors)} chaos {dict(chaos)}")
        assert not bad, f"wrong bytes served for ids {sorted(set(bad))[:10]}"
        assert sum(ops.values()) > 300 and sum(chaos.values()) >= 2
        assert set(errors) <= EXPECTED | {"ConnectionResetError", "BrokenPipeError", "FileNotFoundError",
                                          "ConnectionRefusedError"}, errors
        for name, d in nodes.items():  # every node: each id bit-exact or a clean miss
            with d.client(timeout_s=30) as c:
                for i in range(NUM_IDS):
                    lease = c.get(oid_of(i))
                    if lease is not None:
                        with lease:
                            assert np.array_equal(lease.numpy(), data_of(i)), (name, i)
                c.check_integrity()
