"""A commit_many's plain items are committed as one batch (TierManager._commit_batch,
HostTier.publish_many): each item must come out exactly as its own commit would, whatever the
batch mixes in (an id indexed meanwhile, one named twice, a lease not the caller's, a TTL),
and the index, the policy, the shared index and the ledger must agree afterwards."""

from __future__ import annotations

import asyncio

import pytest
import xxhash

from kvstore import messages as m
from kvstore import replies as r
from kvstore.config import HostTierConfig, LimitsConfig
from kvstore.fields import unpack_uints
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.server.later import resolve
from kvstore.server.local import batches
from kvstore.server.tiering.chain import compose
from kvstore.server.tiering.manager import MIN_BATCH, TierManager

DESC = StateDescriptor("t", "m", "r")
SIZE = 3000  # a slab slot's size class


def oid(i: int) -> ObjectId:
    return ObjectId(i.to_bytes(32, "little"))


def manager(verify_puts: bool = False, limits: LimitsConfig = LimitsConfig(), arena_bytes: int = 16 << 20) -> TierManager:
    chain = compose(HostTierConfig(arena_bytes=arena_bytes, prefault=False, huge_pages="off", namespaces=()))
    mgr = TierManager(chain, limits, verify_puts=verify_puts)
    asyncio.run(mgr.host.open_namespace("t"))
    return mgr


def run(maybe):
    return asyncio.run(resolve(maybe))


def reserved(mgr: TierManager, owner: int, ids: list, hints: Hints = Hints()) -> list[tuple[int, bytes]]:
    """(write lease, checksum) of each id, its bytes written under the lease."""
    reply = run(batches.reserve_many(mgr, owner, m.ReserveMany.of("t", ids, [SIZE] * len(ids), DESC, hints)))
    assert not reply.errors
    items = []
    for key, lease in zip(ids, unpack_uints(reply.leases)):
        if lease:
            data = (bytes(key) * (SIZE // 32 + 1))[:SIZE]
            mgr.reserved_view(lease)[:] = data
            items.append((lease, xxhash.xxh3_128_digest(data)))
    return items


def commit_many(mgr: TierManager, owner: int, items: list) -> r.CommitManyReply:
    leases = [lease for lease, _ in items]
    return run(batches.commit_many(mgr, owner, m.CommitMany.of(leases, [checksum for _, checksum in items])))


def counting_batches(mgr: TierManager) -> list[int]:
    """The sizes of the batches HostTier.publish_many is handed (the real method still runs)."""
    sizes, real = [], mgr.host.publish_many

    def publish_many(ns, oids, *args):
        sizes.append(len(oids))
        return real(ns, oids, *args)
    mgr.host.publish_many = publish_many
    return sizes


def test_a_plain_batch_is_committed_at_once_and_reads_back():
    mgr = manager(verify_puts=True)
    batches_seen = counting_batches(mgr)
    ids = [oid(i) for i in range(300)]
    reply = commit_many(mgr, 1, reserved(mgr, 1, ids))
    assert set(reply.codes) == {r.STORED} and not reply.errors and batches_seen == [300]
    ns = mgr.host.namespaces["t"]
    for key in ids:
        with mgr.host.held_view(ns.objects[key]) as view:
            assert bytes(view) == (bytes(key) * (SIZE // 32 + 1))[:SIZE]
    assert len(mgr.ledger) == 0 and ns.counters.num_puts == 300 and len(ns.policy) == 300
    assert ns.shared.num_published == 300
    mgr.check_integrity()
    mgr.close()


def _mixed(mgr: TierManager) -> list[tuple[int, bytes]]:
    """A batch of 100 commits with, among plain ones: an id committed meanwhile (item 20), an
    id named twice (items 10 and 40), a lease of another client (item 50), a wrong checksum
    (item 60), one with a TTL (item 70), and lone plain ones between odd ones (76, 78)."""
    ids = [oid(i) for i in range(100)]
    ids[40] = ids[10]
    items = reserved(mgr, 1, ids[:70]) + reserved(mgr, 1, ids[70:71], Hints(ttl_s=60.0)) + reserved(mgr, 1, ids[71:])
    items[50] = reserved(mgr, 2, [oid(1000)])[0]
    items[60] = (items[60][0], bytes(16))
    commit_many(mgr, 3, reserved(mgr, 3, [ids[20]]))  # another client's copy, committed first
    for k in (75, 77, 79):  # leases never granted, with a lone plain item (76, 78) between them
        items[k] = (items[k][0] + 10**6, items[k][1])  # leases never granted
    return items


def test_a_mixed_batch_commits_each_item_as_its_own_commit_would():
    results = []
    for batched in (True, False):
        mgr = manager(verify_puts=True)
        items = _mixed(mgr)
        if batched:
            batches_seen = counting_batches(mgr)
            reply = commit_many(mgr, 1, items)
            assert batches_seen and all(size >= MIN_BATCH for size in batches_seen) and sum(batches_seen) < 100
            codes, errors = list(reply.codes), {i: e["code"] for i, e in reply.errors}
        else:  # the same items, each its own commit
            codes, errors = [], {}
            for i, (lease, checksum) in enumerate(items):
                try:
                    got = run(mgr.commit(1, lease, checksum))
                    codes.append(r.STORED if got == r.IN_MEMORY else r.EXISTED if got == r.CommitReply(True) else r.OTHER)
                except Exception as exc:
                    codes.append(r.FAILED)
                    errors[i] = getattr(exc, "code", "internal")
        ns = mgr.host.namespaces["t"]
        held = {bytes(key): (e.size, e.checksum, e.expires_at != float("inf")) for key, e in ns.objects.items()}
        results.append((codes, errors, held, len(mgr.ledger), ns.shared.num_published))
        mgr.check_integrity()
        mgr.close()
    assert results[0] == results[1]
    codes, failed = results[0][0], results[0][1]
    assert sorted(failed) == [50, 60, 75, 77, 79] and "internal" not in failed.values() and codes[40] == codes[20] == r.EXISTED and codes.count(r.STORED) == 93


@pytest.mark.parametrize("max_leases, refusal", [(250, "limit_exceeded"), (10_000, "capacity")])
def test_a_mixed_reserve_many_reserves_each_item_as_its_own_reserve_would(max_leases, refusal):
    """reserve_many's alike runs go as one batch (TierManager._reserve_batch): an id committed
    already (a dedup), one named twice, another size, a quota reached mid-batch and an arena
    that fills up (victims made room for) must come out as single reserves give them."""
    ids = [oid(i) for i in range(400)]
    ids[130] = ids[120]
    sizes = [SIZE] * 400
    sizes[200:230] = [700] * 30
    results = []
    for batched in (True, False):
        mgr = manager(limits=LimitsConfig(max_leases_per_client=max_leases), arena_bytes=1 << 20)
        commit_many(mgr, 1, reserved(mgr, 1, [oid(i) for i in range(1000, 1200)]))  # victims to be
        commit_many(mgr, 1, reserved(mgr, 1, ids[50:51]))  # committed already: a dedup
        if batched:
            arena, handed = mgr.host.namespaces["t"].arena, []
            real = arena.alloc_many
            arena.alloc_many = lambda size, count: handed.append(count) or real(size, count)
            reply = run(batches.reserve_many(mgr, 1, m.ReserveMany.of("t", ids, sizes, DESC)))
            assert handed and min(handed) >= MIN_BATCH
            got = (unpack_uints(reply.leases), unpack_uints(reply.offsets), list(reply.exists),
                   {i: e["code"] for i, e in reply.errors})
        else:
            got = ([], [], [], {})
            for i, (key, size) in enumerate(zip(ids, sizes)):
                try:
                    one = run(mgr.reserve(1, m.Reserve("t", key, size, DESC, Hints())))
                    got[0].append(one.lease or 0)
                    got[1].append(one.offset or 0)
                    got[2].append(int(one.exists))
                except Exception as exc:
                    got[0].append(0), got[1].append(0), got[2].append(0)
                    got[3][i] = getattr(exc, "code", "internal")
        ns = mgr.host.namespaces["t"]
        results.append((got, len(mgr.ledger), ns.counters.num_evictions, ns.counters.num_dedup_puts))
        mgr.check_integrity()
        mgr.close()
    assert results[0] == results[1]
    got = results[0][0]
    assert got[2][50] == 1 and got[0][130] and results[0][2] > 0 and set(got[3].values()) == {refusal}
