"""Checks shared by the reply tests of both protocols (local and peer): a typed reply sends
the bytes its plain map did, and parses that map as it arrives through msgpack."""

from kvstore.protocol import FrameCodec, Reply


def assert_sends_the_same_bytes(typed_wire: dict, wire: dict) -> None:
    assert typed_wire == wire
    assert list(typed_wire) == list(wire)  # same key order: the same msgpack bytes
    codec = FrameCodec()
    assert codec.send_reply(Reply(1, typed_wire)) == codec.send_reply(Reply(1, wire))


def through_msgpack(wire):
    """`wire` as the other side receives it: lists for arrays, bytes as they arrive."""
    receiver, sender = FrameCodec(), FrameCodec()
    receiver.receive_data(sender.send_reply(Reply(1, wire)))
    return receiver.next_event().result
