"""The `[remote]` table: peers by default, the Mooncake pool's keys validated before start,
every bad value refused with its key named."""

import pytest

from kvstore.config import ServerConfig
from kvstore.errors import InvalidArgument

MASTER = {"backend": "mooncake", "mooncake": {"master": "10.0.0.5:50051"}}


def test_peers_by_default():
    config = ServerConfig.from_dict({})
    assert config.remote.backend == "peers" and not config.remote.mooncake_enabled


def test_mooncake_defaults_and_sizes():
    remote = ServerConfig.from_dict({"remote": {"backend": "mooncake", "mooncake": {
        "master": "10.0.0.5:50051", "global_segment_bytes": "2GiB", "local_buffer_bytes": "128MiB",
        "replicas": 2, "tenant_id": "team-a", "protocol": "rdma", "rdma_devices": "mlx5_0"}}}).remote
    m = remote.mooncake
    assert remote.mooncake_enabled and m.metadata_server == "P2PHANDSHAKE" and m.key_prefix == "kvstore/"
    assert (m.global_segment_bytes, m.local_buffer_bytes, m.replicas) == (2 << 30, 128 << 20, 2)


@pytest.mark.parametrize("table, key", [
    ({"backend": "redis"}, "remote.backend"),
    ({"backend": "mooncake"}, "remote.mooncake.master"),  # no master named
    ({"mooncake": {"master": "10.0.0.5"}}, "remote.mooncake.master"),
    ({"mooncake": {"metadata_server": "zk://x"}}, "remote.mooncake.metadata_server"),
    ({"mooncake": {"protocol": "udp"}}, "remote.mooncake.protocol"),
    ({"mooncake": {"local_hostname": "a b"}}, "remote.mooncake.local_hostname"),
    ({"mooncake": {"global_segment_bytes": "lots"}}, "remote.mooncake.global_segment_bytes"),
    ({"mooncake": {"local_buffer_bytes": 4096}}, "remote.mooncake.local_buffer_bytes"),
    ({"mooncake": {"replicas": 0}}, "remote.mooncake.replicas"),
    ({"mooncake": {"replicas": True}}, "remote.mooncake.replicas"),
    ({"mooncake": {"tenant_id": ""}}, "remote.mooncake.tenant_id"),
    ({"mooncake": {"key_prefix": "kv"}}, "remote.mooncake.key_prefix"),  # must end in '/'
    ({"mooncake": {"key_prefix": "a b/"}}, "remote.mooncake.key_prefix"),
    ({"mooncake": {"remote_write": "selective"}}, "remote.mooncake.remote_write"),
    ({"mooncake": {"retry_interval_s": 0}}, "remote.mooncake.retry_interval_s"),
    ({"mooncake": {"io_threads": 0}}, "remote.mooncake.io_threads"),
    ({"mooncake": {"write_through_yield_ms": -1}}, "remote.mooncake.write_through_yield_ms"),
    ({"mooncake": {"write_through_yield_ms": "1s"}}, "remote.mooncake.write_through_yield_ms"),
    ({"mooncake": {"write_through_quiet_ms": float("nan")}}, "remote.mooncake.write_through_quiet_ms"),
    ({"mooncake": {"write_through_quiet_ms": 10 ** 9}}, "remote.mooncake.write_through_quiet_ms"),
    ({"mooncake": {"master_metrics_url": "10.0.0.5:9003"}}, "remote.mooncake.master_metrics_url"),
    ({"mooncake": {"master_address": "x"}}, "remote.mooncake.master_address"),  # unknown key
])
def test_bad_values_name_their_key(table, key):
    with pytest.raises(InvalidArgument, match=key.replace(".", r"\.")):
        ServerConfig.from_dict({"remote": table})


def test_mooncake_and_the_peer_tier_exclude_each_other():
    with pytest.raises(InvalidArgument, match="cluster.enabled"):
        ServerConfig.from_dict({"remote": MASTER, "cluster": {"enabled": True, "secret": "s" * 20}})
