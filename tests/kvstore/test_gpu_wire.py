"""The GPU tier on the local protocol: op gpu_handle and its GpuHandleReply, the Get `gpu`
flag, and a gpu-tier GetReply, through the codec in memory (no socket)."""

from __future__ import annotations

import os

import pytest

from kvstore import messages as m
from kvstore import replies as r
from kvstore.errors import InvalidArgument, ProtocolError
from kvstore.identity import ObjectId
from kvstore.protocol import FrameCodec, Reply, Request

HANDLE = r.GpuHandleReply(device=0, handle=bytes(range(64)), storage_bytes=1 << 30, storage_offset_bytes=0,
                          ref_counter_handle=b"/torch_123_456_0", ref_counter_offset=7,
                          event_handle=b"\x00" * 64, event_sync_required=True, capacity_bytes=1 << 30,
                          device_uuid="GPU-6f2c0a47-0000-1111-2222-333344445555")


def through_the_wire_request(msg: m.Message) -> m.Message:
    client, daemon = FrameCodec(), FrameCodec()
    daemon.receive_data(client.send_request(Request(1, msg.op, msg.to_args())))
    return m.decode_request(daemon.next_event())


def through_the_wire_reply(result: dict):
    client, daemon = FrameCodec(), FrameCodec()
    client.receive_data(daemon.send_reply(Reply(1, result)))
    return client.next_event().result


def test_gpu_handle_request_round_trips_and_takes_no_fields():
    assert through_the_wire_request(m.GpuHandle()) == m.GpuHandle()
    assert r.REPLIES["gpu_handle"] is r.GpuHandleReply
    with pytest.raises(InvalidArgument, match=r"gpu_handle: unknown field\(s\) \['device'\]"):
        m.decode_request(Request(1, "gpu_handle", {"device": 0}))


def test_gpu_handle_reply_keeps_every_byte_of_the_export():
    back = r.GpuHandleReply.from_wire(through_the_wire_reply(HANDLE.to_wire()))
    assert back == HANDLE and type(back.handle) is bytes and type(back.event_handle) is bytes
    no_uuid = r.GpuHandleReply.from_wire(through_the_wire_reply({**HANDLE.to_wire(), "device_uuid": None}))
    assert no_uuid.device_uuid is None and "device_uuid" not in no_uuid.to_wire()


def test_a_gpu_handle_reply_without_the_handle_is_a_protocol_error():
    wire = HANDLE.to_wire()
    del wire["handle"]
    with pytest.raises(ProtocolError, match="GpuHandleReply: the daemon's reply lacks 'handle'"):
        r.GpuHandleReply.from_wire(wire)


def test_get_sends_gpu_only_when_asked_so_older_daemons_see_the_same_request():
    oid = ObjectId(os.urandom(32))
    assert "gpu" not in m.Get("t", oid).to_args()
    asked = m.Get("t", oid, gpu=True)
    assert asked.to_args()["gpu"] is True and through_the_wire_request(asked) == asked
    with pytest.raises(InvalidArgument, match="get.gpu: must be true or false"):
        m.decode_request(Request(1, "get", {"namespace": "t", "object_id": oid.digest, "gpu": 1}))


def test_a_gpu_tier_get_reply_says_gpu():
    hit = r.GetReply(True, lease=3, offset=1 << 20, size=4096, checksum=b"\x01" * 16, tier="gpu")
    assert r.GetReply.from_wire(through_the_wire_reply(hit.to_wire())) == hit
    assert "gpu" in m.TIERS
