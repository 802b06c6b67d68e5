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
    # issue 41 item 15: no namespace name with a control character enters through the config
    ({"host": {"namespaces": ["ok", "a\nlevel=error"]}}, r"host\.namespaces: a namespace must be .* control character"),
    ({"auth": {"namespaces": {"a\nb": {"token": "t" * 16}}}}, r"auth\.namespaces: a namespace must be .* control"),
    ({"auth": {"namespaces": {"": {"token": "t" * 16}}}}, r"auth\.namespaces: a namespace must be 1\.\.256"),
])
def test_bad_config_is_refused_with_the_key_named(data, match):
    with pytest.raises(InvalidArgument, match=match):
        ServerConfig.from_dict(data)


@pytest.mark.parametrize("section, key, value", [
    ("nvme", "enabled", "false"),  # a non-empty string is truthy: this turned NVMe on
    ("cluster", "enabled", "false"),
    (None, "verify_puts", "yes"),
    ("host", "prefault", 0),
    ("nvme", "flush_on_shutdown", 1),
    ("cluster", "rehome", "true"),
    ("admin", "enabled", "no"),
    ("host", "arena_bytes", True),  # bool is an int subclass: not 1 byte
    ("host", "max_namespaces", True),
    ("host", "max_namespaces", 70_000),  # past what the NVMe table numbers (16 bits)
    ("admin", "port", False),
    ("limits", "max_clients", 4.0),
    ("limits", "lease_ttl_s", "300"),
    ("limits", "lease_ttl_s", float("nan")),
    ("nvme", "group_commit_ms", -5.0),
    ("cluster", "replicas", "2"),
    ("cluster", "peers", "a=127.0.0.1:1"),
    ("cluster", "peers", [5]),
    ("host", "namespaces", "default"),
    ("host", "policy", 3),
    ("admin", "host", 127),
    (None, "data_dir", 5),
    (None, "socket_mode", "0600"),
    (None, "socket_mode", 0o7777),
    ("auth", "namespaces", ["a"]),
])
def test_values_of_the_wrong_type_are_refused_naming_the_key(section, key, value):
    data = {key: value} if section is None else {section: {key: value}}
    name = key if section is None else f"{section}.{key}"
    with pytest.raises(InvalidArgument, match=name.replace(".", r"\.")):
        ServerConfig.from_dict(data)


def test_every_config_field_has_a_type_check():
    """A field whose annotation _check_type does not know would fail with a KeyError."""
    from dataclasses import fields, is_dataclass
    from kvstore.config import _TYPES

    def walk(obj, prefix=""):
        for f in fields(obj):
            value = getattr(obj, f.name)
            if is_dataclass(value):
                yield from walk(value, f"{prefix}{f.name}.")
            else:
                yield prefix + f.name, f
    unknown = [key for key, f in walk(ServerConfig()) if not f.metadata.get("size") and f.type not in _TYPES]
    assert unknown == []


@pytest.mark.parametrize("data, message", [
    ({"host": {"arena_bytes": -5}}, "host.arena_bytes must be >= 0 bytes, got -5"),
    ({"host": {"arena_bytes": "lots"}}, "host.arena_bytes must be a size"),
    ({"host": {"arena_bytes": 1.5e9}}, "host.arena_bytes must be a size"),
    ({"nvme": {"capacity_bytes": "-1GiB"}}, "nvme.capacity_bytes must be a size"),
    ({"nvme": {"file_bytes": -1}}, "nvme.file_bytes must be >= 0"),
    ({"limits": {"max_inflight_bytes_per_client": "many"}}, "limits.max_inflight_bytes_per_client must be a size"),
    ({"limits": {"max_frame_bytes": [1]}}, "limits.max_frame_bytes must be a size"),
])
def test_size_errors_name_their_key(data, message):
    with pytest.raises(InvalidArgument, match=message.replace(".", r"\.")):
        ServerConfig.from_dict(data)


def test_unknown_policy_is_refused_by_the_config():
    """It used to pass the config and fail only when the first arena was made (after the admin API started)."""
    with pytest.raises(InvalidArgument, match=r"host\.policy.*'lfu'"):
        ServerConfig.from_dict({"host": {"policy": "lfu"}})


def test_well_typed_values_pass():
    config = ServerConfig.from_dict({
        "verify_puts": True, "socket_mode": 0o660,
        "host": {"arena_bytes": 1 << 20, "prefault": False, "namespaces": ["a", "b"], "policy": "lru"},
        "limits": {"lease_ttl_s": 30, "max_frame_bytes": "1MiB"},
        "nvme": {"enabled": False, "group_commit_ms": 2},
        "cluster": {"enabled": False, "lease_ttl_s": 2.5, "peers": ["a=127.0.0.1:9000"]},
    })
    assert config.host.namespaces == ("a", "b") and config.limits.max_frame_bytes == 1 << 20


# The one NVMe config (kvstore.config.NvmeTierConfig) carries the tier's strict checks: they
# used to live in a twin (tiers/nvme_types.NvmeConfig) that the TOML never reached, so
# `io_threads = 1000` passed the config and failed only when the daemon built the tier.
@pytest.mark.parametrize("table, message", [
    ("io_threads = 1000", "nvme.io_threads must be an integer in 1..256, got 1000"),
    ("io_threads = 0", "nvme.io_threads must be an integer in 1..256, got 0"),
    ("capacity_bytes = 1000", "nvme.capacity_bytes must be a positive multiple of 4096 bytes, got 1000"),
    ('file_bytes = "0B"', "nvme.file_bytes must be a positive multiple of 4096 bytes, got 0"),
    ("group_commit_ms = 20000", r"nvme.group_commit_ms must be a number in (0, 10000], got 20000"),
    ("group_commit_ms = 0", r"nvme.group_commit_ms must be a number in (0, 10000], got 0"),
    ('durability = "async"', "nvme.durability must be sync or group, got 'async'"),
    ("write_after_hits = 0", "nvme.write_after_hits must be an integer in 1..65535, got 0"),
    ("write_after_hits = 65536", "nvme.write_after_hits must be an integer in 1..65535, got 65536"),
    ("admit_min_hits = -1", "nvme.admit_min_hits must be an integer >= 0, got -1"),
])
def test_nvme_values_out_of_range_in_the_toml_are_refused_naming_key_and_range(table, message):
    import re
    import tomllib
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        ServerConfig.from_dict(tomllib.loads(f"[nvme]\nenabled = true\n{table}\n"))


def test_nvme_edges_of_the_ranges_pass_and_sizes_are_parsed():
    import tomllib
    config = ServerConfig.from_dict(tomllib.loads(
        '[nvme]\nio_threads = 256\ncapacity_bytes = "64MiB"\nfile_bytes = 4096\ngroup_commit_ms = 10000\n'))
    nvme = config.nvme
    assert (nvme.io_threads, nvme.capacity_bytes, nvme.file_bytes, nvme.group_commit_ms) == (256, 64 << 20, 4096, 10000)
    assert nvme.file_sizes() == [4096] * (16 << 10)
