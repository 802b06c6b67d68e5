"""Later/Collect (client/core.py): an op sends requests now and collects their replies after
other round trips, in both drivers; replies it never collects do not reach the next op."""

import asyncio
import os

import numpy as np

from kvstore.client import AsyncClient
from kvstore.client.core import Collect, Later
from kvstore import messages as m
from kvstore import replies as r


def lookup(core, oid: bytes):
    return core.request(m.Lookup("default", (oid,)))


def interleaved(core, stored: bytes, absent: bytes):
    """Two lookups sent with Later, a round trip between, then collected in reverse order."""
    first = yield Later([lookup(core, stored)])
    second = yield Later([lookup(core, absent)])
    (between,) = yield [lookup(core, stored)]
    (late_second,) = yield Collect(second)
    (late_first,) = yield Collect(first)
    return [core.result(x, r.LookupReply).hits for x in (late_first, late_second, between)]


def abandoned(core, oid: bytes):
    yield Later([lookup(core, oid) for _ in range(5)])  # never collected


def hits_of(core, oid: bytes):
    (reply,) = yield [lookup(core, oid)]
    return core.result(reply, r.LookupReply).hits


def test_later_replies_reach_their_collect_across_round_trips_sync(daemon):
    stored, absent = os.urandom(32), os.urandom(32)
    with daemon.client() as c:
        c.put(stored, np.ones(4096, np.uint8))
        assert c._run(interleaved(c.core, stored, absent)) == [1, 0, 1]
        c._run(abandoned(c.core, stored))
        assert not c._later  # nothing kept for the abandoned replies
        assert c._run(hits_of(c.core, absent)) == 0  # not one of the abandoned replies (hits 1)
        assert c._run(hits_of(c.core, stored)) == 1


def test_later_replies_reach_their_collect_across_round_trips_asyncio(daemon):
    stored, absent = os.urandom(32), os.urandom(32)

    async def main():
        c = await AsyncClient.connect(daemon.socket)
        try:
            await c.put(stored, np.ones(4096, np.uint8))
            assert await c._run(interleaved(c.core, stored, absent)) == [1, 0, 1]
            await c._run(abandoned(c.core, stored))
            assert await c._run(hits_of(c.core, absent)) == 0
            assert await c._run(hits_of(c.core, stored)) == 1
            assert not c._waiting  # nothing left waiting for the abandoned replies
        finally:
            await c.close()
    asyncio.run(main())
