"""The remote tier against real peer services: homes, batches, isolation, failure as a miss."""

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import xxhash
from peer_helpers import TRANSPORTS, make_object, remote_tier, run, services, transport_or_skip

from kvstore import ranges
from kvstore.errors import CapacityError, RangeError
from kvstore.identity import ObjectId
from kvstore.peer_messages import PeerGet
from bench.peer_service import InMemoryBackend
from kvstore.server.peer.service import PeerRead, PeerService
from kvstore.tiers.remote import MAX_LINKS_PER_PEER

MiB = 1 << 20


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return transport_or_skip(request.param)


def members_of(started):
    return {name: address for name, (_, address) in started.items()}


def test_put_on_one_node_get_on_another_bit_exact(transport):
    objects = [make_object(MiB + i, seed=i) for i in range(6)]

    async def scenario():
        async with services(transport, names=("b", "c")) as started:
            writer = remote_tier(transport, members_of(started), node_id="a")
            reader = remote_tier(transport, members_of(started), node_id="d")
            held = [await writer.put("ns", oid, meta, data) for oid, meta, data in objects]
            outs = []
            for oid, meta, _ in objects:
                out = np.empty(meta.size, dtype=np.uint8)
                got = await reader.get_into("ns", oid, lambda m, out=out: out)
                outs.append((got, out))
            writer.check_integrity()
            reader.check_integrity()
            await writer.close()
            await reader.close()
            return held, outs, writer

    held, outs, writer = run(scenario())
    for (oid, meta, data), homes, (got, out) in zip(objects, held, outs):
        assert homes == writer.homes(oid)  # each object went to its rendezvous home
        assert got == meta and np.array_equal(out, data)
    assert {h[0] for h in held} == {"b", "c"}


def test_lookup_is_batched_ordered_and_namespaced(transport):
    objects = [make_object(1000, seed=i) for i in range(40)]
    missing = ObjectId(b"\x07" * 32)

    async def scenario():
        async with services(transport, names=("b", "c", "e")) as started:
            tier = remote_tier(transport, members_of(started))
            for oid, meta, data in objects[:30]:
                await tier.put("ns", oid, meta, data)
            requests_before = sum(s.counters.num_requests for s, _ in started.values())
            ids = [oid for oid, _, _ in objects] + [missing]
            found = await tier.lookup("ns", ids)
            requests = sum(s.counters.num_requests for s, _ in started.values()) - requests_before
            other = await tier.lookup("tenant-2", ids)
            out = np.empty(1000, dtype=np.uint8)
            cross = await tier.get_into("tenant-2", objects[0][0], lambda m: out)
            tier.check_integrity()
            await tier.close()
            return found, requests, other, cross

    found, requests, other, cross = run(scenario())
    assert found[:30] == [meta for _, meta, _ in objects[:30]]
    assert found[30:] == [None] * 11
    assert requests == 3  # one round trip per home node
    assert other == [None] * 41 and cross is None  # namespaces never leak across nodes


def test_replication_two_survives_losing_a_node(transport):
    objects = [make_object(64 * 1024, seed=i) for i in range(12)]

    async def scenario():
        async with services(transport, names=("b", "c", "e"), timeout_s=0.5) as started:
            tier = remote_tier(transport, members_of(started), replicas=2, timeout_s=0.5)
            for oid, meta, data in objects:
                assert len(await tier.put("ns", oid, meta, data)) == 2
            await started["c"][0].stop()  # c dies
            results = []
            for oid, meta, data in objects:
                out = np.empty(meta.size, dtype=np.uint8)
                results.append((await tier.get_into("ns", oid, lambda m, out=out: out), out))
            found = await tier.lookup("ns", [oid for oid, _, _ in objects])
            tier.check_integrity()
            await tier.close()
            return results, found, tier.stats()

    results, found, stats = run(scenario())
    for (oid, meta, data), (got, out) in zip(objects, results):
        assert got == meta and np.array_equal(out, data)
    assert found == [meta for _, meta, _ in objects]
    assert stats["num_misses"] == 0 and stats["peers_down"] == ["c"]
    # The dead node costs one failed call, then is skipped (counted, not timed).
    assert stats["num_peer_failures"] >= 1 and stats["num_peer_skips"] >= 1


def test_dead_home_is_a_fast_miss_not_a_hang(transport):
    oid, meta, data = make_object(4096, seed=1)

    async def scenario():
        async with services(transport, names=("b",), timeout_s=0.3) as started:
            tier = remote_tier(transport, members_of(started), timeout_s=0.3)
            await tier.put("ns", oid, meta, data)
            await started["b"][0].stop()
            for _ in range(3):  # wait_for is a hang guard far above the 0.3 s peer timeout
                get = tier.get_into("ns", oid, lambda m: np.empty(m.size, np.uint8))
                assert await asyncio.wait_for(get, 30) is None
            tier.check_integrity()
            await tier.close()
            return tier.stats()

    stats = run(scenario())
    assert stats["num_misses"] == 3 and stats["num_peer_failures"] >= 1 and stats["num_peer_skips"] >= 1


def test_corrupted_bytes_are_a_miss_never_served(transport):
    oid, meta, data = make_object(100_000, seed=2)
    backend = InMemoryBackend()

    async def scenario():
        async with services(transport, backends=[backend]) as started:
            tier = remote_tier(transport, members_of(started))
            await tier.put("ns", oid, meta, data)
            backend.objects[("ns", oid)][1][500] ^= 0xFF  # bit rot on the home node
            got = await tier.get_into("ns", oid, lambda m: np.empty(m.size, np.uint8))
            bad = make_object(100_000, seed=3)
            lying = type(meta)(bad[1].size, meta.checksum, meta.descriptor)  # checksum of other bytes
            held = await tier.put("ns", bad[0], lying, bad[2])
            tier.check_integrity()
            await tier.close()
            return got, held, tier.stats(), started["b"][0].stats()

    got, held, stats, service = run(scenario())
    assert got is None and stats["num_checksum_failures"] == 1
    assert held == [] and service["num_checksum_failures"] == 1
    assert len(backend.objects) == 1


def test_full_peer_refuses_a_put_and_keeps_the_link(transport):
    oid, meta, data = make_object(200_000, seed=4)

    class Full(InMemoryBackend):
        def reserve(self, namespace, object_id, meta):
            raise CapacityError("no room on this peer")

    async def scenario():
        async with services(transport, backends=[Full()]) as started:
            tier = remote_tier(transport, members_of(started))
            held = await tier.put("ns", oid, meta, data)
            found = await tier.lookup("ns", [oid])
            tier.check_integrity()
            await tier.close()
            return held, found, started["b"][0].stats(), tier.stats()

    held, found, service, stats = run(scenario())
    assert held == [] and found == [None]
    assert service["num_channels"] == 1 and service["num_errors"] == 1
    assert stats["peers_down"] == []


def test_concurrent_gets_share_a_bounded_pool_of_links(transport):
    objects = [make_object(300_000, seed=i) for i in range(16)]

    async def scenario():
        async with services(transport) as started:
            tier = remote_tier(transport, members_of(started))
            for oid, meta, data in objects:
                await tier.put("ns", oid, meta, data)
            outs = [np.empty(meta.size, dtype=np.uint8) for _, meta, _ in objects]
            got = await asyncio.gather(*(tier.get_into("ns", oid, lambda m, out=out: out)
                                         for (oid, _, _), out in zip(objects, outs)))
            tier.check_integrity()
            links = started["b"][0].stats()["num_channels"]
            await tier.close()
            return got, outs, links

    got, outs, links = run(scenario())
    assert got == [meta for _, meta, _ in objects]
    assert all(np.array_equal(out, data) for out, (_, _, data) in zip(outs, objects))
    assert 1 < links <= MAX_LINKS_PER_PEER  # grew under load, never past the limit


def test_namespaces_are_checked_on_both_ends(transport):
    """A put whose metadata names another tenant is refused; a peer that answers with
    another tenant's object (or lookup entry) is a miss."""
    oid, meta, data = make_object(10_000, seed=5, namespace="tenant-a")

    class Confused(InMemoryBackend):
        def read(self, namespace, object_id):
            return super().read("tenant-a", object_id)

        def lookup(self, namespace, ids):
            return super().lookup("tenant-a", ids)

    backend = Confused()

    async def scenario():
        async with services(transport, backends=[backend]) as started:
            tier = remote_tier(transport, members_of(started))
            refused = await tier.put("tenant-b", oid, meta, data)  # meta says tenant-a
            await tier.put("tenant-a", oid, meta, data)
            leaked = await tier.get_into("tenant-b", oid, lambda m: np.empty(m.size, np.uint8))
            looked = await tier.lookup("tenant-b", [oid])
            await tier.close()
            return refused, leaked, looked

    refused, leaked, looked = run(scenario())
    assert refused == [] and leaked is None and looked == [None]
    assert list(backend.objects) == [("tenant-a", oid)]


def test_wrong_size_buffer_is_the_callers_error_not_a_dead_peer(transport):
    oid, meta, data = make_object(10_000, seed=6)

    async def scenario():
        async with services(transport) as started:
            tier = remote_tier(transport, members_of(started))
            await tier.put("ns", oid, meta, data)
            bad = await tier.get_into("ns", oid, lambda m: np.empty(m.size - 1, np.uint8))
            good = await tier.get_into("ns", oid, lambda m: np.empty(m.size, np.uint8))
            await tier.close()
            return bad, good, tier.stats(), started["b"][0].stats()

    bad, good, stats, service = run(scenario())
    assert bad is None and good == meta
    assert stats["peers_down"] == [] and stats["num_peer_failures"] == 0 and service["num_channels"] == 1


def test_ranged_get_moves_only_the_ranges_and_never_rotted_bytes(transport):
    oid, meta, data = make_object(MiB, seed=7)
    backend = InMemoryBackend()
    pairs = ((900_000, 4096), (0, 100), (50, 200), (MiB - 1, 1))  # unsorted, overlapping, last byte

    async def scenario():
        async with services(transport, backends=[backend]) as started:
            service = started["b"][0]
            tier = remote_tier(transport, members_of(started))
            await tier.put("ns", oid, meta, data)
            sent_before = service.counters.bytes_out
            out = np.empty(ranges.total(pairs), np.uint8)
            got = await tier.get_ranges_into("ns", oid, pairs, lambda m: out)
            sent = service.counters.bytes_out - sent_before
            again = await tier.get_ranges_into("ns", oid, pairs, lambda m: np.empty(out.size, np.uint8))
            checks = service.counters.num_copy_checks  # the second read within recheck_s: not hashed again
            with pytest.raises(RangeError, match="reaches past the object's"):
                await tier.get_ranges_into("ns", oid, ((MiB - 10, 11),), lambda m: np.empty(11, np.uint8))
            with pytest.raises(RangeError, match="add up to 2097152 bytes"):
                await tier.get_ranges_into("ns", oid, ((0, MiB), (0, MiB)), lambda m: np.empty(2 * MiB, np.uint8))
            other = await tier.get_ranges_into("tenant-2", oid, pairs, lambda m: np.empty(out.size, np.uint8))
            service.recheck_s = 0.0
            backend.objects[("ns", oid)][1][MiB // 2] ^= 0xFF  # rot outside the ranges asked for
            rotted = await tier.get_ranges_into("ns", oid, pairs, lambda m: np.empty(out.size, np.uint8))
            tier.check_integrity()
            await tier.close()
            return got, out, sent, again, checks, other, rotted, tier.stats(), service.stats()

    got, out, sent, again, checks, other, rotted, stats, service = run(scenario())
    assert got is not None and got[0] == meta and got[1] == xxhash.xxh3_128_digest(out) and again == got
    assert np.array_equal(out, ranges.pack(data, pairs))
    assert sent == out.size == 4096 + 100 + 200 + 1  # not the object's MiB
    assert checks == 1
    assert other is None  # namespaces stay apart
    assert rotted is None and service["num_checksum_failures"] == 1  # the home checked its whole copy
    assert stats["num_ranged_gets"] == 6 and stats["num_gets"] == stats["num_hits"] + stats["num_misses"]
    assert stats["peers_down"] == []  # a bad range is the caller's error, not a dead peer


def test_ranged_get_goes_on_to_the_next_home_when_one_answers_wrong(transport):
    oid, meta, data = make_object(256 * 1024, seed=8)
    pairs = ((1000, 500),)

    async def scenario():
        async with services(transport, names=("b", "c")) as started:
            tier = remote_tier(transport, members_of(started), replicas=2)
            assert sorted(await tier.put("ns", oid, meta, data)) == ["b", "c"]
            bad = started[tier.homes(oid)[0]][0]  # the first home asked: sends the whole object
            bad._get = lambda channel, rid, msg: PeerService._get(bad, channel, rid, replace(msg, ranges=None))
            out = np.empty(500, np.uint8)
            got = await tier.get_ranges_into("ns", oid, pairs, lambda m: out)
            await tier.close()
            return got, out, tier.stats()

    got, out, stats = run(scenario())
    assert got is not None and np.array_equal(out, data[1000:1500])  # the second home served it
    assert stats["num_hits"] == 1 and stats["num_misses"] == 0


def test_a_new_copy_at_the_same_place_is_hashed_again():
    """The skip-hash window belongs to one stored copy: an object deleted and put again (same
    id and claimed checksum, even the same address) is checked afresh."""
    oid, meta, data = make_object(4096, seed=9)
    service = PeerService(InMemoryBackend(), None, b"secret", "b")
    msg = PeerGet("ns", oid, ((0, 10),))
    buf = bytearray(data.tobytes())
    assert service._copy_checked(msg, PeerRead(meta, memoryview(buf), copy=1))
    assert service._copy_checked(msg, PeerRead(meta, memoryview(buf), copy=1))
    assert service.counters.num_copy_checks == 1
    buf[5] ^= 0xFF  # the next copy holds other bytes in the same place
    assert not service._copy_checked(msg, PeerRead(meta, memoryview(buf), copy=2))
    assert service.counters.num_copy_checks == 2


def test_pins_ask_every_home_once_and_survive_a_dead_one(transport):
    objects = [make_object(1000, seed=40 + i) for i in range(30)]
    missing = ObjectId(b"\x08" * 32)

    async def scenario():
        async with services(transport, names=("b", "c")) as started:
            tier = remote_tier(transport, members_of(started), replicas=2)
            for oid, meta, data in objects:
                await tier.put("ns", oid, meta, data)
            ids = [oid for oid, _, _ in objects] + [missing]
            before = sum(s.counters.num_requests for s, _ in started.values())
            pinned = await tier.pin("ns", ids, 60.0)
            requests = sum(s.counters.num_requests for s, _ in started.values()) - before
            await started["c"][0].stop()
            with_one_dead = await tier.pin("ns", ids, None, unpin=True)
            await tier.close()
            return pinned, requests, with_one_dead, tier.stats()

    pinned, requests, with_one_dead, stats = run(scenario())
    assert pinned == [True] * 30 + [False] and requests == 2  # one batched call per home node
    assert with_one_dead == [True] * 30 + [False] and stats["num_peer_failures"] >= 1
