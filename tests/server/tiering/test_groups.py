"""Store groups in a real daemon: all-or-nothing commits, complete-or-not lookups, whole reads,
on the host tier, on NVMe across restarts and SIGKILLs (kvstore/groups.py)."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvstore import Hints, StateDescriptor
from kvstore import messages as m
from kvstore import replies as r
from kvstore.errors import ChecksumError, InvalidArgument, NotFound
from kvstore.groups import Member, group_descriptor, group_id, manifest_bytes, manifest_size
from kvstore.identity import chunk_keys
from kvs_testing import payload

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, "..", "admin"))  # test_admin_support
KV = StateDescriptor("default", "hybrid", "r1", kind="kv", dtype="bf16")
STATE = StateDescriptor("default", "hybrid", "r1", kind="recurrent", dtype="fp32")


def nvme(**overrides):
    return {"nvme": {"enabled": True, "capacity_bytes": "256MiB", "file_bytes": "64MiB", **overrides}}


def chunk_group(tokens, chunk: int, sizes=(40_000, 9_000)):
    """The members of chunk `chunk`: its attention KV and the state at its end, with bytes."""
    kv, state = chunk_keys(tokens, KV)[chunk], chunk_keys(tokens, STATE)[chunk]
    return [(kv, payload(sizes[0], 2 * chunk)), (state, payload(sizes[1], 2 * chunk + 1))]


def same_bytes(group_lease, items) -> bool:
    return all(np.array_equal(lease.numpy(), data) for lease, (_, data) in zip(group_lease, items))


def test_a_group_round_trips_and_is_found_only_whole(daemon):
    tokens = list(range(1024))
    groups = [chunk_group(tokens, c) for c in range(4)]
    with daemon.client() as c:
        for items in groups[:3]:
            result = c.put_group(items)
            assert not result.existed and result.group == group_id([k.object_id for k, _ in items])
        assert c.put_group(groups[0]).existed  # nothing new: every member and the manifest held
        found = c.lookup_groups([[k for k, _ in items] for items in groups])
        assert found.complete == (True, True, True, False) and found.leading == 3
        assert found.tiers == ("host", "host", "host", None)
        with c.get_group([k for k, _ in groups[1]]) as got:
            assert len(got) == 2 and same_bytes(got, groups[1])
        assert c.get_group([k for k, _ in groups[3]]) is None
        # A member alone is an ordinary object; the group of just that member was never committed.
        assert c.lookup([groups[0][0][0]]).hits == 1
        assert c.lookup_groups([[groups[0][0][0]]]).complete == (False,)
        # Another order of the same members is another group.
        assert c.lookup_groups([[k for k, _ in reversed(groups[0])]]).complete == (False,)
        stats = c.stats()["namespaces"]["default"]
        assert stats["num_group_puts"] == 3 and stats["objects"] == 9
        assert c.stats()["leases"] == 0
        c.check_integrity()


def test_a_member_that_leaves_takes_the_group_away(daemon):
    tokens = list(range(1024))
    deleted, expiring, kept = (chunk_group(tokens, c) for c in range(3))
    with daemon.client() as c:
        c.put_group(deleted)
        c.put_group(expiring, hints=Hints(ttl_s=0.5))
        c.put_group(kept)
        c.delete([deleted[1][0]])  # the state snapshot alone
        time.sleep(0.7)
        found = c.lookup_groups([[k for k, _ in g] for g in (deleted, expiring, kept)])
        assert found.complete == (False, False, True)
        assert c.get_group([k for k, _ in deleted]) is None and c.get_group([k for k, _ in expiring]) is None
        assert c.lookup([deleted[0][0]]).hits == 1  # the KV member stays an object of its own
        assert c.stats()["leases"] == 0
        # Put again, the missing member joins the stored manifest and the group is whole again.
        assert not c.put_group(deleted).existed
        assert c.lookup_groups([[k for k, _ in deleted]]).complete == (True,)
        c.check_integrity()


def test_eviction_never_leaves_a_group_found_without_a_member(daemon_factory):
    d = daemon_factory("2MiB")
    tokens = list(range(256 * 40))
    groups = [chunk_group(tokens, ch, sizes=(60_000, 20_000)) for ch in range(40)]
    with d.client() as c:
        for items in groups:  # ~3.2 MB through a 2 MiB arena: early members are evicted
            c.put_group(items)
        found = c.lookup_groups([[k for k, _ in g] for g in groups])
        members = c.lookup([k for g in groups for k, _ in g]).tiers
        assert 0 < sum(found.complete) < 40
        for g, complete in enumerate(found.complete):
            assert complete == (members[2 * g] is not None and members[2 * g + 1] is not None), g
            got = c.get_group([k for k, _ in groups[g]])
            assert (got is not None) == complete
            if got is not None:
                with got:
                    assert same_bytes(got, groups[g])
        c.check_integrity()


def _reserve(c, oid, size, desc):
    return c._run(c.core.op_simple(m.Reserve(desc.namespace, oid, size, desc)))


def _write(c, reserved, data) -> None:
    c.core.arenas["default"][reserved.offset:reserved.offset + len(data)] = np.frombuffer(bytes(data), np.uint8)


def _raw_group(c, items, wrong=None, listing=None):
    """Reserve and write a group by hand; `wrong`: (member index, bytes written instead);
    `listing`: the manifest's bytes instead of its own. Returns (manifest lease, CommitGroup)."""
    import xxhash
    c._run(c.core.op_open("default"))
    ids = [k.object_id for k, _ in items]
    leases, sums = [], []
    for i, (k, data) in enumerate(items):
        got = _reserve(c, k.object_id, data.size, k.descriptor)
        _write(c, got, wrong[1] if wrong and wrong[0] == i else data)
        leases.append(got.lease)
        sums.append(xxhash.xxh3_128_digest(data))
    manifest = _reserve(c, group_id(ids), manifest_size(len(ids)), group_descriptor(KV))
    _write(c, manifest, listing or manifest_bytes(ids, sums))
    msg = m.CommitGroup(manifest.lease, b"".join(i.digest for i in ids), m.pack_uints(leases), b"".join(sums))
    return manifest.lease, msg


def _commit(c, msg):
    return c._run(c.core.op_simple(msg))


def _nothing_visible(c, items) -> bool:
    ids = [k for k, _ in items]
    return c.lookup(ids + [group_id([k.object_id for k in ids])]).tiers == (None,) * (len(ids) + 1)


def test_a_refused_member_stores_nothing_of_the_group(daemon_factory):
    d = daemon_factory(config={"verify_puts": True})
    tokens = list(range(1024))
    with d.client() as c:
        items = chunk_group(tokens, 0)
        _, msg = _raw_group(c, items, wrong=(1, payload(9_000, 99)))  # the state's bytes are not its checksum's
        with pytest.raises(ChecksumError, match="member 1"):
            _commit(c, msg)
        assert _nothing_visible(c, items) and c.stats()["leases"] == 0

        items = chunk_group(tokens, 1)
        lease, msg = _raw_group(c, items)
        with pytest.raises(InvalidArgument, match="group id"):  # members in another order than the manifest's id
            _commit(c, m.CommitGroup(lease, msg.members[32:] + msg.members[:32], msg.leases[8:] + msg.leases[:8],
                                     msg.checksums[16:] + msg.checksums[:16]))
        assert _nothing_visible(c, items) and c.stats()["leases"] == 0

        ids = [k.object_id for k, _ in items]
        lease, msg = _raw_group(c, items, listing=manifest_bytes(ids, [bytes(16)] * 2))
        with pytest.raises(InvalidArgument, match="list these members"):  # checksums not the members'
            _commit(c, msg)
        assert _nothing_visible(c, items) and c.stats()["leases"] == 0

        with d.client() as other:  # leases are their holder's: another client's commit frees nothing
            lease, msg = _raw_group(c, items)
            with pytest.raises(NotFound, match="lease"):
                _commit(other, msg)
            assert _commit(c, msg).exists is False
        found = c.lookup_groups([[k for k, _ in items]])
        assert found.complete == (True,)
        with c.get_group([k for k, _ in items]) as got:
            assert same_bytes(got, items)

        # A member said to be stored (lease 0) that is not: NotFound, the leased ones are freed.
        items = chunk_group(tokens, 2)
        lease, msg = _raw_group(c, items)
        leases = m.unpack_uints(msg.leases)
        with pytest.raises(NotFound, match="member 0"):
            _commit(c, m.CommitGroup(lease, msg.members, m.pack_uints([0, leases[1]]), msg.checksums))
        c._run(c.core.op_simple(m.Abort(leases[0])))
        assert _nothing_visible(c, items) and c.stats()["leases"] == 0
        c.check_integrity()


def test_groups_survive_a_restart_on_nvme_and_a_corrupt_member_is_no_hit(daemon_factory):
    d = daemon_factory("16MiB", config=nvme(write_policy="write_through"))
    tokens = list(range(1024))
    groups = [chunk_group(tokens, ch) for ch in range(3)]
    with d.client() as c:
        for items in groups:
            assert c.put_group(items).durability == "sync"
    d.stop(signal.SIGKILL)
    needle = groups[2][1][1][100:164].tobytes()  # in the state snapshot of the last group
    for root, _, files in os.walk(os.path.join(d.data_dir, "nvme")):
        for name in files:
            with open(os.path.join(root, name), "r+b") as f:
                blob = f.read()
                if (at := blob.find(needle)) >= 0:
                    f.seek(at)
                    f.write(bytes([blob[at] ^ 0xFF]))
    d.start("16MiB")
    with d.client() as c:
        keys = [[k for k, _ in g] for g in groups]
        found = c.lookup_groups(keys)
        assert found.complete[:2] == (True, True) and found.tiers[:2] == ("nvme", "nvme")
        for items in groups[:2]:
            with c.get_group([k for k, _ in items]) as got:
                assert same_bytes(got, items)
        assert c.get_group(keys[2]) is None  # the flipped byte fails the member's checksum: never read
        assert c.lookup_groups(keys).complete == (True, True, False)
        assert c.stats()["leases"] == 0
        c.check_integrity()


def test_sigkill_at_any_step_of_a_group_put_never_leaves_a_partial_group(daemon_factory, tmp_path):
    """A writer puts groups of eight 1 MiB members (write-through); the daemon is killed during
    another group's put each round; after each restart every group is whole (and bit-exact)
    or not found at all, and each one whose put was acknowledged is whole."""
    d = daemon_factory("64MiB", config=nvme(write_policy="write_through"))
    for round_ in range(6):
        acks = tmp_path / f"acks-{round_}"
        writer = subprocess.Popen([sys.executable, os.path.join(HERE, "group_writer.py"), d.socket, str(round_),
                                   str(acks)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert writer.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 20  # kill once `round_` groups are acknowledged, into the next one's put
        while time.monotonic() < deadline and writer.poll() is None and \
                (not acks.exists() or len(acks.read_text().split()) < round_):
            time.sleep(0.001)
        time.sleep(0.003 * round_)
        d.stop(signal.SIGKILL)
        writer.wait(30)
        d.start("64MiB")
        acked = {int(line) for line in acks.read_text().split()} if acks.exists() else set()
        with d.client() as c:
            from group_writer import GROUPS, items_of
            for g in range(GROUPS):
                items = items_of(round_, g)
                keys = [k for k, _ in items]
                complete = c.lookup_groups([keys]).complete[0]
                got = c.get_group(keys)
                assert complete == (got is not None), (round_, g)
                if got is not None:
                    with got:
                        assert same_bytes(got, items), (round_, g)
                assert complete or g not in acked, f"round {round_}: acknowledged group {g} is not whole"
            c.check_integrity()


def test_eviction_takes_a_broken_groups_other_members_before_breaking_another(daemon_factory):
    """Every group's state member is read again (so LRU alone would keep the states and evict
    the KV members, breaking every old group); a member evicted takes its group's other
    members and manifest with it, so no group is left half stored."""
    d = daemon_factory("2MiB")
    tokens = list(range(256 * 60))
    groups = [chunk_group(tokens, ch, sizes=(30_000, 6_000)) for ch in range(60)]
    with d.client() as c:
        for g, items in enumerate(groups):
            c.put_group(items)
            for older in groups[max(0, g - 8):g]:  # the states stay recently used, the KV does not
                assert c.get_into(older[1][0], np.empty(6_000, np.uint8)) in (None, 6_000)
        found = c.lookup_groups([[k for k, _ in g] for g in groups])
        tiers = c.lookup([k for g in groups for k, _ in g]).tiers
        evicted = c.stats()["namespaces"]["default"]["num_evictions"]
        assert evicted > 0 and 0 < sum(found.complete) < 60
        partial = [g for g in range(60) if not found.complete[g] and (tiers[2 * g], tiers[2 * g + 1]) != (None, None)]
        assert not partial, f"groups left half stored: {partial}"
        c.check_integrity()


def test_the_admin_api_names_an_objects_groups(tmp_path):
    from test_admin_support import admin_daemon
    with admin_daemon(tmp_path) as d, d.client() as c:
        items = chunk_group(list(range(512)), 0)
        gid = c.put_group(items).group
        state = items[1][0].object_id
        shown = d.api.get(f"/v1/objects/{state.hex}")
        assert shown["groups"] == [{"group": gid.hex, "complete": True}]
        manifest = d.api.get(f"/v1/objects/{gid.hex}")
        assert manifest["descriptor"]["kind"] == "group" and manifest["complete"] is True
        assert manifest["members"] == [k.object_id.hex for k, _ in items]
        c.delete([items[0][0]])
        assert d.api.get(f"/v1/objects/{state.hex}")["groups"] == [{"group": gid.hex, "complete": False}]
        assert d.api.get(f"/v1/objects/{gid.hex}")["complete"] is False
        assert d.api.get(f"/v1/objects/{state.hex}")["groups"] != [] and c.stats()["leases"] == 0


def test_the_asyncio_client_puts_finds_and_reads_groups(daemon):
    import asyncio
    from kvstore.client.aio import AsyncClient

    async def main():
        items = chunk_group(list(range(768)), 2)
        c = await AsyncClient.connect(daemon.socket)
        try:
            result = await c.put_group(items)
            assert not result.existed and (await c.put_group(items)).existed
            found = await c.lookup_groups([[k for k, _ in items], [items[0][0]]])
            assert found.complete == (True, False) and found.leading == 1
            got = await c.get_group([k for k, _ in items])
            with got:
                assert same_bytes(got, items) and got.group == result.group
            assert (await c.stats())["leases"] == 0
        finally:
            await c.close()
    asyncio.run(main())


def test_bad_groups_are_refused_by_name_and_store_nothing(daemon):
    from kvstore.errors import Conflict
    tokens = list(range(256))
    kv, state = chunk_keys(tokens, KV)[0], chunk_keys(tokens, STATE)[0]
    data = payload(100, 1)
    with daemon.client() as c:
        for bad, match in (([], "1..256 members, got 0"), ([(kv, data), (kv, data)], "twice"),
                           ([(kv, data), (chunk_keys(tokens, KV.with_(namespace="other"))[0], data)], "one namespace")):
            with pytest.raises(InvalidArgument, match=match):
                c.put_group(bad)
        with pytest.raises(InvalidArgument, match="got 0"):
            c.lookup_groups([[]])
        with pytest.raises(InvalidArgument, match="got 0"):
            c.get_group([])
        c.put(state, payload(100, 2))
        with pytest.raises(Conflict, match="member 1 .* other bytes"):
            c.put_group([(kv, data), (state, payload(100, 3))])  # the state's id holds other bytes
        assert c.lookup([kv]).tiers == (None,) and c.stats()["leases"] == 0
        c.check_integrity()


def test_many_groups_put_and_read_in_batches_each_whole_or_not(daemon):
    tokens = list(range(256 * 8))
    groups = [chunk_group(tokens, ch) for ch in range(8)]
    with daemon.client() as c:
        c.put(groups[3][1][0], payload(9_000, 999))  # group 3's state id already holds other bytes
        results = c.put_groups(groups)
        assert [isinstance(r, Exception) for r in results] == [False, False, False, True, False, False, False, False]
        assert "other bytes" in str(results[3]) and not results[0].existed
        assert c.lookup_groups([[k for k, _ in g] for g in groups]).complete == (True,) * 3 + (False,) + (True,) * 4
        c.delete([groups[5][0][0]])
        got = c.get_groups([[k for k, _ in g] for g in groups])
        assert [g is None for g in got] == [False, False, False, True, False, True, False, False]
        for lease, items in zip(got, groups):
            if lease is not None:
                with lease:
                    assert same_bytes(lease, items)
        assert c.put_groups(groups[:3]) and all(r.existed for r in c.put_groups(groups[:3]))
        assert c.stats()["leases"] == 0
        c.check_integrity()


@pytest.mark.parametrize("config", [{}, nvme(write_policy="write_through")], ids=["host", "nvme"])
def test_a_group_put_again_with_other_bytes_after_its_members_were_deleted_is_stored(daemon_factory, config):
    """The group id names its members, not their bytes: the manifest of a group whose members
    were deleted (or evicted, or expired) stayed and, listing the old checksums, refused every
    later put of the group with other bytes (InvalidArgument, for as long as it was held).
    Found by the history checker (tests/checker/)."""
    d = daemon_factory("16MiB", config=config)
    tokens = list(range(1024))
    first = chunk_group(tokens, 0)
    again = [(key, payload(data.size, 1000 + i)) for i, (key, data) in enumerate(first)]
    with d.client() as c:
        c.put_group(first)
        assert c.delete([key for key, _ in first]) == 2  # the members go; the manifest stays
        result = c.put_group(again)
        assert not result.existed
        with c.get_group([key for key, _ in again]) as got:
            assert same_bytes(got, again)
        c.check_integrity()
