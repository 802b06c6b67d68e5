"""get_many_into: many objects into caller buffers, pipelined, every lease released."""

import asyncio

import numpy as np
import pytest

from kvstore.client import AsyncClient
from kvstore import StateDescriptor, chunk_keys
from kvstore.errors import InvalidArgument
from kvstore.identity import ObjectId

DESC = StateDescriptor("default", "m", "r", kind="kv", dtype="bf16",
                       layout="paged(order=layer_first,layers=1,block=16,kv_heads=1,head_dim=8)", chunk_tokens=16)


def ids(n, seed):
    rng = np.random.default_rng(seed)
    return [ObjectId(rng.bytes(32)) for _ in range(n)]


def data(i, size=4096):
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def test_many_hits_and_misses_come_back_bit_exact_in_one_call(daemon):
    keys = ids(1500, 1)  # more than one pipelined batch (1,024)
    with daemon.client() as c:
        assert all(r.error is None for r in c.put_many([(k, data(i)) for i, k in enumerate(keys) if i % 3]))
        outs = [np.zeros(4096, np.uint8) for _ in keys]
        sizes = c.get_many_into(list(zip(keys, outs)))
        assert sizes == [None if i % 3 == 0 else 4096 for i in range(len(keys))]
        for i, out in enumerate(outs):
            assert np.array_equal(out, data(i) if i % 3 else np.zeros(4096, np.uint8)), i
        assert c.stats()["leases"] == 0


def test_a_buffer_too_small_raises_after_the_others_and_leaks_no_lease(daemon):
    keys = ids(3, 2)
    with daemon.client() as c:
        c.put_many([(k, data(i)) for i, k in enumerate(keys)])
        outs = [np.zeros(4096, np.uint8), np.zeros(10, np.uint8), np.zeros(4096, np.uint8)]
        with pytest.raises(InvalidArgument, match="output buffer only 10"):
            c.get_many_into(list(zip(keys, outs)))
        assert np.array_equal(outs[0], data(0)) and np.array_equal(outs[2], data(2))
        assert c.stats()["leases"] == 0


def test_chunk_keys_expect_their_descriptor_and_the_async_client_agrees(daemon):
    tokens = list(range(32))
    mine, other = chunk_keys(tokens, DESC), chunk_keys(tokens, DESC.with_(model="m2"))
    with daemon.client() as c:
        for k in mine:
            c.put(k, data(k.index, DESC.object_bytes))
        outs = [np.zeros(DESC.object_bytes, np.uint8) for _ in mine]
        assert c.get_many_into([(k, o) for k, o in zip(mine, outs)]) == [DESC.object_bytes] * 2
        assert c.get_many_into([(k, o) for k, o in zip(other, outs)]) == [None, None]
        # An ObjectId with an expectation it was not stored under is a miss too.
        assert c.get_many_into([(mine[0].object_id, outs[0])], expect=DESC.with_(model="m2")) == [None]

    async def run():
        a = await AsyncClient.connect(daemon.socket)
        try:
            out = np.zeros(DESC.object_bytes, np.uint8)
            assert await a.get_many_into([(mine[1], out)]) == [DESC.object_bytes]
            assert np.array_equal(out, data(1, DESC.object_bytes))
        finally:
            await a.close()

    asyncio.run(run())
