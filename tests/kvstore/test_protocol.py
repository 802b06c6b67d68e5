import os
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import StateDescriptor
from kvstore import messages as m
from kvstore import replies as r
from kvstore.errors import InvalidArgument, ProtocolError
from kvstore.identity import ObjectId
from kvstore.protocol import (MAX_BATCH, MAX_FRAME_BYTES, NEED_DATA, BadFrame, Fatal, FrameCodec, Reply,
                              Request)


def frame(body) -> bytes:
    data = msgpack.packb(body, use_bin_type=True)
    return struct.pack("<I", len(data)) + data


def drain(codec):
    events = []
    while (event := codec.next_event()) is not NEED_DATA:
        events.append(event)
        if isinstance(event, Fatal):
            break
    return events


def test_request_reply_round_trip_through_memory():
    client, server = FrameCodec(), FrameCodec()
    req = Request(7, "lookup", {"namespace": "t", "ids": [b"\x01" * 32]})
    server.receive_data(client.send_request(req))
    assert server.next_event() == req and server.next_event() is NEED_DATA
    client.receive_data(server.send_reply(Reply(7, {"hits": 1})))
    assert client.next_event() == Reply(7, {"hits": 1})


def test_pipelined_frames_split_at_every_byte():
    client, server = FrameCodec(), FrameCodec()
    reqs = [Request(i, "stats", {}, no_reply=i % 2 == 0) for i in range(1, 6)]
    stream = b"".join(client.send_request(r) for r in reqs)
    events = []
    for i in range(len(stream)):
        server.receive_data(stream[i:i + 1])
        events += drain(server)
    assert events == reqs


def test_error_reply_round_trip():
    codec = FrameCodec()
    codec.receive_data(codec.send_reply(Reply(3, error={"code": "capacity", "message": "full"})))
    event = codec.next_event()
    assert not event.ok and event.error["code"] == "capacity"


@pytest.mark.parametrize("raw, match", [
    (struct.pack("<I", 3) + b"\xc1\xc1\xc1", "undecodable"),               # msgpack's never-used byte
    (frame([1, 2, 3]), "must be a map"),
    (frame({"v": 1, "op": "stats"}), "request id"),
    (frame({"v": 1, "id": -4, "op": "stats"}), "request id"),
    (frame({"v": 1, "id": True, "op": "stats"}), "request id"),
    (frame({"v": 99, "id": 5, "op": "stats"}), "version"),
    (frame({"v": 1, "id": 5, "op": 17}), "op must be"),
    (frame({"v": 1, "id": 5, "op": "get", "a": [1]}), "args must be a map"),
    (frame({"v": 1, "id": 5, "op": "get", "a": {str(i): i for i in range(40)}}), "at most"),
    (frame({"v": 1, "id": 5}), "neither"),
    (frame({"v": 1, "id": 5, "e": "boom"}), "error reply"),
    (frame({1: 2}), "undecodable"),                                        # non-string map keys
    (frame({"v": 1, "id": 5, "op": "x" * 5000}), "undecodable"),           # string past the limit
])
def test_every_malformed_frame_class_is_a_typed_event(raw, match):
    codec = FrameCodec()
    codec.receive_data(raw + FrameCodec().send_request(Request(9, "stats", {})))
    bad, good = codec.next_event(), codec.next_event()
    assert isinstance(bad, BadFrame) and match in bad.error.message
    assert isinstance(bad.error, ProtocolError)
    assert good == Request(9, "stats", {})  # the stream goes on after a bad frame


def test_oversized_length_is_fatal_and_stays_fatal():
    codec = FrameCodec()
    codec.receive_data(struct.pack("<I", MAX_FRAME_BYTES + 1) + b"xx")
    event = codec.next_event()
    assert isinstance(event, Fatal) and "exceeds" in event.error.message
    codec.receive_data(FrameCodec().send_request(Request(1, "stats", {})))
    assert isinstance(codec.next_event(), Fatal)


def test_truncated_frame_waits_for_more():
    data = FrameCodec().send_request(Request(1, "stats", {}))
    codec = FrameCodec()
    codec.receive_data(data[:-1])
    assert codec.next_event() is NEED_DATA
    codec.receive_data(data[-1:])
    assert codec.next_event() == Request(1, "stats", {})


def test_sending_an_oversized_message_raises():
    with pytest.raises(ProtocolError, match="frame limit"):
        FrameCodec().send_reply(Reply(1, b"x" * (MAX_FRAME_BYTES + 1)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_raise(data):
    codec = FrameCodec()
    codec.receive_data(data)
    for event in drain(codec):
        assert isinstance(event, (Request, Reply, BadFrame, Fatal))


# --- typed messages ------------------------------------------------------------------

def _oid():
    return ObjectId(os.urandom(32))


@pytest.mark.parametrize("msg", [
    m.Hello("engine", 123), m.OpenNamespace("t"), m.OpenNamespace("t", "tok"),
    m.Reserve("t", _oid(), 4096, StateDescriptor("t", "m", "r")),
    m.CommitMany.of([5, 6], [b"\x00" * 16, b"\x01" * 16]), m.Abort(5), m.Get("t", _oid()), m.Get("t", _oid(), ("bf16",)),
    m.Get("t", _oid(), expect=StateDescriptor("t", "m", "r")),
    m.Lookup("t", (_oid(), _oid()), (StateDescriptor("t", "m", "r"),)),
    m.Lookup("t", (_oid(), _oid()), (StateDescriptor("t", "m", "r"), StateDescriptor("t", "m2", "r")), b"\x01\xff"),
    m.Release(5), m.Lookup("t", (_oid(), _oid())), m.Delete("t", (_oid(),)), m.Pin("t", (_oid(),), 3.0),
    m.Unpin("t", ()), m.Prefetch("t", (_oid(),), "host", "wait", 0.5), m.Stats(),
])
def test_every_message_survives_the_wire(msg):
    client, server = FrameCodec(), FrameCodec()
    server.receive_data(client.send_request(Request(1, msg.op, msg.to_args())))
    decoded = m.decode_request(server.next_event())
    if isinstance(msg, m.Get) and msg.accept:
        assert [d.value for d in decoded.accept] == list(msg.accept)
    else:
        assert decoded == msg


def test_ids_packed_or_listed_decode_alike_and_keep_trailing_zero_bytes():
    """A lookup's ids come packed (one bin, what to_args sends) or, from a client from
    before the packed form, as a list of bins; both give the same ids, an id ending in zeros
    included (numpy's bytes dtype would have stripped them)."""
    ids = (b"\x01" + b"\x00" * 31, bytes(range(32)), b"\x00" * 32, _oid())
    sent = m.Lookup("t", ids).to_args()
    assert sent["ids"] == b"".join(ids)
    packed = m.decode_request(Request(1, "lookup", sent))
    listed = m.decode_request(Request(1, "lookup", {"namespace": "t", "ids": [bytes(i) for i in ids]}))
    assert packed.ids == listed.ids == tuple(bytes(i) for i in ids)
    assert all(type(i) is bytes and len(i) == 32 for i in packed.ids)
    assert m.decode_request(Request(1, "lookup", {"namespace": "t", "ids": b""})).ids == ()


@pytest.mark.parametrize("op, args, match", [
    ("nope", {}, "unknown op"),
    ("get", {"namespace": "t"}, "missing field 'object_id'"),
    ("get", {"namespace": "t", "object_id": b"short"}, "32 bytes"),
    ("get", {"namespace": "t", "object_id": "00" * 32}, "msgpack bin"),
    ("get", {"namespace": "", "object_id": b"\x00" * 32}, "namespace"),
    ("get", {"namespace": "t", "object_id": b"\x00" * 32, "accept": ["int3"]}, "unknown dtype"),
    ("get", {"namespace": "t", "object_id": b"\x00" * 32, "evil": 1}, "unknown field"),
    ("reserve", {"namespace": "t", "object_id": b"\x00" * 32, "size": -1, "descriptor": {}}, "size"),
    ("reserve", {"namespace": "t", "object_id": b"\x00" * 32, "size": 1, "descriptor": {"namespace": "t"}}, "descriptor"),
    ("commit_many", {"leases": m.pack_uints([1]), "checksums": b"\x00" * 8}, "commit_many.checksums"),
    ("commit_many", {"leases": m.pack_uints([1, 2]), "checksums": b"\x00" * 16}, "2 leases but 1 checksums"),
    ("commit", {"lease": 1, "checksum": b"\x00" * 16}, "unknown op 'commit'"),  # removed: clients send commit_many
    ("lookup", {"namespace": "t", "ids": [b"\x00" * 32] * (MAX_BATCH + 1)}, "at most"),
    ("lookup", {"namespace": "t", "ids": b"\x00" * 32 * (MAX_BATCH + 1)}, f"at most {MAX_BATCH} ids"),
    ("lookup", {"namespace": "t", "ids": b"\x00" * 33}, "lookup.ids: packed ids must be a multiple of 32 bytes"),
    ("lookup", {"namespace": "t", "ids": [b"\x00" * 32, "ab" * 16]}, "every object id must be 32 bytes"),
    ("lookup", {"namespace": "t", "ids": [b"\x00" * 32], "codes": 1}, "lookup.codes"),
    ("lookup", {"namespace": "t", "ids": [b"\x00" * 32], "expect": []}, "lookup.expect: must be a list of 1..16"),
    ("lookup", {"namespace": "t", "ids": [b"\x00" * 32], "expect_of": b"\x00"}, "expect_of needs expect"),
    ("lookup", {"namespace": "t", "ids": [b"\x00" * 32], "expect": [{"namespace": "t", "model": "m",
                "model_revision": "r"}], "expect_of": b"\x01"}, "index past expect's 1"),
    ("get", {"namespace": "t", "object_id": b"\x00" * 32, "expect": {"model": "m"}}, "get.expect"),
    ("pin", {"namespace": "t", "ids": [], "ttl_s": float("nan")}, r"pin\.ttl_s: ttl_s must be a number of seconds"),
    # issue 41 item 14: TTLs past a century are refused on the wire as where they are made
    ("pin", {"namespace": "t", "ids": [], "ttl_s": 2**64 - 1}, r"pin\.ttl_s: .* in 0\.\.3,153,600,000"),
    ("pin", {"namespace": "t", "ids": [], "ttl_s": 1e300}, r"pin\.ttl_s: .* in 0\.\.3,153,600,000"),
    ("pin", {"namespace": "t", "ids": [], "ttl_s": 0}, r"pin\.ttl_s: ttl_s must be > 0 seconds"),
    ("put_inline", {"namespace": "t", "object_id": b"\x00" * 32, "data": b"x",
                    "descriptor": {"namespace": "t", "model": "m", "model_revision": "r"},
                    "hints": {"ttl_s": 2**64 - 1}}, r"put_inline\.hints: hint ttl_s must be a number of seconds"),
    ("prefetch", {"namespace": "t", "ids": [], "tier": "moon"}, "one of"),
    # issue 41 item 15: a namespace that would forge a log line is refused as the client refuses it
    ("open", {"namespace": "x\nts=1 level=error"}, r"open\.namespace: namespace must be .* control character"),
    ("lookup", {"namespace": "t", "ids": [b"\x00" * 32], "expect": [{"namespace": "t\x1b", "model": "m",
                "model_revision": "r"}]}, r"lookup\.expect: namespace must be .* control character"),
])
def test_hostile_values_get_errors_that_name_the_field(op, args, match):
    with pytest.raises((InvalidArgument, ProtocolError), match=match):
        m.decode_request(Request(1, op, args))


def test_a_removed_op_is_refused_as_unknown_and_its_name_is_not_reused():
    assert m.RETIRED_OPS and not m.RETIRED_OPS & (set(m.OPS) | set(r.REPLIES))
    for op in sorted(m.RETIRED_OPS):
        with pytest.raises(ProtocolError) as removed:
            m.decode_request(Request(1, op, {}))
        with pytest.raises(ProtocolError) as unknown:
            m.decode_request(Request(1, "no_such_op", {}))
        assert removed.value.message == unknown.value.message.replace("'no_such_op'", repr(op))
