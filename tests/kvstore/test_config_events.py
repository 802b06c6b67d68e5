"""The `[events]` table: defaults, endpoints filled in under the data directory, and every
bad value refused with its key named."""

import pytest

from kvstore.config import ServerConfig
from kvstore.config_events import EventsConfig
from kvstore.errors import InvalidArgument


def test_off_by_default_with_endpoints_in_the_data_dir():
    config = ServerConfig.from_dict({"data_dir": "/srv/kv"})
    assert config.events.enabled is False
    events = config.events.under(config.data_dir)
    assert events.endpoint == "ipc:///srv/kv/events.pub" and events.replay_endpoint == "ipc:///srv/kv/events.replay"


def test_named_endpoints_are_kept():
    events = ServerConfig.from_dict({"events": {"enabled": True, "endpoint": "tcp://127.0.0.1:5557",
                                                "replay_endpoint": "tcp://[::1]:5558", "topic": "t/",
                                                "buffer_batches": 5, "hwm": 7}}).events
    assert events.under("/x") == EventsConfig(True, "tcp://127.0.0.1:5557", "tcp://[::1]:5558", "t/", 5, 7)


@pytest.mark.parametrize("key, value", [
    ("enabled", "true"),
    ("endpoint", "tcp://127.0.0.1"),  # no port
    ("endpoint", "tcp://127.0.0.1:0"),  # subscribers could not know the port
    ("endpoint", "tcp://127.0.0.1:70000"),
    ("endpoint", "udp://127.0.0.1:5557"),
    ("endpoint", "ipc://"),
    ("endpoint", "ipc:///" + "x" * 200),  # past sun_path
    ("replay_endpoint", 5557),
    ("topic", 5),
    ("topic", "t" * 300),
    ("buffer_batches", 0),
    ("buffer_batches", True),
    ("buffer_batches", 10**9),
    ("hwm", 0),  # ZMQ's "no limit": a dead subscriber would grow the daemon's memory
    ("hwm", 1.5),
    ("heartbeat_s", -1),
    ("heartbeat_s", "1s"),
    ("heartbeat_s", True),
    ("heartbeat_s", float("nan")),
    ("heartbeat_s", 86400),
])
def test_bad_values_are_refused_naming_the_key(key, value):
    with pytest.raises(InvalidArgument, match=rf"events\.{key}"):
        ServerConfig.from_dict({"events": {key: value}})


def test_heartbeats_every_second_by_default_and_off_at_zero():
    assert ServerConfig.from_dict({}).events.heartbeat_s == 1.0
    assert ServerConfig.from_dict({"events": {"heartbeat_s": 0}}).events.heartbeat_s == 0
    assert ServerConfig.from_dict({"events": {"heartbeat_s": 0.25}}).events.heartbeat_s == 0.25


def test_the_two_endpoints_must_differ():
    with pytest.raises(InvalidArgument, match="must differ"):
        EventsConfig(endpoint="tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:1")


def test_a_namespace_of_its_own_gets_its_endpoints_under_the_data_dir_by_default():
    events = ServerConfig.from_dict({"events": {"enabled": True, "namespaces": {
        "tenant-a": {}, "tenant-b": {"endpoint": "tcp://127.0.0.1:6001"}}}}).events.under("/srv/kv")
    assert events.int_block_hashes is True and events.ownership == ""
    own = events.own_endpoints("tenant-a")
    assert (own.endpoint, own.replay_endpoint) == ("ipc:///srv/kv/events-tenant-a.pub",
                                                   "ipc:///srv/kv/events-tenant-a.replay")
    assert own.namespaces == {} and own.topic == events.topic
    assert events.own_endpoints("tenant-b").endpoint == "tcp://127.0.0.1:6001"
    assert events.own_endpoints("default") is None  # on the shared endpoints


@pytest.mark.parametrize("table, message", [
    ({"int_block_hashes": "yes"}, r"events\.int_block_hashes"),
    ({"ownership": 5}, r"events\.ownership"),
    ({"namespaces": {"a": {"endpoint": "udp://x:1"}}}, r"events\.namespaces\.a\.endpoint"),
    ({"namespaces": {"a": {"port": 1}}}, r"events\.namespaces\.a must be a table"),
    ({"namespaces": {"": {}}}, r"events\.namespaces: a namespace must be 1\.\.256 characters"),
    ({"namespaces": {"a\nlevel=error": {}}}, r"events\.namespaces: a namespace must be .*control character"),
    ({"namespaces": {"a/b": {}}}, r"events\.namespaces\.a/b: a name of its own endpoints' files"),
    ({"namespaces": {"a": {"endpoint": "tcp://127.0.0.1:7"}}, "endpoint": "tcp://127.0.0.1:7"}, "must differ"),
])
def test_bad_namespace_endpoints_and_wire_options_are_refused_by_name(table, message):
    with pytest.raises(InvalidArgument, match=message):
        ServerConfig.from_dict({"events": table})
