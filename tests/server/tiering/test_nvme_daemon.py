"""The NVMe tier inside a real daemon: demotion, promotion, restart, corruption, full disk."""

import os
import shutil
import signal
import subprocess

import numpy as np
import pytest

from kvstore import Hints
from kvstore.errors import RangeError
from kvstore.identity import ObjectId
from kvs_testing import payload

MiB = 1 << 20


def ids(n, seed=0):
    rng = np.random.default_rng(seed)
    return [ObjectId(rng.bytes(32)) for _ in range(n)]


def nvme(**overrides):
    return {"nvme": {"enabled": True, "capacity_bytes": "256MiB", "file_bytes": "64MiB", **overrides}}


def read(c, key, size):
    out = np.empty(size, np.uint8)
    return out if c.get_into(key, out) == size else None


def test_overflowing_host_tenfold_keeps_every_object_readable(daemon_factory):
    d = daemon_factory("8MiB", config=nvme(admit_min_hits=0))
    keys = ids(80)
    with d.client() as c:
        for i, key in enumerate(keys):
            c.put(key, payload(MiB, i))
        found = c.lookup(keys)
        assert found.hits == 80 and set(found.tiers) == {"host", "nvme"}
        assert found.tiers.count("nvme") >= 70
        order = np.random.default_rng(1).permutation(80)
        for i in order:  # every get of an NVMe-only object promotes it, demoting others
            got = read(c, keys[i], MiB)
            assert got is not None and np.array_equal(got, payload(MiB, i)), f"object {i}"
        nvme_stats = c.stats()["tiers"]["nvme"]
        assert nvme_stats["num_promotions"] >= 70 and nvme_stats["num_demotions"] >= 70
        assert nvme_stats["num_checksum_failures"] == 0
        c.check_integrity()


def test_objects_survive_a_clean_restart(daemon_factory):
    d = daemon_factory("16MiB", config=nvme())
    keys = ids(6)
    with d.client() as c:
        for i, key in enumerate(keys):
            c.put(key, payload(MiB, i))  # write_back: all still only in memory
    assert d.stop(signal.SIGTERM) == 0  # flush_on_shutdown writes them out
    d.start("16MiB")
    with d.client() as c:
        found = c.lookup(keys)
        assert found.hits == 6 and set(found.tiers) == {"nvme"}
        assert found.est_load_s > 0
        for i, key in enumerate(keys):
            assert np.array_equal(read(c, key, MiB), payload(MiB, i))
        assert c.stats()["recovery"]["objects"] == 6
        c.check_integrity()


def test_write_through_put_survives_sigkill(daemon_factory):
    d = daemon_factory("16MiB", config=nvme(write_policy="write_through"))
    keys = ids(4)
    with d.client() as c:
        results = [c.put(key, payload(300_000, i)) for i, key in enumerate(keys)]
    assert [r.durability for r in results] == ["sync"] * 4
    d.stop(signal.SIGKILL)
    d.start("16MiB")
    with d.client() as c:
        for i, key in enumerate(keys):
            assert np.array_equal(read(c, key, 300_000), payload(300_000, i))
        c.check_integrity()


def test_flipped_byte_on_disk_is_a_miss_not_wrong_data(daemon_factory):
    d = daemon_factory("16MiB", config=nvme(write_policy="write_through"))
    key = ids(1)[0]
    data = payload(200_000, 7)
    with d.client() as c:
        assert c.put(key, data).durability == "sync"
    d.stop(signal.SIGTERM)
    needle = data[1000:1064].tobytes()
    flipped = 0
    for root, _, files in os.walk(os.path.join(d.data_dir, "nvme")):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "r+b") as f:
                blob = f.read()
                at = blob.find(needle)
                if at >= 0:
                    f.seek(at)
                    f.write(bytes([blob[at] ^ 0xFF]))
                    flipped += 1
    assert flipped == 1
    d.start("16MiB")
    with d.client() as c:
        assert c.get(key) is None
        stats = c.stats()
        # Caught either by the restart's sample check or by the read that verified it.
        caught = stats["tiers"]["nvme"]["num_checksum_failures"] + stats["recovery"]["dropped_by_reason"].get("checksum", 0)
        assert caught == 1
        assert c.lookup([key]).hits == 0  # dropped, not offered again
        c.check_integrity()


COLD_SIZE = MiB - 8192


def put_until_cold(c) -> list:
    """12 objects through a 4 MiB host tier; returns the keys now only on NVMe, in order."""
    keys = ids(12)
    for i, key in enumerate(keys):
        c.put(key, payload(COLD_SIZE, i))
    return [k for k, t in zip(keys, c.lookup(keys).tiers) if t == "nvme"]


def test_prefetch_wait_brings_objects_back_to_host(daemon_factory):
    d = daemon_factory("4MiB", config=nvme(admit_min_hits=0))
    with d.client() as c:
        cold = put_until_cold(c)[:2]
        assert len(cold) == 2
        assert c.prefetch(cold, policy="wait") == 2
        assert c.lookup(cold).tiers == ("host", "host")
        c.check_integrity()


def test_ranged_get_of_an_nvme_object_checks_ranges_before_promoting(daemon_factory):
    d = daemon_factory("4MiB", config=nvme(admit_min_hits=0))
    with d.client() as c:
        cold = put_until_cold(c)[0]
        promotions = c.stats()["tiers"]["nvme"]["num_promotions"]
        with pytest.raises(RangeError, match="reaches past the object's"):
            c.get(cold, ranges=[(COLD_SIZE, 1)])
        assert c.stats()["tiers"]["nvme"]["num_promotions"] == promotions  # nothing was moved for it
        with c.get(cold, ranges=[(4096, 100)]) as lease:  # held here: promoted and leased whole
            assert lease.ranges is None
            assert np.array_equal(lease.read(4096, 100), payload(COLD_SIZE, ids(12).index(cold))[4096:4196])
        c.check_integrity()


def test_delete_removes_nvme_copies_too(daemon_factory):
    d = daemon_factory("4MiB", config=nvme(admit_min_hits=0))
    keys = ids(8)
    with d.client() as c:
        for i, key in enumerate(keys):
            c.put(key, payload(MiB - 8192, i))
        assert c.delete(keys) == 8
        assert c.lookup(keys).tiers == (None,) * 8
        c.check_integrity()


def _can_mount_tmpfs():
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs root to mount a small tmpfs")
def test_full_disk_is_reported_and_daemon_keeps_serving(daemon_factory, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("mount -t tmpfs failed here")
    try:
        d = daemon_factory("4MiB", config=nvme(path=str(mnt / "nvme"), capacity_bytes="4MiB", file_bytes="4MiB",
                                               write_policy="write_through"))
        with d.client() as c:
            keys = ids(12)
            results = [c.put(key, payload(MiB - 8192, i)) for i, key in enumerate(keys)]
            # NVMe holds about 4 MiB: older copies are evicted from it, never the daemon
            assert all(r.error is None for r in results)
            with open(mnt / "filler", "wb") as f:  # now take the rest of the disk away
                try:
                    f.write(b"\0" * (8 << 20))
                except OSError:
                    pass
            more = [c.put(key, payload(MiB - 8192, 100 + i), hints=Hints(priority=1))
                    for i, key in enumerate(ids(4, seed=5))]
            assert all(r.error is None for r in more)
            last = ids(4, seed=5)[-1]
            assert np.array_equal(read(c, last, MiB - 8192), payload(MiB - 8192, 103))
            c.check_integrity()
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


_STORM = r"""
import sys, numpy as np
from kvstore.client import Client
from kvstore.identity import ObjectId
c = Client.connect(sys.argv[1], timeout_s=5)
acks = open(sys.argv[2], "a", buffering=1)
for i in range(100000):
    data = np.random.default_rng(i).integers(0, 256, 50_000 + 997 * (i % 50), dtype=np.uint8)
    r = c.put(ObjectId(i.to_bytes(32, "little")), data)
    acks.write(f"{i} {r.durability}\n")
"""


@pytest.mark.parametrize("round_", range(3))
def test_sigkill_during_a_write_storm_loses_no_durable_put(daemon_factory, tmp_path, round_):
    import random
    import subprocess
    import sys
    import time
    d = daemon_factory("16MiB", config=nvme(write_policy="write_through", durability="sync"))
    acks = tmp_path / "acks"
    writer = subprocess.Popen([sys.executable, "-c", _STORM, d.socket, str(acks)],
                              env={**os.environ, "PYTHONPATH": os.getcwd()}, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not acks.exists() or len(acks.read_text().splitlines()) < 20):
        time.sleep(0.05)
    time.sleep(random.Random(round_).uniform(0, 0.5))
    d.stop(signal.SIGKILL)
    writer.wait(30)
    durable = [int(line.split()[0]) for line in acks.read_text().splitlines() if line.endswith(" sync")]
    assert len(durable) >= 20
    d.start("16MiB")
    with d.client() as c:
        for i in durable:
            size = 50_000 + 997 * (i % 50)
            got = read(c, ObjectId(i.to_bytes(32, "little")), size)
            assert got is not None, f"acknowledged durable put {i} is missing"
            assert np.array_equal(got, np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8))
        c.check_integrity()


def test_metrics_report_the_nvme_tier(daemon_factory):
    import json
    import urllib.request
    d = daemon_factory("4MiB", config=nvme(admit_min_hits=0))
    with d.client() as c:
        for i, key in enumerate(ids(8)):
            c.put(key, payload(MiB - 8192, i))
    with open(os.path.join(d.data_dir, "admin.addr")) as f:
        addr = f.read().strip()
    with open(os.path.join(d.data_dir, "admin.token")) as f:
        token = f.read().strip()
    base = addr if addr.startswith("http") else f"http://{addr}"
    req = urllib.request.Request(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    demotions = [line for line in text.splitlines() if line.startswith("kvstore_nvme_demotions_total")]
    assert demotions and float(demotions[0].split()[-1]) >= 4
    assert 'kvstore_objects{namespace="*",tier="nvme"}' in text
    req = urllib.request.Request(f"{base}/v1/stats", headers={"Authorization": f"Bearer {token}"})
    stats = json.loads(urllib.request.urlopen(req, timeout=10).read())
    assert "nvme" in json.dumps(stats)


def _tiers_of(c, keys):
    return dict(zip(keys, c.lookup(keys).tiers)) if keys else {}


def test_flush_of_a_full_nvme_tier_never_evicts_durable_objects(daemon_factory):
    """Issue 13.1: a clean SIGTERM with a full NVMe tier deleted objects that were already
    durable (to make room for host objects it then failed to write)."""
    conf = nvme(capacity_bytes="64MiB", file_bytes="64MiB")
    d = daemon_factory("32MiB", config=conf)
    large, small = ids(12, seed=1), ids(40, seed=2)
    with d.client() as c:
        for i, key in enumerate(large):
            c.put(key, payload(8 * MiB, i))
        for i, key in enumerate(small):
            c.put(key, payload(256 << 10, 100 + i))
        before = _tiers_of(c, large + small)
        durable = [k for k, t in before.items() if t == "nvme"]
        held = [k for k, t in before.items() if t is not None]
    assert durable, "the scenario must have objects on NVMe before the stop"
    assert d.stop(signal.SIGTERM) == 0
    d.start("32MiB")
    with d.client() as c:
        after = _tiers_of(c, large + small)
        lost = [k for k in durable if after[k] is None]
        assert not lost, f"{len(lost)} of {len(durable)} objects that were durable before the stop are gone"
        kept = [k for k in held if after[k] is not None]
        sizes = {k: 8 * MiB for k in large} | {k: 256 << 10 for k in small}
        # What the flush kept fills the tier: it did not empty NVMe and then fail.
        assert sum(sizes[k] for k in kept) >= 56 * MiB
        everything = {k: payload(8 * MiB, i) for i, k in enumerate(large)}
        everything |= {k: payload(256 << 10, 100 + i) for i, k in enumerate(small)}
        for key in kept:
            assert np.array_equal(read(c, key, sizes[key]), everything[key])
        c.check_integrity()


def test_a_full_nvme_tier_ages_out_unread_objects_for_new_puts(daemon_factory):
    """Issue 13.2: once NVMe was full, new acknowledged puts vanished (refused by the
    admission filter) while old, never-read NVMe objects stayed for good."""
    d = daemon_factory("8MiB", config=nvme(capacity_bytes="16MiB", file_bytes="16MiB"))
    old, new = ids(64, seed=3), ids(100, seed=4)
    with d.client() as c:
        for i, key in enumerate(old):  # 16 MiB of objects nobody reads: NVMe fills
            c.put(key, payload(256 << 10, i))
        for i, key in enumerate(new):
            c.put(key, payload(256 << 10, 1000 + i))
        tiers = _tiers_of(c, new)
        # The last 8 MiB of new puts fit in host; the 16 MiB before them must be on NVMe,
        # displacing the old unread objects.
        recent = new[-80:]
        missing = [k for k in recent if tiers[k] is None]
        assert not missing, f"{len(missing)} of the last 80 acknowledged puts are gone"
        assert c.stats()["tiers"]["nvme"]["num_nvme_evictions"] > 0
        # A few reads (each promotes, which pushes other objects down again).
        for i in (20, 30, 40, 50):
            assert tiers[new[i]] == "nvme"
            assert np.array_equal(read(c, new[i], 256 << 10), payload(256 << 10, 1000 + i))
        c.check_integrity()


def test_a_full_nvme_tier_keeps_objects_read_more_often_than_the_newcomer(daemon_factory):
    """The other side of 13.2: ageing out must not flush objects that are being read."""
    d = daemon_factory("8MiB", config=nvme(capacity_bytes="16MiB", file_bytes="16MiB"))
    hot, new = ids(16, seed=5), ids(120, seed=6)
    with d.client() as c:
        for i, key in enumerate(hot):
            c.put(key, payload(256 << 10, i))
        for i, key in enumerate(new):
            c.put(key, payload(256 << 10, 1000 + i))
            if i % 8 == 0:  # the hot set is read all along
                for j, h in enumerate(hot):
                    assert np.array_equal(read(c, h, 256 << 10), payload(256 << 10, j))
        assert all(t is not None for t in c.lookup(hot).tiers)
