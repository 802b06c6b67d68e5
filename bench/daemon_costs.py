"""The daemon's own cost per small object: reserve, commit and get of a 1,000-object batch.

    .venv/bin/python bench/daemon_costs.py [--reps 30]     # bench/results/daemon_costs.json

Reaches inside: it times the tier manager's batch ops in one process (server/local/batches.py
over a composed chain, host tier only, arena prefaulted), without the socket, the codec or a
client, to show what the daemon's Python costs per object where issue 29's small-object goals
are decided. Cases, per 4 KiB object, the best of `--reps` batches of 1,000:

    reserve_many      a batch's reserves (ids new to the arena)
    commit_many       its commits, shared index on (the default)
    commit_many, no shared index    the same without publishing to the shared index
    get_many          leases on resident objects, then release_many
    touch             a client's report of 1,000 hits it read from the shared index

Baseline in the same run: a Python dict's insert and lookup of the same 1,000 ids with a
small tuple as value, the floor of any index kept as Python objects. The ratio says how many
such dict operations one object's daemon work costs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import xxhash  # noqa: E402

from bench.common import Row, report  # noqa: E402
from kvstore import messages as m  # noqa: E402
from kvstore.config import HostTierConfig  # noqa: E402
from kvstore.fields import unpack_uints  # noqa: E402
from kvstore.identity import ObjectId, StateDescriptor  # noqa: E402
from kvstore.server.local import batches  # noqa: E402
from kvstore.server.tiering.chain import compose  # noqa: E402
from kvstore.server.tiering.index_ops import IndexOps  # noqa: E402
from kvstore.server.tiering.manager import TierManager  # noqa: E402

SUITE = "daemon_costs"
N, SIZE = 1000, 4096


def manager(shared_index: bool) -> tuple[TierManager, IndexOps]:
    """The tier manager over a host tier with namespace "t" open, and the chain's index ops."""
    chain = compose(HostTierConfig(arena_bytes=64 << 20, prefault=True, shared_index=shared_index,
                                   huge_pages="off", namespaces=()))
    host = chain.host
    asyncio.run(host.open_namespace("t"))
    return TierManager(chain), chain.index


def one_batch(mgr: TierManager, index: IndexOps, rep: int, checksum: bytes,
              desc: StateDescriptor) -> tuple[float, float, float, float]:
    """Seconds per object of reserve_many, commit_many, get_many (+ release_many) and touch."""
    ids = [ObjectId(rep.to_bytes(4, "little") + i.to_bytes(28, "little")) for i in range(N)]
    reserve = m.ReserveMany.of("t", ids, [SIZE] * N, desc)
    start = time.perf_counter()
    reserved = batches.reserve_many(mgr, 1, reserve)
    reserved_s = time.perf_counter() - start
    commit = m.CommitMany.of(unpack_uints(reserved.leases), [checksum] * N)
    start = time.perf_counter()
    committed = batches.commit_many(mgr, 1, commit)
    committed_s = time.perf_counter() - start
    if set(committed.codes) != {0}:
        raise RuntimeError(f"commit_many: codes {set(committed.codes)}, errors {committed.errors[:1]}")
    get = m.GetMany.of("t", ids, desc)
    start = time.perf_counter()
    got = batches.get_many(mgr, 1, get)
    batches.release_many(mgr, 1, m.ReleaseMany.of(unpack_uints(got.leases)))
    got_s = time.perf_counter() - start
    if sum(got.hits) != N:
        raise RuntimeError(f"get_many: {sum(got.hits)} of {N} hits")
    shared_hits = mgr.stats()["namespaces"]["t"]["num_shared_hits"]
    start = time.perf_counter()
    mgr.touch("t", tuple(oid.digest for oid in ids))
    touched_s = time.perf_counter() - start
    if mgr.stats()["namespaces"]["t"]["num_shared_hits"] != shared_hits + N:
        raise RuntimeError("touch: the hits were not counted")
    index.delete("t", ids, scope="node")
    return reserved_s / N, committed_s / N, got_s / N, touched_s / N


def dict_floor(reps: int) -> tuple[float, float]:
    """Seconds per object of a dict insert, and of a lookup, of the same kind of ids."""
    best_put = best_get = float("inf")
    for rep in range(reps):
        ids = [ObjectId(rep.to_bytes(4, "little") + i.to_bytes(28, "little")) for i in range(N)]
        index: dict = {}
        start = time.perf_counter()
        for i, oid in enumerate(ids):
            index[oid] = (i, SIZE)
        best_put = min(best_put, time.perf_counter() - start)
        start = time.perf_counter()
        for oid in ids:
            index[oid]
        best_get = min(best_get, time.perf_counter() - start)
    return best_put / N, best_get / N


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="batches per case (the best is reported)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps takes a positive integer")
    desc, checksum = StateDescriptor("t", "m", "r"), xxhash.xxh3_128_digest(bytes(SIZE))
    best = {}
    for shared_index in (True, False):  # alternated batches would share one arena's state: one manager each
        mgr, index = manager(shared_index)
        runs = [one_batch(mgr, index, rep, checksum, desc) for rep in range(args.reps)]
        best[shared_index] = [min(r[k] for r in runs) for k in range(4)]
        mgr.close()
    put_floor, get_floor = dict_floor(args.reps)
    us = 1e6
    rows = [
        Row(SUITE, "reserve_many, per 4KiB object", "best", "us", best[True][0] * us, "dict insert", put_floor * us,
            higher_is_better=False),
        Row(SUITE, "commit_many, per 4KiB object", "best", "us", best[True][1] * us, "dict insert", put_floor * us,
            higher_is_better=False),
        Row(SUITE, "commit_many, no shared index", "best", "us", best[False][1] * us, "dict insert", put_floor * us,
            higher_is_better=False),
        Row(SUITE, "get_many + release_many, per object", "best", "us", best[True][2] * us, "dict lookup",
            get_floor * us, higher_is_better=False),
        Row(SUITE, "touch (a shared-index hit reported), per object", "best", "us", best[True][3] * us,
            "dict lookup", get_floor * us, higher_is_better=False),
    ]
    report(SUITE, rows, [], {}, {"objects_per_batch": N, "object_bytes": SIZE, "reps": args.reps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
