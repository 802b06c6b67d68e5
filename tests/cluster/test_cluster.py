"""Three nodes, each in its own network namespace, with a static peer list.

Shown: an object put on A is read on C bit-exact through its rendezvous home; lookups work
across nodes; B cut off (link down): reads of B-homed objects fail fast while the rest keep
working, and B serves again once its link is back; with two replicas, losing B loses nothing.
"""

import time

import pytest
from cluster_helpers import expected_digest, seeds_by_home, start_cluster, wait_until

pytestmark = pytest.mark.cluster

NAMES = ["a", "b", "c"]
TIMEOUT_S = 1.0  # peer_timeout_s, the default
MARGIN_S = 0.5
SIZE = 1 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    net, nodes = start_cluster(NAMES, str(tmp_path_factory.mktemp("cluster")), timeout_s=TIMEOUT_S)
    try:
        yield net, nodes
    finally:
        net.close()


def test_put_on_a_read_on_c_bit_exact_via_the_home(cluster):
    net, nodes = cluster
    seeds = seeds_by_home(NAMES, "ns", SIZE, per_node=2)
    for home, home_seeds in seeds.items():
        for seed in home_seeds:
            put = nodes["a"].cmd(op="put", seed=seed, size=SIZE)
            assert put["homes"] == [home] and put["held"] == [home]
            got = nodes["c"].cmd(op="get", seed=seed, size=SIZE)
            assert got["found"] and got["digest"] == expected_digest("ns", seed, SIZE)
            assert got["source"] == ("local" if home == "c" else "remote")
    all_seeds = [s for v in seeds.values() for s in v]
    assert nodes["b"].cmd(op="lookup", seeds=all_seeds + [10_000], size=SIZE)["found"] == [True] * 6 + [False]
    assert nodes["b"].cmd(op="lookup", ns="other-tenant", seeds=all_seeds, size=SIZE)["found"] == [False] * 6


def test_cut_off_node_fails_fast_others_work_then_it_rejoins(cluster):
    net, nodes = cluster
    seeds = seeds_by_home(NAMES, "cut", SIZE, per_node=3)
    for seed in [s for v in seeds.values() for s in v]:
        nodes["a"].cmd(op="put", ns="cut", seed=seed, size=SIZE)
    net.set_link("b", up=False)
    try:
        for seed in seeds["b"]:
            start = time.monotonic()
            got = nodes["c"].cmd(op="get", ns="cut", seed=seed, size=SIZE)
            assert not got["found"]
            assert time.monotonic() - start < TIMEOUT_S + MARGIN_S
        for seed in seeds["a"] + seeds["c"]:
            got = nodes["c"].cmd(op="get", ns="cut", seed=seed, size=SIZE)
            assert got["found"] and got["digest"] == expected_digest("cut", seed, SIZE)
        start = time.monotonic()
        found = nodes["c"].cmd(op="lookup", ns="cut", seeds=seeds["a"] + seeds["b"], size=SIZE)["found"]
        assert found == [True] * 3 + [False] * 3
        assert time.monotonic() - start < TIMEOUT_S + MARGIN_S
        stats = nodes["c"].cmd(op="stats")["remote"]
        assert stats["num_peer_failures"] >= 1 and stats["num_misses"] >= 3
    finally:
        net.set_link("b", up=True)

    def b_serves_again():
        return nodes["c"].cmd(op="get", ns="cut", seed=seeds["b"][0], size=SIZE)["found"]

    wait_until(b_serves_again, TIMEOUT_S + 5.0, "B serves again after its link is back")
    for seed in seeds["b"]:
        got = nodes["c"].cmd(op="get", ns="cut", seed=seed, size=SIZE)
        assert got["found"] and got["digest"] == expected_digest("cut", seed, SIZE)


def test_two_replicas_survive_losing_one_node(cluster):
    net, nodes = cluster
    seeds = [s for v in seeds_by_home(NAMES, "rep", SIZE, per_node=3, replicas=2).values() for s in v]
    for seed in seeds:
        put = nodes["a"].cmd(op="put", ns="rep", seed=seed, size=SIZE, replicas=2)
        assert sorted(put["held"]) == sorted(put["homes"]) and len(put["homes"]) == 2
    net.set_link("b", up=False)
    try:
        for reader in ("a", "c"):
            for seed in seeds:
                got = nodes[reader].cmd(op="get", ns="rep", seed=seed, size=SIZE, replicas=2)
                assert got["found"] and got["digest"] == expected_digest("rep", seed, SIZE), (reader, seed)
            found = nodes[reader].cmd(op="lookup", ns="rep", seeds=seeds, size=SIZE, replicas=2)["found"]
            assert found == [True] * len(seeds)
    finally:
        net.set_link("b", up=True)
