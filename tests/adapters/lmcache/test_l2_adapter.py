"""kvstore as an L2 adapter of LMCache's multiprocess mode, built by LMCache's own config parser
and adapter factory (as `lmcache server --l2-adapter JSON` and `lmcache bench l2` build it),
driven with LMCache's own MemoryObjs and by LMCache's StorageManager, against a real daemon."""

import argparse
import json

import pytest
import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import (create_l1_memory_desc, make_aligned_tensor,
                                                              make_memory_objects, wait_eventfd)
from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
from lmcache.v1.distributed.config import (EvictionConfig, L1ManagerConfig, L1MemoryManagerConfig,
                                           StorageManagerConfig)
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.distributed.storage_manager import StorageManager
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

import kvstore.adapters.lmcache_mp as l2
from kvstore import StateDescriptor
from kvs_testing import free_port, wait_until

pytestmark = pytest.mark.engines

MODEL = "test/tiny-model"
SIZE = 64 * 1024


def spec(**params) -> str:
    return json.dumps({"type": "plugin", "module_path": "kvstore.adapters.lmcache_mp", "class_name": l2.CLASS_NAME,
                       "adapter_params": params})


def l2_config(**params):
    """LMCache's L2 config from the JSON its CLI takes (`--l2-adapter`)."""
    return parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec(**params)]))


class Harness:
    """One adapter made by LMCache's factory, an L1 buffer and its MemoryObjs (LMCache's bench helpers)."""

    def __init__(self, socket_path: str, keys: int = 8, **params):
        self.buffer = make_aligned_tensor(4 * keys * SIZE)
        self.keys = keys
        self.adapter = create_l2_adapter(l2_config(socket_path=socket_path, retry_after_s=0.05, timeout_s=2, **params)
                                         .adapters[0], l1_memory_desc=create_l1_memory_desc(self.buffer))

    def objects(self, slot: int, fill: int = 0):
        return make_memory_objects(self.buffer, self.keys, SIZE, slot * self.keys * SIZE, fill_offset=fill)

    def store(self, keys, objects):
        task = self.adapter.submit_store_task(keys, objects)
        assert wait_eventfd(self.adapter.get_store_event_fd(), 30)
        done = self.adapter.pop_completed_store_tasks()
        return done[task]

    def lookup(self, keys) -> list[int]:
        task = self.adapter.submit_lookup_and_lock_task(keys, {0: MemoryLayoutDesc([], [])})
        assert wait_eventfd(self.adapter.get_lookup_and_lock_event_fd(), 30)
        return self.adapter.query_lookup_and_lock_result(task).get_indices_list()

    def load(self, keys, objects) -> list[int]:
        task = self.adapter.submit_load_task(keys, objects)
        assert wait_eventfd(self.adapter.get_load_event_fd(), 30)
        return self.adapter.query_load_result(task).get_indices_list()


def keys_of(n: int, offset: int = 0, **fields) -> list[ObjectKey]:
    base = {"model_name": MODEL, "kv_rank": 0, **fields}
    return [ObjectKey(chunk_hash=(offset + i).to_bytes(16, "big"), **base) for i in range(n)]


def test_lmcache_builds_the_adapter_and_its_config_from_the_cli_json(daemon):
    config = l2_config(socket_path=daemon.socket, group_kinds={"1": "recurrent"}, io_threads=2)
    adapter = create_l2_adapter(config.adapters[0])
    try:
        assert type(adapter).__name__ == l2.CLASS_NAME and isinstance(adapter, L2AdapterInterface)
        assert adapter.params["group_kinds"] == {1: l2.Kind.RECURRENT} and adapter.params["io_threads"] == 2
        assert adapter.params["namespace"] == "default" and adapter.params["lock_ttl_s"] == 60
        fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()}
        assert len(fds) == 3, "LMCache's controllers need a distinct fd per operation"
        assert "group_kinds" in l2.KVStoreL2AdapterConfig.help()
        assert adapter.report_status()["is_healthy"]
    finally:
        adapter.close()


@pytest.mark.parametrize("params, field", [
    ({"timeout_s": 0}, "timeout_s"), ({"io_threads": 0}, "io_threads"), ({"io_threads": True}, "io_threads"),
    ({"lock_ttl_s": -1}, "lock_ttl_s"), ({"group_kinds": {"x": "recurrent"}}, "group_kinds"),
    ({"group_kinds": {"1": "ssm"}}, "group_kinds"), ({"namespace": "a\tb"}, "namespace"),
    ({"socket": "/tmp/x"}, "unknown adapter_params"),
])
def test_bad_adapter_params_are_refused_naming_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        create_l2_adapter(l2_config(**params).adapters[0])


def test_store_lookup_load_round_trip_is_bit_exact(daemon):
    h = Harness(daemon.socket)
    try:
        keys, sent = keys_of(h.keys), h.objects(0)
        result = h.store(keys, sent)
        assert result.is_successful() and result.bytes_transferred() == h.keys * SIZE
        unknown = keys_of(2, offset=1000)
        assert h.lookup(keys + unknown) == list(range(h.keys))
        assert h.adapter.report_status()["locked_objects"] == h.keys
        got = h.objects(1, fill=7)
        assert h.load(keys + unknown, got + h.objects(2)[:2]) == list(range(h.keys))
        assert all(torch.equal(a.raw_data, b.raw_data) for a, b in zip(sent, got))
        h.adapter.submit_unlock(keys)
        wait_until(lambda: h.adapter.report_status()["locked_objects"] == 0, 10, "the unlock released every lock")
        assert h.store(keys, sent).is_successful(), "storing what the store holds again is a success"
    finally:
        h.adapter.close()


def test_lookups_submitted_together_each_get_their_own_answer(daemon):
    """Lookups queued while one is answered share the next round trip; each task still gets
    the bitmap of its own keys, and each found key is locked once per lookup that found it."""
    h = Harness(daemon.socket)
    try:
        keys = keys_of(h.keys)
        assert h.store(keys, h.objects(0)).is_successful()
        asked = [keys[j:j + 3] + keys_of(2, offset=1000 + 10 * j) + keys[:1] for j in range(6)]
        tasks = [h.adapter.submit_lookup_and_lock_task(ks, {0: MemoryLayoutDesc([], [])}) for ks in asked]
        results = {}

        def all_answered():
            for task in tasks:
                if task not in results and (found := h.adapter.query_lookup_and_lock_result(task)) is not None:
                    results[task] = found.get_indices_list()
            return len(results) == len(tasks)
        wait_until(all_answered, 30, "every lookup answered")
        for task, ks in zip(tasks, asked):
            assert results[task] == [i for i, k in enumerate(ks) if k in keys], ks
        assert h.adapter.report_status()["locked_objects"] == h.keys
        for ks in asked:
            h.adapter.submit_unlock(ks)
        wait_until(lambda: h.adapter.report_status()["locked_objects"] == 0, 10, "every lock released")
    finally:
        h.adapter.close()


def test_a_chunk_hash_that_does_not_hash_is_the_same_object(daemon):
    """Ids are kept per ObjectKey; a key whose chunk hash is a bytearray cannot be kept, and is
    still the object its bytes name."""
    h = Harness(daemon.socket, keys=2)
    try:
        keys = keys_of(2)
        odd = [ObjectKey(chunk_hash=bytearray(k.chunk_hash), model_name=MODEL, kv_rank=0) for k in keys]
        assert h.store(odd, h.objects(0)).is_successful()
        assert h.lookup(keys) == [0, 1] and h.lookup(odd) == [0, 1]
        assert h.load(odd, h.objects(1, fill=7)) == [0, 1]
    finally:
        h.adapter.close()


def test_every_field_of_the_key_and_the_buffers_type_are_identity(daemon):
    """Another salt (tenant), model, rank or object group is another object; a buffer that
    describes another dtype gets a miss and keeps its bytes."""
    h = Harness(daemon.socket, keys=1)
    try:
        key = keys_of(1)[0]
        assert h.store([key], h.objects(0)).is_successful()
        others = [ObjectKey(key.chunk_hash, MODEL, 0, cache_salt="tenant-b"), ObjectKey(key.chunk_hash, "other/model", 0),
                  ObjectKey(key.chunk_hash, MODEL, 1), ObjectKey(key.chunk_hash, MODEL, 0, object_group_id=1)]
        assert h.lookup(others + [key]) == [4]
        bf16 = h.objects(1, fill=9)[0]
        bf16 = TensorMemoryObj(bf16.raw_data, MemoryObjMetadata(torch.Size([SIZE // 2]), torch.bfloat16, 0, SIZE,
                                                                 fmt=MemoryFormat.KV_2LTD, ref_count=1), None)
        before = bf16.raw_data.clone()
        assert h.load([key], [bf16]) == []
        assert torch.equal(bf16.raw_data, before), "a refused load must not write the buffer"
        smaller = h.objects(2)[0]
        small = TensorMemoryObj(smaller.raw_data[:SIZE // 2], MemoryObjMetadata(
            torch.Size([SIZE // 2]), torch.uint8, 0, SIZE // 2, fmt=MemoryFormat.KV_2LTD, ref_count=1), None)
        assert h.load([key], [small]) == [], "a buffer of another size is a miss"
    finally:
        h.adapter.close()


def test_a_model_name_kvstore_refuses_is_a_counted_miss_per_key(daemon):
    h = Harness(daemon.socket, keys=2)
    try:
        bad = keys_of(2, model_name="bad\tname")
        assert not h.store(bad, h.objects(0)).is_successful()
        assert h.lookup(bad) == [] and h.load(bad, h.objects(1)) == []
        assert h.adapter.report_status()["refused_keys"] == 6  # two keys, three calls
        assert h.store(keys_of(2), h.objects(0)).is_successful(), "other models are stored as before"
    finally:
        h.adapter.close()


def test_a_daemon_down_is_a_miss_and_a_failed_store_and_both_recover(daemon):
    h = Harness(daemon.socket, keys=2)
    try:
        keys = keys_of(2)
        assert h.store(keys, h.objects(0)).is_successful()
        daemon.stop()
        assert not h.store(keys_of(2, offset=10), h.objects(1)).is_successful()
        assert h.lookup(keys) == [] and h.load(keys, h.objects(2)) == []
        status = h.adapter.report_status()
        assert status["num_failures"] >= 1 and status["last_error"]
        daemon.start()  # host memory only: what it held is gone, the adapter reconnects
        wait_until(lambda: h.store(keys, h.objects(0)).is_successful(), 20, "a store through the restarted daemon")
        assert h.lookup(keys) == [0, 1]
    finally:
        h.adapter.close()


def manager(l2) -> StorageManager:
    memory = L1MemoryManagerConfig(size_in_bytes=64 << 20, use_lazy=False, init_size_in_bytes=64 << 20, shm_name="")
    return StorageManager(StorageManagerConfig(l1_manager_config=L1ManagerConfig(memory_config=memory),
                                               eviction_config=EvictionConfig(eviction_policy="LRU"),
                                               l2_adapter_config=l2))


def test_lmcache_storage_manager_stores_a_hybrid_chunk_and_a_fresh_one_loads_it(daemon):
    """LMCache's StorageManager (its store and prefetch controllers): attention KV in object
    group 0 (bf16), Mamba state pages in group 1 (int8, vLLM's raw page view, a one-chunk
    window). A fresh manager (a restarted LMCache server: empty L1) prefetches every
    attention chunk and the last state from kvstore, bit-exact, the state stored as kind
    recurrent, dtype u8."""
    config = l2_config(socket_path=daemon.socket, group_kinds={"1": "recurrent"})
    attn = MemoryLayoutDesc(shapes=[torch.Size([2, 2, 16, 64])], dtypes=[torch.bfloat16])
    state = MemoryLayoutDesc(shapes=[torch.Size([1, 1, 1, 3000])], dtypes=[torch.int8])
    kattn = keys_of(4)
    kstate = keys_of(4, object_group_id=1)
    generator = torch.Generator().manual_seed(5)
    sent = {}
    writer = manager(config)
    try:
        for keys, layout in ((kattn, attn), (kstate, state)):
            objs = writer.reserve_write(keys, layout)
            for key in keys:
                raw = objs[key].raw_data.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
                sent[key] = bytes(objs[key].byte_array)
            writer.finish_write(keys)
        adapter = writer.l2_adapters()[0][1]
        wait_until(lambda: adapter.report_status()["stored"] >= 8, 30, "LMCache's store controller stored 8 objects")
        assert adapter.report_status()["stored"] == 8
        oid = adapter._object_id(kstate[3])
    finally:
        writer.close()
    with daemon.client(namespace="default") as client:
        recurrent = StateDescriptor("default", MODEL, "main", kind="recurrent", dtype="u8")
        assert client.lookup([oid], expect=recurrent).hits == 1
        assert client.lookup([oid], expect=StateDescriptor("default", MODEL, "main", dtype="u8")).hits == 0
    reader = manager(config)
    try:
        handle = reader.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys(kattn, 0, attn),
                                                               GroupedObjectKeys(kstate, 1, state, sliding_window_size=1)]))
        assert reader.wait_prefetch_status(handle, 30)
        result = reader.query_prefetch_status(handle)
        assert [c.get_indices_list() for c in result.l2_hit_cells] == [[0, 1, 2, 3], [3]]
        for keys in (kattn, kstate[3:]):
            with reader.read_prefetched_results(keys) as got:
                assert got is not None and [bytes(o.byte_array) for o in got] == [sent[k] for k in keys]
            reader.finish_read_prefetched(keys)
    finally:
        reader.close()


def test_lmcache_mp_server_runs_the_adapter_from_its_command_line(daemon, tmp_path):
    """`lmcache server` (the MP mode's own server, on CPU) builds the adapter from
    --l2-adapter, reports it in /status, and its DELETE /cache/objects reaches the daemon
    through it. (Storing and loading need an engine's registered KV layout, a GPU engine.)"""
    import os
    import shutil
    import subprocess
    import sys
    import urllib.request
    h = Harness(daemon.socket, keys=1)
    key = keys_of(1)[0]
    assert h.store([key], h.objects(0)).is_successful() and h.lookup([key]) == [0]
    port, http = free_port(), free_port()
    cli = shutil.which("lmcache", path=os.path.dirname(sys.executable))
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "PYTHONWARNINGS": "ignore"}
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([cli, "server", "--port", str(port), "--http-port", str(http), "--l1-size-gb", "1",
                               "--eviction-policy", "LRU", "--l2-adapter", spec(socket_path=daemon.socket)],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{http}"
    try:
        def status():
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            try:
                return json.load(urllib.request.urlopen(url + "/status", timeout=5))
            except OSError:
                return None  # not listening yet
        wait_until(lambda: status() is not None, 180, "lmcache server answering on its HTTP port")
        (ours,) = status()["storage_manager"]["l2_adapters"]
        assert ours["type"] == "kvstore" and ours["is_healthy"] and ours["socket_path"] == daemon.socket
        body = json.dumps({"keys": [{"chunk_hash_hex": key.chunk_hash.hex(), "model_name": MODEL, "kv_rank": 0}],
                           "tier": "l2"}).encode()
        request = urllib.request.Request(url + "/cache/objects", data=body, method="DELETE",
                                         headers={"Content-Type": "application/json"})
        assert urllib.request.urlopen(request, timeout=30).status == 200
        assert h.lookup([key]) == [], "the server's adapter deleted the object from the daemon"
    finally:
        server.terminate()
        server.wait(60)
        h.adapter.close()


def test_calls_after_close_fail_their_task_without_raising(daemon):
    h = Harness(daemon.socket, keys=1)
    h.adapter.close()
    h.adapter.close()  # twice is harmless
    task = h.adapter.submit_store_task(keys_of(1), h.objects(0))
    assert not h.adapter.pop_completed_store_tasks()[task].is_successful()
    task = h.adapter.submit_load_task(keys_of(1), h.objects(1))
    assert h.adapter.query_load_result(task).get_indices_list() == []
    h.adapter.submit_unlock(keys_of(1))
    assert not h.adapter.report_status()["is_healthy"]
