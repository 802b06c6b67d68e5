"""Run inside a container of the compose cluster (`python3 - VERB ... < probe.py`): one client
call against the daemon behind $KVSTORE_SOCKET, one JSON line on stdout.

It imports only what the image installs (kvstore's light core and numpy): the tests pipe it
into `docker exec -i`, so nothing of the repository is mounted into the containers.

    put NS TAG PER_GROUP SIZE     put the objects of `ids` (deterministic bytes)
    check NS TAG PER_GROUP SIZE   read each back verified: {"exact", "missing", "wrong"}
    tiers NS TAG PER_GROUP        where each object is on this node (lookup, no remote fetch)
    zero_copy NS TAG PER_GROUP    whether a lease's view lies inside the mapped arena memfd
    members                       the cluster members this node sees
    remote                        the remote tier's stats (the Mooncake pool's: up, counters)
"""

import hashlib
import itertools
import json
import os
import sys

import numpy as np

from kvstore.client import Client
from kvstore.identity import ObjectId
from kvstore.ownership import home_nodes

NODES = ["node-a", "node-b", "node-c"]
REPLICAS = 2
TIMEOUT_S = 15.0


def ids(tag: str, per_group: int) -> list:
    """`per_group` ids for every ordered pair of homes among the three nodes."""
    groups = {pair: [] for pair in itertools.permutations(NODES, REPLICAS)}
    for i in itertools.count():
        oid = ObjectId(hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest())
        group = groups[tuple(home_nodes(oid, NODES, REPLICAS))]
        if len(group) < per_group:
            group.append(oid)
        if all(len(g) == per_group for g in groups.values()):
            return [oid for g in groups.values() for oid in g]


def payload(oid: ObjectId, size: int) -> np.ndarray:
    seed = int.from_bytes(oid.digest[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


def mapping_of(address: int) -> str:
    """The name /proc/self/maps gives the mapping that holds `address` ("/memfd:... (deleted)")."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def connect(namespace: str = "default") -> Client:
    return Client.connect(os.environ["KVSTORE_SOCKET"], namespace=namespace, timeout_s=TIMEOUT_S)


def main(verb: str, *args: str) -> dict:
    if verb == "members":
        with connect() as c:
            return {"members": sorted(c.stats()["tiers"]["remote"]["members"])}
    if verb == "remote":
        with connect() as c:
            return c.stats()["tiers"]["remote"]
    namespace, tag, per_group = args[0], args[1], int(args[2])
    keys = ids(tag, per_group)
    with connect(namespace) as c:
        if verb == "put":
            size = int(args[3])
            for oid in keys:
                c.put(oid, payload(oid, size))
            return {"put": len(keys)}
        if verb == "check":
            size, exact, missing, wrong = int(args[3]), 0, [], []
            for oid in keys:
                out = np.empty(size, dtype=np.uint8)
                got = c.get_into(oid, out, verify=True)
                if got is None:
                    missing.append(str(oid))
                elif got == size and np.array_equal(out, payload(oid, size)):
                    exact += 1
                else:
                    wrong.append(str(oid))
            return {"exact": exact, "missing": missing, "wrong": wrong}
        if verb == "tiers":
            return {"tiers": list(c.lookup(keys).tiers)}
        if verb == "zero_copy":
            # The client maps the daemon's arena memfd, received over the Unix socket; a lease
            # is a view into that mapping, not a copy.
            inside = []
            for oid in keys:
                with c.get(oid) as lease:
                    view = lease.numpy()
                    arena = c.core.arenas[namespace]  # mapped at the first read
                    start, end = arena.ctypes.data, arena.ctypes.data + arena.nbytes
                    inside.append(start <= view.ctypes.data and view.ctypes.data + view.nbytes <= end)
            return {"inside_arena": inside, "mapping": mapping_of(start)}
    raise SystemExit(f"probe: unknown verb {verb!r}")


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
