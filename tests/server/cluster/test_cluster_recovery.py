"""Real daemons on loopback, static peer list: a peer that stops and comes back is seen up
again, takes puts at once, and receives what it missed; a wrong secret is reported."""

import re
import signal

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvstore.identity import ObjectId
from kvstore.server.admin.client import AdminClient
from kvs_testing import wait_for
from test_cluster_daemons import free_port
from test_cluster_tiers import ids_homed, local_tiers, payload, static_cluster

SIZE = 100_000


def metrics(daemon) -> dict:
    text = AdminClient.from_data_dir(daemon.data_dir).request("GET", "/metrics", raw=True)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def seen_down(daemon, node: str) -> bool:
    members = AdminClient.from_data_dir(daemon.data_dir).get("/v1/cluster")["members"]
    return next(m["down"] for m in members if m["node_id"] == node)


def test_a_restarted_peer_takes_remote_puts_at_once_on_fresh_links(daemon_factory):
    """B restarts cleanly while A holds pooled links to it: A's next tier="remote" puts homed
    on B reach B (the stale link is retried on a fresh one), and say so in `homes`."""
    a, b = static_cluster(daemon_factory, {"a": "32MiB", "b": "32MiB"})
    on_b = ids_homed("restart", "ab", ("b",), 8)
    with a.client() as ca:
        for oid in on_b[:4]:  # A now keeps an open link to B in its pool
            assert ca.put(oid, payload(SIZE, oid), tier="remote").tier == "remote"
    assert b.stop(signal.SIGTERM) == 0
    b.start("32MiB")
    with a.client() as ca:
        for oid in on_b[4:]:
            result = ca.put(oid, payload(SIZE, oid), tier="remote")
            assert (result.tier, result.homes) == ("remote", ("b",)), oid
        assert ca.stats()["tiers"]["remote"]["num_remote_put_fallbacks"] == 0
    with b.client() as cb:
        for oid in on_b[4:]:
            with cb.get(oid) as lease:
                assert np.array_equal(lease.numpy(), payload(SIZE, oid))


def test_a_peer_that_answers_again_is_up_without_traffic_to_it(daemon_factory):
    """A marks B down when a read fails; once B is back, A shows it up again (in /v1/cluster
    and kvstore_cluster_member_up) though A sends it nothing."""
    a, b = static_cluster(daemon_factory, {"a": "16MiB", "b": "16MiB"})
    b.stop(signal.SIGKILL)
    with a.client() as ca:
        assert ca.get(ids_homed("gone", "ab", ("b",), 1)[0]) is None  # asks B: fails, B is down
    assert seen_down(a, "b")
    assert metrics(a)[("kvstore_cluster_member_up", (("node", "b"),))] == 0
    b.start("16MiB")
    assert wait_for(lambda: not seen_down(a, "b"), 60)  # bound: not a hang
    assert metrics(a)[("kvstore_cluster_member_up", (("node", "b"),))] == 1


def test_a_static_peer_back_up_receives_what_it_missed(daemon_factory):
    """B is down while A takes tier="remote" puts homed on B (kept on A). When B answers
    again, A re-homes them to B: the static list never changed, B's return counts as a join."""
    a, b = static_cluster(daemon_factory, {"a": "32MiB", "b": "32MiB"}, rehome_delay_s=0.2)
    on_b = ids_homed("missed", "ab", ("b",), 6)
    b.stop(signal.SIGKILL)
    with a.client() as ca:
        for oid in on_b:
            result = ca.put(oid, payload(SIZE, oid), tier="remote")
            assert (result.tier, result.homes) == ("host", ())  # no home took it: kept here
    b.start("32MiB")
    assert wait_for(lambda: local_tiers(b, on_b) == ("host",) * len(on_b), 60)  # bound: not a hang

    def rehome():
        with a.client() as ca:
            return ca.stats()["tiers"]["remote"]["rehome"]
    assert wait_for(lambda: rehome()["objects_sent"] == len(on_b) and not rehome()["running"], 60), rehome()
    assert rehome()["passes"] >= 1
    with b.client() as cb:
        for oid in on_b:
            with cb.get(oid) as lease:
                assert np.array_equal(lease.numpy(), payload(SIZE, oid))


def test_a_wrong_secret_is_a_warning_on_both_sides_and_counted(daemon_factory, capfd):
    port_a, port_b = free_port(), free_port()
    peers = [f"a=127.0.0.1:{port_a}", f"b=127.0.0.1:{port_b}"]

    def node(name, port, secret):
        return daemon_factory("16MiB", config={"cluster": {
            "enabled": True, "node_id": name, "listen": f"127.0.0.1:{port}", "peers": peers, "secret": secret}})
    a = node("a", port_a, "a-cluster-secret-of-some-length")
    b = node("b", port_b, "another-secret-entirely-x")  # B shakes hands with A as it starts

    def failures(daemon, side):
        return metrics(daemon).get(("kvstore_peer_auth_failures_total", (("side", side),)), 0)
    assert wait_for(lambda: failures(a, "server") >= 1 and failures(b, "client") >= 1, 60)  # bound: not a hang
    with b.client() as cb:
        assert cb.get(ObjectId(b"\x01" * 32)) is None
    cluster = AdminClient.from_data_dir(b.data_dir).get("/v1/cluster")
    assert cluster["auth_failures"]["client"] >= 1
    assert [(m["node_id"], m["down"]) for m in cluster["members"]] == [("a", True), ("b", False)]
    err = capfd.readouterr().err  # both daemons log to the test's stderr
    lines = [line for line in err.splitlines() if "wrong secret from" in line]
    assert any("level=warning" in line and "side=server" in line for line in lines), err[-2000:]
    assert any("level=warning" in line and "side=client" in line and f"127.0.0.1:{port_a}" in line
               for line in lines), err[-2000:]
    assert all(re.search(r"wrong secret from \S+:\d+", line) for line in lines)


def test_a_put_that_reached_one_of_its_homes_names_it(daemon_factory):
    """Two replicas, homes B and C, C down: the tier="remote" put stays on A too (not every
    home took it), and `homes` names B, which holds it, not ()."""
    a, b, c = static_cluster(daemon_factory, {"a": "16MiB", "b": "16MiB", "c": "16MiB"}, replicas=2)
    oids = ids_homed("partial", "abc", ("b", "c"), 2, replicas=2)
    c.stop(signal.SIGKILL)
    with a.client() as ca:
        for oid in oids:
            result = ca.put(oid, payload(SIZE, oid), tier="remote")
            assert (result.tier, result.homes) == ("host", ("b",))
    assert local_tiers(b, oids) == ("host", "host")
