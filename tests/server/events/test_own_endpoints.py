"""A namespace with endpoints of its own (`[events.namespaces.<name>]`): its events, replays
and snapshots are there only, and the shared endpoints never show it (nor it another's)."""

import os
import socket
import subprocess
import sys

import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvstore.identity import ObjectId
from kvs_events import EventSubscriber, all_events, endpoints, events_of, last_seq, vllm_int_hash, \
    wait_subscribed
from kvs_testing import payload
from kvstore.server.admin.client import AdminClient

CONFIG = {"host": {"namespaces": ["default", "tenant"]},
          "events": {"enabled": True, "heartbeat_s": 0, "namespaces": {"tenant": {}}}}


def own_endpoints(daemon, name: str) -> tuple[str, str]:
    return (f"ipc://{os.path.join(daemon.data_dir, f'events-{name}.pub')}",
            f"ipc://{os.path.join(daemon.data_dir, f'events-{name}.replay')}")


def test_a_namespace_of_its_own_is_published_on_its_endpoints_only(daemon_factory):
    d = daemon_factory("16MiB", config=CONFIG)
    mine = EventSubscriber(d, "tenant", at=own_endpoints(d, "tenant"))
    shared = EventSubscriber(d, "default")
    ctx = zmq.Context()
    everything = ctx.socket(zmq.SUB)  # every topic of the shared endpoint, as Dynamo subscribes
    everything.setsockopt(zmq.SUBSCRIBE, b"")
    everything.connect(endpoints(d)[0])
    ours, theirs = ObjectId(os.urandom(32)), ObjectId(os.urandom(32))
    try:
        with d.client(namespace="tenant") as tc, d.client() as dc:
            wait_subscribed(mine, lambda: tc.put(ObjectId(os.urandom(32)), b"probe"))
            wait_subscribed(shared, lambda: dc.put(ObjectId(os.urandom(32)), b"probe"))
            tc.put(ours, payload(4096, 1))
            dc.put(theirs, payload(4096, 2))
            for sub, c, name in ((mine, tc, "tenant"), (shared, dc, "default")):
                last = last_seq(c, name)
                sub.receive_until(lambda s: s.received and s.received[-1][0] >= last, f"{name}'s events")
            topics = set()
            while everything.poll(200):
                topics.add(everything.recv_multipart()[0])
            stats = dc.stats()["events"]
        mine_events, shared_events = all_events(mine.received), all_events(shared.received)
        assert vllm_int_hash(ours) in {h for e in mine_events for h in e.get("block_hashes", ())}
        assert vllm_int_hash(ours) not in {h for e in shared_events for h in e.get("block_hashes", ())}
        assert topics == {shared.topic}  # the tenant's topic never reaches the shared endpoint
        # vLLM's replay form on the tenant's endpoint replays the tenant's namespace
        assert [seq for seq, _ in mine.replay(0)] == list(range(last_seq_of(stats, "tenant") + 1))
        # each endpoint's snapshot shows its own namespace, and nothing of the other's
        seq, frames = mine.snapshot()
        assert vllm_int_hash(ours) in {h for f in frames for e in events_of(f) for h in e.get("block_hashes", ())}
        for sub, other in ((mine, shared.topic), (shared, mine.topic)):  # asked at the wrong endpoint
            seq, frames = sub.snapshot(other)
            assert seq == -1 and [events_of(f) for f in frames] == [[{"type": "AllBlocksCleared"}]]
        assert mine.replay(0, topic=shared.topic) == []  # another namespace's ring is not there
        assert stats["own_endpoints"]["tenant"]["endpoint"] == own_endpoints(d, "tenant")[0]
        # /metrics counts every endpoint's publisher
        metrics = AdminClient.from_data_dir(d.data_dir).request("GET", "/metrics", raw=True)
        samples = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
        assert samples["kvstore_events_snapshot_requests_total"] == 3
        assert samples["kvstore_events_snapshots_total"] == 3
        assert samples["kvstore_events_replays_total"] == 2
        assert samples["kvstore_events_held_objects"] >= 4  # two probes, ours and theirs
    finally:
        mine.close()
        shared.close()
        everything.close(linger=0)
        ctx.term()


def last_seq_of(stats: dict, name: str) -> int:
    return stats["namespaces"][name]["next_seq"] - 1


def test_a_namespace_endpoint_that_cannot_be_bound_is_refused_naming_its_key(unstarted_daemon):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = unstarted_daemon({"events": {"enabled": True,
                                         "namespaces": {"tenant": {"endpoint": f"tcp://127.0.0.1:{port}"}}}})
        result = subprocess.run([sys.executable, "-m", "kvstore.commands.cli", "serve", "--config", d.config_path,
                                 "--socket", d.socket], capture_output=True, text=True, timeout=60,
                                stdin=subprocess.DEVNULL)
    assert result.returncode != 0
    assert "events.namespaces.tenant.endpoint" in result.stderr and "Traceback" not in result.stderr, result.stderr
