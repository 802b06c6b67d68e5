"""The daemon's KV event stream read with vLLM's own classes (vllm.distributed.kv_events).

A real daemon (host arena and NVMe) stores, evicts, demotes, promotes, deletes and expires
objects, then stops; every batch it published, live and replayed, and every snapshot and
heartbeat frame, is decoded the way vLLM's subscribers decode
(msgspec.msgpack.Decoder(type=KVEventBatch)), its fields checked, and encoded again by
msgspec to the same document the daemon sent.
"""

import os
import signal

import msgspec
import numpy as np
import pytest
from vllm.distributed.kv_events import (MEDIUM_CPU, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored,
                                        KVEventBatch)

from kvstore import Hints
from kvstore.identity import ObjectId
from kvstore.route import Route
from kvs_events import EventSubscriber, last_seq, vllm_int_hash, wait_subscribed
from kvs_testing import payload

pytestmark = pytest.mark.engines

MiB = 1 << 20
CONFIG = {"events": {"enabled": True},
          "nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB", "admit_min_hits": 0}}


def _document(body: bytes):
    """A batch as plain msgpack: (ts, [event maps as (key, value) lists], rank)."""
    ts, events, rank = msgspec.msgpack.decode(body)
    yield from (ts, [list(e.items()) for e in events], rank)


def read(c, key, size) -> bool:
    out = np.empty(size, np.uint8)
    return c.get_into(key, out) == size


def test_every_batch_decodes_with_vllms_classes(daemon_factory):
    d = daemon_factory("4MiB", config=CONFIG)
    sub = EventSubscriber(d, "default")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    keys = [ObjectId(os.urandom(32)) for _ in range(8)]
    try:
        with d.client() as c:
            wait_subscribed(sub, lambda: c.put(ObjectId(os.urandom(32)), b"probe"))
            for i, key in enumerate(keys):  # 8 MiB through a 4 MiB arena: demoted to NVMe
                c.put(key, payload(MiB, i), hints=Hints(session_id="s1"))
            assert read(c, keys[0], MiB)  # promoted back
            assert c.delete(keys[-1:]) == 1
            short = ObjectId(os.urandom(32))
            c.put(short, b"short-lived", hints=Hints(ttl_s=0.5))

            def expired(s):
                return any(isinstance(e, BlockRemoved) and vllm_int_hash(short) in e.block_hashes
                           for _, body in s.received for e in decoder.decode(body).events)
            sub.receive_until(expired, "the expiry's event")
        assert d.stop(signal.SIGTERM) == 0
        sub.drain()
    finally:
        sub.close()
    seqs = [seq for seq, _ in sub.received]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    batches = [decoder.decode(body) for _, body in sub.received]
    # msgspec writes the same document: no field more or less, the same values, in the same order
    # (its map header for BlockStored is map16 where ours is a fixmap: both are msgpack maps)
    assert all(list(_document(msgspec.msgpack.encode(batch))) == list(_document(body))
               for batch, (_, body) in zip(batches, sub.received))
    events = [e for batch in batches for e in batch.events]
    assert all(batch.data_parallel_rank == 0 and batch.ts > 0 for batch in batches)
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert isinstance(events[-1], AllBlocksCleared)  # the stop
    for e in stored:  # objects put without a route: named by their ids, in vLLM's default int form
        assert len(e.block_hashes) == 1 and isinstance(e.block_hashes[0], int) and 0 <= e.block_hashes[0] < 2**64
        assert e.parent_block_hash is None and e.token_ids == [] and e.block_size == 256
        assert e.lora_id is None and e.lora_name is None and e.extra_keys is None
        assert e.medium in (MEDIUM_CPU, MEDIUM_STORAGE) and e.locality == "LOCAL" and e.ownership is None
    names = {vllm_int_hash(k): k for k in keys + [short]}
    assert {e.session_id for e in stored if e.block_hashes[0] in names} == {"s1", None}
    media = {(names.get(e.block_hashes[0]), e.medium) for e in stored}
    assert (keys[0], MEDIUM_STORAGE) in media and (keys[0], MEDIUM_CPU) in media  # demoted, promoted
    gone = {(names.get(e.block_hashes[0]), e.medium) for e in removed}
    assert (keys[-1], MEDIUM_CPU) in gone and (short, MEDIUM_CPU) in gone  # deleted, expired


def test_a_replay_decodes_with_vllms_classes(daemon_factory):
    d = daemon_factory("16MiB", config={"events": {"enabled": True}})
    live = EventSubscriber(d, "default")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    try:
        with d.client() as c:
            wait_subscribed(live, lambda: c.put(ObjectId(os.urandom(32)), b"probe"))
            last = last_seq(c, "default")
            live.receive_until(lambda s: s.received[-1][0] >= last, "catch up")
            replayed = live.replay(0)  # vLLM's request: [b"", start_seq]
    finally:
        live.close()
    assert [seq for seq, _ in replayed] == list(range(last + 1))
    assert all(isinstance(e, BlockStored) for _, body in replayed for e in decoder.decode(body).events)
    assert dict(replayed)[last] == live.received[-1][1]


def test_snapshots_and_heartbeats_decode_with_vllms_classes(daemon_factory):
    """Routes' fields land in BlockStored's as vLLM types them: bytes and int hashes (bytes
    kept with int_block_hashes = false), parent, token ids, extra keys, group."""
    d = daemon_factory("4MiB", config={"events": {"enabled": True, "int_block_hashes": False, "heartbeat_s": 0.05},
                                       "nvme": CONFIG["nvme"]})
    sub = EventSubscriber(d, "default")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    keys = [ObjectId(os.urandom(32)) for _ in range(8)]

    def route_of(i):
        return Route([b"blk-%d" % i, 1000 + i], parent_block_hash=999 + i, token_ids=list(range(32)), block_size=16,
                     extra_keys=[None, ["ad", ["mm", i]]], group_idx=1)
    try:
        with d.client() as c:
            wait_subscribed(sub, lambda: c.put(ObjectId(os.urandom(32)), b"probe"))
            for i, key in enumerate(keys):  # 8 MiB through a 4 MiB arena: on NVMe too
                c.put(key, payload(MiB, i), hints=Hints(route=route_of(i) if i % 4 else None, session_id="s1"))
            seq, bodies = sub.snapshot()
            last = last_seq(c, "default")
            sub.receive_until(lambda s: len(s.heartbeats) >= 1 and s.heartbeats[-1][0] == last, "a heartbeat")
    finally:
        sub.close()
    assert seq == last
    frames = bodies + [body for _, body in sub.heartbeats]
    batches = [decoder.decode(body) for body in frames]
    assert all(list(_document(msgspec.msgpack.encode(b))) == list(_document(body)) for b, body in zip(batches, frames))
    assert all(b.events == [] and b.data_parallel_rank == 0 for b in batches[len(bodies):])  # heartbeats
    events = [e for b in batches[:len(bodies)] for e in b.events]
    assert isinstance(events[0], AllBlocksCleared) and all(isinstance(e, BlockStored) for e in events[1:])
    by_name = {e.block_hashes[0]: e for e in events[1:]}
    media = {(h, e.medium) for e in events[1:] for h in e.block_hashes}
    assert {m for _, m in media} == {MEDIUM_CPU, MEDIUM_STORAGE}
    for i, key in enumerate(keys):
        if i % 4 == 0:
            e = by_name[bytes(key)]
            assert e.token_ids == [] and e.block_size == 256 and e.parent_block_hash is None and e.group_idx is None
            continue
        e = by_name[b"blk-%d" % i]
        assert e.block_hashes == [b"blk-%d" % i, 1000 + i] and e.parent_block_hash == 999 + i
        assert e.token_ids == list(range(32)) and e.block_size == 16 and e.group_idx == 1
        assert e.extra_keys == [None, ("ad", ["mm", i])] and e.session_id == "s1" and e.locality == "LOCAL"
