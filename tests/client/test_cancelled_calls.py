"""A call cancelled or interrupted mid-way never leaves its replies, fds or leases for a later
call to take (issue 41, items 3 and 4): the client closes that connection and the next call
opens a new one."""

import asyncio

import numpy as np
import pytest

from kvstore.client import AsyncClient, Client
from kvstore.errors import DaemonUnavailable, LeaseEnded
from kvstore.client.core import Later
from kvstore.identity import ObjectId
from kvstore.messages import ReserveMany
from kvs_testing import payload, read_back, wait_until

SIZE = 64 << 10
KEY_X, KEY_Y = ObjectId(b"x" * 32), ObjectId(b"y" * 32)


@pytest.fixture
def two_tenants(daemon_factory):
    """A daemon with one object in namespace x and one in y (each namespace its own arena)."""
    d = daemon_factory("8MiB")
    with Client.connect(d.socket, namespace="x") as c:
        c.put(KEY_X, payload(SIZE, 1))
    with Client.connect(d.socket, namespace="y") as c:
        c.put(KEY_Y, payload(SIZE, 2))
    return d


def assert_tenants_intact(d):
    """A fresh client reads each namespace's own bytes."""
    with Client.connect(d.socket, namespace="x") as c:
        assert np.array_equal(read_back(c, KEY_X, SIZE), payload(SIZE, 1))
    with Client.connect(d.socket, namespace="y") as c:
        assert np.array_equal(read_back(c, KEY_Y, SIZE), payload(SIZE, 2))


def test_a_cancelled_get_into_never_hands_its_namespace_to_the_next_call(two_tenants):
    """Before the fix the cancelled open's arena fd stayed queued, the next open (of y) mapped
    x's arena: y's read returned x's bytes and a put into y landed in x's arena."""
    async def run():
        c = await AsyncClient.connect(two_tenants.socket, namespace="x")
        out = np.zeros(SIZE, np.uint8)
        task = asyncio.ensure_future(c.get_into(KEY_X, out, namespace="x"))
        await asyncio.sleep(0)  # the open of x is sent, its reply not read
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        got = np.zeros(SIZE, np.uint8)
        assert await c.get_into(KEY_Y, got, namespace="y") == SIZE
        assert np.array_equal(got, payload(SIZE, 2)), "read another namespace's bytes"
        await c.put(ObjectId(b"z" * 32), payload(SIZE, 3), desc=None)
        await c.close()
    asyncio.run(run())
    assert_tenants_intact(two_tenants)
    with Client.connect(two_tenants.socket, namespace="x") as c:
        assert np.array_equal(read_back(c, ObjectId(b"z" * 32), SIZE), payload(SIZE, 3))


def test_a_sync_call_interrupted_before_its_reply_never_hands_it_to_the_next_call(two_tenants):
    c = Client.connect(two_tenants.socket, namespace="x")
    read = c._read_replies_into

    def interrupted(wanted):  # the KeyboardInterrupt lands after the open of x was sent
        c._read_replies_into = read
        raise KeyboardInterrupt
    c._read_replies_into = interrupted
    with pytest.raises(KeyboardInterrupt):
        c.get_into(KEY_X, np.zeros(SIZE, np.uint8), namespace="x")
    got = np.zeros(SIZE, np.uint8)
    assert c.get_into(KEY_Y, got, namespace="y") == SIZE
    assert np.array_equal(got, payload(SIZE, 2)), "read another namespace's bytes"
    c.close()
    assert_tenants_intact(two_tenants)


def test_gets_cancelled_in_flight_leave_no_lease_held(daemon_factory):
    """Before the fix 20 cancelled gets left their leases held: the next get failed with
    LimitExceeded until the client reconnected."""
    d = daemon_factory("16MiB", config={"limits": {"max_leases_per_client": 8}})
    keys = [ObjectId(bytes([i]) * 32) for i in range(20)]

    async def run():
        c = await AsyncClient.connect(d.socket, shared_index=False)  # every get a round trip
        for i, key in enumerate(keys):
            await c.put(key, payload(SIZE, i))
        for key in keys:
            task = asyncio.ensure_future(c.get(key))
            await asyncio.sleep(0)  # sent; its reply, and the lease it grants, not read yet
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await c.stats()  # (connected again: the next get's first await is its own reply)
        leases = [await c.get(key) for key in keys[:8]]  # the whole quota, again
        assert all(lease is not None for lease in leases)
        for i, lease in enumerate(leases):
            assert np.array_equal(lease.numpy(), payload(SIZE, i))
            lease.release()
        await c.close()
    asyncio.run(run())
    with d.client() as c:
        wait_until(lambda: c.stats()["leases"] == 0, 10, "every lease given back")


def test_a_lease_of_an_abandoned_connection_refuses_to_read(daemon_factory):
    """Its extent may hold another object once the daemon ended the lease with the connection."""
    d = daemon_factory("8MiB")
    async def run():
        c = await AsyncClient.connect(d.socket, shared_index=False)
        await c.put(KEY_X, payload(SIZE, 1))
        lease = await c.get(KEY_X)
        task = asyncio.ensure_future(c.lookup([KEY_X]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(LeaseEnded, match="connection to the daemon closed"):
            lease.numpy()
        lease.release()  # nothing to send: the daemon ended it with the connection
        assert (await c.lookup([KEY_X])).hits == 1  # the next call reconnected
        await c.close()
    asyncio.run(run())


def test_deferred_puts_survive_a_cancelled_call(daemon_factory):
    """Deferred puts held in the client (never sent) are stored by the next connection."""
    d = daemon_factory("8MiB")

    async def run():
        c = await AsyncClient.connect(d.socket)
        await c.put(KEY_X, payload(SIZE, 1), wait=False)
        task = asyncio.ensure_future(c.lookup([KEY_Y]))  # stores the deferred put first
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await c.put(KEY_Y, payload(SIZE, 2), wait=False)
        results = await c.flush()
        await c.close()
        return results
    results = asyncio.run(run())
    assert [r.object_id for r in results] == [KEY_X, KEY_Y]
    # The first was being stored when the call was cancelled: stored, or said not to be.
    assert results[1].error is None
    with d.client() as c:
        assert np.array_equal(read_back(c, KEY_Y, SIZE), payload(SIZE, 2))
        if results[0].error is None:
            assert np.array_equal(read_back(c, KEY_X, SIZE), payload(SIZE, 1))


def test_a_put_whose_connection_closes_after_its_reservation_came_says_daemon_unavailable(daemon_factory):
    """The reader may see the close after the reserve reply but before the put runs on (the
    checker's async workers did, with the daemon restarted under them): the reservation ended
    with the connection and the arena was forgotten. The put went on and failed with a
    KeyError (a crash, not an error of the store); it says DaemonUnavailable, and a reconnected
    client stores the object."""
    d = daemon_factory("8MiB")
    BIG = 1 << 20  # larger than an inline put: reserved, copied, committed

    async def run():
        c = await AsyncClient.connect(d.socket, namespace="x")
        exchange = c._exchange

        reserving = []

        async def lost_after_reserve(requests, later):
            replies = await exchange(requests, later)
            if isinstance(requests, Later) and any(r.op == ReserveMany.op for r in requests):
                reserving.extend(replies)  # the futures of the reserve replies
            elif any(fut is not None and any(fut is f for f in reserving) for fut in requests):
                c._lost("connection closed")  # what the reader does on the close that follows
            return replies
        c._exchange = lost_after_reserve
        with pytest.raises(DaemonUnavailable, match="during this call"):
            await c.put(KEY_X, payload(BIG, 1))
        c._exchange = exchange
        await c.reconnect()
        await c.put(KEY_X, payload(BIG, 1))
        await c.close()
    asyncio.run(run())
    with Client.connect(d.socket, namespace="x") as c:
        assert np.array_equal(read_back(c, KEY_X, BIG), payload(BIG, 1))
        wait_until(lambda: c.stats()["leases"] == 0, 10, "the lost connection's reservation given back")
