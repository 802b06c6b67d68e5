"""put(wait=False) and flush(): puts a client holds and stores together (client/batched.py).

What a deferred put must keep: the bytes of the moment it was made (the caller's buffer is
free at once), the order of the client's own calls (its reads, deletes and waited puts see
every deferred put before them), every failure reported by flush(), and nothing silently
lost (close stores what is held; a lost daemon is each unstored put's error)."""

import asyncio
import signal

import numpy as np
import pytest

from kvstore import StateDescriptor
from kvstore.client import AsyncClient
from kvstore.client.batched import DEFER_BYTES, WINDOW_ITEMS
from kvstore.errors import Conflict, DaemonUnavailable, InvalidArgument, PermissionDenied
from kvstore.hints import Hints
from kvstore.identity import ObjectId, chunk_keys
from kvs_testing import payload, read_back, sent_ops

KiB = 1024


def ids(n, seed=0):
    return [ObjectId(bytes([seed, i % 256, i // 256]) * 10 + b"dp") for i in range(n)]


def test_deferred_puts_send_nothing_until_another_call_which_sees_them(daemon):
    keys = ids(20, 1)
    with daemon.client() as c, daemon.client() as other:
        c.put(ids(1, 9)[0], payload(8, 0))  # namespace open: only the puts' own requests below
        sent = sent_ops(c)
        for i, key in enumerate(keys):
            assert c.put(key, payload(1000 + i, key), wait=False) is None
        assert sent == []  # held in this process
        assert other.lookup(keys).hits == 0  # no one else sees them yet
        assert np.array_equal(read_back(c, keys[7], 1007), payload(1007, keys[7]))  # this client's read stores them first
        assert sent[:2] == ["reserve_many", "commit_many"]
        assert other.lookup(keys).hits == len(keys)
        for i, key in enumerate(keys):
            assert np.array_equal(read_back(other, key, 1000 + i), payload(1000 + i, key))
        results = c.flush()
        assert [r.object_id for r in results] == keys
        assert all(r.error is None and not r.existed and r.tier == "host" for r in results)
        assert c.flush() == []  # reported once


def test_the_bytes_stored_are_those_of_the_put_not_of_the_reused_buffer(daemon):
    keys = ids(8, 2)
    buf = np.zeros(64 * KiB, np.uint8)
    with daemon.client() as c:
        for key in keys:
            buf[:] = payload(buf.size, key)
            c.put(key, buf, wait=False)
        buf[:] = 0xAB  # the caller reuses its buffer before anything was stored
        raw = bytearray(payload(5000, 77))
        c.put(ids(1, 3)[0], raw, wait=False)
        raw[:] = b"\0" * len(raw)
        assert all(r.error is None for r in c.flush())
        for key in keys:
            assert np.array_equal(read_back(c, key, buf.size), payload(buf.size, key))
        assert np.array_equal(read_back(c, ids(1, 3)[0], 5000), payload(5000, 77))


def test_the_callers_mistakes_raise_at_the_put_and_hold_nothing(daemon):
    desc = StateDescriptor("default", "kv", "m")
    other = StateDescriptor("default", "kv", "other-model")
    key = chunk_keys(list(range(desc.chunk_tokens)), desc)[0]
    with daemon.client() as c:
        with pytest.raises(InvalidArgument, match="empty"):
            c.put(ids(1, 4)[0], b"", wait=False)
        with pytest.raises(InvalidArgument, match="tier"):
            c.put(ids(1, 4)[0], b"x", tier="disk", wait=False)
        with pytest.raises(InvalidArgument, match="a key is"):
            c.put(12, b"x", wait=False)
        with pytest.raises(InvalidArgument, match="another descriptor"):
            c.put(key, b"x", desc=other, wait=False)
        layout = StateDescriptor("default", "m", "r", "kv", "bf16",
                                 "paged(order=layer_first,layers=2,block=16,kv_heads=1,head_dim=8)", chunk_tokens=16)
        with pytest.raises(InvalidArgument, match="object of 100 bytes does not match its layout"):
            c.put(ids(1, 4)[0], b"x" * 100, desc=layout, wait=False)
        assert c.core.deferred == [] and c.flush() == []


def test_hints_the_wire_would_refuse_raise_where_they_are_made_and_cost_no_other_put(daemon):
    """Issue 41 items 8 and 14: Hints(ttl_s=2**64) was accepted; flush() then raised a bare
    OverflowError (msgpack), a valid deferred put after it was never stored, and close()
    raised with the socket left open. A waited pin with such a TTL raised OverflowError too."""
    keys = ids(3, 19)
    with pytest.raises(InvalidArgument, match=r"hint ttl_s must be a number of seconds in 0\.\.3,153,600,000"):
        Hints(ttl_s=2**64)
    c = daemon.client()
    c.put(keys[0], payload(100, keys[0]), wait=False)
    with pytest.raises(InvalidArgument, match="hints must be a kvstore.hints.Hints or None, got dict"):
        c.put(keys[1], payload(100, keys[1]), hints={"ttl_s": 2**64}, wait=False)
    with pytest.raises(InvalidArgument, match="hints must be a kvstore.hints.Hints or None, got dict"):
        c.put(keys[1], payload(100, keys[1]), hints={"ttl_s": 60})
    c.put(keys[2], payload(100, keys[2]), hints=Hints(ttl_s=3600), wait=False)
    with pytest.raises(InvalidArgument, match=r"ttl_s must be a number of seconds in 0\.\.3,153,600,000"):
        c.pin([keys[0]], ttl_s=2**64)  # refused before anything is sent
    assert [(r.object_id, r.error) for r in c.flush()] == [(keys[0], None), (keys[2], None)]
    c.close()
    with daemon.client() as other:
        assert other.lookup(keys).tiers == ("host", None, "host")
        assert other.pin([keys[0]], ttl_s=60.5) == 1


def test_a_deferred_put_into_a_namespace_the_client_may_not_open_raises_at_the_put(daemon_factory):
    d = daemon_factory(config={"auth": {"unlisted": "deny", "namespaces": {"mine": {"token": "t" * 16}}}})
    key = ids(1, 18)[0]
    with d.client(namespace="mine", token="t" * 16) as c:
        with pytest.raises(PermissionDenied, match="other"):
            c.put(key, b"x" * 100, desc=StateDescriptor("other", "opaque", "0"), wait=False)
        assert c.core.deferred == []  # nothing held for later calls to trip over
        c.put(key, b"y" * 100, wait=False)
        assert c.lookup([key]).hits == 1 and [r.error for r in c.flush()] == [None]


def test_a_refused_deferred_put_is_in_flush_and_the_others_and_the_stored_one_stay(daemon):
    keys = ids(6, 5)
    with daemon.client() as c:
        c.put(keys[2], payload(3000, keys[2]))  # stored already, at another size
        for key in keys:
            c.put(key, payload(2000, key), wait=False)
        results = c.flush()
        assert [r.object_id for r in results] == keys
        assert isinstance(results[2].error, Conflict) and "already stored with 3000 bytes" in str(results[2].error)
        assert [r.error for i, r in enumerate(results) if i != 2] == [None] * 5
        assert np.array_equal(read_back(c, keys[2], 3000), payload(3000, keys[2]))
        for key in keys[:2] + keys[3:]:
            assert np.array_equal(read_back(c, key, 2000), payload(2000, key))


def test_the_clients_own_calls_keep_their_order_with_deferred_puts(daemon):
    a, b, c_key = ids(3, 6)
    with daemon.client() as c:
        c.put(a, payload(100, a), wait=False)
        assert c.delete([a]) == 1  # the put before it was stored first
        assert c.lookup([a]).hits == 0
        c.put(b, payload(100, b), wait=False)
        with pytest.raises(Conflict):  # the deferred put of 100 bytes came first
            c.put(b, payload(200, b))
        c.put(c_key, payload(300, c_key), wait=False)
        assert c.pin([c_key]) == 1
        assert [r.error for r in c.flush()] == [None, None, None]


def test_held_puts_are_stored_once_a_batch_is_full_without_a_flush(daemon):
    size = 512 * KiB
    count = DEFER_BYTES // size
    keys = ids(count + 3, 7)
    with daemon.client() as c, daemon.client() as other:
        for key in keys:
            c.put(key, payload(size, key), wait=False)
        assert other.lookup(keys).hits == count  # the first DEFER_BYTES went as one batch
        assert len(c.core.deferred) == 3
        small = ids(WINDOW_ITEMS, 8)
        for key in small:  # a window's worth of small puts goes too
            c.put(key, payload(64, key), wait=False)
        assert other.lookup(small[:-3]).hits == WINDOW_ITEMS - 3
        assert len(c.flush()) == len(keys) + len(small)


def test_a_put_of_defer_bytes_or_more_is_stored_before_it_returns(daemon_factory):
    d = daemon_factory("64MiB")
    key = ids(1, 9)[0]
    with d.client() as c, d.client() as other:
        c.put(key, payload(DEFER_BYTES, key), wait=False)
        assert other.lookup([key]).hits == 1 and c.core.deferred == []
        assert np.array_equal(read_back(other, key, DEFER_BYTES), payload(DEFER_BYTES, key))
        assert c.flush()[0].error is None


def test_runs_of_other_hints_are_stored_apart_in_order(daemon):
    keys = ids(6, 10)
    pinned = Hints(pin=True)
    with daemon.client() as c:
        c.put(ids(1, 11)[0], b"open")
        sent = sent_ops(c)
        for i, key in enumerate(keys):
            c.put(key, payload(100, key), hints=pinned if i in (2, 3) else None, wait=False)
        assert [r.error for r in c.flush()] == [None] * 6
        assert sent.count("reserve_many") == 3  # three runs: plain, hinted, plain
        for key in keys:
            assert np.array_equal(read_back(c, key, 100), payload(100, key))


def test_close_stores_held_puts(daemon):
    keys = ids(5, 12)
    c = daemon.client()
    for key in keys:
        c.put(key, payload(777, key), wait=False)
    c.close()
    with daemon.client() as other:
        for key in keys:
            assert np.array_equal(read_back(other, key, 777), payload(777, key))


def test_close_warns_of_failed_deferred_puts_no_flush_reported(daemon):
    key = ids(1, 13)[0]
    with daemon.client() as c:
        c.put(key, payload(10, key))
        c.put(key, payload(20, key), wait=False)
        with pytest.warns(RuntimeWarning, match=f"1 deferred put.*failed.*{key.hex}.*already stored with 10 bytes"):
            c.close()


def test_a_daemon_lost_under_held_puts_makes_each_one_an_error_and_none_is_lost_quietly(daemon_factory):
    d = daemon_factory()
    keys = ids(4, 14)
    c = d.client(timeout_s=5.0)
    c.put(ids(1, 15)[0], b"open")
    for key in keys:
        c.put(key, payload(100, key), wait=False)
    d.stop(signal.SIGKILL)
    with pytest.raises(DaemonUnavailable):
        c.lookup(keys)  # stores the held puts first: the daemon is gone
    d.start()
    c.reconnect()
    results = c.flush()  # the results survive the reconnect
    assert [r.object_id for r in results] == keys
    assert all(isinstance(r.error, DaemonUnavailable) for r in results)
    assert c.lookup(keys).hits == 0
    c.close()


def test_the_asyncio_client_defers_and_flushes_alike(daemon):
    keys = ids(10, 16)

    async def run():
        a = await AsyncClient.connect(daemon.socket)
        try:
            for key in keys:
                assert await a.put(key, payload(3000, key), wait=False) is None
            assert a.core.deferred
            out = np.empty(3000, np.uint8)
            assert await a.get_into(keys[4], out) == 3000  # its own read stores them first
            assert np.array_equal(out, payload(3000, keys[4]))
            await a.put(ids(1, 17)[0], payload(10, 78), wait=False)
            results = await a.flush()
            assert [r.object_id for r in results] == keys + ids(1, 17)
            assert all(r.error is None for r in results)
        finally:
            await a.close()

    asyncio.run(run())
