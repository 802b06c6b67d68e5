"""What NVMe kept, read for the event stream's holdings (server/tiering/nvme_kept.py)."""

import os

from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.route import Route
from kvstore.server.tiering.nvme_kept import read_chunk
from kvstore.tiers.nvme.index import NvmeRecord, object_key

DESC = StateDescriptor("ns", "m", "r1", kind="kv", dtype="bf16", chunk_tokens=64)


def record(descriptor=DESC, hints=Hints()) -> bytes:
    wire = descriptor if isinstance(descriptor, dict) else descriptor.to_wire()
    return NvmeRecord(0, 0, 10, b"\0" * 16, None, wire, hints.to_wire(), 1.0).encode()


def test_routes_sizes_and_sessions_are_read_and_what_cannot_be_is_counted_and_left_out():
    ids = [ObjectId(os.urandom(32)) for _ in range(6)]
    route = Route([b"h", 7], token_ids=list(range(4)), block_size=2)
    group = DESC.with_(kind="group")
    records = [(object_key("ns", ids[0]), record(hints=Hints(route=route, session_id="s"))),
               (object_key("ns", ids[1]), record()),
               (object_key("ns", ids[2]), b"\xc1 not a record"),
               (object_key("ns", ids[3]), record(group)),  # a store group's manifest: never published
               (object_key("ns", ids[4]), record({**DESC.to_wire(), "chunk_tokens": -1})),
               (b"\x00", record())]  # no object's key
    out, read, unreadable = read_chunk(iter(records), 10)
    assert read == 6 and unreadable == 3
    assert out == [("ns", ids[0].digest, route.pack(), 64, "s"), ("ns", ids[1].digest, None, 64, None)]
    assert read_chunk(iter(records), 2)[1:] == (2, 0)  # at most n a call
