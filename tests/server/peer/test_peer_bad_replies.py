"""A peer that answers wrong (an old or broken daemon): each malformed reply is a miss or a
failed call for that peer, never an exception in the daemon, and the peer stays up.

The peer is a real service on loopback whose request handler is replaced by one that sends
a fixed reply (and payload bytes, when the reply announces some), so the reply crosses the
real frames, client and link pool before the remote tier decodes it."""

import numpy as np
import pytest
from peer_helpers import make_object, remote_tier, run, services, transport_or_skip

from kvstore.identity import ObjectId
from kvstore.protocol import Reply
from kvstore.server.peer.transport import payload_bytes

OID, META, DATA = make_object(4096, seed=3)
META_WIRE = META.to_wire()
OTHER = ObjectId(b"\x09" * 32)
IDS = [OID, OTHER]


def with_bytes(result: dict, nbytes: int = META.size) -> tuple:
    return {**result, "payload_bytes": nbytes}, bytes(nbytes)


def get(tier):
    out = np.empty(META.size, np.uint8)
    return tier.get_into("ns", OID, lambda meta: out)


def ranged_get(tier):
    out = np.empty(10, np.uint8)
    return tier.get_ranges_into("ns", OID, ((0, 10),), lambda meta: out)


# (what the tier is asked, what it answers for a peer that failed, the peer's replies)
CASES = {
    "get": (get, None, [
        (["meta"], None), ("hit", None), ({}, None), ({"meta": 5}, None),
        with_bytes({}), with_bytes({"meta": None}), with_bytes({"meta": 5}), with_bytes({"meta": [META_WIRE]}),
        with_bytes({"meta": {"checksum": META.checksum, "descriptor": META_WIRE["descriptor"]}}),  # no size
        with_bytes({"meta": {**META_WIRE, "checksum": "not bytes"}}),
        with_bytes({"meta": META_WIRE}, META.size - 1),  # fewer bytes than the meta says
    ]),
    "ranged get": (ranged_get, None, [
        with_bytes({"meta": META_WIRE}, 10), with_bytes({"meta": META_WIRE, "ranges_checksum": 7}, 10),
        with_bytes({"meta": META_WIRE, "ranges_checksum": b"\x00" * 16}, 10),
    ]),
    "put": (lambda tier: tier.put("ns", OID, META, DATA), [], [
        ({}, None), ({"stored": "yes"}, None), ({"stored": 1}, None), (None, None), ([True], None),
    ]),
    "lookup": (lambda tier: tier.lookup("ns", IDS), [None, None], [
        ({}, None), ({"metas": 3}, None), ({"metas": [META_WIRE]}, None), ({"metas": [META_WIRE, 3]}, None),
        ({"metas": [{"checksum": META.checksum, "descriptor": META_WIRE["descriptor"]}, None]}, None),
        ({"metas": [{**META_WIRE, "descriptor": {**META_WIRE["descriptor"], "namespace": "other"}}, None]}, None),
        ("metas", None),
    ]),
    "held_on": (lambda tier: tier.held_on("b", "ns", IDS), None, [
        ({}, None), ({"metas": None}, None), ({"metas": [None]}, None), ({"metas": [{"size": 1}, None]}, None),
    ]),
    "delete": (lambda tier: tier.delete("ns", IDS), [False, False], [
        ({}, None), ({"found": [1, 1]}, None), ({"found": [True]}, None), ({"found": "ab"}, None), (7, None),
    ]),
    "pin": (lambda tier: tier.pin("ns", IDS, 30.0), [False, False], [
        ({}, None), ({"pinned": [1, 0]}, None), ({"pinned": [True, True, True]}, None), ({"pinned": None}, None),
    ]),
    "unpin": (lambda tier: tier.pin("ns", IDS, None, unpin=True), [False, False], [
        ({"pinned": [None, None]}, None), ([], None),
    ]),
}


def canned(service, result, payload):
    """Make `service` answer every request with `result` (+ `payload`), after the handshake."""
    async def answer(channel, request):
        pending = payload_bytes(request.args)
        if pending:  # a put's bytes: read past them, as the real service does
            await channel.discard(pending)
        await channel.send(Reply(request.id, result), payload)
    service._handle = answer


@pytest.mark.parametrize("call, failed, replies", CASES.values(), ids=CASES.keys())
def test_a_malformed_peer_reply_is_a_failed_call_never_an_exception(call, failed, replies):
    transport = transport_or_skip("tcp")

    async def scenario():
        answers = []
        async with services(transport, names=("b",)) as started:
            service, address = started["b"]
            tier = remote_tier(transport, {"b": address})
            for result, payload in replies:
                canned(service, result, payload)
                answers.append(await call(tier))
            # The link and the peer survived every bad reply: a real answer still gets through.
            del service._handle
            stored = await tier.put("ns", OID, META, DATA)
            out = np.empty(META.size, np.uint8)
            got = await tier.get_into("ns", OID, lambda meta: out)
            tier.check_integrity()
            await tier.close()
            return answers, stored, got, out, tier.stats()

    answers, stored, got, out, stats = run(scenario())
    assert answers == [failed] * len(replies)
    assert stats["peers_down"] == [] and stats["num_peer_failures"] == 0  # it answered: up, if wrong
    assert stored == ["b"] and got == META and np.array_equal(out, DATA)
