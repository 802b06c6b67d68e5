"""kvstore daemons sharing one Mooncake Store pool (`[remote] backend = "mooncake"`): a real
mooncake_master on loopback (TCP, P2PHANDSHAKE), a keeper process lending the pool its
memory, and real daemons. State crosses nodes only as verified pool values."""

import signal
import time

import numpy as np

from kvstore.hints import Hints
from kvstore.identity import ObjectId
from kvstore.pool_header import HEADER_BYTES, pool_key
from kvstore.server.admin.client import AdminClient
from kvs_testing import payload, wait_for
from mooncake_helpers import Keeper, Master, mooncake_or_skip, oids, pool_config, pool_stats, pool_up, put_into_pool

PREFIX = "kvstore/"


def test_put_on_a_read_on_c_bit_exact(master, keeper, daemon_factory):
    a, c = (daemon_factory("32MiB", config=pool_config(master)) for _ in range(2))
    b = daemon_factory("32MiB", config=pool_config(master, global_segment_bytes="16MiB"))  # lends memory too
    keys = oids(1, 8)
    sizes = [100_000 + 4096 * i + i for i in range(8)]
    with a.client() as ca, c.client() as cc, b.client() as cb:
        pool_up(ca, cb, cc)
        put_into_pool(ca, keys, sizes)
        assert keeper.exist([pool_key(PREFIX, "default", k) for k in keys]) == [1] * 8
        assert cc.lookup(keys).tiers == ("remote",) * 8
        for i, key in enumerate(keys):
            out = np.empty(sizes[i], np.uint8)
            assert cc.get_into(key, out) == sizes[i]
            assert np.array_equal(out, payload(sizes[i], i)), f"object {i}"
        assert cc.lookup(keys).tiers == ("host",) * 8  # promoted, verified
        with cb.get(keys[3], ranges=[(4096, 100)]) as lease:  # a ranged read fetches the whole object
            assert bytes(lease.read(4096, 100)) == payload(sizes[3], 3)[4096:4196].tobytes()
        remote = pool_stats(cc)["remote"]
        assert remote["num_hits"] == 8 and remote["num_checksum_failures"] == 0
        assert pool_stats(cc)["pool"]["up"] is True
        # the pool value is kvstore's header, then the payload
        value = keeper.get(pool_key(PREFIX, "default", keys[0]))
        assert len(value) == HEADER_BYTES + sizes[0] and value[HEADER_BYTES:] == payload(sizes[0], 0).tobytes()
        for client in (ca, cb, cc):
            client.check_integrity()
    api = AdminClient.from_data_dir(c.data_dir)  # the pool's counters under the peer tier's names
    metrics = api.request("GET", "/metrics", raw=True)
    assert "kvstore_remote_hits_total 8.0" in metrics and "kvstore_remote_checksum_failures_total 0.0" in metrics
    assert [n["node_id"] for n in api.get("/v1/cluster")["nodes"]]  # one node: a pool has no members


def test_restarted_daemon_finds_the_pools_objects(master, keeper, daemon_factory):
    a = daemon_factory("32MiB", config=pool_config(master))
    keys = oids(20, 5)
    with a.client() as ca:
        pool_up(ca)
        put_into_pool(ca, keys, [70_000 + i for i in range(5)])
    assert a.stop() == 0
    a.start("32MiB")  # no NVMe: its host tier starts empty
    with a.client() as ca:
        pool_up(ca)
        assert ca.lookup(keys).tiers == ("remote",) * 5
        for i, key in enumerate(keys):
            out = np.empty(70_000 + i, np.uint8)
            assert ca.get_into(key, out) == out.size and np.array_equal(out, payload(70_000 + i, i))


def test_a_get_in_a_namespace_with_no_arena_asks_the_pool_once_and_a_miss_makes_none(master, keeper, daemon_factory):
    """A namespace new to this daemon: a get reads the object's header from the pool once (no
    lookup first, as there used to be) and makes the arena only once the pool has the object."""
    a, c = (daemon_factory("32MiB", config=pool_config(master)) for _ in range(2))
    key, absent = oids(30, 2)
    with a.client(namespace="cold") as ca:
        pool_up(ca)
        put_into_pool(ca, [key], [60_000])
    with c.client(namespace="cold") as cc:
        pool_up(cc)
        assert cc.get(absent) is None
        assert "cold" not in cc.stats()["namespaces"]  # a miss makes no arena
        out = np.empty(60_000, np.uint8)
        assert cc.get_into(key, out) == 60_000 and np.array_equal(out, payload(60_000, 0))
        assert "cold" in cc.stats()["namespaces"]
        remote = pool_stats(cc)["remote"]
        assert remote["num_lookups"] == 0  # each get walked the chain once: no lookup before it
        assert (remote["num_gets"], remote["num_hits"], remote["num_misses"]) == (2, 1, 1)
        assert cc.stats()["namespaces"]["cold"]["num_gets"] == 1  # counted once the arena exists
        cc.check_integrity()


def test_object_corrupted_in_the_pool_is_a_counted_miss(master, keeper, daemon_factory):
    a, c = (daemon_factory("32MiB", config=pool_config(master)) for _ in range(2))
    flipped, moved, good = oids(40, 3)
    with a.client() as ca:
        pool_up(ca)
        put_into_pool(ca, [flipped, moved, good], [50_000] * 3)
    # Written with Mooncake's own client: one payload byte flipped under its valid header,
    # and another object's whole value (a valid header naming that object) under `moved`.
    keeper.flip(pool_key(PREFIX, "default", flipped), HEADER_BYTES + 1234, 0x01)
    keeper.replace(pool_key(PREFIX, "default", moved), keeper.get(pool_key(PREFIX, "default", good)))
    with c.client() as cc:
        pool_up(cc)
        assert cc.get(flipped) is None
        assert cc.lookup([moved]).tiers == (None,)  # its header names another object
        assert cc.get(moved) is None
        out = np.empty(50_000, np.uint8)
        assert cc.get_into(good, out) == 50_000 and np.array_equal(out, payload(50_000, 2))
        remote = pool_stats(cc)["remote"]
        assert remote["num_checksum_failures"] == 1 and remote["num_header_failures"] >= 2
        assert remote["num_hits"] == 1 and remote["num_misses"] == 2
        assert cc.lookup([flipped, moved]).tiers[1] is None
        cc.check_integrity()


def test_gets_guessing_the_size_read_header_and_payload_at_once_and_check_them_alike(master, keeper, daemon_factory):
    """A get guesses the payload's size (the namespace's last one) and reads it with the
    header in one Mooncake call; a wrong guess, larger or smaller, reads the payload again,
    and a payload or header that does not match is a miss on this path as on the other."""
    a, c = (daemon_factory("32MiB", config=pool_config(master)) for _ in range(2))
    keys = oids(80, 8)
    u0, u1, small, big, u2, flipped, moved, u3 = keys
    sizes = [60_000, 60_000, 30_000, 90_000, 60_000, 60_000, 60_000, 60_000]
    with a.client() as ca:
        pool_up(ca)
        put_into_pool(ca, keys, sizes)
    keeper.flip(pool_key(PREFIX, "default", flipped), HEADER_BYTES + 59_999, 0x80)  # the payload's last byte
    keeper.replace(pool_key(PREFIX, "default", moved), keeper.get(pool_key(PREFIX, "default", u2)))
    with c.client() as cc:
        pool_up(cc)

        def read(i):
            out = np.empty(sizes[i], np.uint8)
            return cc.get_into(keys[i], out) == sizes[i] and np.array_equal(out, payload(sizes[i], i))

        # u0: nothing to guess (two calls); u1: guessed 60,000, right; small: 60,000 is past
        # its end; big: 30,000 reads a prefix of it; u2: 90,000 is past its end.
        for i in range(5):
            assert read(i), f"object {i}"
            assert pool_stats(cc)["remote"]["num_size_guesses_missed"] == [0, 0, 1, 2, 3][i]
        assert cc.get(flipped) is None  # guessed right, and its checksum fails
        assert cc.get(moved) is None  # guessed, and its header names u2
        assert read(7)
        remote = pool_stats(cc)["remote"]
        assert remote["num_size_guesses_missed"] == 3 and remote["num_checksum_failures"] == 1
        assert remote["num_header_failures"] == 1 and remote["num_hits"] == 6 and remote["num_misses"] == 2
        assert pool_stats(cc)["pool"]["up"] is True and pool_stats(cc)["pool"]["num_pool_failures"] == 0
        cc.check_integrity()


def test_commits_go_to_the_pool_in_batches_and_a_delete_meanwhile_wins(master, keeper, daemon_factory):
    """write_through queues commits and sends what has queued as one batch: every object of a
    put_many reaches the pool, counted once each, and objects deleted right after their put
    are not left in the pool, whether their batch had gone or not."""
    a = daemon_factory("32MiB", config=pool_config(master))
    keys = oids(100, 40)
    with a.client() as ca:
        pool_up(ca)
        results = ca.put_many([(key, payload(10_000 + i, i)) for i, key in enumerate(keys)])
        assert all(r.error is None for r in results)
        ca.delete(keys[::2])
        assert wait_for(lambda: pool_stats(ca)["num_replicated"] >= 20)
        assert wait_for(lambda: keeper.exist([pool_key(PREFIX, "default", k) for k in keys]) == [0, 1] * 20)
        stats = pool_stats(ca)
        assert stats["num_replicated"] <= 40 and stats["num_put_failures"] == 0
        out = np.empty(10_001, np.uint8)
        assert ca.get_into(keys[1], out) == out.size and np.array_equal(out, payload(10_001, 1))
        assert ca.get(keys[0]) is None


def test_write_through_copies_wait_while_a_client_is_busy_and_go_once_it_pauses(master, keeper, daemon_factory):
    """The copies yield to clients (server/traffic.py): while a client sends requests, or reads
    from the shared index (reported by its touches), more often than write_through_quiet_ms,
    a commit's copy waits (at most write_through_yield_ms); once the client pauses it goes."""
    quiet_s = 1.0
    a = daemon_factory("32MiB", config=pool_config(master, write_through_quiet_ms=quiet_s * 1000,
                                                   write_through_yield_ms=60_000))
    key = oids(190, 1)[0]
    out = np.empty(20_000, np.uint8)

    def busy(step, seconds: float = 2.0) -> int:
        """Run step() every 20 ms for `seconds`; then the pool's count of copies."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            step()
            time.sleep(0.02)
        return pool_stats(ca)["num_replicated"]

    with a.client() as ca:
        pool_up(ca)
        ca.put(key, payload(20_000, 0))
        assert busy(lambda: ca.lookup([key])) == 0
        assert busy(lambda: ca.get_into(key, out)) == 0 and np.array_equal(out, payload(20_000, 0))
        assert ca.stats()["namespaces"]["default"]["num_shared_hits"] > 50  # read by the client, not through gets
        for _ in range(30):  # asked less often than the quiet span: each ask leaves a pause behind it
            time.sleep(quiet_s * 1.5)
            if pool_stats(ca)["num_replicated"] == 1:
                break
        assert pool_stats(ca)["num_replicated"] == 1
        assert keeper.exist([pool_key(PREFIX, "default", key)]) == [1]


def test_a_clean_stop_sends_the_write_through_copies_still_waiting(master, keeper, daemon_factory):
    a = daemon_factory("32MiB", config=pool_config(master, write_through_quiet_ms=60_000,
                                                   write_through_yield_ms=60_000))
    keys = oids(215, 3)
    with a.client() as ca:
        pool_up(ca)
        for i, key in enumerate(keys):
            ca.put(key, payload(30_000, i))
        assert pool_stats(ca)["num_replicated"] == 0  # waiting: the client has not paused for a minute
    assert a.stop() == 0
    assert keeper.exist([pool_key(PREFIX, "default", k) for k in keys]) == [1] * 3
    c = daemon_factory("32MiB", config=pool_config(master))
    with c.client() as cc:  # read back on another node, verified
        pool_up(cc)
        out = np.empty(30_000, np.uint8)
        for i, key in enumerate(keys):
            assert cc.get_into(key, out) == out.size and np.array_equal(out, payload(30_000, i))


def test_a_write_through_copy_that_waited_past_its_host_entry_goes_from_nvme(master, keeper, daemon_factory):
    """Copies wait while the client puts; the host tier meanwhile evicts most of the objects to
    NVMe. Each copy still reaches the pool, read back from NVMe (verified), not left for NVMe's
    own eviction."""
    config = {**pool_config(master, write_through_quiet_ms=1000, write_through_yield_ms=60_000),
              "nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB", "admit_min_hits": 0}}
    a = daemon_factory("4MiB", config=config)
    keys = oids(200, 12)
    with a.client() as ca:
        pool_up(ca)
        for i, key in enumerate(keys):  # 6 MiB through a 4 MiB arena
            ca.put(key, payload(512 * 1024, i))
        assert pool_stats(ca)["num_replicated"] == 0 and ca.stats()["tiers"]["nvme"]["objects"] >= 4
        for _ in range(30):  # asked less often than the quiet span
            time.sleep(1.5)
            if pool_stats(ca)["num_replicated"] == 12:
                break
        assert pool_stats(ca)["num_replicated"] == 12 and pool_stats(ca)["num_put_failures"] == 0
        assert keeper.exist([pool_key(PREFIX, "default", k) for k in keys]) == [1] * 12
    b = daemon_factory("32MiB", config=pool_config(master))
    with b.client() as cb:  # another node reads every one from the pool, verified
        pool_up(cb)
        out = np.empty(512 * 1024, np.uint8)
        for i, key in enumerate(keys):
            assert cb.get_into(key, out) == out.size and np.array_equal(out, payload(512 * 1024, i))


def test_a_put_with_tier_remote_returns_once_the_pool_holds_it_and_keeps_no_copy(master, keeper, daemon_factory):
    a, c = (daemon_factory("32MiB", config=pool_config(master)) for _ in range(2))
    keys = oids(150, 4)
    with a.client() as ca, c.client() as cc:
        pool_up(ca, cc)
        result = ca.put(keys[0], payload(50_000, 0), tier="remote")
        assert (result.tier, result.homes) == ("remote", ())
        assert keeper.exist([pool_key(PREFIX, "default", keys[0])]) == [1]  # before the reply, not after
        results = ca.put_many([(k, payload(50_000, i)) for i, k in enumerate(keys[1:], 1)], tier="remote")
        assert [r.tier for r in results] == ["remote"] * 3
        assert ca.lookup(keys).tiers == ("remote",) * 4  # no local copy
        assert pool_stats(ca)["num_remote_puts"] == 4 and pool_stats(ca)["num_remote_put_fallbacks"] == 0
        out = np.empty(50_000, np.uint8)
        for i, key in enumerate(keys):  # read back through the pool, verified, on either node
            for client in (cc, ca):
                assert client.get_into(key, out) == 50_000 and np.array_equal(out, payload(50_000, i))
        assert ca.put(keys[0], payload(50_000, 0), tier="remote").existed  # held here again since the read
        ca.check_integrity()


def test_objects_expire_in_the_pool_and_in_copies_read_from_it_when_their_ttl_ends(master, keeper, daemon_factory):
    """Mooncake has no expiry: the header carries the put's time, so a reader's copy expires
    with the object, and a read past the TTL is a miss that removes the pool's key."""
    a, c = (daemon_factory("32MiB", config=pool_config(master)) for _ in range(2))
    short, long = oids(170, 2)
    with a.client() as ca, c.client() as cc:
        pool_up(ca, cc)
        put_at = time.monotonic()
        ca.put(short, payload(20_000, 0), hints=Hints(ttl_s=3.0))
        ca.put(long, payload(20_000, 1), hints=Hints(ttl_s=600.0))
        assert wait_for(lambda: pool_stats(ca)["num_replicated"] == 2)
        time.sleep(max(0.0, put_at + 1.5 - time.monotonic()))
        out = np.empty(20_000, np.uint8)
        assert cc.get_into(short, out) == 20_000 and np.array_equal(out, payload(20_000, 0))
        assert cc.lookup([short]).tiers == ("host",)
        time.sleep(max(0.0, put_at + 3.6 - time.monotonic()))
        # ttl_s from the read would keep c's copy until about 4.5 s after the put
        assert cc.lookup([short]).tiers == (None,) and cc.get(short) is None
        assert pool_stats(cc)["remote"]["num_expired"] >= 1
        assert wait_for(lambda: keeper.exist([pool_key(PREFIX, "default", short)]) == [0])
        assert cc.get_into(long, out) == 20_000 and np.array_equal(out, payload(20_000, 1))
        cc.check_integrity()


def test_get_many_reads_its_misses_from_the_pool_together_and_checks_each(master, keeper, daemon_factory):
    """A get_many's local misses are read ahead in one Mooncake call per batch (headers and
    payloads, sizes guessed); each is verified as a single get's would be, and what the read
    ahead leaves (a miss, a damaged payload, another size) the batch's own gets handle."""
    a, c = (daemon_factory("32MiB", config=pool_config(master)) for _ in range(2))
    keys = oids(180, 12)
    sizes = [40_000] * 10 + [25_000, 40_000]
    with a.client() as ca:
        pool_up(ca)
        put_into_pool(ca, keys, sizes)
    flipped, absent = keys[9], ObjectId(b"\xee" * 32)
    keeper.flip(pool_key(PREFIX, "default", flipped), HEADER_BYTES + 7, 0x04)
    with c.client() as cc:
        pool_up(cc)
        out = np.empty(40_000, np.uint8)
        assert cc.get_into(keys[0], out) == 40_000  # a size to guess from
        asked = keys[1:9] + [flipped, absent, keys[10], keys[11]]
        outs = [np.empty(40_000, np.uint8) for _ in asked]
        got = cc.get_many_into(list(zip(asked, outs)))
        assert got == [40_000] * 8 + [None, None, 25_000, 40_000]
        for key, o, n in zip(asked, outs, got):
            if n is not None:
                i = keys.index(key)
                assert np.array_equal(o[:n], payload(sizes[i], i)), f"object {i}"
        remote = pool_stats(cc)["remote"]
        assert remote["num_fetched_ahead"] == 9  # keys 1-8 and 11; 10's size was not the guess
        assert remote["num_checksum_failures"] >= 1 and remote["num_size_guesses_missed"] >= 1
        assert pool_stats(cc)["pool"]["num_pool_failures"] == 0
        # the damaged one's header still holds (a lookup reads headers only): a get misses it
        assert cc.lookup(asked).tiers == ("host",) * 8 + ("remote", None, "host", "host")
        cc.check_integrity()


def test_sizes_a_lookup_read_make_gets_of_mixed_sizes_one_call_each(master, keeper, daemon_factory):
    """A hybrid model's chunks and states differ in size: after a lookup (headers read), each
    get reads its value with its own size, never a wrong guess."""
    a, c = (daemon_factory("32MiB", config=pool_config(master)) for _ in range(2))
    keys = oids(200, 12)
    sizes = [30_000 if i % 3 else 150_000 for i in range(12)]  # a state after every two chunks
    with a.client() as ca:
        pool_up(ca)
        put_into_pool(ca, keys, sizes)
    with c.client() as cc:
        pool_up(cc)
        assert cc.lookup(keys).tiers == ("remote",) * 12
        outs = [np.empty(150_000, np.uint8) for _ in keys]
        assert cc.get_many_into(list(zip(keys[:8], outs))) == sizes[:8]
        for i in range(8, 12):
            assert cc.get_into(keys[i], outs[i]) == sizes[i]
        for i, o in enumerate(outs):
            assert np.array_equal(o[:sizes[i]], payload(sizes[i], i)), f"object {i}"
        remote = pool_stats(cc)["remote"]
        assert remote["num_size_guesses_missed"] == 0 and remote["num_fetched_ahead"] == 8
        assert remote["num_hits"] == 12 and remote["num_checksum_failures"] == 0
        cc.check_integrity()


def test_another_namespaces_objects_are_invisible(master, keeper, daemon_factory):
    config = {**pool_config(master), "host": {"namespaces": ["tenant-a", "tenant-b"]}}
    a, c = daemon_factory("32MiB", config=config), daemon_factory("32MiB", config=config)
    keys = oids(60, 3)
    with a.client(namespace="tenant-a") as ca:
        pool_up(ca)
        put_into_pool(ca, keys, [20_000] * 3)
    assert keeper.exist([pool_key(PREFIX, "tenant-a", k) for k in keys]) == [1] * 3
    with c.client(namespace="tenant-b") as cb:
        pool_up(cb)
        assert cb.lookup(keys).tiers == (None,) * 3
        assert all(cb.get(key) is None for key in keys)
    with c.client(namespace="tenant-a") as ca:
        assert ca.lookup(keys).tiers == ("remote",) * 3


def test_master_sigkill_is_misses_and_local_tiers_keep_serving(master, keeper, daemon_factory):
    a, c = (daemon_factory("32MiB", config=pool_config(master)) for _ in range(2))
    keys = oids(80, 6)
    with a.client() as ca, c.client(timeout_s=60) as cc:
        pool_up(ca, cc)
        put_into_pool(ca, keys, [30_000] * 6)
        out = np.empty(30_000, np.uint8)
        assert cc.get_into(keys[0], out) == 30_000  # c holds this one now
        master.kill()
        # c's misses are misses, not errors (the first call waits for Mooncake's own RPC timeout)
        assert all(cc.get(key) is None for key in keys[1:])
        assert cc.lookup(keys[1:]).tiers == (None,) * 5
        stats = pool_stats(cc)
        assert stats["pool"]["up"] is False and stats["pool"]["num_pool_failures"] >= 1
        assert cc.get_into(keys[0], out) == 30_000 and np.array_equal(out, payload(30_000, 0))
        for i, key in enumerate(keys):  # a's local tiers are intact
            assert ca.get_into(key, out) == 30_000 and np.array_equal(out, payload(30_000, i))
        new = ObjectId(b"\x99" * 32)
        ca.put(new, payload(30_000, 9))  # the put succeeds locally; its copy to the pool fails
        assert wait_for(lambda: pool_stats(ca)["num_put_failures"] >= 1 or pool_stats(ca)["pool"]["up"] is False)
        kept = ObjectId(b"\x97" * 32)  # tier="remote" with the pool gone: the copy stays, and says so
        assert ca.put(kept, payload(30_000, 7), tier="remote").tier == "host"
        assert pool_stats(ca)["num_remote_put_fallbacks"] == 1 and ca.lookup([kept]).tiers == ("host",)
        # The master comes back (empty: it kept its metadata in memory); the keeper mounts
        # its segment again, and the daemons' probes find it.
        master.start()
        assert wait_for(lambda: pool_stats(cc)["pool"]["up"] and pool_stats(ca)["pool"]["up"], timeout=60)
        # Until the keeper has mounted its memory again the pool has no room (a put then
        # fails, counted as pool full): wait for Mooncake's own client to store something.
        assert wait_for(lambda: keeper.put("probe/after-restart", b"x" * 4096) == 0, timeout=60)
        later = ObjectId(b"\x98" * 32)
        ca.put(later, payload(30_000, 8))
        assert wait_for(lambda: cc.lookup([later]).tiers == ("remote",), timeout=30)
        assert cc.get_into(later, out) == 30_000 and np.array_equal(out, payload(30_000, 8))
        ca.check_integrity()
        cc.check_integrity()


def test_full_pool_fails_demotions_counted_and_objects_stay_on_nvme(master, keeper, daemon_factory):
    assert keeper.fill() > 0  # hard-pinned: the pool can evict none of it
    config = {**pool_config(master), "nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB",
                                              "admit_min_hits": 0}}
    a = daemon_factory("4MiB", config=config)
    keys = oids(120, 12)
    with a.client() as ca:
        pool_up(ca)
        for i, key in enumerate(keys):  # 6 MiB through a 4 MiB arena: the host tier evicts to NVMe
            ca.put(key, payload(512 * 1024, i))
        assert wait_for(lambda: pool_stats(ca)["num_put_failures"] == 12)
        stats = pool_stats(ca)
        assert stats["num_replicated"] == 0 and stats["pool"]["num_pool_full"] >= 1 and stats["pool"]["up"]
        assert ca.stats()["tiers"]["nvme"]["objects"] >= 4
        out = np.empty(512 * 1024, np.uint8)
        for i, key in enumerate(keys):
            assert ca.get_into(key, out) == out.size and np.array_equal(out, payload(512 * 1024, i))
        ca.check_integrity()
    # write_back and no NVMe: host victims are demoted to the pool as they leave; it takes none.
    b = daemon_factory("4MiB", config=pool_config(master, remote_write="write_back"))
    with b.client() as cb:
        pool_up(cb)
        for i, key in enumerate(keys):
            cb.put(key, payload(512 * 1024, i))
        stats = pool_stats(cb)
        assert stats["num_demotion_failures"] >= 4 and stats["num_demoted_remote"] == 0
        assert stats["num_demotion_failures"] == stats["num_put_failures"]
        cb.check_integrity()


def test_master_down_at_start_daemon_serves_locally_then_joins(daemon_factory, tmp_path):
    exe = mooncake_or_skip()
    master = Master(exe, str(tmp_path))  # not started yet
    a = daemon_factory("32MiB", config=pool_config(master))
    with a.client() as ca:
        key = ObjectId(b"\x42" * 32)
        ca.put(key, payload(10_000, 1))
        out = np.empty(10_000, np.uint8)
        assert ca.get_into(key, out) == 10_000 and np.array_equal(out, payload(10_000, 1))
        assert ca.get(ObjectId(b"\x43" * 32)) is None  # a miss, not an error
        stats = pool_stats(ca)
        assert stats["pool"]["up"] is False and stats["pool"]["last_error"]
        master.start()
        keeper = Keeper(master)
        try:
            assert wait_for(lambda: pool_stats(ca)["pool"]["up"], timeout=60)
            later = ObjectId(b"\x44" * 32)
            ca.put(later, payload(10_000, 2))
            assert wait_for(lambda: keeper.exist([pool_key(PREFIX, "default", later)]) == [1])
        finally:
            keeper.stop()
            master.kill()
    assert a.stop() == 0  # a clean stop with the master gone: nothing waits for it


def test_pool_memory_holder_sigkilled_is_misses_not_errors(master, keeper, daemon_factory):
    a, c = (daemon_factory("32MiB", config=pool_config(master)) for _ in range(2))
    keys = oids(140, 4)
    with a.client() as ca, c.client(timeout_s=60) as cc:
        pool_up(ca, cc)
        put_into_pool(ca, keys, [40_000] * 4)
        keeper.proc.send_signal(signal.SIGKILL)  # the only memory of the pool, and every copy in it
        keeper.proc.wait()
        assert all(cc.get(key) is None for key in keys)  # misses: no error, no hang
        assert pool_stats(cc)["remote"]["num_hits"] == 0
        out = np.empty(40_000, np.uint8)
        for i, key in enumerate(keys):  # a's own copies are untouched
            assert ca.get_into(key, out) == out.size and np.array_equal(out, payload(40_000, i))
        cc.check_integrity()
