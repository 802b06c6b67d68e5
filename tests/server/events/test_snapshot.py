"""A snapshot's batches (server/events/snapshot.py) and the topic's inverse, without sockets."""

import pytest

from kvstore.server.events.holdings import Held
from kvstore.server.events.snapshot import SNAPSHOT_BATCH_EVENTS, Snapshot
from kvstore.server.events.wire import CLEARED, STORED, namespace_of, topic_of

CPU, STORAGE, PEER = 1, 2, 4  # Held.media bits, in holdings.MEDIA order


def snapshot_of(n: int, media: int = CPU) -> Snapshot:
    return Snapshot(b"client", b"t", 7, 0.0, [(b"%032d" % i, Held(None, 16, None, media)) for i in range(n)])


def test_cleared_first_then_a_stored_event_per_object_and_medium():
    batches = list(Snapshot(b"c", b"t", 3, 0.0, [(b"a" * 32, Held(b"r", 16, "s", CPU | STORAGE)),
                                                 (b"b" * 32, Held(None, 256, None, PEER))]).batches(10))
    assert batches == [[(CLEARED,), (STORED, b"a" * 32, "CPU", b"r", 16, "s"),
                        (STORED, b"a" * 32, "STORAGE", b"r", 16, "s"), (STORED, b"b" * 32, "PEER", None, 256, None)]]


def test_an_empty_namespace_is_one_batch_of_all_blocks_cleared():
    assert list(snapshot_of(0).batches(10)) == [[(CLEARED,)]]


def test_batches_are_bounded_and_fuller_only_past_the_frames_a_reader_can_queue():
    n = 2 * SNAPSHOT_BATCH_EVENTS + 500
    sizes = [len(b) for b in snapshot_of(n).batches(100)]
    assert sizes == [SNAPSHOT_BATCH_EVENTS, SNAPSHOT_BATCH_EVENTS, 501] and sum(sizes) == n + 1
    fewer = [len(b) for b in snapshot_of(n).batches(2)]
    assert len(fewer) <= 2 and sum(fewer) == n + 1


@pytest.mark.parametrize("namespace", ["default", "a", "a:b", "ünï", "x" * 300])
def test_a_topic_names_its_namespace(namespace):
    assert namespace_of("kvstore.", topic_of("kvstore.", namespace)) == namespace


@pytest.mark.parametrize("topic", [b"snapshot", b"kvstore.", b"kvstore.7:defaul", b"kvstore.2:a", b"other.1:a",
                                   b"kvstore.x:a", b"kvstore.2:\xff\xfe", b"kvstore.01:a"])
def test_what_is_no_topic_names_no_namespace(topic):
    assert namespace_of("kvstore.", topic) is None
