"""Which life of its data directory a daemon is (server/events/lives.py), and what a life after
the first publishes first (server/events/stream.py), without a daemon: a real directory, the
stream with a publisher that records what it is offered."""

import json
import os

import pytest

from kvstore.config_events import EventsConfig
from kvstore.hints import Hints
from kvstore.identity import StateDescriptor
from kvstore.server.data_dir import DataDirError
from kvstore.server.events import MEDIUM_CPU, EventStream, topic_of
from kvstore.server.events.lives import LIVES_FILE, MAX_LIFE, SEQ_PER_LIFE, Lives
from kvstore.server.events.wire import CLEARED, STORED

DESC = StateDescriptor("default", "m", "r1", kind="kv", dtype="bf16")


class RecordingPublisher:
    """The publisher's surface, keeping what it is offered (no sockets, no thread)."""

    def __init__(self, config, rings, namespace=None):
        self.config, self.rings, self.offered = config, rings, []

    def start(self, ask_snapshot=None, subscribed=None) -> None:
        pass

    def offer(self, ring, batch) -> bool:
        self.offered.append((ring.topic, batch.seq, list(batch.events)))
        return True

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {}


def started(data_dir) -> EventStream:
    stream = EventStream(EventsConfig(enabled=True).under(str(data_dir)), RecordingPublisher)
    stream.start()  # no running loop: every report is a batch at once
    return stream


def test_each_start_of_a_data_directory_numbers_past_every_earlier_one(tmp_path):
    first = Lives(str(tmp_path))
    first.begin()
    first.named("a")
    again = Lives(str(tmp_path))
    again.begin()
    assert (first.life, first.first_seq) == (0, 0)
    assert (again.life, again.first_seq, again.previous) == (1, SEQ_PER_LIFE, ("a",))
    assert os.stat(tmp_path / LIVES_FILE).st_mode & 0o777 == 0o600


def test_a_life_past_the_last_one_that_fits_starts_again_at_one(tmp_path):
    (tmp_path / LIVES_FILE).write_text(json.dumps({"life": MAX_LIFE, "namespaces": []}))
    lives = Lives(str(tmp_path))
    lives.begin()
    assert lives.life == 1
    last_number = (MAX_LIFE + 1) * SEQ_PER_LIFE - 1  # of the last life that fits: signed 8 bytes on the wire
    assert last_number < 2**63 <= last_number + SEQ_PER_LIFE


@pytest.mark.parametrize("body", [b"not json", b"[]", b'{"life": -1, "namespaces": []}',
                                  b'{"life": 3, "namespaces": [1]}', b'{"life": "3"}'])
def test_an_unreadable_record_of_lives_is_refused_naming_the_file(tmp_path, body):
    (tmp_path / LIVES_FILE).write_bytes(body)
    with pytest.raises(DataDirError, match=f"{tmp_path / LIVES_FILE} is unreadable.*Remove it"):
        Lives(str(tmp_path)).begin()


def test_a_new_life_clears_what_earlier_ones_published_and_begins_every_namespace_with_a_clear(tmp_path):
    old = started(tmp_path)
    old.stored("a", b"a" * 32, MEDIUM_CPU, DESC, Hints())
    assert [events for _, _, events in old.publisher.offered] == [[(STORED, b"a" * 32, MEDIUM_CPU, None, 256, None)]]
    new = started(tmp_path)  # "a" published before: its first batch is AllBlocksCleared, at start
    new.stored("b", b"b" * 32, MEDIUM_CPU, DESC, Hints())  # "b" did not: its first batch begins with one
    new.stored("b", b"c" * 32, MEDIUM_CPU, DESC, Hints())
    new.cleared("a")  # nothing since the last AllBlocksCleared: another says nothing
    offered = new.publisher.offered
    assert offered[0] == (topic_of("kvstore.", "a"), SEQ_PER_LIFE, [(CLEARED,)])
    assert offered[1] == (topic_of("kvstore.", "b"), SEQ_PER_LIFE,
                          [(CLEARED,), (STORED, b"b" * 32, MEDIUM_CPU, None, 256, None)])
    assert offered[2] == (topic_of("kvstore.", "b"), SEQ_PER_LIFE + 1, [(STORED, b"c" * 32, MEDIUM_CPU, None, 256, None)])
    assert len(offered) == 3 and new.stats()["life"] == 1
    assert json.loads((tmp_path / LIVES_FILE).read_text()) == {"life": 1, "namespaces": ["a", "b"]}
