"""ClusterConfig and PeerNode: what the daemon wires from its config file."""

import pathlib
import tomllib

import numpy as np
import pytest
from peer_helpers import free_port, make_object, run

from kvstore.config import ClusterConfig, ServerConfig
from kvstore.errors import InvalidArgument
from kvstore.server.cluster.node import PeerNode, read_secret
from bench.peer_service import InMemoryBackend

ROOT = pathlib.Path(__file__).resolve().parents[3]
SECRET = "node-test-secret-000001"


@pytest.mark.parametrize("bad, match", [
    ({"transport": "rdma"}, "transport must be tcp or ucx"),
    ({"membership": "zookeeper"}, "membership must be static or etcd"),
    ({"enabled": True}, "needs cluster.secret"),
    ({"secret": "short"}, "at least 16"),
    ({"peers": ["a=10.0.0.1"]}, "host:port"),
    ({"peers": ["a=10.0.0.1:1", "a=10.0.0.2:1"]}, "twice"),
    ({"replicas": 0}, "replicas"),
    ({"peer_timeout_s": 0}, "peer_timeout_s"),
    ({"node_id": "no spaces"}, "node_id"),
    ({"remote_write": "selective"}, "remote_write must be write_through or write_back"),
    ({"rehome": "yes"}, "rehome must be true or false"),
    ({"rehome_delay_s": 0}, "rehome_delay_s"),
    ({"handover_s": -1}, "handover_s"),
])
def test_bad_cluster_config_is_refused_with_the_key_named(bad, match):
    with pytest.raises(InvalidArgument, match=match):
        ServerConfig.from_dict({"cluster": bad})


def test_cluster_defaults_are_off_and_loopback():
    cluster = ServerConfig().cluster
    assert not cluster.enabled and cluster.listen.startswith("127.0.0.1:")
    assert cluster.replicas == 1 and cluster.peer_timeout_s == 1.0 and cluster.lease_ttl_s == 5.0
    assert cluster.remote_write == "write_through" and cluster.rehome and cluster.handover_s == 10.0


@pytest.mark.parametrize("node", ["a", "b", "c"])
def test_docker_node_configs_parse(node):
    with open(ROOT / "docker" / "config" / f"node-{node}.toml", "rb") as f:
        config = ServerConfig.from_dict(tomllib.load(f))
    assert config.cluster.enabled and config.cluster.node_id == f"node-{node}"
    assert config.cluster.membership == "etcd" and config.cluster.replicas == 2


def test_secret_file_is_read_and_checked(tmp_path):
    good, short = tmp_path / "good", tmp_path / "short"
    good.write_text(SECRET + "\n")
    short.write_text("abc")
    assert read_secret(ClusterConfig(enabled=True, secret_file=str(good))) == SECRET.encode()
    with pytest.raises(InvalidArgument, match="fewer than 16"):
        read_secret(ClusterConfig(enabled=True, secret_file=str(short)))
    with pytest.raises(InvalidArgument, match="cannot read"):
        read_secret(ClusterConfig(enabled=True, secret_file=str(tmp_path / "missing")))


def test_a_secret_file_others_can_read_is_used_with_a_warning(tmp_path, caplog):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    with caplog.at_level("WARNING", logger="kvstore.peer"):
        assert read_secret(ClusterConfig(enabled=True, secret_file=str(secret))) == SECRET.encode()
    assert "secret_file_readable" not in caplog.text
    secret.chmod(0o644)
    with caplog.at_level("WARNING", logger="kvstore.peer"):
        assert read_secret(ClusterConfig(enabled=True, secret_file=str(secret))) == SECRET.encode()
    assert "event=secret_file_readable" in caplog.text and "mode=644" in caplog.text


def test_wildcard_listen_needs_an_advertised_address():
    node = PeerNode(ClusterConfig(enabled=True, node_id="a", listen="0.0.0.0:0", secret=SECRET))
    with pytest.raises(InvalidArgument, match="cluster.advertise"):
        run(node.start(InMemoryBackend()))


def test_two_nodes_from_config_exchange_an_object():
    ports = {"a": free_port(), "b": free_port()}
    peers = tuple(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
    backends = {n: InMemoryBackend() for n in ports}
    nodes = {n: PeerNode(ClusterConfig(enabled=True, node_id=n, listen=f"127.0.0.1:{p}", secret=SECRET,
                                       peers=peers)) for n, p in ports.items()}
    seen = []

    async def scenario():
        for n, node in nodes.items():
            await node.start(backends[n], on_members=seen.append if n == "a" else None)
        try:
            for seed in range(20):  # until one object is homed on b
                oid, meta, data = make_object(50_000, seed=seed)
                if nodes["a"].remote.homes(oid) == ["b"]:
                    break
            held = await nodes["a"].remote.put("ns", oid, meta, data)
            out = np.empty(meta.size, dtype=np.uint8)
            got = await nodes["a"].remote.get_into("ns", oid, lambda m: out)
            return held, got, out, oid, meta, data, nodes["b"].stats()
        finally:
            for node in nodes.values():
                await node.stop()

    held, got, out, oid, meta, data, stats_b = run(scenario())
    assert held == ["b"] and got == meta and np.array_equal(out, data)
    assert ("ns", oid) in backends["b"].objects
    assert seen == [{"a": f"127.0.0.1:{ports['a']}", "b": f"127.0.0.1:{ports['b']}"}]
    assert stats_b["service"]["num_requests"] == 2
