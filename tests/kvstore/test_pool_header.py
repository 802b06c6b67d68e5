"""The header in front of every object in a Mooncake pool (kvstore/pool_header.py): round
trip, and every kind of damage or mismatch refused."""

import pytest

from kvstore import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.peer_messages import RemoteMeta
from kvstore.pool_header import HEADER_BYTES, PoolHeaderError, decode_header, encode_header, pool_key

OID = ObjectId(b"\x11" * 32)
META = RemoteMeta(1234, b"\x22" * 16, StateDescriptor("ns", "m", "r"), Hints(priority=3))


def test_round_trip_and_fixed_size():
    header = encode_header(OID, META)
    assert len(header) == HEADER_BYTES
    assert decode_header(header, "ns", OID) == META


def test_key_names_the_namespace():
    assert pool_key("kvstore/", "ns", OID) == "kvstore/ns/" + "11" * 32
    assert pool_key("kvstore/", "a", OID) != pool_key("kvstore/", "b", OID)


@pytest.mark.parametrize("damage", ["magic", "body", "length", "short"])
def test_damaged_header_is_refused(damage):
    header = bytearray(encode_header(OID, META))
    if damage == "magic":
        header[0] ^= 1
    elif damage == "body":
        header[40] ^= 1
    elif damage == "length":
        header[8:12] = (HEADER_BYTES).to_bytes(4, "little")
    else:
        header = header[:100]
    with pytest.raises(PoolHeaderError):
        decode_header(bytes(header), "ns", OID)


def test_other_object_or_namespace_is_refused():
    header = encode_header(OID, META)
    with pytest.raises(PoolHeaderError, match="another object"):
        decode_header(header, "ns", ObjectId(b"\x12" * 32))
    with pytest.raises(PoolHeaderError, match="namespace"):
        decode_header(header, "other", OID)


def test_metadata_that_does_not_fit_is_not_stored():
    longest = RemoteMeta(1, b"\x00" * 16, StateDescriptor("n" * 256, "m" * 256, "r" * 256),
                         Hints(session_id="s" * 128, branch_id="b" * 128))
    assert decode_header(encode_header(OID, longest), "n" * 256, OID) == longest

    class Oversized:  # metadata past the header, however it came to be
        hints = Hints()

        def to_wire(self):
            return {"size": 1, "descriptor": "d" * HEADER_BYTES}

    with pytest.raises(ValueError, match="does not fit"):
        encode_header(OID, Oversized())
