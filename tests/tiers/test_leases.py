import math
import random

import pytest

from kvstore.errors import InvalidArgument, NotFound
from kvstore.tiers.allocator import Extent
from kvstore.tiers.leases import Lease, LeaseTable

E1, E2, E3 = Extent(0, 4096), Extent(4096, 4096), Extent(8192, 8192)


def test_grant_then_release():
    table = LeaseTable()
    lease = table.grant("conn-1", "obj-a", E1, "read", ttl_s=5.0, now=100.0)
    assert lease == Lease(lease.lease_id, "conn-1", "obj-a", E1, "read", 105.0)
    assert len(table) == 1 and table.get(lease.lease_id) == lease and lease.lease_id in table
    assert table.release(lease.lease_id) == lease
    assert len(table) == 0 and table.get(lease.lease_id) is None
    table.check_integrity()


def test_lease_ids_increase_and_are_never_reused():
    table = LeaseTable()
    ids = []
    for i in range(50):
        lease = table.grant(f"conn-{i % 3}", None, E1, "write", 1.0, now=0.0)
        ids.append(lease.lease_id)
        if i % 2:
            table.release(lease.lease_id)
    table.release_owner("conn-0")
    ids.append(table.grant("conn-9", None, E2, "write", 1.0, now=0.0).lease_id)
    assert ids == sorted(set(ids))


def test_unknown_or_double_release_raises_not_found():
    table = LeaseTable()
    with pytest.raises(NotFound):
        table.release(1)
    lease = table.grant("conn-1", "obj-a", E1, "read", 5.0, 0.0)
    table.release(lease.lease_id)
    with pytest.raises(NotFound, match=str(lease.lease_id)):
        table.release(lease.lease_id)
    assert len(table) == 0


def test_lease_released_when_client_dies():
    table = LeaseTable()
    a1 = table.grant("dead", "obj-a", E1, "read", 5.0, 0.0)
    b1 = table.grant("alive", "obj-a", E1, "read", 5.0, 0.0)
    a2 = table.grant("dead", None, E2, "write", 5.0, 0.0)
    a3 = table.grant("dead", "obj-c", E3, "read", 5.0, 0.0)
    b2 = table.grant("alive", "obj-c", E3, "write", 5.0, 0.0)
    assert (table.count("dead"), table.count("alive")) == (3, 2)
    assert table.release_owner("dead") == [a1, a2, a3]
    assert table.count("dead") == 0 and table.count("alive") == 2
    assert table.get(b1.lease_id) == b1 and table.get(b2.lease_id) == b2
    assert (table.readers("obj-a"), table.readers("obj-c")) == (1, 0)
    assert table.release_owner("dead") == [] and table.release_owner("never-seen") == []
    assert table.expired(now=10.0) == [b1, b2]  # the dead owner's leases do not come back
    table.check_integrity()


def test_expiry_returns_due_leases_soonest_first():
    table = LeaseTable()
    late = table.grant("c", "k3", E3, "read", 3.0, now=0.0)
    early = table.grant("c", "k1", E1, "read", 1.0, now=0.0)
    middle = table.grant("c", None, E2, "write", 2.0, now=0.0)
    released = table.grant("c", "k4", E1, "read", 1.5, now=0.0)
    table.release(released.lease_id)
    assert table.expired(now=0.5) == []
    assert table.expired(now=2.0) == [early, middle]  # expires_at <= now is expired
    assert table.expired(now=2.0) == []
    assert len(table) == 1 and table.get(late.lease_id) == late
    assert table.expired(now=math.inf) == [late] and len(table) == 0
    table.check_integrity()


def test_readers_counts_only_live_read_leases_on_the_key():
    table = LeaseTable()
    r1 = table.grant("c1", "obj", E1, "read", 1.0, 0.0)
    table.grant("c2", "obj", E1, "read", 2.0, 0.0)
    table.grant("c1", "obj", E1, "write", 5.0, 0.0)
    table.grant("c1", "other", E2, "read", 5.0, 0.0)
    assert table.readers("obj") == 2 and table.readers("other") == 1 and table.readers("x") == 0
    table.release(r1.lease_id)
    assert table.readers("obj") == 1
    table.expired(now=2.0)
    assert table.readers("obj") == 0 and table.readers("other") == 1
    table.check_integrity()


@pytest.mark.parametrize(
    "owner, key, mode, ttl_s",
    [
        ("c", "k", "append", 1.0),
        ("c", None, "read", 1.0),
        ("c", "k", "read", 0.0),
        ("c", "k", "read", -1.0),
        ("c", "k", "read", math.inf),
        ("c", "k", "read", math.nan),
        (["unhashable"], "k", "read", 1.0),
        ("c", ["unhashable"], "write", 1.0),
    ],
)
def test_bad_grants_rejected_without_change(owner, key, mode, ttl_s):
    table = LeaseTable()
    with pytest.raises(InvalidArgument):
        table.grant(owner, key, E1, mode, ttl_s, now=0.0)
    assert len(table) == 0
    table.check_integrity()
    assert table.grant("c", "k", E1, "read", 1.0, 0.0).lease_id == 1


def test_released_leases_do_not_grow_the_expiry_heap():
    table = LeaseTable()
    keep = table.grant("c", "k", E1, "read", 1e9, 0.0)
    for _ in range(10_000):
        table.release(table.grant("c", "k", E1, "read", 1e9, 0.0).lease_id)
    assert len(table._expiry) <= 2 * len(table) + 65
    assert table.expired(now=2e9) == [keep]


def test_random_ops_keep_indexes_consistent():
    rng = random.Random(3)
    table, live, now = LeaseTable(), {}, 0.0
    for step in range(5000):
        now += rng.random()
        op = rng.random()
        if op < 0.5:
            owner, mode = rng.randrange(5), rng.choice(["read", "write"])
            key = rng.randrange(8) if mode == "read" or rng.random() < 0.5 else None
            lease = table.grant(owner, key, E1, mode, rng.uniform(0.1, 20.0), now)
            live[lease.lease_id] = lease
        elif op < 0.75 and live:
            lease_id = rng.choice(list(live))
            assert table.release(lease_id) == live.pop(lease_id)
        elif op < 0.8:
            owner = rng.randrange(5)
            ended = table.release_owner(owner)
            assert ended == [l for l in live.values() if l.owner == owner]
            for lease in ended:
                del live[lease.lease_id]
        else:
            ended = table.expired(now)
            due = sorted((l for l in live.values() if l.expires_at <= now), key=lambda l: l.expires_at)
            assert sorted(l.lease_id for l in ended) == sorted(l.lease_id for l in due)
            for lease in ended:
                del live[lease.lease_id]
        if step % 50 == 0:
            table.check_integrity()
            assert len(table) == len(live)
            for key in range(8):
                n = sum(1 for l in live.values() if l.mode == "read" and l.key == key)
                assert table.readers(key) == n
            for owner in range(5):
                assert table.count(owner) == sum(1 for l in live.values() if l.owner == owner)


def test_check_integrity_catches_a_stale_reader_count():
    table = LeaseTable()
    table.grant("c", "k", E1, "read", 1.0, 0.0)
    table._readers["k"] = 2
    with pytest.raises(RuntimeError, match="reader"):
        table.check_integrity()


def test_a_batch_of_write_leases_is_as_many_grants():
    one, many = LeaseTable(), LeaseTable()
    extents = [Extent(i * 4096, 4096) for i in range(50)]
    singles = [one.grant("c", None, e, "write", 5.0, 100.0).lease_id for e in extents]
    assert many.grant_writes("c", extents, 5.0, 100.0) == singles
    assert [many.get(i) for i in singles] == [one.get(i) for i in singles] and many.count("c") == 50
    for table in (one, many):
        table.check_integrity()
    assert [lease.lease_id for lease in many.expired(105.0)] == singles and len(many) == 0
    with pytest.raises(InvalidArgument):
        many.grant_writes("c", extents, math.inf, 100.0)
    assert many.grant_writes("c", [], 5.0, 100.0) == [] and len(many) == 0
    many.check_integrity()
