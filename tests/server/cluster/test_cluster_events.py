"""A node's KV events name what its peers hold for it (medium PEER, locality REMOTE): what it
sent to their home nodes, until it deletes them or finds them gone."""

import os

import pytest

from kvstore.identity import ObjectId
from kvstore.ownership import home_nodes
from kvstore.route import Route
from kvs_events import EventSubscriber, all_events, last_seq, wait_subscribed
from kvs_testing import payload
from test_cluster_daemons import static_pair

@pytest.fixture
def pair(daemon_factory):
    return static_pair(daemon_factory, events={"enabled": True, "int_block_hashes": False})


def peer_holdings(events) -> set:
    """Block hashes held in medium PEER, from events applied in order (and their localities)."""
    held = set()
    for e in events:
        if e.get("medium") != "PEER":
            continue
        assert e["locality"] == "REMOTE", e
        if e["type"] == "BlockStored":
            held.update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            held.difference_update(e["block_hashes"])
    return held


def test_what_a_node_sent_to_its_peer_is_published_as_peer_until_deleted_or_gone(pair):
    a, b = pair
    on_b = [k for k in (ObjectId(os.urandom(32)) for _ in range(64)) if home_nodes(k, ["a", "b"]) == ["b"]][:4]
    sub = EventSubscriber(a, "default")
    try:
        with a.client() as ca, b.client() as cb:
            wait_subscribed(sub, lambda: ca.put(ObjectId(os.urandom(32)), b"probe"))
            for i, key in enumerate(on_b):  # b is their home: a keeps no copy
                (put,) = ca.put_many([(key, payload(8192, i))], tier="remote", routes=[Route([b"blk-%d" % i])])
                assert put.error is None and put.tier == "remote"
            assert ca.delete(on_b[:1]) == 1  # through a: everywhere
            assert cb.delete(on_b[1:2], scope="node") == 1  # behind a's back: a learns at its next read
            assert ca.get(on_b[1]) is None
            last = last_seq(ca, "default")
            sub.receive_until(lambda s: s.received and s.received[-1][0] >= last, "a's events")
    finally:
        sub.close()
    named = {b"blk-%d" % i for i in range(4)}  # (the probes, replicated to b when homed there, are PEER too)
    assert peer_holdings(all_events(sub.received)) & named == {b"blk-2", b"blk-3"}
