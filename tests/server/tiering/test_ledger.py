"""The Ledger (server/tiering/ledger.py): every way a lease ends undoes exactly what its
grant did, and the books (leases, quotas, pending puts, readers, extents) stay in balance.

The real host tier and arena; the Ledger's own surface, as the tier manager uses it.
"""

import asyncio

import pytest

from kvstore.config import HostTierConfig, LimitsConfig
from kvstore.errors import LimitExceeded, NotFound
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.server.tiering.host import HostTier
from kvstore.server.tiering.ledger import Ledger
from kvstore.server.tiering.objects import PendingPut

DESC = StateDescriptor("t", "m", "r")


def setup(now, **limits):
    host = HostTier(HostTierConfig(arena_bytes=1 << 20, prefault=False), clock=lambda: now[0])
    ns = asyncio.run(host.open_namespace("t"))
    return host, ns, Ledger(host, LimitsConfig(**limits))


def reserve(ledger, ns, owner, i: int, size: int = 4096) -> tuple[int, PendingPut]:
    put = PendingPut("t", ObjectId(bytes([i]) * 32), size, DESC, Hints(), ns.arena.alloc(size))
    return ledger.grant_write(owner, put), put


def committed(host, ns, ledger, owner, i: int):
    lease, put = reserve(ledger, ns, owner, i)
    taken = ledger.take_put(owner, lease)
    return host.publish(ns, taken.object_id, taken.extent, taken.size, b"\1" * 16, DESC, Hints())


def test_each_end_of_a_lease_undoes_its_grant():
    now = [0.0]
    host, ns, ledger = setup(now, lease_ttl_s=10.0)
    entry = committed(host, ns, ledger, "a", 1)
    used = ns.arena.allocator.used_bytes
    read = ledger.grant_read("a", entry)
    assert entry.readers == 1 and ledger.count("a") == 1
    ledger.check_integrity()
    ledger.end("a", read, "read")
    assert entry.readers == 0 and ledger.count("a") == 0
    write, _ = reserve(ledger, ns, "a", 2)
    assert ledger.room("a")[1] == LimitsConfig().max_inflight_bytes_per_client - 4096
    ledger.end("a", write, "write")  # an abort frees the reserved extent and settles the quota
    assert ns.arena.allocator.used_bytes == used and ledger.room("a")[1] == LimitsConfig().max_inflight_bytes_per_client
    released = []
    ledger.grant_read("b", entry, on_gpu=entry.extent, release_gpu=lambda: released.append(1))
    reserve(ledger, ns, "b", 3)
    assert ledger.drop_owner("b") == 2 and released == [1] and ns.arena.allocator.used_bytes == used
    ledger.grant_read("c", entry)
    now[0] = 11.0
    ledger.expire()
    assert entry.readers == 0 and len(ledger) == 0
    ledger.check_integrity()


def test_a_lease_ends_only_for_its_owner_and_mode():
    now = [0.0]
    host, ns, ledger = setup(now)
    entry = committed(host, ns, ledger, "a", 1)
    read = ledger.grant_read("a", entry)
    for owner, mode in (("b", "read"), ("a", "write")):
        with pytest.raises(NotFound, match=f"no {mode} lease {read}"):
            ledger.end(owner, read, mode)
    assert ledger.own_put("a", read) is None  # a read lease holds no put
    ledger.end("a", read, "read")
    with pytest.raises(NotFound):
        ledger.end("a", read, "read")
    ledger.check_integrity()


def test_quotas_refuse_past_the_limits():
    now = [0.0]
    host, ns, ledger = setup(now, max_leases_per_client=2, max_inflight_bytes_per_client=1 << 20)
    reserve(ledger, ns, "a", 1, size=1 << 19)
    ledger.check_reserve("a", 1 << 19)
    with pytest.raises(LimitExceeded, match="max_inflight_bytes_per_client"):
        ledger.check_reserve("a", (1 << 19) + 1)
    reserve(ledger, ns, "a", 2)
    with pytest.raises(LimitExceeded, match="max_leases_per_client"):
        ledger.check_lease("a")
    ledger.check_lease("b")
    ledger.check_integrity()


def test_check_integrity_finds_a_reader_the_books_do_not_hold():
    now = [0.0]
    host, ns, ledger = setup(now)
    entry = committed(host, ns, ledger, "a", 1)
    ledger.grant_read("a", entry)
    entry.readers += 1  # a reader no lease or hold accounts for
    with pytest.raises(RuntimeError, match="readers counted on entries"):
        ledger.check_integrity()
