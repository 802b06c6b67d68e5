"""The GPU tier in the daemon's chain: gets with gpu=True leased on device copies.

The real tier manager, host arena, leases and GpuCopies; the device is tests/kvs_testing's
NumpyDevice, the one stand-in for a GPU this machine lacks (tests/gpu and scripts/
gpu_check.sh run the real GpuTier and an engine mapping it by CUDA IPC on a lent GPU).
"""

import asyncio

import numpy as np
import pytest

from kvstore.config import HostTierConfig
from kvstore.errors import InvalidArgument
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvs_testing import NumpyDevice, payload
from kvstore.server.tiering.gpu_reads import GpuReads
from kvstore.server.later import is_ready, resolve
from kvstore.server.tiering.chain import compose
from kvstore.messages import Get
from kvstore.server.tiering.manager import TierManager

KiB = 1024


def manager_with_gpu(capacity_bytes: int | None = 8 * KiB):
    manager = TierManager(compose(HostTierConfig(arena_bytes=1 << 20, prefault=False)))
    device = None
    if capacity_bytes is not None:
        device = NumpyDevice(capacity_bytes)
        manager.chain.attach_gpu(GpuReads(device, manager.host))
    return manager, device


async def put(manager, i: int, size: int = 2 * KiB) -> ObjectId:
    ns = await manager.host.open_namespace("t")
    oid = ObjectId(bytes([i]) * 32)
    extent = await manager.host.allocate(ns, size, manager.chain.sink)
    np.frombuffer(ns.arena.view(extent), dtype=np.uint8)[:size] = payload(size, oid)
    manager.host.publish(ns, oid, extent, size, b"\0" * 16, StateDescriptor("t", "m", "r"), Hints())
    return oid


def test_a_gpu_get_is_leased_on_a_device_copy_holding_the_objects_bytes():
    manager, device = manager_with_gpu()

    async def scenario():
        oid = await put(manager, 1)
        first = manager.get("me", Get("t", oid, gpu=True))
        assert not is_ready(first)  # the copy is made off the loop
        first = await first
        second = manager.get("me", Get("t", oid, gpu=True))
        assert is_ready(second)  # the copy is there now: acquired at once
        host = manager.get("me", Get("t", oid))  # a reader without gpu still reads the arena
        return oid, first, second, host
    oid, first, second, host = asyncio.run(scenario())
    assert first.tier == second.tier == "gpu" and host.tier == "host"
    assert first.offset == second.offset and first.size == 2 * KiB
    got = device.buffer[first.offset:first.offset + first.size]
    assert np.array_equal(got, payload(2 * KiB, oid))
    manager.check_integrity()
    assert manager.chain.gpu.stats()["readers"] == 2
    for reply in (first, second, host):
        manager.release("me", reply.lease)
    assert manager.chain.gpu.stats()["readers"] == 0 and manager.chain.gpu.stats()["objects"] == 1
    manager.check_integrity()


def test_a_deleted_object_loses_its_device_copy_after_its_last_reader():
    manager, device = manager_with_gpu()

    async def scenario():
        oid = await put(manager, 2)
        reply = await resolve(manager.get("me", Get("t", oid, gpu=True)))
        assert await resolve(manager.index.delete("t", [oid])) == 1
        return reply
    reply = asyncio.run(scenario())
    assert manager.chain.gpu.stats()["objects"] == 0 and device.allocator.used_bytes > 0  # still read
    manager.check_integrity()
    manager.release("me", reply.lease)
    assert device.allocator.used_bytes == 0
    manager.check_integrity()


def test_a_gpu_tier_too_full_of_read_copies_leaves_the_get_on_the_host():
    manager, device = manager_with_gpu(capacity_bytes=4 * KiB)  # room for two 2 KiB copies

    async def scenario():
        oids = [await put(manager, i) for i in range(3)]
        held = [await resolve(manager.get("me", Get("t", oid, gpu=True))) for oid in oids[:2]]
        third = await resolve(manager.get("me", Get("t", oids[2], gpu=True)))
        return held, third
    held, third = asyncio.run(scenario())
    assert [r.tier for r in held] == ["gpu", "gpu"] and third.tier == "host" and third.hit
    manager.check_integrity()


def test_a_client_that_goes_away_gives_its_device_copies_back():
    manager, device = manager_with_gpu()

    async def scenario():
        oid = await put(manager, 4)
        await resolve(manager.get("me", Get("t", oid, gpu=True)))
    asyncio.run(scenario())
    assert manager.drop_owner("me") == 1
    assert manager.chain.gpu.stats()["readers"] == 0
    manager.check_integrity()


def test_a_failed_device_copy_serves_that_get_from_the_host_and_keeps_nothing(caplog):
    manager, device = manager_with_gpu()
    device.fail_next_copy = True

    async def scenario():
        oid = await put(manager, 5)
        first = await resolve(manager.get("me", Get("t", oid, gpu=True)))
        assert device.allocator.used_bytes == 0  # the room is given back
        return first, await resolve(manager.get("me", Get("t", oid, gpu=True)))  # the next one copies
    first, again = asyncio.run(scenario())
    assert first.hit and first.tier == "host" and again.tier == "gpu"
    assert "event=gpu_copy_failed" in caplog.text
    manager.check_integrity()


def test_without_a_gpu_tier_gpu_gets_are_host_gets_and_the_handle_is_refused():
    manager, _ = manager_with_gpu(capacity_bytes=None)

    async def scenario():
        oid = await put(manager, 3)
        return manager.get("me", Get("t", oid, gpu=True))
    reply = asyncio.run(scenario())
    assert is_ready(reply) and reply.tier == "host"
    with pytest.raises(InvalidArgument, match="runs no GPU tier"):
        manager.chain.gpu.handle()
    manager.check_integrity()


def test_a_get_cancelled_mid_copy_keeps_the_room_until_the_copy_thread_stops():
    """The copy runs in a thread that a cancelled get cannot stop: its device extent and the
    host hold are given back only once the thread is done, so nothing is placed where it
    still writes."""
    import threading
    manager, device = manager_with_gpu()
    gate, started = threading.Event(), threading.Event()
    plain_copy = device.copy_from_host

    def slow_copy(extent, src):
        started.set()
        gate.wait(10)
        plain_copy(extent, src)
    device.copy_from_host = slow_copy

    async def scenario():
        oid = await put(manager, 6)
        get = asyncio.ensure_future(resolve(manager.get("me", Get("t", oid, gpu=True))))
        while not started.is_set():
            await asyncio.sleep(0.01)
        get.cancel()
        await asyncio.gather(get, return_exceptions=True)
        assert manager.chain.gpu.stats()["copying"] == 1 and device.allocator.used_bytes > 0  # still the thread's
        assert manager.host.num_holds == 1  # and the host bytes under it stay put
        gate.set()
        while manager.chain.gpu.stats()["copying"]:
            await asyncio.sleep(0.01)
        return oid, await resolve(manager.get("me", Get("t", oid, gpu=True)))
    oid, reply = asyncio.run(scenario())
    assert reply.tier == "gpu" and manager.host.num_holds == 0  # the finished copy was kept
    assert np.array_equal(device.buffer[reply.offset:reply.offset + reply.size], payload(2 * KiB, oid))
    manager.check_integrity()
