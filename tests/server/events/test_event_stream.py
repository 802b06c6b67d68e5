"""The event stream without a daemon: batching per loop iteration, numbering, the replay ring,
the wire format, and the publisher's sockets in-process."""

import asyncio
import types

import msgpack

from kvstore.config_events import EventsConfig
from kvs_events import EventSubscriber, events_of
from kvs_testing import wait_until
from server.events import MEDIUM_CPU, MEDIUM_STORAGE, EventStream, topic_of
from server.events.publisher import ZmqPublisher
from server.events import stream as stream_module
from server.events.stream import FLUSH_INTERVAL_S
from server.events.wire import CLEARED, REMOVED, STORED, encode_batch

A, B = b"a" * 32, b"b" * 32


class RefusingPublisher:
    """The publisher's surface, refusing the offers listed: what a full queue does, which a
    real thread cannot be made to have on cue."""

    def __init__(self, refuse: set[int]):
        self.refuse, self.offered = refuse, []

    def offer(self, ring, batch) -> bool:
        if batch.seq in self.refuse:
            return False
        self.offered.append(batch.seq)
        return True

    def stats(self) -> dict:
        return {}


def test_a_refused_batch_is_counted_and_kept_for_replay():
    publisher = RefusingPublisher({1})
    stream = EventStream(EventsConfig(enabled=True), lambda config, rings: publisher)
    for digest in (A, B, A):  # no event loop: each report is its own batch
        stream.stored("ns", digest, MEDIUM_CPU, 256, None)
    assert publisher.offered == [0, 2] and stream.counters.num_dropped_batches == 1
    ring = stream.rings[topic_of("kvstore.", "ns")]
    assert [b.seq for b in ring.since(1)] == [1, 2] and ring.since(1)[0].events[0][1] == B


def test_the_ring_keeps_at_most_its_batches_and_max_ring_events(monkeypatch):
    monkeypatch.setattr(stream_module, "MAX_RING_EVENTS", 5)
    ring = stream_module.Ring(b"t", size=3)
    for n in (1, 1, 1, 1):
        ring.append(0.0, [(CLEARED,)] * n)
    assert [b.seq for b in ring.since(0)] == [1, 2, 3]  # size
    ring.append(0.0, [(CLEARED,)] * 4)
    assert [b.seq for b in ring.since(0)] == [3, 4] and ring.num_events == 5  # events
    ring.append(0.0, [(CLEARED,)] * 9)
    assert [b.seq for b in ring.since(0)] == [5]  # the newest batch stays, whatever its size


def test_reports_within_one_flush_interval_are_one_batch_per_namespace():
    publisher = RefusingPublisher(set())
    stream = EventStream(EventsConfig(enabled=True), lambda config, rings: publisher)

    async def main():
        stream.stored("x", A, MEDIUM_CPU, 16, "s")
        stream.removed("y", A, MEDIUM_STORAGE)
        await asyncio.sleep(0)  # another loop iteration, the same batch
        stream.removed("x", B, MEDIUM_CPU)
        await asyncio.sleep(FLUSH_INTERVAL_S)  # a timer due no earlier than the flush's: after it
        stream.cleared("x")
        await asyncio.sleep(FLUSH_INTERVAL_S)
    asyncio.run(main())
    x = stream.rings[topic_of("kvstore.", "x")].since(0)
    assert [len(b.events) for b in x] == [2, 1] and [b.seq for b in x] == [0, 1]
    assert stream.rings[topic_of("kvstore.", "y")].since(0)[0].seq == 0  # each namespace numbers its own
    assert stream.stats()["num_events"] == 4


def test_the_wire_format_is_a_kv_event_batch():
    ts, events, rank = msgpack.unpackb(encode_batch(12.5, [(STORED, A, "CPU", 256, "s"), (REMOVED, B, "STORAGE"),
                                                           (CLEARED,)]))
    assert ts == 12.5 and rank == 0
    assert events[0] == {"type": "BlockStored", "block_hashes": [A], "parent_block_hash": None, "token_ids": [],
                         "block_size": 256, "lora_id": None, "medium": "CPU", "lora_name": None,
                         "locality": "LOCAL", "ownership": "kvstore", "session_id": "s"}
    assert list(events[0])[0] == "type"  # msgspec reads the tag first
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [B], "medium": "STORAGE", "locality": "LOCAL",
                         "ownership": "kvstore"}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_the_publisher_answers_replays_and_ignores_malformed_requests(tmp_path):
    config = EventsConfig(enabled=True).under(str(tmp_path))
    stream = EventStream(config, ZmqPublisher)
    stream.start()
    sub = EventSubscriber(types.SimpleNamespace(data_dir=str(tmp_path)), "default")
    try:
        for digest in (A, B):
            stream.stored("default", digest, MEDIUM_CPU, 256, None)
        sub.replay_socket.send_multipart([b"", b"not a sequence number"])  # neither form: ignored
        assert [events_of(body)[0]["block_hashes"] for _, body in sub.replay(0)] == [[A], [B]]
        assert sub.replay(0, topic=topic_of("kvstore.", "nobody")) == []  # just the end marker
        wait_until(lambda: stream.stats()["num_bad_replay_requests"] == 1, 10, "the bad request counted")
        assert stream.stats()["num_replays"] == 2
    finally:
        sub.close()
        stream.close()
    stream.close()  # idempotent
