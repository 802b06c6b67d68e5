"""Views of a read lease over a real daemon: read-only, dead after release, one meaning for a
ranged lease, and leases of the asyncio client as async context managers."""

import asyncio

import numpy as np
import pytest
import torch

from kvstore.client import AsyncClient
from kvstore.errors import InvalidArgument, LeaseEnded
from kvstore.identity import ObjectId

KEY = ObjectId(b"\x11" * 32)
OTHER = ObjectId(b"\x22" * 32)


def test_writing_a_lease_tensor_leaves_the_stored_object_unchanged(daemon):
    original = torch.arange(1024, dtype=torch.float32)
    with daemon.client() as c:
        c.put(KEY, original)
        with c.get(KEY) as lease:
            t = lease.tensor(torch.float32)
            t.mul_(2)  # the caller's copy: writable, and nobody else sees it
            assert np.array_equal(lease.numpy(np.float32), original.numpy())
        with c.get(KEY) as again:
            assert again.verify()
            assert torch.equal(again.tensor(torch.float32), original)
        assert torch.equal(t, original * 2)  # a copy outlives its lease


def test_views_of_a_released_lease_refuse(daemon):
    with daemon.client() as c:
        c.put(KEY, b"\x01" * 8192)
        lease = c.get(KEY)
        early = lease.buffer
        assert early[0] == 1
        lease.release()
        for view in (lambda: lease.numpy(), lambda: lease.tensor(), lambda: lease.buffer,
                     lambda: lease.read(0, 1)):
            with pytest.raises(LeaseEnded, match="has ended"):
                view()
        with pytest.raises(ValueError, match="released"):
            early[0]  # a buffer taken before release went dead with the lease
        c.delete([KEY])
        c.put(OTHER, b"\x02" * 8192)  # may land where KEY was
        with pytest.raises(ValueError, match="released"):
            bytes(early)


def test_a_ranged_lease_refuses_whole_object_views_on_this_node(daemon):
    data = np.arange(16384, dtype=np.uint8)
    with daemon.client() as c:
        c.put(KEY, data)
        with c.get(KEY, ranges=[(4096, 100)]) as lease:
            assert lease.ranges is None  # held here: leased whole, yet read only by range
            assert np.array_equal(lease.read(4096, 100), data[4096:4196])
            for view in (lambda: lease.numpy(), lambda: lease.tensor(), lambda: lease.buffer):
                with pytest.raises(InvalidArgument, match=r"read\(offset, length\)"):
                    view()


def test_async_client_leases_are_async_context_managers(daemon):
    async def main():
        c = await AsyncClient.connect(daemon.socket)
        try:
            await c.put(KEY, b"\x07" * 4096)
            async with await c.get(KEY) as lease:
                assert bytes(lease.read(0, 4)) == b"\x07" * 4
            assert lease.closed
            with await c.get(KEY) as lease:  # still a plain context manager too
                assert lease.numpy()[0] == 7
            assert lease.closed
            assert (await c.stats())["leases"] == 0
        finally:
            await c.close()

    asyncio.run(main())
