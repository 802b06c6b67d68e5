"""A TTL counts from the put on every tier: an object demoted to NVMe, promoted back, or kept
across a restart is a miss once its TTL has passed (it was served from NVMe, and after a restart,
long after; a promotion restarted its TTL)."""

import time

import numpy as np

from kvstore import Hints
from kvs_testing import payload
from test_nvme_daemon import MiB, ids, nvme, read

TTL_S = 8.0  # long enough for the set-up on a loaded machine; the test waits it out


def put_then_demote(c, short, kept, filler):
    """Put `short` (TTL_S) and `kept` (an hour), then enough filler to push them to NVMe."""
    started = time.time()
    for i, key in enumerate(short):
        c.put(key, payload(MiB, i), hints=Hints(ttl_s=TTL_S))
    for i, key in enumerate(kept):
        c.put(key, payload(MiB, 100 + i), hints=Hints(ttl_s=3600))
    for i, key in enumerate(filler):
        c.put(key, payload(MiB, 200 + i))
    return started


def wait_past(started: float) -> None:
    time.sleep(max(0.0, started + TTL_S + 1.5 - time.time()))


def test_an_object_past_its_ttl_is_a_miss_on_nvme_after_promotion_and_after_a_restart(daemon_factory):
    d = daemon_factory("8MiB", config=nvme(admit_min_hits=0))
    short, kept, filler = ids(4, 1), ids(2, 2), ids(12, 3)
    with d.client() as c:
        started = put_then_demote(c, short, kept, filler)
        tiers = c.lookup(short + kept).tiers
        assert set(tiers) <= {"nvme", None} and tiers.count("nvme") >= 5, tiers  # demoted (or expired)
        promoted = read(c, short[0], MiB)  # back in the host tier, its TTL still counted from the put
        wait_past(started)
        assert c.lookup(short).tiers == (None,) * 4
        assert all(read(c, key, MiB) is None for key in short)
        assert all(np.array_equal(read(c, key, MiB), payload(MiB, 100 + i)) for i, key in enumerate(kept))
        assert promoted is None or np.array_equal(promoted, payload(MiB, 0))
        c.check_integrity()
    d.stop()
    d.start("8MiB")
    with d.client() as c:
        assert c.lookup(short).tiers == (None,) * 4 and all(read(c, key, MiB) is None for key in short)
        assert c.lookup(kept).hits == 2
        c.check_integrity()


def test_a_restart_keeps_the_deadline_of_what_has_not_expired(daemon_factory):
    d = daemon_factory("8MiB", config=nvme(admit_min_hits=0))
    short, kept, filler = ids(3, 4), ids(1, 5), ids(12, 6)
    with d.client() as c:
        started = put_then_demote(c, short, kept, filler)
    d.stop()  # before the deadline: the restart must learn it from the NVMe records
    d.start("8MiB")
    with d.client() as c:
        wait_past(started)
        assert c.lookup(short).tiers == (None,) * 3
        assert all(read(c, key, MiB) is None for key in short)
        assert np.array_equal(read(c, kept[0], MiB), payload(MiB, 100))
        time.sleep(1.5)  # housekeeping deleted them from NVMe
        assert c.stats()["tiers"]["nvme"]["num_expired"] >= 1
        c.check_integrity()
