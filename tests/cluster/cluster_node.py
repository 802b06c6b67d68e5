"""A cluster test node: PeerNode (peer service, membership, remote tier) over an in-memory
backend, driven by JSON lines on stdin; one JSON reply line on stdout per command.

    python tests/cluster/cluster_node.py --node-id a --listen 10.77.0.1:7000 --secret S \
        [--peer b=10.77.0.2:7000 ...] [--etcd http://10.77.0.254:2379 --ttl-s 2]

Commands: {"op": "put" | "get" | "lookup" | "homes" | "members" | "stats", ...}; objects are
named by (namespace, seed, size) and generated the same way here and in the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time

import numpy as np
import xxhash

from kvstore.config import ClusterConfig
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.ownership import home_nodes
from server.peer_node import PeerNode
from server.peer_service import InMemoryBackend
from kvstore.peer_messages import RemoteMeta
from tiers.remote import RemoteTier


def make_object(namespace: str, seed: int, size: int):
    data = np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
    oid = ObjectId(hashlib.blake2b(f"{namespace}/{seed}/{size}".encode(), digest_size=32).digest())
    meta = RemoteMeta(size, xxhash.xxh3_128_digest(data), StateDescriptor(namespace, "m", "r1"))
    return oid, meta, data


def digest(data) -> str:
    return hashlib.blake2b(bytes(data), digest_size=16).hexdigest()


class Agent:
    def __init__(self, node: PeerNode, backend: InMemoryBackend):
        self.node, self.backend = node, backend
        self.tiers = {node.cluster.replicas: node.remote}

    def tier(self, replicas: int) -> RemoteTier:
        if replicas not in self.tiers:
            self.tiers[replicas] = RemoteTier(self.node.node_id, self.node.membership.members, self.node.connect,
                                              replicas, self.node.cluster.peer_timeout_s)
        return self.tiers[replicas]

    async def handle(self, cmd: dict) -> dict:
        op, ns, r = cmd["op"], cmd.get("ns", "ns"), cmd.get("replicas", 1)
        if op == "members":
            return {"members": self.node.membership.members()}
        if op == "stats":
            return self.node.stats()
        if op == "homes":
            oid = make_object(ns, cmd["seed"], cmd["size"])[0]
            return {"homes": home_nodes(oid, self.node.membership.members(), r)}
        if op == "put":
            oid, meta, data = make_object(ns, cmd["seed"], cmd["size"])
            tier = self.tier(r)
            held = []
            if self.node.node_id in tier.homes(oid):
                self.backend.objects[(ns, oid)] = (meta, bytearray(data.tobytes()))
                held.append(self.node.node_id)
            held += await tier.put(ns, oid, meta, data)
            return {"homes": tier.homes(oid), "held": held}
        if op == "get":
            oid, meta, _ = make_object(ns, cmd["seed"], cmd["size"])
            start = time.monotonic()
            local = self.backend.read(ns, oid)
            if local is not None:
                return {"found": True, "digest": digest(local.buffer), "source": "local", "elapsed_s": 0.0}
            out = np.empty(cmd["size"], dtype=np.uint8)
            got = await self.tier(r).get_into(ns, oid, lambda m: out if m.size == out.nbytes else None)
            return {"found": got is not None, "digest": digest(out) if got else None, "source": "remote",
                    "elapsed_s": time.monotonic() - start}
        if op == "lookup":
            ids = [make_object(ns, s, cmd["size"])[0] for s in cmd["seeds"]]
            metas = await self.tier(r).lookup(ns, ids)
            return {"found": [m is not None or (ns, oid) in self.backend.objects for m, oid in zip(metas, ids)]}
        return {"error": f"unknown op {op}"}


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--node-id", required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--secret", required=True)
    p.add_argument("--peer", action="append", default=[])
    p.add_argument("--etcd")
    p.add_argument("--ttl-s", type=float, default=2.0)
    p.add_argument("--timeout-s", type=float, default=1.0)
    p.add_argument("--transport", default="tcp")
    args = p.parse_args()
    cluster = ClusterConfig(enabled=True, node_id=args.node_id, listen=args.listen, secret=args.secret,
                            transport=args.transport, membership="etcd" if args.etcd else "static",
                            peers=tuple(args.peer), etcd_endpoint=args.etcd or "http://127.0.0.1:2379",
                            etcd_prefix="/kvstore-test/members/", lease_ttl_s=args.ttl_s, peer_timeout_s=args.timeout_s)
    backend = InMemoryBackend()
    node = PeerNode(cluster, backend)
    await node.start()
    agent = Agent(node, backend)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": node.address}), flush=True)
    while line := await reader.readline():
        try:
            reply = await agent.handle(json.loads(line))
        except Exception as exc:  # the test reads the error; the node keeps serving
            reply = {"error": repr(exc)}
        print(json.dumps(reply), flush=True)
    await node.stop()


if __name__ == "__main__":
    from server.logs import configure
    configure("info")
    asyncio.run(main())
