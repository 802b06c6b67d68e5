"""The reader's guards, one at a time, with the daemon's writer (server/tiering/shared_index.py)
changing things at the worst moment: between the reader's look at the record and its check
of the copy. The race test (test_shared_reads.py) shows the same under real concurrency;
here each interleaving is forced, so each guard is shown to refuse on its own."""

from __future__ import annotations

import os
import time

import numpy as np
import xxhash

from kvs_testing import payload
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.server.tiering.objects import lone_entry
from kvstore.server.tiering.shared_index import SharedIndex
from kvstore.tiers.allocator import Extent
from kvstore.client.shared_reads import SharedReads

DESC = StateDescriptor("t", "m", "r")
OID = ObjectId(b"guarded".ljust(32, b"."))
SIZE = 4096


class Arena:
    """The client's arena mapping, with a hook run as the reader takes its slice to copy."""

    def __init__(self):
        self.bytes = np.zeros(1 << 20, np.uint8)
        self.size = self.bytes.size
        self.hook = None

    def __getitem__(self, item):
        if self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return self.bytes[item]


class Core:
    def __init__(self, arena: Arena):
        self.arenas = {"t": arena}

    def request(self, msg, no_reply=False):
        return msg


def setup():
    index, arena = SharedIndex("t", 1 << 20), Arena()
    arena.bytes[:SIZE] = payload(SIZE, OID)
    entry = lone_entry(OID, "t", Extent(0, SIZE), SIZE, xxhash.xxh3_128_digest(arena.bytes[:SIZE]), DESC,
                               Hints(), time.monotonic())
    index.publish(entry)
    reader = SharedReads(Core(arena), True, lambda ns: DESC)
    reader.attach("t", index.size_bytes, os.dup(index.fd))
    return index, arena, entry, reader


def driven(op):
    """A reader's op driven to its end (it yields only to report hits): what it returns."""
    try:
        while True:
            next(op)
    except StopIteration as done:
        return done.value


def read(reader: SharedReads, want: StateDescriptor | None = None) -> int | None:
    return driven(reader.op_read_into("t", OID, np.zeros(SIZE, np.uint8), want))


def test_an_undisturbed_read_is_accepted_and_queued_for_report():
    index, _, _, reader = setup()
    assert read(reader) == SIZE and reader.num_pending == 1
    index.close()


def test_a_record_changed_while_copying_is_refused_even_when_the_bytes_check():
    index, arena, entry, reader = setup()
    # the same object removed and published again: the copy passes its checksum, seq moved
    arena.hook = lambda: (index.remove(entry), index.publish(entry))
    assert read(reader) is None and reader.num_pending == 0
    assert read(reader) == SIZE  # the next read sees the settled record
    index.close()


def test_an_extent_reused_while_copying_is_refused():
    index, arena, entry, reader = setup()
    other = ObjectId(b"other".ljust(32, b"."))

    def reuse():  # evicted, its extent refilled with another object's bytes and published
        index.remove(entry)
        arena.bytes[:SIZE] = payload(SIZE, other)
        checksum = xxhash.xxh3_128_digest(arena.bytes[:SIZE])
        index.publish(lone_entry(other, "t", Extent(0, SIZE), SIZE, checksum, DESC, Hints(), time.monotonic()))
    arena.hook = reuse
    assert read(reader) is None and reader.num_pending == 0
    assert read(reader) is None  # gone from the index: the daemon is asked
    index.close()


def test_bytes_changed_under_an_unchanged_record_fail_the_checksum():
    index, arena, _, reader = setup()
    arena.hook = lambda: arena.bytes.__setitem__(slice(100, 101), arena.bytes[100] ^ 1)  # one bit, no seq change
    assert read(reader) is None and reader.num_pending == 0
    index.close()



def test_a_record_past_its_ttl_is_refused_before_the_daemon_drops_it():
    index, arena, entry, reader = setup()
    index.remove(entry)
    expired = lone_entry(OID, "t", Extent(0, SIZE), SIZE, entry.checksum, DESC, Hints(ttl_s=1.0),
                                 time.monotonic() - 2.0)  # its TTL ran out a second ago; still published
    index.publish(expired)
    assert read(reader) is None and reader.num_pending == 0
    index.close()


def test_another_descriptor_or_a_dead_table_is_refused():
    index, _, _, reader = setup()
    assert read(reader, DESC.with_(model="other")) is None and reader.num_pending == 0
    assert read(reader, DESC) == SIZE
    index.close()  # a daemon that stops marks its tables dead
    assert read(reader) is None


def read_many(reader: SharedReads, oids) -> list:
    """Each object into its own buffer, in one op_read_many."""
    return driven(reader.op_read_many("t", [(oid, np.zeros(SIZE, np.uint8), None) for oid in oids]))


def test_a_batch_checks_the_table_once_and_each_object_on_its_own():
    index, arena, _, reader = setup()
    oids = [OID] + [ObjectId(f"batch{i}".encode().ljust(32, b".")) for i in (1, 2)]
    for i, oid in enumerate(oids[1:], start=1):
        arena.bytes[i * SIZE:(i + 1) * SIZE] = payload(SIZE, oid)
        checksum = xxhash.xxh3_128_digest(arena.bytes[i * SIZE:(i + 1) * SIZE])
        index.publish(lone_entry(oid, "t", Extent(i * SIZE, SIZE), SIZE, checksum, DESC, Hints(),
                                         time.monotonic()))
    assert read_many(reader, oids) == [SIZE] * 3 and reader.num_pending == 3
    # as the first object is copied, the second's bytes change under its unchanged record
    arena.hook = lambda: arena.bytes.__setitem__(SIZE + 7, arena.bytes[SIZE + 7] ^ 1)
    assert read_many(reader, oids) == [SIZE, None, SIZE] and reader.num_refused == 1
    index.close()  # a dead table: the whole batch asks the daemon
    assert read_many(reader, oids) == [None] * 3
