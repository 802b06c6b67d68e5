"""A delete that lands while its object moves between the host arena and NVMe is never undone
(issue 41, items 1 and 2). The daemon widens those windows (`[testing] delay_points`,
server/windows.py) so the deletes land inside them; before the fix each of these tests
brought deleted objects back, in memory and after a restart."""

import signal
import threading
import time

import numpy as np
import pytest

from kvstore.identity import ObjectId
from kvs_testing import payload, read_back

MiB = 1 << 20
N = 30


def config(write_policy: str, points: list[str], min_ms: float = 0, max_ms: float = 150) -> dict:
    return {"nvme": {"enabled": True, "capacity_bytes": "256MiB", "file_bytes": "64MiB", "admit_min_hits": 0,
                     "write_policy": write_policy},
            "testing": {"delay_points": points, "delay_min_ms": min_ms, "delay_max_ms": max_ms, "delay_seed": 7}}


def ids(seed: int) -> list[ObjectId]:
    rng = np.random.default_rng(seed)
    return [ObjectId(rng.bytes(32)) for _ in range(N)]


def assert_gone(d, keys, size):
    """No read, lookup or put sees any of `keys`: now, and after a SIGKILL and restart."""
    for restart in (False, True):
        if restart:
            d.stop(signal.SIGKILL)
            d.start("8MiB")
        with d.client() as c:
            back = [i for i, key in enumerate(keys) if read_back(c, key, size) is not None]
            assert back == [], f"deleted objects came back{' after a restart' if restart else ''}: {back}"
            assert c.lookup(keys).tiers == (None,) * len(keys)
            c.check_integrity()
    with d.client() as c:  # and a new put of the id is stored, not taken for the deleted one
        assert c.put(keys[0], payload(size, 99)).existed is False
        assert np.array_equal(read_back(c, keys[0], size), payload(size, 99))


def test_a_delete_during_a_write_through_put_stays_deleted(daemon_factory):
    d = daemon_factory("8MiB", config=config("write_through", ["nvme_write"]))
    keys = ids(1)
    with d.client() as writer, d.client() as deleter:
        for i, key in enumerate(keys):
            done = threading.Thread(target=writer.put, args=(key, payload(256 << 10, i)))
            done.start()  # published in the host arena, then the reply waits for the NVMe write
            while deleter.lookup([key]).hits == 0 and done.is_alive():
                pass
            assert deleter.delete([key]) == 1 or not done.is_alive()
            done.join()
    assert_gone(d, keys, 256 << 10)


def test_a_delete_during_a_demotion_stays_deleted(daemon_factory):
    """write_back: a put into the full 8 MiB arena demotes the oldest objects, each copy to
    NVMe held up 200 ms; 100 ms into each put every object put before it is deleted, the one
    being copied down among them."""
    d = daemon_factory("8MiB", config=config("write_back", ["nvme_write"], min_ms=200, max_ms=200))
    keys = ids(2)
    started = threading.Semaphore(0)

    def delete_behind():
        with d.client() as c:
            deleted = 0
            for k in range(1, N + 1):
                started.acquire()  # put k has begun (k = N: the last one has returned)
                time.sleep(0.1)
                c.delete(keys[deleted:k])
                deleted = k
    deleter = threading.Thread(target=delete_behind)
    deleter.start()
    with d.client() as c:
        for i, key in enumerate(keys):
            if i:
                started.release()
            c.put(key, payload(MiB, i))
    started.release()
    deleter.join()
    assert_gone(d, keys, MiB)


def test_a_delete_during_a_promotion_stays_deleted(daemon_factory):
    """Each get of an NVMe-only object reads it, then waits 300 ms before publishing it; the
    delete comes 100 ms into the get."""
    d = daemon_factory("8MiB", config=config("write_back", ["nvme_read"], min_ms=300, max_ms=300))
    keys = ids(3)
    with d.client() as c:
        for i, key in enumerate(keys):
            c.put(key, payload(MiB, i))
        on_nvme = [key for key, tier in zip(keys, c.lookup(keys).tiers) if tier == "nvme"]
    assert len(on_nvme) >= 15
    with d.client() as reader, d.client() as deleter:
        for key in on_nvme:
            got = []
            promoting = threading.Thread(target=lambda: got.append(read_back(reader, key, MiB)))
            promoting.start()
            time.sleep(0.1)
            assert deleter.delete([key]) == 1
            promoting.join()
            if got[0] is not None:  # the read may come before the delete: then with the right bytes
                assert np.array_equal(got[0], payload(MiB, keys.index(key)))
    assert_gone(d, on_nvme, MiB)


@pytest.mark.parametrize("point", ["nvme_write", "nvme_read", "nvme_delete", "victims"])
def test_each_window_is_widened_where_it_is_named(daemon_factory, point):
    """The hook the race tests rely on: a daemon widening one window still stores and serves."""
    d = daemon_factory("8MiB", config=config("write_through", [point], max_ms=5))
    keys = ids(4)[:12]
    with d.client() as c:
        for i, key in enumerate(keys):
            c.put(key, payload(MiB, i))
        for i, key in enumerate(keys):
            assert np.array_equal(read_back(c, key, MiB), payload(MiB, i))
        assert c.delete(keys) == len(keys)
        c.check_integrity()
