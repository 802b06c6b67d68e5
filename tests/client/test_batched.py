"""The batched ops (reserve_many, commit_many, get_many, release_many) against a real daemon:
per-item results and errors, leases accounted, bad frames refused by name, nothing lost."""

import signal
import socket

import numpy as np
import pytest
import xxhash

from kvstore import StateDescriptor
from kvstore import messages as m
from kvstore.fields import unpack_uints
from kvstore.errors import Conflict, InvalidArgument, LimitExceeded, NotFound, PermissionDenied
from kvstore.identity import ObjectId
from kvstore.protocol import MAX_BATCH, FrameCodec, Reply, Request
from kvs_testing import payload

MiB = 1 << 20


def ids(n, seed=0):
    rng = np.random.default_rng(seed)
    return [ObjectId(rng.bytes(32)) for _ in range(n)]


@pytest.mark.parametrize("shared", [False, True], ids=["daemon leases", "shared index copies"])
def test_get_many_leases_every_hit_bit_exact_and_release_many_ends_them(daemon, shared):
    keys = ids(1300, 1)  # more than one batch (1,024)
    with daemon.client(shared_index=shared) as c:
        assert all(r.error is None for r in c.put_many([(k, payload(512 + i, i)) for i, k in enumerate(keys)
                                                        if i % 5]))
        leases = c.get_many(keys)
        assert [lease is None for lease in leases] == [i % 5 == 0 for i in range(len(keys))]
        for i, lease in enumerate(leases):
            if lease is not None:
                assert lease.size == 512 + i and lease.verify()
                assert np.array_equal(lease.numpy(), payload(512 + i, i)), i
        # from the shared index, small hits are private copies: the daemon holds no lease for them
        held = [lease.lease_id != 0 for lease in leases if lease is not None]
        assert held == [not shared] * len(held)
        assert c.stats()["leases"] == sum(held)
        leases[1].release()  # released already: release_many skips it
        c.release_many(leases)
        assert c.stats()["leases"] == 0
        assert all(lease is None or lease.closed for lease in leases)
        c.release_many(leases)  # again: nothing is sent twice
        assert c.stats()["leases"] == 0
        c.check_integrity()


def test_one_items_failure_stays_in_its_place_and_the_rest_are_stored(daemon):
    keys = ids(5, 2)
    with daemon.client() as c:
        c.put(keys[2], payload(100, 0))
        results = c.put_many([(k, payload(200, i)) for i, k in enumerate(keys)])
        assert isinstance(results[2].error, Conflict) and "100" in str(results[2].error)
        assert [r.error is None for r in results] == [True, True, False, True, True]
        for i in (0, 1, 3, 4):
            with c.get(keys[i]) as lease:
                assert np.array_equal(lease.numpy(), payload(200, i))
        with c.get(keys[2]) as lease:  # the stored object is untouched
            assert np.array_equal(lease.numpy(), payload(100, 0))
        assert c.put_many([(k, payload(200, i)) for i, k in enumerate(keys[:2])])[0].existed


def test_a_commit_many_with_a_lease_not_held_fails_that_item_only(daemon):
    keys = ids(2, 3)
    desc = StateDescriptor("default", "opaque", "0")
    with daemon.client() as c:
        c._run(c.core.op_open("default"))
        reserved = c._run(c.core.op_simple(m.ReserveMany.of("default", keys, [64, 64], desc)))
        leases = unpack_uints(reserved.leases)
        offsets = unpack_uints(reserved.offsets)
        arena = c.core.arenas["default"]
        arena[offsets[0]:offsets[0] + 64] = 9
        good = xxhash.xxh3_128_digest(arena[offsets[0]:offsets[0] + 64])
        done = c._run(c.core.op_simple(m.CommitMany.of([leases[0], 999_999], [good, bytes(16)])))
        assert list(done.codes) == [0, 2] and done.errors[0][0] == 1
        assert done.errors[0][1]["code"] == "not_found"
        with c.get(keys[0]) as lease:
            assert bytes(lease.buffer) == b"\x09" * 64
        assert c.get(keys[1]) is None
        assert c.stats()["leases"] == 1  # keys[1]'s write lease: still the client's to commit or abort
        c._run(c.core.op_simple(m.Abort(leases[1])))
        assert c.stats()["leases"] == 0
        c.check_integrity()


def _raw(daemon, requests):
    """Send raw requests on a fresh connection; their replies, in order."""
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(daemon.socket)
    sock.settimeout(20)
    codec = FrameCodec()
    sock.sendall(b"".join(codec.send_request(r) for r in requests))
    replies = []
    while len(replies) < len(requests):
        codec.receive_data(sock.recv(1 << 16))
        while isinstance(event := codec.next_event(), Reply):
            replies.append(event)
    sock.close()
    return replies


@pytest.mark.parametrize("op, args, named", [
    ("reserve_many", {"ids": b"x" * 33, "sizes": bytes(8)}, "reserve_many.ids: must be"),
    ("reserve_many", {"ids": b"x" * 64, "sizes": (1).to_bytes(8, "little")}, "2 ids but 1 sizes"),
    ("reserve_many", {"ids": b"x" * 32, "sizes": bytes(8)}, "every size must be"),
    ("reserve_many", {"ids": b"x" * 32 * (MAX_BATCH + 1), "sizes": (1).to_bytes(8, "little") * (MAX_BATCH + 1)},
     f"1..{MAX_BATCH}"),
    ("reserve_many", {"ids": [b"x" * 32], "sizes": bytes(8)}, "msgpack bin"),
    ("commit_many", {"leases": bytes(16), "checksums": bytes(16)}, "2 leases but 1 checksums"),
    ("commit_many", {"leases": bytes(8), "checksums": bytes(15)}, "commit_many.checksums: must be"),
    ("get_many", {"ids": b""}, "get_many.ids: must be"),
    ("get_many", {"ids": b"x" * 32, "expect": "opaque"}, "get_many.expect"),
    ("release_many", {"leases": 5}, "release_many.leases: must be"),
])
def test_malformed_batches_are_refused_by_field_and_nothing_changes(daemon, op, args, named):
    desc = StateDescriptor("default", "opaque", "0").to_wire()
    key = ids(1, 4)[0]
    with daemon.client() as c:
        c.put(key, payload(4096, 4))
        if op == "reserve_many":
            args = {"namespace": "default", "descriptor": desc, **args}
        elif op == "get_many":
            args = {"namespace": "default", **args}
        opened, reply = _raw(daemon, [Request(1, "open", {"namespace": "default"}), Request(2, op, args)])
        assert opened.ok
        assert reply.error["code"] == "invalid_argument" and named in reply.error["message"], reply.error
        with c.get(key) as lease:
            assert np.array_equal(lease.numpy(), payload(4096, 4))
        assert c.stats()["leases"] == 0
        c.check_integrity()


def test_a_namespace_not_opened_is_refused_and_one_in_another_tenant_is_not_readable(daemon):
    key = ids(1, 5)[0]
    with daemon.client(namespace="alpha") as c:
        c.put(key, payload(64, 5))
    (reply,) = _raw(daemon, [Request(1, "get_many", {"namespace": "alpha", "ids": key.digest})])
    assert reply.error["code"] == "permission_denied" and "not open" in reply.error["message"]
    with daemon.client(namespace="beta") as c:
        assert c.get_many([key]) == [None]  # ids are per namespace
        with pytest.raises(PermissionDenied):
            c._run(c.core.op_simple(m.GetMany.of("alpha", [key])))


def test_release_many_ends_what_it_holds_and_names_what_it_did_not(daemon):
    keys = ids(3, 6)
    with daemon.client(shared_index=False) as c:  # daemon leases
        c.put_many([(k, payload(64, i)) for i, k in enumerate(keys)])
        leases = c.get_many(keys)
        held = [lease.lease_id for lease in leases]
        with pytest.raises(NotFound, match="1 of 4 leases were not held"):
            c._run(c.core.op_simple(m.ReleaseMany.of(held + [424242])))
        assert c.stats()["leases"] == 0


def test_get_many_past_the_lease_quota_raises_and_keeps_no_lease(daemon_factory):
    d = daemon_factory(config={"limits": {"max_leases_per_client": 3}})
    keys = ids(5, 7)
    with d.client(shared_index=False) as c:  # daemon leases
        c.put_many([(k, payload(64, i)) for i, k in enumerate(keys)])
        with pytest.raises(LimitExceeded, match="max_leases_per_client"):
            c.get_many(keys)
        assert c.stats()["leases"] == 0
        outs = [np.zeros(64, np.uint8) for _ in keys[:3]]
        assert c.get_many_into(list(zip(keys[:3], outs))) == [64] * 3
    with d.client() as c:  # copies from the shared index hold no daemon lease: the quota does not bind
        leases = c.get_many(keys)
        assert [lease.size for lease in leases] == [64] * 5 and c.stats()["leases"] == 0


def test_get_many_promotes_from_nvme_after_a_restart(daemon_factory):
    config = {"nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB"}}
    d = daemon_factory("16MiB", config=config)
    keys = ids(4, 8)
    with d.client() as c:
        c.put_many([(k, payload(MiB, i)) for i, k in enumerate(keys)])
    assert d.stop(signal.SIGTERM) == 0  # flushed to NVMe on shutdown
    d.start("16MiB")
    with d.client() as c:  # the namespace has no arena yet: get_many makes one for what NVMe holds
        leases = c.get_many(keys + ids(1, 9))
        assert leases[-1] is None
        for i, lease in enumerate(leases[:4]):
            assert np.array_equal(lease.numpy(), payload(MiB, i))
        c.release_many(leases)
        assert c.stats()["leases"] == 0
        c.check_integrity()


def test_an_empty_or_odd_item_in_put_many_is_named_and_the_rest_stored(daemon):
    keys = ids(3, 10)
    with daemon.client() as c:
        results = c.put_many([(keys[0], b""), (keys[1], payload(64, 1)), ("not-a-key", b"x")])
        assert isinstance(results[0].error, InvalidArgument) and "empty" in str(results[0].error)
        assert results[1].error is None
        assert isinstance(results[2].error, InvalidArgument) and results[2].object_id is None
        assert c.get_many([keys[0], keys[1]])[0] is None


def test_an_array_of_python_objects_is_invalid_argument_per_item(daemon):
    keys = ids(2, 20)
    objects = np.array([object(), object()])
    with daemon.client() as c:
        with pytest.raises(InvalidArgument, match="Python objects"):
            c.put(keys[0], objects)
        results = c.put_many([(keys[0], objects), (keys[1], payload(64, 1))])
        assert isinstance(results[0].error, InvalidArgument) and results[1].error is None
        c.put(keys[0], payload(64, 0))
        with pytest.raises(InvalidArgument, match="Python objects"):
            c.get_into(keys[0], np.empty(8, dtype=object))
        assert c.lookup([keys[0], keys[1]]).tiers == ("host", "host")


@pytest.mark.parametrize("driver", ["sync", "asyncio"])
def test_a_put_many_over_several_pipeline_steps_keeps_every_result_in_its_place(daemon_factory, driver):
    """put_many copies step k while the daemon reserves step k+1 and commits step k-1
    (client/batched.py: PIPE_BYTES): results, conflicts and bytes stay with their items."""
    import asyncio

    from kvstore.client import AsyncClient
    from kvstore.client.batched import PIPE_BYTES
    size = PIPE_BYTES // 128  # steps of 128 objects
    PIPE_ITEMS = 128
    n = 3 * PIPE_ITEMS + 7
    keys = ids(n, 7)
    conflicting = {5, PIPE_ITEMS + 3, 2 * PIPE_ITEMS + 9, n - 1}  # one in every step
    existing = {PIPE_ITEMS + 4, 3 * PIPE_ITEMS + 1}
    items = [(k, payload(size + i % 11, i)) for i, k in enumerate(keys)]
    daemon = daemon_factory("256MiB")  # the whole batch fits: no object is evicted meanwhile
    with daemon.client() as c:
        for i in conflicting:
            c.put(keys[i], payload(50, i))
        for i in existing:
            c.put(*items[i])
        if driver == "sync":
            results = c.put_many(items)
        else:
            async def put_all():
                ac = await AsyncClient.connect(daemon.socket)
                try:
                    return await ac.put_many(items)
                finally:
                    await ac.close()
            results = asyncio.run(put_all())
        assert [i for i, res in enumerate(results) if isinstance(res.error, Conflict)] == sorted(conflicting)
        assert [i for i, res in enumerate(results) if res.existed] == sorted(existing)
        assert all(res.error is None for i, res in enumerate(results) if i not in conflicting)
        outs = [np.empty(size + i % 11 if i not in conflicting else 50, np.uint8) for i in range(n)]
        assert c.get_many_into(list(zip(keys, outs))) == [len(o) for o in outs]
        for i, out in enumerate(outs):
            assert np.array_equal(out, payload(50, i) if i in conflicting else items[i][1]), i
        assert c.stats()["leases"] == 0
        c.check_integrity()


def _reserve_many(c, keys, sizes, desc=StateDescriptor("default", "opaque", "0")):
    c._run(c.core.op_open("default"))
    reserved = c._run(c.core.op_simple(m.ReserveMany.of("default", keys, sizes, desc)))
    return reserved, unpack_uints(reserved.leases), unpack_uints(reserved.offsets)


def test_a_reserve_many_served_in_plain_runs_answers_each_item_as_a_reserve_would(daemon_factory):
    """The daemon serves runs of plain items (new id, room now) without its per-item reserve;
    dedups, refusals and quota limits in between still land on exactly their own items."""
    d = daemon_factory(config={"limits": {"max_leases_per_client": 6}})
    keys = ids(9, 11)
    with d.client() as c:
        c.put(keys[1], payload(64, 1))  # stored: exists
        c.put(keys[3], payload(32, 3))  # stored with another size: Conflict
        sizes = [64] * 9
        reserved, leases, offsets = _reserve_many(c, keys, sizes)
        errors = dict(reserved.errors)
        assert list(reserved.exists) == [0, 1, 0, 0, 0, 0, 0, 0, 0]
        assert errors.keys() == {3, 8}  # 7 new ids, a quota of 6 leases: the seventh is refused
        assert errors[3]["code"] == "conflict" and errors[8]["code"] == "limit_exceeded"
        granted = [i for i in range(9) if leases[i]]
        assert granted == [0, 2, 4, 5, 6, 7] and len(set(offsets[i] for i in granted)) == 6
        assert c.stats()["leases"] == 6
        for i in granted:
            c._run(c.core.op_simple(m.Abort(leases[i])))
        c.check_integrity()


def test_a_get_many_served_in_plain_runs_answers_each_item_as_a_get_would(daemon_factory):
    """The daemon serves runs of plain items (resident, live, the expected descriptor, a lease
    quota left) without its per-item get; misses, another descriptor and the quota in between
    land on exactly their own items, and the counters are a get's each."""
    d = daemon_factory(config={"limits": {"max_leases_per_client": 5}})
    desc, other = StateDescriptor("default", "m", "r"), StateDescriptor("default", "m", "r2")
    keys = ids(9, 14)
    with d.client() as c:
        for i, k in enumerate(keys):
            if i == 2:
                continue  # never stored: a miss
            c.put(k, payload(64 + i, i), desc=other if i == 4 else desc)  # item 4: another descriptor
        before = c.stats()["namespaces"]["default"]
        got = c._run(c.core.op_simple(m.GetMany.of("default", keys, desc)))
        leases, offsets, sizes = (unpack_uints(x) for x in (got.leases, got.offsets, got.sizes))
        errors = dict(got.errors)
        hit = [i for i in range(9) if got.hits[i]]
        assert hit == [0, 1, 3, 5, 6]  # 2 missing, 4 stored under `other`; the quota of 5 ends at 6
        assert errors.keys() == {7, 8} and {e["code"] for e in errors.values()} == {"limit_exceeded"}
        arena = c.core.arenas["default"]
        for i in hit:
            assert sizes[i] == 64 + i and np.array_equal(arena[offsets[i]:offsets[i] + sizes[i]], payload(64 + i, i))
            assert got.checksums[16 * i:16 * i + 16] == xxhash.xxh3_128_digest(payload(64 + i, i))
        assert len(got.descriptors) == 1 and len(set(leases[i] for i in hit)) == 5
        after = c.stats()["namespaces"]["default"]
        assert after["num_gets"] - before["num_gets"] == 9  # the two refused by the quota were asked too
        assert after["num_hits"] - before["num_hits"] == 5 and after["num_misses"] - before["num_misses"] == 2
        assert c.stats()["leases"] == 5
        c._run(c.core.op_simple(m.ReleaseMany.of([leases[i] for i in hit])))
        assert c.stats()["leases"] == 0
        c.check_integrity()


def test_a_reserve_many_that_must_evict_midway_gets_room_and_keeps_order(daemon_factory):
    d = daemon_factory("4MiB")
    with d.client() as c:
        old = ids(48, 12)
        assert all(r.error is None for r in c.put_many([(k, payload(64 << 10, i)) for i, k in enumerate(old)]))
        new = ids(16, 13)
        results = c.put_many([(k, payload(64 << 10, 100 + i)) for i, k in enumerate(new)])
        assert all(r.error is None and not r.existed for r in results)
        for i, k in enumerate(new):
            with c.get(k) as lease:
                assert np.array_equal(lease.numpy(), payload(64 << 10, 100 + i))
        c.check_integrity()


def test_a_commit_many_with_a_bad_checksum_midway_fails_that_item_only(daemon_factory):
    d = daemon_factory(config={"verify_puts": True})
    keys = ids(4, 14)
    with d.client() as c:
        _, leases, offsets = _reserve_many(c, keys, [64] * 4)
        import xxhash
        arena = c.core.arenas["default"]
        sums = []
        for i, offset in enumerate(offsets):
            arena[offset:offset + 64] = i + 1
            sums.append(xxhash.xxh3_128_digest(arena[offset:offset + 64]))
        sums[2] = bytes(16)
        done = c._run(c.core.op_simple(m.CommitMany.of(leases, sums)))
        assert list(done.codes) == [0, 0, 2, 0] and done.errors[0][0] == 2
        assert done.errors[0][1]["code"] == "checksum"
        assert c.get(keys[2]) is None
        for i in (0, 1, 3):
            with c.get(keys[i]) as lease:
                assert bytes(lease.buffer) == bytes([i + 1]) * 64
        assert c.stats()["leases"] == 0
        c.check_integrity()


def test_a_commit_many_of_an_id_committed_meanwhile_answers_existed_for_it(daemon):
    keys = ids(3, 15)
    with daemon.client() as c, daemon.client() as other:
        _, leases, offsets = _reserve_many(c, keys, [64] * 3)
        import xxhash
        arena = c.core.arenas["default"]
        sums = []
        for i, offset in enumerate(offsets):
            arena[offset:offset + 64] = 7
            sums.append(xxhash.xxh3_128_digest(arena[offset:offset + 64]))
        other.put(keys[1], np.full(64, 7, np.uint8))
        done = c._run(c.core.op_simple(m.CommitMany.of(leases, sums)))
        assert list(done.codes) == [0, 1, 0]
        assert c.stats()["leases"] == 0
        c.check_integrity()


def test_calls_that_take_many_keys_take_one_key_alone(daemon):
    """delete(oid) iterated the id's bytes and refused an int; one key, in each form a key
    takes (ObjectId, 32 bytes, 64 hex characters), is one key."""
    a, b, c_ = ids(3, 7)
    with daemon.client() as c:
        for k in (a, b, c_):
            c.put(k, payload(4096, 1))
        assert c.lookup(a).hits == 1
        assert c.pin(bytes(b)) == 1 and c.unpin(bytes(b)) == 1
        assert c.prefetch(c_.hex) == 1
        (lease,) = c.get_many(a)
        assert np.array_equal(lease.numpy(), payload(4096, 1))
        lease.release()
        assert c.delete(a) == 1 and c.delete(bytes(b)) == 1 and c.delete(c_.hex) == 1
        assert c.lookup([a, b, c_]).hits == 0
        assert c.delete(a) == 0
