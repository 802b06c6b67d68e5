"""The kvstore RemoteConnector, loaded by LMCache's own factory and backend, against a real daemon."""

import asyncio
import inspect
import signal
import threading

import pytest
import torch
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.storage_backend import CreateStorageBackends

import kvstore.adapters.lmcache as lmcache_adapter
from kvstore.adapters.common import engine_object_id
from kvstore import StateDescriptor
from kvstore.errors import InvalidArgument
from kvstore.adapters.lmcache import HybridStateUnsupported
from kvs_events import EventSubscriber, all_events, last_seq
from lmcache_helpers import (CHUNK_TOKENS, MODEL, PLUGIN, chunk, connect, engine_config, engine_metadata,
                             hybrid_layer_groups, key, put_chunk, run, yaml_config)

pytestmark = pytest.mark.engines


def test_lmcache_create_connector_loads_kvstore_from_the_plugin_config(daemon, lmcache_loop, cpu_backend):
    connector = connect(daemon, lmcache_loop, cpu_backend)
    ours = connector.getWrappedConnector()
    assert type(ours) is lmcache_adapter.KVStoreConnector
    assert isinstance(ours, RemoteConnector) and ours.plugin_name == PLUGIN
    assert ours.store.config.socket_path == daemon.socket
    run(lmcache_loop, connector.close())


@pytest.mark.parametrize("tokens", [CHUNK_TOKENS, 5], ids=["full_chunk", "partial_chunk"])
def test_cpu_memory_obj_round_trip_is_bit_exact(daemon, lmcache_loop, cpu_backend, tokens):
    writer = connect(daemon, lmcache_loop, cpu_backend)
    sent = put_chunk(lmcache_loop, writer, cpu_backend, key(7), seed=tokens, tokens=tokens)
    assert sent.get_ref_count() == 1, "put must release only the caller's reference, once"
    run(lmcache_loop, writer.close())

    reader = connect(daemon, lmcache_loop, cpu_backend)  # a fresh connector, as after a restart
    assert reader.exists_sync(key(7)) and run(lmcache_loop, reader.exists(key(7)))
    got = run(lmcache_loop, reader.get(key(7)))
    assert got is not None and got is not sent
    assert got.get_shapes() == sent.get_shapes() and got.get_dtypes() == [torch.bfloat16]
    assert got.get_memory_format() == MemoryFormat.KV_2LTD
    assert bytes(got.byte_array) == bytes(sent.byte_array)
    assert torch.equal(got.tensor.view(torch.uint8), sent.tensor.view(torch.uint8))
    assert got.get_ref_count() == 1  # the caller's
    got.ref_count_down()
    sent.ref_count_down()
    run(lmcache_loop, reader.close())


def test_lmcache_builds_the_plugin_from_a_yaml_config_and_its_remote_backend_uses_it(
        daemon, lmcache_loop, tmp_path):
    """The README's config keys, read by LMCache from YAML; LMCache's own storage wiring
    (CreateStorageBackends: its CPU backend, its RemoteBackend with serde and put tasks)."""
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml_config(daemon.socket))
    backends = CreateStorageBackends(LMCacheEngineConfig.from_file(str(path)), engine_metadata(), lmcache_loop)
    cpu, remote = backends["LocalCPUBackend"], backends[f"RemoteBackend-{PLUGIN}"]
    assert type(remote.connection.getWrappedConnector()) is lmcache_adapter.KVStoreConnector
    sent = [chunk(cpu, seed=i) for i in range(3)]
    sent_bytes = [bytes(m.byte_array) for m in sent]
    keys = [key(i) for i in range(3)]
    stored, all_stored = [], threading.Event()

    def on_stored(k):
        stored.append(k)
        if len(stored) == len(keys):
            all_stored.set()

    remote.batched_submit_put_task(keys, sent, on_complete_callback=on_stored)
    assert all_stored.wait(60) and sorted(k.chunk_hash for k in stored) == [0, 1, 2]
    assert [m.get_ref_count() for m in sent] == [1, 1, 1]
    assert remote.contains(key(1)) and remote.batched_contains(keys + [key(9)]) == 3
    got = remote.batched_get_blocking(keys + [key(9)])
    assert [bytes(m.byte_array) for m in got[:3]] == sent_bytes and got[3] is None
    assert remote.get_blocking(key(9)) is None
    for m in got[:3] + sent:
        m.ref_count_down()
    run(lmcache_loop, remote.connection.close())


def test_chunks_are_stored_under_the_keys_model_rank_and_dtype(daemon, lmcache_loop, cpu_backend):
    """Two objects per chunk (bytes, LMCache's header), ids and descriptors as documented; a
    chunk whose header is gone is a miss, not a MemoryObj of unknown shape."""
    connector = connect(daemon, lmcache_loop, cpu_backend, namespace="team-a", model_revision="r7")
    ours = connector.getWrappedConnector()
    stored_key = key(6, worker_id=1, world_size=2)
    sent = put_chunk(lmcache_loop, connector, cpu_backend, stored_key, seed=6)
    desc = StateDescriptor("team-a", MODEL, "r7", kind="kv", dtype="bf16", layout="raw(bytes=0)", shard="1/2",
                           chunk_tokens=CHUNK_TOKENS)
    data_id = engine_object_id(desc, "lmcache", stored_key.to_string())
    meta_id = engine_object_id(desc, f"lmcache.meta/{ours.remote_metadata_bytes}", stored_key.to_string())
    with daemon.client(namespace="team-a") as client:
        with client.get(data_id) as lease:
            assert lease.descriptor == desc and bytes(lease.buffer) == bytes(sent.byte_array)
        with client.get(meta_id) as lease:
            assert lease.descriptor == desc and lease.size == ours.remote_metadata_bytes
        assert connector.exists_sync(stored_key)
        assert client.delete([meta_id]) == 1
    assert not connector.exists_sync(stored_key) and run(lmcache_loop, connector.get(stored_key)) is None
    sent.ref_count_down()
    run(lmcache_loop, connector.close())


def test_a_chunk_is_named_in_kv_events_by_lmcaches_chunk_hash(daemon_factory, lmcache_loop, cpu_backend):
    """As LMCache's own events name it (CacheStoreEvent: [key.chunk_hash], its tokens)."""
    d = daemon_factory("16MiB", config={"events": {"enabled": True}})
    connector = connect(d, lmcache_loop, cpu_backend)
    chunk_hash = -(1 << 62) + 12345  # LMCache's hashes are signed 64-bit integers
    sent = put_chunk(lmcache_loop, connector, cpu_backend, key(chunk_hash), seed=8, tokens=CHUNK_TOKENS // 2)
    sub = EventSubscriber(d, "default")
    try:
        with d.client() as c:
            last_seq(c, "default")  # every report is in a batch: the replay holds them all
        stored = [e for e in all_events(sub.replay(0)) if e["type"] == "BlockStored"]
    finally:
        sub.close()
    assert [(e["block_hashes"], e["block_size"]) for e in stored] == [([chunk_hash], CHUNK_TOKENS // 2)] * 2
    sent.ref_count_down()
    run(lmcache_loop, connector.close())


def test_missing_keys_are_misses(daemon, lmcache_loop, cpu_backend):
    connector = connect(daemon, lmcache_loop, cpu_backend)
    sent = put_chunk(lmcache_loop, connector, cpu_backend, key(1), seed=1)
    assert not connector.exists_sync(key(2)) and not run(lmcache_loop, connector.exists(key(2)))
    assert run(lmcache_loop, connector.get(key(2))) is None
    # the same chunk hash seen by another rank, model or dtype is another object
    for other in (key(1, worker_id=1, world_size=2), key(1, model="other/model"), key(1, dtype=torch.float16)):
        assert not connector.exists_sync(other) and run(lmcache_loop, connector.get(other)) is None
    keys = [key(1), key(2), key(1)]
    assert run(lmcache_loop, connector.batched_async_contains("lookup-1", keys)) == 1
    ours = connector.getWrappedConnector()
    assert ours.batched_contains(keys) == 1
    assert ours.remove_sync(key(1)) and not connector.exists_sync(key(1))
    assert ours.store.num_failures == 0
    sent.ref_count_down()
    run(lmcache_loop, connector.close())


def test_a_key_kvstore_cannot_describe_is_a_counted_miss(daemon, lmcache_loop, cpu_backend):
    connector = connect(daemon, lmcache_loop, cpu_backend)
    odd = key(3, dtype=torch.int8)  # LMCache allows it; kvstore has no int8 dtype
    sent = put_chunk(lmcache_loop, connector, cpu_backend, odd, seed=3)
    assert sent.get_ref_count() == 1
    assert not connector.exists_sync(odd) and run(lmcache_loop, connector.get(odd)) is None
    assert connector.getWrappedConnector().num_refused >= 1
    sent.ref_count_down()
    run(lmcache_loop, connector.close())


def test_daemon_killed_means_misses_and_no_exception(daemon, lmcache_loop, cpu_backend):
    connector = connect(daemon, lmcache_loop, cpu_backend)
    ours = connector.getWrappedConnector()
    sent = put_chunk(lmcache_loop, connector, cpu_backend, key(4), seed=4)
    assert connector.exists_sync(key(4))
    daemon.stop(signal.SIGKILL)
    assert not connector.exists_sync(key(4))
    assert not run(lmcache_loop, connector.exists(key(4)))
    assert run(lmcache_loop, connector.get(key(4))) is None
    assert run(lmcache_loop, connector.batched_async_contains("lookup-2", [key(4)])) == 0
    sent.ref_count_up()
    run(lmcache_loop, connector.put(key(5), sent))  # a no-op, counted
    assert sent.get_ref_count() == 1
    assert ours.store.num_failures >= 1 and ours.stats()["num_stored"] == 2
    sent.ref_count_down()
    run(lmcache_loop, connector.close())


def test_cancelled_put_and_get_neither_free_memory_in_use_nor_leak_it(daemon, lmcache_loop, cpu_backend,
                                                                      monkeypatch):
    """LMCache cancels a get past blocking_timeout_secs, and its wrapper drops the caller's
    reference when a put is cancelled; the copy still running on an I/O thread must keep the
    put's MemoryObj alive and release the one the get allocated."""
    connector = connect(daemon, lmcache_loop, cpu_backend, timeout_s=120)
    sent = put_chunk(lmcache_loop, connector, cpu_backend, key(8), seed=8)
    allocated = []

    def allocate_and_record(*args, **kwargs):  # LMCache's allocator, watched
        allocated.append(real_allocate(*args, **kwargs))
        return allocated[-1]

    real_allocate = cpu_backend.allocate
    monkeypatch.setattr(cpu_backend, "allocate", allocate_and_record)
    daemon.proc.send_signal(signal.SIGSTOP)  # every store call now waits
    try:
        sent.ref_count_up()  # the reference LMCache's wrapper drops when the put ends
        put = asyncio.run_coroutine_threadsafe(connector.put(key(9), sent), lmcache_loop)
        get = asyncio.run_coroutine_threadsafe(connector.get(key(8)), lmcache_loop)
        put.cancel()
        get.cancel()
        for _ in range(3):  # let the loop run the cancellations
            run(lmcache_loop, asyncio.sleep(0))
        assert sent.get_ref_count() == 2, "the put's copy is still running: its MemoryObj must stay allocated"
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    run(lmcache_loop, connector.close())  # waits for the copies in flight
    assert sent.get_ref_count() == 1
    assert len(allocated) == 1 and allocated[0].get_ref_count() == 0, "the abandoned get's MemoryObj leaked"
    sent.ref_count_down()


def test_every_method_is_sync_or_async_as_remote_connector_declares():
    """A third-party adapter ships an async `exists_sync`: its coroutine is truthy, so every key
    reads as present. Each method here must match the base class."""
    ours = lmcache_adapter.KVStoreConnector
    methods = inspect.getmembers(RemoteConnector, inspect.isfunction)
    assert len(methods) > 10
    wrong = [name for name, base in methods
             if inspect.iscoroutinefunction(getattr(ours, name)) != inspect.iscoroutinefunction(base)]
    assert not wrong, f"sync/async differs from RemoteConnector: {wrong}"
    assert not ours.__abstractmethods__


def test_a_bad_setting_names_its_config_key(daemon, lmcache_loop, cpu_backend):
    config = engine_config(daemon.socket, timeout_s="soon")
    with pytest.raises(InvalidArgument, match=f"remote_storage_plugin.{PLUGIN}.timeout_s"):
        CreateConnector(f"plugin://{PLUGIN}", lmcache_loop, cpu_backend, config, cpu_backend.metadata,
                        plugin_name=PLUGIN)


def test_a_hybrid_model_is_refused_at_creation(daemon, lmcache_loop, cpu_backend):
    """LMCache's metadata (its CPU backend's, which LMCache's plug-in loader hands over) names
    a recurrent-state kernel group: the connector must not start."""
    cpu_backend.metadata.kv_layer_groups_manager = hybrid_layer_groups()
    with pytest.raises(HybridStateUnsupported, match=r"kernel groups \[1\].*recurrent state.*adapters\.vllm"):
        connect(daemon, lmcache_loop, cpu_backend)


def test_kv_of_a_hybrid_model_is_never_stored_without_its_state(daemon, lmcache_loop, cpu_backend):
    """LMCache's GPU connector sets the layer groups on its first transfer, after the
    connector exists: from then on every chunk is a counted refusal, and the daemon holds
    nothing for it."""
    connector = connect(daemon, lmcache_loop, cpu_backend)
    ours = connector.getWrappedConnector()
    sent = chunk(cpu_backend, seed=11)
    cpu_backend.metadata.kv_layer_groups_manager = hybrid_layer_groups()
    sent.ref_count_up()
    run(lmcache_loop, connector.put(key(11), sent))
    assert sent.get_ref_count() == 1
    assert not connector.exists_sync(key(11)) and run(lmcache_loop, connector.get(key(11))) is None
    assert ours.num_refused >= 3 and ours.stats()["num_stored"] == 0
    desc = StateDescriptor("default", MODEL, "main", kind="kv", dtype="bf16", layout="raw(bytes=0)",
                           chunk_tokens=CHUNK_TOKENS)
    with daemon.client() as client:
        assert list(client.lookup([engine_object_id(desc, "lmcache", key(11).to_string())]).tiers) == [None]
    sent.ref_count_down()
    run(lmcache_loop, connector.close())
