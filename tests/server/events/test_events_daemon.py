"""The KV event stream of a real daemon, read over real ZMQ sockets as a router reads it.

Each test checks the stream against what the store holds: applying a namespace's events in
sequence order gives the objects its lookup finds, per medium.
"""

import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Hints
from kvstore.errors import InvalidArgument
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.protocol import NEED_DATA, FrameCodec, Reply, Request
from kvstore.route import Route
from kvs_events import EventSubscriber, all_events, events_of, held_media, last_seq, wait_subscribed
from kvs_testing import payload, wait_until
from kvstore.server.admin.client import AdminClient

MiB = 1 << 20
# Block hashes as bytes, so events name objects by their ids here (the default int form is
# tested with vLLM's classes: tests/adapters/vllm/test_kv_events.py).
EVENTS = {"events": {"enabled": True, "int_block_hashes": False}}


def read(c, key, size) -> bool:
    out = np.empty(size, np.uint8)
    return c.get_into(key, out) == size


def new_ids(n):
    return [ObjectId(os.urandom(32)) for _ in range(n)]


holdings = held_media  # medium -> ids held, from events applied in order


def catch_up(subscriber, client, namespace):
    """Receive until the subscriber has the last batch the daemon numbered for `namespace`."""
    last = last_seq(client, namespace)
    subscriber.receive_until(lambda s: s.received and s.received[-1][0] >= last, f"catch up on {namespace}")


def assert_gapless(received):
    seqs = [seq for seq, _ in received]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs


def test_a_subscriber_sees_stored_evicted_deleted_and_expired_of_its_namespace_only(daemon_factory):
    d = daemon_factory("4MiB", config=EVENTS)
    # "a" and "ab": one name is a prefix of the other, as ZMQ's topic filter matches prefixes
    mine, other = EventSubscriber(d, "a"), EventSubscriber(d, "ab")
    put_in = {"a": [], "ab": []}
    try:
        with d.client(namespace="a") as a, d.client(namespace="ab") as ab:
            for name, c, sub in (("a", a, mine), ("ab", ab, other)):
                def poke(c=c, name=name):
                    put_in[name].extend(new_ids(1))
                    c.put(put_in[name][-1], b"probe")
                wait_subscribed(sub, poke)
            keys = new_ids(8)
            put_in["a"] += keys
            for i, key in enumerate(keys):  # 8 MiB through a 4 MiB arena: the first ones are evicted
                a.put(key, payload(MiB, i), hints=Hints(session_id="s1"))
            ab.put(put_in["ab"][-1], b"probe")  # the other namespace stores meanwhile
            assert a.delete([keys[-1]]) == 1
            short = new_ids(1)[0]
            put_in["a"].append(short)
            a.put(short, b"short-lived", hints=Hints(ttl_s=0.5))
            mine.receive_until(lambda s: any(e["type"] == "BlockRemoved" and short in e["block_hashes"]
                                             for e in all_events(s.received)), "the expiry's event")
            catch_up(mine, a, "a")
            catch_up(other, ab, "ab")
            found = a.lookup(put_in["a"]).tiers
            resident = {key for key, tier in zip(put_in["a"], found) if tier == "host"}
    finally:
        mine.close(), other.close()
    mine_events = all_events(mine.received)
    seen = {h for e in mine_events for h in e.get("block_hashes", ())}
    assert seen <= set(put_in["a"]) and not seen & set(put_in["ab"])
    assert {h for e in all_events(other.received) for h in e.get("block_hashes", ())} <= set(put_in["ab"])
    assert_gapless(mine.received), assert_gapless(other.received)
    stored = {e["block_hashes"][0]: e for e in mine_events if e["type"] == "BlockStored"}
    assert set(keys) <= set(stored)
    assert all(stored[k]["medium"] == "CPU" and stored[k]["block_size"] == 256 and stored[k]["session_id"] == "s1"
               for k in keys)
    removed = {e["block_hashes"][0] for e in mine_events if e["type"] == "BlockRemoved"}
    assert keys[-1] in removed and short in removed and keys[0] in removed  # deleted, expired, evicted
    # The events replay to what the store holds, the probes before the subscription aside.
    held = holdings(mine_events).get("CPU", set())
    assert held == resident - (resident - seen)


def test_a_replay_returns_the_batches_a_subscriber_missed(daemon_factory):
    d = daemon_factory("16MiB", config=EVENTS)
    early = EventSubscriber(d, "default")
    with d.client() as c:
        wait_subscribed(early, lambda: c.put(new_ids(1)[0], b"probe"))
        for key in new_ids(5):
            c.put(key, b"x" * 100)
        catch_up(early, c, "default")
        late = EventSubscriber(d, "default")  # missed everything so far
        try:
            missed = late.replay(0)  # vLLM's request: no topic, the namespace "default"
            by_topic = late.replay(3, topic=late.topic)
        finally:
            late.close()
        early.close()
    # Everything early received, and the seal of late's subscription if it came before the replay
    assert [seq for seq, _ in missed] == list(range(len(missed))) and missed[-1][0] >= early.received[-1][0]
    live = dict(early.received)
    assert all(live[seq] == body for seq, body in missed if seq in live)
    # the same batches, and late's seal if it came between the two replays
    assert by_topic[:len(missed) - 3] == missed[3:] and all(not events_of(b) for _, b in by_topic[len(missed) - 3:])
    metrics = AdminClient.from_data_dir(d.data_dir).request("GET", "/metrics", raw=True)
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert samples["kvstore_events_replays_total"] == 2
    assert samples["kvstore_events_batches_total"] - len(missed) in (0, 1)  # late's seal may follow its replay
    assert samples["kvstore_events_dropped_batches_total"] == 0


def test_a_subscriber_that_never_reads_does_not_stop_puts_and_gets(daemon_factory):
    d = daemon_factory("16MiB", config={"events": {"enabled": True, "hwm": 1, "buffer_batches": 100_000}})
    stuck = EventSubscriber(d, "default", rcvhwm=1)
    n = 2000
    try:
        with d.client() as c:
            wait_subscribed(stuck, lambda: c.put(new_ids(1)[0], b"probe"))
            keys = new_ids(n)
            for i, key in enumerate(keys):  # the subscriber reads nothing meanwhile
                c.put(key, payload(4096, i))
                assert read(c, key, 4096)
            # The publisher thread sent every batch: the PUB socket dropped frames, never waited.
            wait_until(lambda: c.stats()["events"]["num_sent_batches"] == c.stats()["events"]["num_batches"],
                       10, "every batch sent")
            last = last_seq(c, "default")
        stuck.drain()
        got = dict(stuck.received)
        first_missing = next((seq for seq in range(min(got), last + 1) if seq not in got), last + 1)
        replayed = dict(stuck.replay(first_missing)) if first_missing <= last else {}
    finally:
        stuck.close()
    assert set(got) | set(replayed) >= set(range(min(got), last + 1))  # what was dropped comes back
    assert all(got[seq] == replayed[seq] for seq in set(got) & set(replayed))


def test_nvme_holdings_are_storage_events(daemon_factory):
    d = daemon_factory("4MiB", config={**EVENTS, "nvme": {"enabled": True, "capacity_bytes": "64MiB",
                                                         "file_bytes": "16MiB", "admit_min_hits": 0}})
    sub = EventSubscriber(d, "default")
    probes = []
    try:
        with d.client() as c:
            def poke():
                probes.extend(new_ids(1))
                c.put(probes[-1], b"probe")
            wait_subscribed(sub, poke)
            keys = new_ids(8)
            for i, key in enumerate(keys):  # the first ones are demoted to NVMe
                c.put(key, payload(MiB, i))
            assert read(c, keys[0], MiB)  # promoted back
            catch_up(sub, c, "default")
            tiers = dict(zip(keys, c.lookup(keys).tiers))
            held = holdings(all_events(sub.received))
            assert {k for k in keys if tiers[k] == "host"} == held["CPU"] & set(keys)
            assert {k for k in keys if tiers[k] == "nvme"} <= held["STORAGE"] - held["CPU"]
            assert keys[0] in held["CPU"] and keys[0] in held["STORAGE"]
            assert c.delete(keys) == len(keys)
            catch_up(sub, c, "default")
    finally:
        sub.close()
    held = holdings(all_events(sub.received))
    assert not (held.get("CPU", set()) | held.get("STORAGE", set())) & set(keys)


def test_a_stopping_daemon_clears_every_namespace_it_published(daemon_factory):
    d = daemon_factory("16MiB", config=EVENTS)
    sub = EventSubscriber(d, "default")
    try:
        with d.client() as c:
            wait_subscribed(sub, lambda: c.put(new_ids(1)[0], b"probe"))
        assert d.stop(signal.SIGTERM) == 0
        sub.drain()
    finally:
        sub.close()
    assert events_of(sub.received[-1][1]) == [{"type": "AllBlocksCleared"}]
    assert_gapless(sub.received)


def test_an_endpoint_that_cannot_be_bound_is_refused_naming_the_key(unstarted_daemon):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = unstarted_daemon({"events": {"enabled": True, "endpoint": f"tcp://127.0.0.1:{port}"}})
        result = subprocess.run([sys.executable, "-m", "kvstore.commands.cli", "serve", "--config", d.config_path,
                                 "--socket", d.socket], capture_output=True, text=True, timeout=60,
                                stdin=subprocess.DEVNULL)
    assert result.returncode != 0
    assert "events.endpoint" in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("namespace", ["default", "a:b", "ünï"])
def test_topics_are_not_prefixes_of_each_other(namespace):
    from kvstore.server.events import topic_of
    others = ["default2", "a", "a:", "ün", "defaul"]
    mine = topic_of("kvstore.", namespace)
    assert not any(topic_of("kvstore.", o).startswith(mine) for o in others if o != namespace)


def route_of(i: int) -> Route:
    """Two engine blocks per object, as an adapter names them (bytes and an int hash)."""
    return Route([b"blk-%d-a" % i, 1000 + i], parent_block_hash=None if i == 0 else 1000 + i - 1,
                 token_ids=list(range(32)), block_size=16, group_idx=0)


def test_routes_name_the_blocks_on_every_tier_until_the_object_leaves_the_node(daemon_factory):
    """Objects put with routes travel host -> NVMe -> out of the node; every event names them
    by their engine block hashes, so the hashes held per medium are those of what lookups find."""
    d = daemon_factory("4MiB", config={**EVENTS, "nvme": {"enabled": True, "capacity_bytes": "8MiB",
                                                         "file_bytes": "2MiB", "admit_min_hits": 0}})
    sub = EventSubscriber(d, "default")
    try:
        with d.client() as c:
            wait_subscribed(sub, lambda: c.put(new_ids(1)[0], b"probe"))
            keys = new_ids(24)
            results = c.put_many([(k, payload(MiB, i)) for i, k in enumerate(keys[:20])],
                                 routes=[route_of(i) if i % 5 else None for i in range(20)])
            assert all(r.error is None for r in results)
            for i, key in enumerate(keys[20:], 20):
                c.put(key, payload(MiB, i), hints=Hints(route=route_of(i)))
            before = c.lookup(keys).tiers
            back = next(i for i, t in enumerate(before) if t == "nvme" and i % 5)
            assert read(c, keys[back], MiB)  # promoted: stored in CPU again, under the same route
            assert c.delete(keys[23:24]) == 1
            catch_up(sub, c, "default")
            tiers = dict(zip(keys, c.lookup(keys).tiers))
            shown = AdminClient.from_data_dir(d.data_dir).get(f"/v1/objects/{keys[back].hex}")
    finally:
        sub.close()
    held = holdings(all_events(sub.received))
    names = {k: ([b"blk-%d-a" % i, 1000 + i] if i % 5 or i >= 20 else [bytes(k)]) for i, k in enumerate(keys)}
    for key, tier in tiers.items():
        for medium, on in (("CPU", tier == "host"), ("STORAGE", tier in ("host", "nvme"))):
            inside = {h in held.get(medium, set()) for h in names[key]}  # a host object may be on NVMe too
            assert inside == {on} or (medium == "STORAGE" and tier == "host"), (key, tier, medium, inside)
    assert any(t is None for t in tiers.values()) and any(t == "nvme" for t in tiers.values())  # all paths taken
    assert tiers[keys[back]] == "host" and tiers[keys[23]] is None
    assert shown["hints"]["route"] == {"block_hashes": [(b"blk-%d-a" % back).hex(), 1000 + back],
                                       "parent_block_hash": 1000 + back - 1, "token_ids": list(range(32)),
                                       "block_size": 16, "group_idx": 0}


def replies_to(path: str, requests: list[Request]) -> dict[int, Reply]:
    """Send raw requests on a fresh connection (what a client of another language could send)."""
    codec = FrameCodec()
    replies = {}
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(b"".join(codec.send_request(r) for r in requests))
        while len(replies) < len(requests):
            event = codec.next_event()
            if event is NEED_DATA:
                codec.receive_data(sock.recv(1 << 16))
            else:
                replies[event.id] = event
    return replies


def test_a_bad_route_is_refused_by_name_and_the_daemon_serves_on(daemon_factory):
    d = daemon_factory("16MiB", config=EVENTS)
    key, good = new_ids(2)
    desc = StateDescriptor("default", "m", "r1", kind="kv", dtype="bf16").to_wire()
    bad_routes = [b"\x81\xa1x\x01",  # a map without block_hashes
                  Route([1]).pack().replace(b"\x01", b"\xc3"),  # a hash that is a bool
                  b"\xc1"]  # not msgpack
    requests = [Request(1, "open", {"namespace": "default"})]
    for i, route in enumerate(bad_routes):
        requests.append(Request(10 + i, "reserve", {"namespace": "default", "object_id": key.digest, "size": 64,
                                                    "descriptor": desc, "hints": {"route": route}}))
    requests.append(Request(20, "reserve_many", {"namespace": "default", "ids": key.digest + good.digest,
                                                 "sizes": (64).to_bytes(8, "little") * 2, "descriptor": desc,
                                                 "routes": [None]}))  # one route for two ids
    replies = replies_to(d.socket, requests)
    for rid in (10, 11, 12, 20):
        assert replies[rid].error["code"] == "invalid_argument" and "route" in replies[rid].error["message"], \
            replies[rid].error
    with d.client() as c:
        results = c.put_many([(key, b"x" * 64), (good, b"y" * 64)], routes=[None, route_of(3)])
        assert [r.error for r in results] == [None, None]
        assert c.lookup([key, good]).hits == 2
        with pytest.raises(InvalidArgument, match="2 items but 1 routes"):
            c.put_many([(key, b"x" * 64), (good, b"y" * 64)], routes=[None])
