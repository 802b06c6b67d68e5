"""Typed peer replies keep the wire format daemons sent as plain maps, byte for byte: in a
cluster of mixed versions, what an older daemon sends still parses, and what a newer one
sends is what the older one parses. A malformed reply is a ProtocolError naming the field."""

import dataclasses

import pytest
from reply_wire import assert_sends_the_same_bytes, through_msgpack

from kvstore.errors import ProtocolError
from kvstore.identity import StateDescriptor
from kvstore.hints import Hints
from kvstore.peer_messages import PEER_OPS, RemoteMeta
from kvstore.peer_replies import (PEER_MISS, PEER_REPLIES, PeerDeleteReply, PeerGetReply, PeerLookupReply,
                                  PeerPinReply, PeerPutReply, peer_reply)
from kvstore.replies import ReplyMessage

CHECKSUM = b"\x01" * 16
RANGES_CHECKSUM = b"\x02" * 16
META = RemoteMeta(4096, CHECKSUM, StateDescriptor("t", "m", "r"))
META_HINTED = RemoteMeta(10, CHECKSUM, StateDescriptor("t", "m", "r", dtype="fp16"), Hints(ttl_s=30.0))
# RemoteMeta's own wire form is not what these tests pin (it has not changed): built once.
META_WIRE, HINTED_WIRE = META.to_wire(), META_HINTED.to_wire()

# (the map a daemon of before the typed replies sent, its typed reply): literal maps, as
# server/peer/service.py built them.
OLD_WIRE = [
    ({"meta": None}, PEER_MISS),
    ({"meta": META_WIRE}, PeerGetReply(META)),
    ({"meta": HINTED_WIRE, "ranges_checksum": RANGES_CHECKSUM}, PeerGetReply(META_HINTED, RANGES_CHECKSUM)),
    ({"stored": True}, PeerPutReply(True)),
    ({"stored": False}, PeerPutReply(False)),
    ({"metas": [META_WIRE, None, HINTED_WIRE]}, PeerLookupReply((META, None, META_HINTED))),
    ({"metas": []}, PeerLookupReply(())),
    ({"found": [True, False]}, PeerDeleteReply((True, False))),
    ({"pinned": [False, True, True]}, PeerPinReply((False, True, True))),
    ({"pinned": []}, PeerPinReply(())),
]


@pytest.mark.parametrize("wire, typed", OLD_WIRE)
def test_typed_peer_replies_send_the_bytes_the_plain_maps_did(wire, typed):
    assert_sends_the_same_bytes(typed.to_wire(), wire)


def test_a_get_hit_with_its_payload_field_sends_the_old_bytes():
    """The service adds the transport's payload_bytes after the reply's own fields."""
    old = {"meta": META_WIRE, "ranges_checksum": RANGES_CHECKSUM, "payload_bytes": 30}
    new = PeerGetReply(META, RANGES_CHECKSUM).to_wire()
    new["payload_bytes"] = 30
    assert_sends_the_same_bytes(new, old)


@pytest.mark.parametrize("wire, typed", OLD_WIRE)
def test_typed_peer_replies_parse_what_an_older_daemon_sends(wire, typed):
    assert type(typed).from_wire(through_msgpack(wire)) == typed


def test_fields_a_newer_daemon_adds_are_ignored():
    assert PeerGetReply.from_wire({"meta": META_WIRE, "payload_bytes": 4096, "tier": "nvme"}) == PeerGetReply(META)
    assert PeerPutReply.from_wire({"stored": True, "durability": "sync"}) == PeerPutReply(True)


@pytest.mark.parametrize("kind, wire, message", [
    (PeerGetReply, ["meta"], "PeerGetReply: .* not a map: list"),
    (PeerGetReply, None, "PeerGetReply: .* not a map"),
    (PeerGetReply, {}, "PeerGetReply: .* lacks 'meta'"),
    (PeerGetReply, {"meta": 5}, "PeerGetReply.meta: "),
    (PeerGetReply, {"meta": {"checksum": CHECKSUM, "descriptor": META_WIRE["descriptor"]}}, "PeerGetReply.meta: .*size"),
    (PeerGetReply, {"meta": {**META_WIRE, "size": "4096"}}, "PeerGetReply.meta: "),
    (PeerGetReply, {"meta": {**META_WIRE, "descriptor": {"namespace": []}}}, "PeerGetReply.meta: "),
    (PeerGetReply, {"meta": META_WIRE, "ranges_checksum": 7}, "PeerGetReply.ranges_checksum: expected bytes"),
    (PeerPutReply, {"stored": 1}, "PeerPutReply.stored: expected true or false"),
    (PeerPutReply, {"stored": None}, "PeerPutReply.stored: "),
    (PeerPutReply, "stored", "PeerPutReply: .* not a map: str"),
    (PeerLookupReply, {"metas": {"a": 1}}, "PeerLookupReply.metas: expected a list"),
    (PeerLookupReply, {"metas": [META_WIRE, 3]}, "PeerLookupReply.metas: "),
    (PeerLookupReply, {"found": []}, "PeerLookupReply: .* lacks 'metas'"),
    (PeerDeleteReply, {"found": [True, 1]}, "PeerDeleteReply.found: expected a list of true or false"),
    (PeerDeleteReply, {"found": "ab"}, "PeerDeleteReply.found: "),
    (PeerPinReply, {"pinned": None}, "PeerPinReply.pinned: "),
    (PeerPinReply, 3, "PeerPinReply: .* not a map: int"),
])
def test_a_malformed_peer_reply_is_a_protocol_error_naming_the_reply_and_field(kind, wire, message):
    with pytest.raises(ProtocolError, match=message):
        kind.from_wire(wire)


def test_every_peer_op_has_its_reply_kind():
    assert set(PEER_REPLIES) == set(PEER_OPS)


def test_a_peer_reply_field_without_a_checking_decoder_is_refused():
    with pytest.raises(TypeError, match=r"\['stored'\] need a checking decoder"):
        @peer_reply
        class Unchecked(ReplyMessage):  # noqa: F841 (the decorator refuses it)
            stored: bool


def test_peer_replies_are_frozen_slotted_dataclasses():
    reply = PeerGetReply(META)
    assert reply.ranges_checksum is None and not hasattr(reply, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        reply.meta = None
