"""The event stream without a daemon: batching per loop iteration, numbering, the replay ring,
the wire format, and the publisher's sockets in-process."""

import asyncio
import types

import msgpack

from kvstore.config_events import EventsConfig
from kvstore.hints import Hints
from kvstore.identity import StateDescriptor
from kvstore.route import Route
from kvs_events import EventSubscriber, events_of, vllm_int_hash
from kvs_testing import wait_until
from kvstore.server.events import MEDIUM_CPU, MEDIUM_PEER, MEDIUM_STORAGE, EventStream, topic_of
from kvstore.server.events import holdings as holdings_module
from kvstore.server.events.publisher import ZmqPublisher
from kvstore.server.events import ring as ring_module
from kvstore.server.events.stream import FLUSH_INTERVAL_S
from kvstore.server.events.wire import CLEARED, REMOVED, STORED, Wire, encode_batch

A, B = b"a" * 32, b"b" * 32
LIVENESS_STEPS = 1000  # of FLUSH_INTERVAL_S each: a bound on the publisher thread answering, not a timing
DESC = StateDescriptor("default", "m", "r1", kind="kv", dtype="bf16")  # chunk_tokens 256
SMALL = DESC.with_(chunk_tokens=16)


class RefusingPublisher:
    """The publisher's surface, refusing the offers listed: what a full queue does, which a
    real thread cannot be made to have on cue."""

    def __init__(self, refuse: set[int]):
        self.refuse, self.offered = refuse, []
        self.rings = {}

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
    for digest, medium in ((A, MEDIUM_CPU), (B, MEDIUM_CPU), (A, MEDIUM_STORAGE)):  # no loop: a batch each
        stream.stored("ns", digest, medium, DESC, Hints())
    assert publisher.offered == [0, 2] and stream.counters.num_dropped_batches == 1
    ring = stream.rings[topic_of("kvstore.", "ns")]
    assert [b.seq for b in ring.since(1)] == [1, 2] and ring.since(1)[0].events[0][1] == B


def test_the_ring_keeps_at_most_its_batches_and_max_ring_events(monkeypatch):
    monkeypatch.setattr(ring_module, "MAX_RING_EVENTS", 5)
    ring = ring_module.Ring(b"t", size=3)
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
        stream.stored("x", A, MEDIUM_CPU, SMALL, Hints(session_id="s"))
        stream.stored("y", A, MEDIUM_STORAGE, DESC, Hints())
        await asyncio.sleep(0)  # another loop iteration, the same batch
        stream.removed("x", A, MEDIUM_CPU)
        await asyncio.sleep(FLUSH_INTERVAL_S)  # a timer due no earlier than the flush's: after it
        stream.cleared("x")
        await asyncio.sleep(FLUSH_INTERVAL_S)
    asyncio.run(main())
    x = stream.rings[topic_of("kvstore.", "x")].since(0)
    assert [len(b.events) for b in x] == [2, 1] and [b.seq for b in x] == [0, 1]
    assert stream.rings[topic_of("kvstore.", "y")].since(0)[0].seq == 0  # each namespace numbers its own
    assert stream.stats()["num_events"] == 4


def test_the_wire_format_is_a_kv_event_batch():
    ts, events, rank = msgpack.unpackb(encode_batch(12.5, [(STORED, A, "CPU", None, 256, "s"),
                                                           (REMOVED, B, "STORAGE", None), (CLEARED,)]))
    assert ts == 12.5 and rank == 0
    assert events[0] == {"type": "BlockStored", "block_hashes": [vllm_int_hash(A)], "parent_block_hash": None,
                         "token_ids": [], "block_size": 256, "lora_id": None, "medium": "CPU", "lora_name": None,
                         "locality": "LOCAL", "session_id": "s"}
    assert list(events[0])[0] == "type"  # msgspec reads the tag first
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [vllm_int_hash(B)], "medium": "STORAGE",
                         "locality": "LOCAL"}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_bytes_hashes_and_an_ownership_are_written_when_configured():
    wire = Wire.of(EventsConfig(int_block_hashes=False, ownership="kvstore"))
    stored, removed = msgpack.unpackb(wire.encode_batch(0.0, [(STORED, A, "CPU", None, 16, None),
                                                              (REMOVED, A, "CPU", None)]))[1]
    assert stored["block_hashes"] == [A] and stored["ownership"] == "kvstore"
    assert removed == {"type": "BlockRemoved", "block_hashes": [A], "medium": "CPU", "locality": "LOCAL",
                       "ownership": "kvstore"}


def test_the_publisher_answers_replays_and_ignores_malformed_requests(tmp_path):
    config = EventsConfig(enabled=True).under(str(tmp_path))
    stream = EventStream(config, ZmqPublisher)
    stream.start()
    sub = EventSubscriber(types.SimpleNamespace(data_dir=str(tmp_path)), "default")
    try:
        for digest in (A, B):
            stream.stored("default", digest, MEDIUM_CPU, DESC, Hints())
        sub.replay_socket.send_multipart([b"", b"not a sequence number"])  # neither form: ignored
        assert [events_of(body)[0]["block_hashes"] for _, body in sub.replay(0)] == [[vllm_int_hash(A)],
                                                                                     [vllm_int_hash(B)]]
        assert sub.replay(0, topic=topic_of("kvstore.", "nobody")) == []  # just the end marker
        wait_until(lambda: stream.stats()["num_bad_replay_requests"] == 1, 10, "the bad request counted")
        assert stream.stats()["num_replays"] == 2
    finally:
        sub.close()
        stream.close()
    stream.close()  # idempotent


def test_an_object_is_published_once_per_medium_and_removed_only_where_it_was_stored():
    publisher = RefusingPublisher(set())
    stream = EventStream(EventsConfig(enabled=True), lambda config, rings: publisher)
    stream.stored("ns", A, MEDIUM_CPU, DESC, Hints())
    stream.stored("ns", A, MEDIUM_CPU, DESC, Hints())  # again: nothing new to say
    stream.removed("ns", A, MEDIUM_STORAGE)  # never stored there: nothing to remove
    stream.removed("ns", B, MEDIUM_CPU)
    stream.stored("ns", A.replace(b"a", b"g", 1), MEDIUM_CPU, DESC.with_(kind="group"), Hints())  # a manifest
    events = [e for b in stream.rings[topic_of("kvstore.", "ns")].since(0) for e in b.events]
    assert events == [(STORED, A, MEDIUM_CPU, None, 256, None)]
    assert stream.holdings.get("ns", A).in_media() == ["CPU"]


def test_a_route_names_the_blocks_in_stored_and_removed_events_and_indexes_them():
    publisher = RefusingPublisher(set())
    stream = EventStream(EventsConfig(enabled=True), lambda config, rings: publisher)
    route = Route([b"h1", 7], parent_block_hash=b"h0", token_ids=range(32), block_size=16, lora_name="ad",
                  extra_keys=[None, ["ad", ["mm", 3]]], group_idx=1, kv_cache_spec_kind="full_attention")
    stream.stored("ns", A, MEDIUM_CPU, DESC, Hints(route=route, session_id="s"))
    stream.stored("ns", B, MEDIUM_STORAGE, DESC, Hints(route=Route([7], block_size=256)))  # another shard of 7
    assert set(stream.holdings.objects_of("ns", 7)) == {A, B} and stream.holdings.objects_of("ns", b"h1") == (A,)
    stream.removed("ns", A, MEDIUM_CPU)
    assert stream.holdings.objects_of("ns", 7) == (B,) and stream.holdings.objects_of("ns", b"h1") == ()
    events = [e for b in stream.rings[topic_of("kvstore.", "ns")].since(0) for e in b.events]
    stored, _, removed = msgpack.unpackb(encode_batch(0.0, events))[1]
    assert stored == {"type": "BlockStored", "block_hashes": [vllm_int_hash(b"h1"), 7],
                      "parent_block_hash": vllm_int_hash(b"h0"), "token_ids": list(range(32)), "block_size": 16,
                      "lora_id": None, "medium": "CPU", "lora_name": "ad", "extra_keys": [None, ["ad", ["mm", 3]]],
                      "group_idx": 1, "kv_cache_spec_kind": "full_attention", "locality": "LOCAL", "session_id": "s"}
    assert removed == {"type": "BlockRemoved", "block_hashes": [vllm_int_hash(b"h1"), 7], "medium": "CPU",
                       "group_idx": 1, "locality": "LOCAL"}


def test_peer_marks_are_capped_oldest_first_and_published_as_remote(monkeypatch):
    monkeypatch.setattr(holdings_module, "MAX_PEER_OBJECTS", 2)
    publisher = RefusingPublisher(set())
    stream = EventStream(EventsConfig(enabled=True), lambda config, rings: publisher)
    ids = [bytes([i]) * 32 for i in range(3)]
    stream.stored("ns", ids[0], MEDIUM_CPU, DESC, Hints())  # held here too: its CPU mark stays
    for digest in ids:
        stream.stored("ns", digest, MEDIUM_PEER, DESC, Hints())
    events = msgpack.unpackb(encode_batch(0.0, [e for b in stream.rings[topic_of("kvstore.", "ns")].since(0)
                                                for e in b.events]))[1]
    assert [(e["type"], e["medium"], e["locality"]) for e in events][-2:] == [
        ("BlockStored", "PEER", "REMOTE"), ("BlockRemoved", "PEER", "REMOTE")]
    assert events[-1]["block_hashes"] == [vllm_int_hash(ids[0])]  # the oldest mark went
    assert stream.holdings.get("ns", ids[0]).in_media() == ["CPU"]
    assert [stream.holdings.get("ns", d).in_media() for d in ids[1:]] == [["PEER"], ["PEER"]]


def test_lookahead_tokens_come_last_in_a_stored_event_as_in_vllms_field_order():
    route = Route([1, 2], token_ids=[5] * 4, block_size=2, lookahead_token_ids=[[6], [7]])
    (stored,) = msgpack.unpackb(encode_batch(0.0, [(STORED, A, "CPU", route.pack(), 4, "s")]))[1]
    assert list(stored)[-2:] == ["session_id", "lookahead_token_ids"]
    assert stored["lookahead_token_ids"] == [[6], [7]]


def test_a_subscription_after_a_batch_went_gets_an_empty_batch_numbered_next(tmp_path):
    """A seal: a subscriber that follows vLLM's rules would otherwise take heartbeats repeating
    batch 0 for batch 0 itself. Only the subscribed namespace, only after a batch with events."""
    async def scenario():
        stream = EventStream(EventsConfig(enabled=True, heartbeat_s=0).under(str(tmp_path)), ZmqPublisher)
        stream.start()
        stream.stored("default", A, MEDIUM_CPU, DESC, Hints())
        stream.stored("other", B, MEDIUM_CPU, DESC, Hints())
        stream.flush()
        daemon = types.SimpleNamespace(data_dir=str(tmp_path))
        late, later = EventSubscriber(daemon, "default"), None
        try:
            for _ in range(LIVENESS_STEPS):  # the seal comes once the subscription applies
                if late.receive(timeout_ms=0) is not None:
                    break
                await asyncio.sleep(FLUSH_INTERVAL_S)
            later = EventSubscriber(daemon, "default")  # the last batch is empty now: nothing to seal
            for _ in range(LIVENESS_STEPS):
                if stream.stats()["num_subscriptions"] == 2:
                    break
                await asyncio.sleep(FLUSH_INTERVAL_S)
            await asyncio.sleep(FLUSH_INTERVAL_S)  # the loop took the second subscription
            rings = {name: [(b.seq, b.events) for b in stream.rings[topic_of("kvstore.", name)].since(0)]
                     for name in ("default", "other")}
            return late.frames, rings, stream.stats()["num_seals"]
        finally:
            late.close()
            if later is not None:
                later.close()
            stream.close()

    frames, rings, num_seals = asyncio.run(scenario())
    assert [(seq, events_of(body)) for seq, body in frames] == [(1, [])]
    assert rings == {"default": [(0, [(STORED, A, MEDIUM_CPU, None, 256, None)]), (1, [])],
                     "other": [(0, [(STORED, B, MEDIUM_CPU, None, 256, None)])]}
    assert num_seals == 1
