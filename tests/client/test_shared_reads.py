"""Hits read from the shared index (client/shared_reads.py, server/tiering/shared_index.py):
no round trip, never a deleted, expired, other-descriptor or recycled object, and the
daemon still learns every hit. Real daemons, real sockets, real processes."""

from __future__ import annotations

import multiprocessing
import signal
import time

import numpy as np
import pytest

from kvstore.client import AsyncClient
from kvs_testing import payload, sent_ops
from kvstore import StateDescriptor, chunk_keys
from kvstore.errors import DaemonUnavailable
from kvstore.hints import Hints
from kvstore.identity import ObjectId

DESC = StateDescriptor("default", "m", "r", kind="kv", dtype="bf16",
                       layout="paged(order=layer_first,layers=1,block=16,kv_heads=1,head_dim=64)", chunk_tokens=16)


def oid(tag, i: int = 0) -> ObjectId:
    return ObjectId(f"{tag}:{i}".encode().ljust(32, b"."))


def round_trips(client) -> list:
    """Record the requests each round trip of `client` sends (the sync driver's one door)."""
    trips = []
    inner = client._roundtrip
    client._roundtrip = lambda requests: trips.append([r.op for r in requests]) or inner(requests)
    return trips


def host_stats(client) -> dict:
    return client.stats()["namespaces"]["default"]


def test_a_hit_is_read_without_a_round_trip_and_bit_exact(daemon):
    with daemon.client() as c:
        small, big = oid("small"), oid("big")
        c.put(small, payload(4096, small))
        c.put(big, payload(100_000, big))  # past the size get() copies
        out = np.zeros(100_000, np.uint8)
        trips = round_trips(c)
        assert c.get_into(small, out) == 4096 and np.array_equal(out[:4096], payload(4096, small))
        with c.get(small) as lease:
            assert lease.lease_id == 0 and np.array_equal(lease.numpy(), payload(4096, small))
        assert c.get_into(big, out) == 100_000 and np.array_equal(out, payload(100_000, big))
        assert trips == []
        with c.get(big) as lease:  # bigger than GET_COPY_MAX_BYTES: the daemon's zero-copy lease
            assert lease.lease_id > 0 and np.array_equal(lease.numpy(), payload(100_000, big))
        assert trips == [["get"]]
        c.check_integrity()


def test_get_into_reads_up_to_8_mib_from_the_index_and_asks_the_daemon_past_it(daemon_factory):
    """Objects up to WHOLE_COPY_MAX_BYTES are copied whole and then hashed, bigger ones copied
    and hashed by blocks (client/copies.py; a last block short of the others, and two threads
    at 8 MiB); one byte past READ_INTO_MAX_BYTES takes the round trip."""
    d = daemon_factory("64MiB")
    sizes = {oid("1m"): 1 << 20, oid("1m+1"): (1 << 20) + 1, oid("4m"): 4 << 20, oid("8m"): 8 << 20,
             oid("8m+1"): (8 << 20) + 1}
    with d.client() as c:
        for k, n in sizes.items():
            c.put(k, payload(n, k))
        out = np.zeros((8 << 20) + 1, np.uint8)
        trips = round_trips(c)
        for k, n in sizes.items():
            assert c.get_into(k, out) == n and np.array_equal(out[:n], payload(n, k))
        assert trips == [["get"]]  # the last one only (its release needs no reply)
        assert c.stats()["leases"] == 0 and host_stats(c)["num_shared_hits"] == 4


def test_hits_are_counted_and_reported_ahead_of_the_next_request_and_at_close(daemon):
    k = oid("counted")
    with daemon.client() as c:
        c.put(k, payload(4096, k))
        before = host_stats(c)
        for _ in range(3):
            assert c.get_into(k, np.zeros(4096, np.uint8)) == 4096
        after = host_stats(c)  # the stats request carried the touch ahead of it
        assert after["num_shared_hits"] - before["num_shared_hits"] == 3
        assert after["num_hits"] - before["num_hits"] == 3 and after["num_gets"] - before["num_gets"] == 3
        assert after["bytes_out"] - before["bytes_out"] == 3 * 4096
        c.get_into(k, np.zeros(4096, np.uint8))
    with daemon.client() as other:  # the first client reported its last hit as it closed
        assert host_stats(other)["num_shared_hits"] == 4


def test_the_eviction_policy_learns_hits_read_from_the_index(daemon_factory):
    d = daemon_factory("1MiB", config={"host": {"policy": "lru"}})
    keys = [oid("lru", i) for i in range(32)]  # 32 x 32 KiB fill the arena
    with d.client() as c:
        for k in keys:
            c.put(k, payload(32 << 10, k))
        assert c.get_into(keys[0], np.zeros(32 << 10, np.uint8)) == 32 << 10  # the oldest, read from the index
        c.put(oid("newcomer"), payload(32 << 10, 0))  # makes room: the touch went ahead of it
        assert c.lookup([keys[0], keys[1]]).tiers == ("host", None)


def test_a_deleted_object_never_hits(daemon):
    k = oid("deleted")
    with daemon.client() as reader, daemon.client() as writer:
        writer.put(k, payload(4096, k))
        out = np.zeros(4096, np.uint8)
        assert reader.get_into(k, out) == 4096
        writer.delete([k])
        assert reader.get_into(k, out) is None and reader.get(k) is None
        writer.put(k, payload(4096, k))  # back: readable again
        assert reader.get_into(k, out) == 4096


def test_an_expired_object_never_hits(daemon):
    k, kept = oid("ttl"), oid("kept")
    with daemon.client() as c:
        c.put(k, payload(4096, k), hints=Hints(ttl_s=0.2))
        c.put(kept, payload(4096, kept), hints=Hints(ttl_s=3600))
        out = np.zeros(4096, np.uint8)
        assert c.get_into(k, out) == 4096
        time.sleep(0.3)  # past the TTL; the daemon's housekeeping may not have dropped it yet
        trips = round_trips(c)
        assert c.get_into(k, out) is None and c.get(k) is None
        assert trips, "the index refused the expired record and the daemon was asked"
        assert c.get_into(kept, out) == 4096


def test_another_descriptor_never_hits(daemon):
    tokens = list(range(32))
    mine, other = chunk_keys(tokens, DESC), chunk_keys(tokens, DESC.with_(model="m2"))
    plain = oid("plain")
    with daemon.client() as c:
        for k in mine:
            c.put(k, payload(DESC.object_bytes, k.object_id))
        c.put(plain, payload(4096, plain), DESC)
        out = np.zeros(DESC.object_bytes, np.uint8)
        trips = round_trips(c)
        assert c.get_into(mine[0], out) == DESC.object_bytes and trips == []
        with c.get(mine[1]) as lease:
            assert lease.descriptor == DESC
            assert np.array_equal(lease.numpy(), payload(DESC.object_bytes, mine[1].object_id))
        assert c.get_into(other[0], out) is None  # another model's id: not stored
        assert c.get_into(mine[0].object_id, out, expect=DESC.with_(model="m2")) is None
        assert c.get(mine[0].object_id, expect=DESC.with_(dtype="fp16")) is None
        assert c.get_into(plain, out, expect=DESC) == 4096
        assert c.get_into(plain, out, expect=DESC.with_(shard="1/2")) is None
        # a get without expect of an object put with a descriptor: answered by the daemon, naming it
        with c.get(plain) as lease:
            assert lease.lease_id > 0 and lease.descriptor == DESC
        assert c.get_many_into([(mine[0], out), (other[1], out)]) == [DESC.object_bytes, None]


def test_get_many_into_mixes_index_hits_and_the_daemons_answers(daemon):
    keys = [oid("many", i) for i in range(40)]
    with daemon.client() as c:
        assert all(r.error is None for r in c.put_many([(k, payload(8192, k)) for k in keys[::2]]))
        outs = [np.zeros(8192, np.uint8) for _ in keys]
        assert c.get_many_into(list(zip(keys, outs))) == [8192 if i % 2 == 0 else None for i in range(40)]
        for i, k in enumerate(keys):
            assert np.array_equal(outs[i], payload(8192, k) if i % 2 == 0 else np.zeros(8192, np.uint8))
        assert host_stats(c)["num_shared_hits"] == 20 and c.stats()["leases"] == 0


def test_get_many_copies_small_hits_from_the_index_and_leases_the_rest(daemon):
    """Up to 16 KiB a copy (the first small object is exactly that); past it, 64 KiB too (which
    `get` copies), a zero-copy lease from the daemon."""
    small, large = [oid("gm", i) for i in range(30)], [oid("gml", i) for i in range(4)]
    small_sizes = [16384] + [4096] * 14
    large_sizes = [16385, 65536, 100_000, 100_000]
    with daemon.client() as c:
        c.put_many([(k, payload(n, k)) for k, n in zip(small[::2], small_sizes)]
                   + [(k, payload(n, k)) for k, n in zip(large, large_sizes)])
        sent = sent_ops(c)
        leases = c.get_many(small + large)
        assert [lease is None for lease in leases[:30]] == [i % 2 == 1 for i in range(30)]
        for k, lease in zip(small + large, leases):
            if lease is not None:
                assert np.array_equal(lease.numpy(), payload(lease.size, k))
        assert [lease.lease_id == 0 for lease in leases if lease is not None] == [True] * 15 + [False] * 4
        assert "get_many" in sent  # the misses and the large objects were asked of the daemon
        assert c.stats()["leases"] == 4  # only the large objects' leases
        c.release_many(leases)
        assert c.stats()["leases"] == 0 and host_stats(c)["num_shared_hits"] == 15


def test_the_async_client_reads_from_the_index_too(daemon):
    import asyncio

    async def go():
        k = oid("async")
        c = await AsyncClient.connect(daemon.socket)
        await c.put(k, payload(4096, k))
        out = np.zeros(4096, np.uint8)
        assert await c.get_into(k, out) == 4096 and np.array_equal(out, payload(4096, k))
        assert c.core.shared.num_pending == 1
        stats = await c.stats()  # carried the report ahead of it
        assert await c.get_into(k, out) == 4096
        await c.close()  # reports the second hit
        return stats["namespaces"]["default"]["num_shared_hits"]
    assert asyncio.run(go()) == 1
    with daemon.client() as other:
        assert host_stats(other)["num_shared_hits"] == 2


@pytest.mark.parametrize("daemon_on, client_on", [(False, True), (True, False)])
def test_with_the_index_off_on_either_side_reads_are_round_trips(daemon_factory, daemon_on, client_on):
    d = daemon_factory(config={"host": {"shared_index": daemon_on}})
    k = oid("off")
    with d.client(shared_index=client_on) as c:
        c.put(k, payload(4096, k))
        out = np.zeros(4096, np.uint8)
        trips = round_trips(c)
        assert c.get_into(k, out) == 4096 and np.array_equal(out, payload(4096, k))
        with c.get(k) as lease:
            assert lease.lease_id > 0
        assert [t[0] for t in trips] == ["get", "get"]
        assert host_stats(c)["num_shared_hits"] == 0 and host_stats(c)["num_hits"] == 2
        c.delete([k])
        assert c.get_into(k, out) is None


# --- the race: readers against a writer that deletes, evicts and reuses extents -------------

RACE_S = 3.0
# (ids, bytes a unit, puts a batch, deletes a batch). Small: a 1 MiB arena holds ~60 of 400
# ids' objects of 1-4 pages, so extents are recycled constantly. Large: objects of 2-8 MiB,
# read on two threads from 4 MiB (client/copies.py), ~8 of 24 ids in a 40 MiB arena.
SMALL_RACE = (400, 4096, 16, 6)
LARGE_RACE = (24, 2 << 20, 3, 1)


def race_size(i: int, unit: int = 4096) -> int:
    return unit * (1 + i % 4) - (i * 37) % 4000  # 1-4 units, rarely a whole number of pages


def race_writer(socket_path: str, until: float, results, race) -> None:
    """As fast as it can: batches of puts (each evicting others to make room) and deletes."""
    from kvstore.client import Client
    pool, unit, puts, deletes = race
    rng = np.random.default_rng(1)
    keys = [oid("race", i) for i in range(pool)]
    writes = 0
    with Client.connect(socket_path) as c:
        while time.monotonic() < until:
            batch = rng.integers(pool, size=puts).tolist()
            c.put_many([(keys[i], payload(race_size(i, unit), keys[i])) for i in batch])
            c.delete([keys[i] for i in rng.integers(pool, size=deletes).tolist()])
            writes += puts + deletes
    results.put(("writer", writes))


def race_reader(socket_path: str, seed: int, until: float, results, race) -> None:
    """get_into, get and get_many_into of random ids; every byte accepted is checked."""
    from kvstore.client import Client
    pool, unit, _, _ = race
    rng = np.random.default_rng(seed)
    keys = [oid("race", i) for i in range(pool)]
    outs = [np.empty(4 * unit, np.uint8) for _ in range(8)]
    hits = wrong = 0

    def check(i: int, got) -> None:
        nonlocal hits, wrong
        if got is not None:
            hits += 1
            wrong += len(got) != race_size(i, unit) or not np.array_equal(got, payload(race_size(i, unit), keys[i]))
    with Client.connect(socket_path) as c:
        while time.monotonic() < until:
            way = rng.random()
            if way < 0.7:
                i = int(rng.integers(pool))
                size = c.get_into(keys[i], outs[0])
                check(i, None if size is None else outs[0][:size])
            elif way < 0.85:
                i = int(rng.integers(pool))
                lease = c.get(keys[i])
                if lease is not None:
                    with lease:
                        check(i, lease.numpy().copy())
            else:
                batch = rng.integers(pool, size=8).tolist()
                sizes = c.get_many_into([(keys[i], out) for i, out in zip(batch, outs)])
                for i, out, size in zip(batch, outs, sizes):
                    check(i, None if size is None else out[:size])
        results.put((f"reader{seed}", (hits, wrong, c.core.shared.num_refused)))


@pytest.mark.parametrize("race, arena", [(SMALL_RACE, "1MiB"), (LARGE_RACE, "40MiB")], ids=["small", "large"])
def test_readers_racing_deletes_evictions_and_reused_extents_get_only_exact_bytes(daemon_factory, race, arena):
    d = daemon_factory(arena)
    ctx = multiprocessing.get_context("fork")
    results, until = ctx.SimpleQueue(), time.monotonic() + RACE_S  # CLOCK_MONOTONIC: one clock for all
    procs = [ctx.Process(target=race_writer, args=(d.socket, until, results, race))]
    procs += [ctx.Process(target=race_reader, args=(d.socket, seed, until, results, race)) for seed in (2, 3)]
    for p in procs:
        p.start()
    got = dict(results.get() for _ in procs)
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    readers = [got[f"reader{seed}"] for seed in (2, 3)]
    assert got["writer"] > race[0]
    assert all(wrong == 0 for _, wrong, _ in readers) and all(hits > 0 for hits, _, _ in readers), readers
    with d.client() as c:
        c.check_integrity()  # index, arena and records agree after the race
        stats = host_stats(c)
        assert stats["num_evictions"] > 0 and stats["num_deletes"] > 0
        assert stats["num_shared_hits"] > 0  # the readers read the index (reported as they closed)


def test_a_killed_daemons_table_is_not_read_even_before_its_keep_alive_lapses(daemon):
    """SIGKILL leaves the table's keep-alive seconds ahead; the closed socket says at once
    that the daemon left, so a read is the daemon's question (a DaemonUnavailable), as an
    adapter's "exists" already is, never bytes from a dead daemon."""
    key = oid("killed")
    with daemon.client() as c:
        c.put(key, payload(4096, key))
        out = np.zeros(4096, np.uint8)
        assert c.get_into(key, out) == 4096  # from the table
        daemon.stop(signal.SIGKILL)
        with pytest.raises(DaemonUnavailable):
            c.get_into(key, out)
        with pytest.raises(DaemonUnavailable):
            c.get(key)
