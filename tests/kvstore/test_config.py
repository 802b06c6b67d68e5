import pytest

from kvstore.config import ServerConfig, parse_size
from kvstore.errors import InvalidArgument


@pytest.mark.parametrize("text, value", [(4096, 4096), ("64MiB", 64 << 20), ("1.5GiB", 3 << 29), ("2GB", 2 * 10**9), ("10", 10)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["lots", "-1", "1 parsec", -5])
def test_parse_size_rejects(bad):
    with pytest.raises(InvalidArgument):
        parse_size(bad)


def test_defaults_need_no_file():
    config = ServerConfig()
    assert config.host.arena_bytes > 0 and config.socket_mode == 0o600 and config.admin.host == "127.0.0.1"


def test_nested_tables_and_sizes():
    config = ServerConfig.from_dict({"host": {"arena_bytes": "64MiB", "policy": "lru"}, "limits": {"max_clients": 4}})
    assert config.host.arena_bytes == 64 << 20 and config.host.policy == "lru" and config.limits.max_clients == 4


@pytest.mark.parametrize("data, match", [
    ({"hots": {}}, "unknown config key"),
    ({"host": {"arena_byte": 1}}, r"host\.arena_byte"),
    ({"host": {"arena_bytes": 1000}}, "multiple of 4096"),
    ({"log_level": "loud"}, "log_level"),
    ({"limits": {"lease_ttl_s": -1}}, "lease_ttl_s"),
    ({"host": 5}, "must be a table"),
])
def test_bad_config_is_refused_with_the_key_named(data, match):
    with pytest.raises(InvalidArgument, match=match):
        ServerConfig.from_dict(data)
