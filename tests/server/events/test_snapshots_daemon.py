"""Snapshots, heartbeats and restarts of a real daemon's KV event stream, over real ZMQ.

A snapshot is checked against what the admin API lists (host and NVMe, with their tiers):
a router that applies it, then the live batches numbered after it, holds what the store holds.
"""

import os
import signal

import pytest

from kvstore import Hints
from kvstore.identity import ObjectId
from kvstore.route import Route
from kvs_events import EventSubscriber, all_events, events_of, held_media, last_seq, wait_subscribed
from kvs_testing import payload
from kvstore.server.admin.client import AdminClient

MiB = 1 << 20
NVME = {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB", "admit_min_hits": 0}
# Bytes hashes, so events name objects by their ids (the int form: tests/adapters/vllm).
EVENTS = {"enabled": True, "int_block_hashes": False}
MEDIUM = {"host": "CPU", "nvme": "STORAGE"}


def new_ids(n):
    return [ObjectId(os.urandom(32)) for _ in range(n)]


def route_of(i: int) -> Route:
    """Two engine blocks per object (a bytes hash and an int one), chained to the one before."""
    return Route([b"blk-%d-a" % i, 1000 + i], parent_block_hash=None if i == 0 else 1000 + i - 1,
                 token_ids=list(range(32)), block_size=16, group_idx=0, extra_keys=[None, ["ad", ["mm", i]]])


def listed(d, namespace: str) -> set[tuple]:
    """(block hash, medium) of every object GET /v1/objects lists in `namespace` (all pages):
    the route's hashes, or the id of an object put without one."""
    api, held, cursor = AdminClient.from_data_dir(d.data_dir), set(), None
    while True:
        page = api.get("/v1/objects", namespace=namespace, **({"cursor": cursor} if cursor else {}))
        for o in page["objects"]:
            route = o["hints"]["route"]
            hashes = [bytes.fromhex(o["object_id"])] if route is None else \
                [bytes.fromhex(h) if isinstance(h, str) else h for h in route["block_hashes"]]
            held |= {(h, MEDIUM[tier]) for tier in o["tiers"] for h in hashes}
        cursor = page["next_cursor"]
        if cursor is None:
            return held


def pairs(held: dict[str, set]) -> set[tuple]:
    return {(h, medium) for medium, hashes in held.items() for h in hashes}


def snapshot_of(sub, topic=None) -> tuple[int, list[dict]]:
    seq, bodies = sub.snapshot(topic)
    events = [e for body in bodies for e in events_of(body)]
    assert events[0] == {"type": "AllBlocksCleared"} and all(e["type"] == "BlockStored" for e in events[1:])
    return seq, events


def test_a_snapshot_is_what_the_admin_api_lists_for_its_namespace_only(daemon_factory):
    d = daemon_factory("4MiB", config={"events": EVENTS, "nvme": NVME})
    mine, other = EventSubscriber(d, "a"), EventSubscriber(d, "ab")  # "a" is a prefix of "ab"
    try:
        with d.client(namespace="a") as a, d.client(namespace="ab") as ab:
            keys = new_ids(10)
            results = a.put_many([(k, payload(MiB, i)) for i, k in enumerate(keys[:6])],
                                 routes=[route_of(i) if i % 3 else None for i in range(6)])
            assert all(r.error is None for r in results)
            for i, key in enumerate(keys[6:], 6):  # 10 MiB through a 4 MiB arena: some on NVMe only
                a.put(key, payload(MiB, i), hints=Hints(route=route_of(i), session_id="s1"))
            theirs = new_ids(2)
            for key in theirs:
                ab.put(key, b"theirs")
            seq, events = snapshot_of(mine)
            assert seq == last_seq(a, "a")  # the batch pending when it was asked is numbered first
            tiers = {t for t in a.lookup(keys).tiers}
        assert pairs(held_media(events)) == listed(d, "a")
        assert {"host", "nvme"} <= tiers  # both media are in it
        assert not {bytes(k) for k in theirs} & {h for e in events[1:] for h in e["block_hashes"]}
        stored = {e["block_hashes"][0]: e for e in events[1:]}
        assert stored[b"blk-7-a"]["session_id"] == "s1" and stored[b"blk-7-a"]["extra_keys"] == [None, ["ad", ["mm", 7]]]
        assert stored[b"blk-7-a"]["parent_block_hash"] == 1006 and stored[b"blk-7-a"]["token_ids"] == list(range(32))
        _, their_events = snapshot_of(other)
        assert pairs(held_media(their_events)) == listed(d, "ab") == {(bytes(k), "CPU") for k in theirs}
    finally:
        mine.close(), other.close()


def test_a_snapshot_then_the_live_batches_after_it_are_what_the_store_holds(daemon_factory):
    d = daemon_factory("4MiB", config={"events": EVENTS, "nvme": NVME})
    sub = EventSubscriber(d, "default")
    try:
        with d.client() as c:
            wait_subscribed(sub, lambda: c.put(new_ids(1)[0], b"probe"))
            keys = new_ids(12)
            for i, key in enumerate(keys[:6]):
                c.put(key, payload(MiB, i), hints=Hints(route=route_of(i)))
            seq, events = snapshot_of(sub)  # the live frames keep coming meanwhile
            for i, key in enumerate(keys[6:], 6):  # demotes the first ones
                c.put(key, payload(MiB, i), hints=Hints(route=route_of(i) if i % 2 else None))
            assert c.delete(keys[5:7]) == 2
            last = last_seq(c, "default")
            sub.receive_until(lambda s: s.received[-1][0] >= last, "catch up")
        held = held_media(all_events([(s, body) for s, body in sub.received if s > seq]), held_media(events))
        assert pairs(held) == listed(d, "default")
    finally:
        sub.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_snapshot_after_a_restart_lists_what_nvme_kept_with_routes(daemon_factory, sig):
    config = {"events": EVENTS, "nvme": {**NVME, "durability": "sync"}}  # SIGKILL loses no record
    d = daemon_factory("4MiB", config=config)
    keys = new_ids(10)
    with d.client() as c:
        results = c.put_many([(k, payload(MiB, i)) for i, k in enumerate(keys[:5])],
                             routes=[route_of(i) if i != 2 else None for i in range(5)])
        assert all(r.error is None for r in results)
        for i, key in enumerate(keys[5:], 5):
            c.put(key, payload(MiB, i), hints=Hints(route=route_of(i), session_id="s1"))
    assert d.stop(sig) is not None
    d.start("4MiB")
    sub = EventSubscriber(d, "default")
    try:
        seq, events = snapshot_of(sub)  # taken once the kept objects are read in
        kept = listed(d, "default")
        assert pairs(held_media(events)) == kept and kept  # with routes: the engine's names
        assert {medium for _, medium in kept} == {"STORAGE"}  # the host arena starts empty
        assert seq >= 0  # the restart's AllBlocksCleared is batch 0
        by_hash = {e["block_hashes"][0]: e for e in events[1:]}
        gone = next(i for i in range(5, 10) if (b"blk-%d-a" % i, "STORAGE") in kept)
        assert by_hash[b"blk-%d-a" % gone]["session_id"] == "s1"
        assert by_hash[b"blk-%d-a" % gone]["block_hashes"] == [b"blk-%d-a" % gone, 1000 + gone]
        with d.client() as c:
            assert c.stats()["events"]["num_kept_objects"] == sum(t is not None for t in c.lookup(keys).tiers)
            wait_subscribed(sub, lambda: c.put(new_ids(1)[0], b"probe"))
            assert c.delete([keys[gone]]) == 1  # a kept object's removal names its route
            last = last_seq(c, "default")
            sub.receive_until(lambda s: s.received[-1][0] >= last, "the delete's event")
        removed = [e for e in all_events(sub.received) if e["type"] == "BlockRemoved"]
        assert {"type": "BlockRemoved", "block_hashes": [b"blk-%d-a" % gone, 1000 + gone], "medium": "STORAGE",
                "group_idx": 0, "locality": "LOCAL"} in removed
    finally:
        sub.close()


def test_heartbeats_repeat_the_last_number_and_stay_out_of_replays(daemon_factory):
    d = daemon_factory("16MiB", config={"events": {**EVENTS, "heartbeat_s": 0.05}})
    sub = EventSubscriber(d, "default")
    try:
        with d.client() as c:
            wait_subscribed(sub, lambda: c.put(new_ids(1)[0], b"probe"))
            c.put(new_ids(1)[0], b"x")
            last = last_seq(c, "default")
            sub.receive_until(lambda s: len(s.heartbeats) >= 2 and s.heartbeats[-1][0] == last, "two heartbeats")
            replayed = sub.replay(0)
            stats = c.stats()["events"]
    finally:
        sub.close()
    for at, (seq, body) in enumerate(sub.frames):
        if (seq, body) in sub.heartbeats:  # each repeats the number of the last batch before it, if any
            assert events_of(body) == [] and seq == max((s for s, _ in sub.received if (s, _) in sub.frames[:at]),
                                                        default=seq)
    assert [seq for seq, _ in sub.received] == list(range(sub.received[0][0], last + 1))  # no number taken
    # Heartbeats take no number and are not kept: an empty batch in a replay is a seal (of this
    # subscription, when a probe went before it took effect), which the subscriber received
    assert [seq for seq, _ in replayed] == list(range(last + 1))
    assert all(events_of(b) or (s, b) in sub.heartbeats for s, b in replayed)
    assert stats["num_heartbeats"] >= len(sub.heartbeats) and stats["num_sent_batches"] == stats["num_batches"]


def test_no_heartbeats_at_zero(daemon_factory):
    d = daemon_factory("16MiB", config={"events": {**EVENTS, "heartbeat_s": 0}})
    sub = EventSubscriber(d, "default")
    try:
        with d.client() as c:
            wait_subscribed(sub, lambda: c.put(new_ids(1)[0], b"probe"))
            sub.drain(timeout_ms=1500)  # a heartbeat_s of 1 would have sent one by now
            assert c.stats()["events"]["num_heartbeats"] == 0 and c.stats()["events"]["heartbeat_s"] == 0
    finally:
        sub.close()
    assert sub.heartbeats == [] and sub.received


def test_a_snapshot_of_a_namespace_with_nothing_is_all_blocks_cleared_only(daemon_factory):
    d = daemon_factory("16MiB", config={"events": EVENTS})
    sub = EventSubscriber(d, "empty")
    try:
        assert snapshot_of(sub) == (-1, [{"type": "AllBlocksCleared"}])  # nothing published: -1; its first is 0
        assert snapshot_of(sub, topic=b"not a topic") == (-1, [{"type": "AllBlocksCleared"}])
        with d.client(namespace="empty") as c:
            key = new_ids(1)[0]
            c.put(key, b"x")
            assert c.delete([key]) == 1
            seq, events = snapshot_of(sub)
            assert events == [{"type": "AllBlocksCleared"}] and seq == last_seq(c, "empty") >= 0
    finally:
        sub.close()
