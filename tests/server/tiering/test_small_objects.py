"""Objects below 4 KiB in a real daemon: slots of their size class (tiers/slabs.py, issue 15)."""

import numpy as np
import pytest

from kvstore.identity import ObjectId
from kvs_testing import payload
from kvstore.tiers.allocator import ExtentAllocator
from kvstore.tiers.slabs import SIZE_CLASSES, SlabAllocator

KiB, MiB = 1 << 10, 1 << 20
FOOTPRINT = SlabAllocator(ExtentAllocator(4096, 4096)).footprint
NVME = {"nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB", "admit_min_hits": 0}}


def ids(n, seed):
    rng = np.random.default_rng(seed)
    return [ObjectId(rng.bytes(32)) for _ in range(n)]


def read(c, key, size):
    out = np.empty(size, np.uint8)
    return out if c.get_into(key, out) == size else None


def put_all(c, items, batch=200):
    for i in range(0, len(items), batch):
        errors = [r.error for r in c.put_many(items[i:i + batch]) if r.error is not None]
        assert not errors, errors[0]


def on_host(c, keys):
    return [k for k, tier in zip(keys, c.lookup(keys).tiers) if tier == "host"]


def host(c):
    return c.stats()["namespaces"]["default"]


def test_small_objects_round_trip_bit_exact_and_stats_count_their_slots(daemon):
    sizes = sorted({1, 63, 64, 65, 500, 511, 512, 513, 4095, 4096, 4097, 9000,
                    *SIZE_CLASSES, *(c + 1 for c in SIZE_CLASSES)})
    sizes = [s for s in sizes for _ in range(3)]  # several of each: slots side by side in one slab
    keys = ids(len(sizes), seed=1)
    with daemon.client() as c:
        put_all(c, [(k, payload(s, k)) for k, s in zip(keys, sizes)])
        for k, s in zip(keys, sizes):
            got = read(c, k, s)
            assert got is not None and np.array_equal(got, payload(s, k)), f"{s} B object"
            with c.get(k) as lease:
                assert lease.size == s and np.array_equal(lease.numpy(), payload(s, k))
        stats = host(c)
        assert stats["used_bytes"] == sum(FOOTPRINT(s) for s in sizes)
        assert stats["used_bytes"] < sum(-(-s // 4096) * 4096 for s in sizes) / 2
        c.delete(keys[::2])
        assert host(c)["used_bytes"] == sum(FOOTPRINT(s) for s in sizes[1::2])
        c.check_integrity()


def test_a_deleted_slot_under_a_read_lease_is_not_reused_until_release(daemon):
    a, *others = ids(41, seed=2)
    with daemon.client(shared_index=False) as c:  # a daemon lease (not a copy from the shared index)
        c.put(a, payload(1000, a))  # the only object of its class: its slab's slot is next in line
        lease = c.get(a)
        view = lease.numpy()
        c.delete([a])
        put_all(c, [(k, payload(1000, k)) for k in others[:20]])  # would take a's slot if it were free
        assert np.array_equal(view, payload(1000, a)), "a leased slot was handed to another object"
        assert host(c)["used_bytes"] == 21 * 1024  # a's slot still taken
        lease.release()
        assert host(c)["used_bytes"] == 20 * 1024
        put_all(c, [(k, payload(1000, k)) for k in others[20:]])
        for k in others:
            got = read(c, k, 1000)
            assert got is not None and np.array_equal(got, payload(1000, k))
        c.check_integrity()


@pytest.mark.parametrize("config", [None, NVME], ids=["host only", "with nvme"])
def test_a_full_class_makes_room_while_other_classes_have_free_slots(daemon_factory, config):
    d = daemon_factory("1MiB", config)
    first, second = ids(1400, seed=3), ids(200, seed=4)
    with d.client() as c:
        put_all(c, [(k, payload(700, k)) for k in first])  # 768 B slots, 3-page slabs: the arena fills
        left = on_host(c, first)
        assert len(left) < len(first) and host(c)["num_evictions"] > 0
        c.delete(left[::2])  # half of every slab free, yet no free page
        before = host(c)
        assert before["slab_free_bytes"] > 256 * KiB and before["used_bytes"] + before["slab_free_bytes"] > MiB - 8 * KiB
        put_all(c, [(k, payload(2000, k)) for k in second])  # 2 KiB slots need pages: evict until slabs empty
        for k in second[-50:]:
            got = read(c, k, 2000)
            assert got is not None and np.array_equal(got, payload(2000, k))
        live = 0
        for keys, size in ((first, 700), (second, 2000)):
            for k in keys:
                got = read(c, k, size)
                if got is not None:
                    assert np.array_equal(got, payload(size, k))
                    live += FOOTPRINT(size)
        stats = host(c)
        assert stats["num_evictions"] > before["num_evictions"]
        assert stats["used_bytes"] == live and live + stats["slab_free_bytes"] <= MiB
        c.check_integrity()


@pytest.mark.parametrize("config", [None, NVME], ids=["host only", "with nvme"])
def test_eviction_under_pressure_with_mixed_small_and_big_objects_keeps_objects_intact(daemon_factory, config):
    d = daemon_factory("2MiB", config)
    rng = np.random.default_rng(5)
    sizes = [int(s) for s in np.where(rng.random(1500) < 0.8, rng.integers(1, 4096, 1500),
                                      rng.integers(4097, 64 * KiB, 1500))]
    keys = ids(len(sizes), seed=6)
    with d.client() as c:
        leased = None
        for i in range(0, len(keys), 100):
            put_all(c, [(k, payload(s, k)) for k, s in zip(keys[i:i + 100], sizes[i:i + 100])])
            if leased is None:  # a reader holds a small object through all the pressure
                leased = (c.get(keys[1]), keys[1], sizes[1])
        lease, key, size = leased
        assert np.array_equal(lease.numpy(), payload(size, key))
        lease.release()
        stats = host(c)
        assert stats["num_evictions"] > 0
        live = 0
        for k, s in zip(keys, sizes):
            got = read(c, k, s)
            if got is not None:
                assert np.array_equal(got, payload(s, k)), f"object of {s} B"
                live += FOOTPRINT(s)
        if config is not None:  # NVMe kept every object; reads promoted some, evicting others
            assert all(c.lookup([k]).hits for k in keys)
            assert c.stats()["tiers"]["nvme"]["num_checksum_failures"] == 0
        else:
            assert host(c)["used_bytes"] == live
        c.check_integrity()
