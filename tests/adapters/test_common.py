"""adapters.common against a real daemon: ids from engine keys, and a store that never raises."""

import signal

import numpy as np

from kvstore.adapters.common import SafeStore, StoreConfig, engine_ids, engine_object_id
from kvstore import StateDescriptor
from kvs_testing import wait_for

DESC = StateDescriptor("default", "m", "r1", kind="kv", dtype="bf16",
                       layout="paged(order=layer_first,layers=2,block=16,kv_heads=1,head_dim=8)", chunk_tokens=16)


def test_engine_ids_depend_on_every_identity_field_and_the_engine():
    base = engine_object_id(DESC, "vllm", b"\x01" * 32)
    assert base == engine_object_id(DESC, "vllm", b"\x01" * 32)
    others = [
        engine_object_id(DESC, "sglang", b"\x01" * 32),
        engine_object_id(DESC, "vllm", b"\x02" * 32),
        engine_object_id(DESC.with_(model="m2"), "vllm", b"\x01" * 32),
        engine_object_id(DESC.with_(model_revision="r2"), "vllm", b"\x01" * 32),
        engine_object_id(DESC.with_(dtype="fp8_e4m3"), "vllm", b"\x01" * 32),
        engine_object_id(DESC.with_(shard="1/2"), "vllm", b"\x01" * 32),
        engine_object_id(DESC.with_(namespace="other"), "vllm", b"\x01" * 32),
    ]
    assert len({base, *others}) == len(others) + 1
    assert engine_object_id(DESC, "vllm", 12345) == engine_object_id(DESC, "vllm", 12345)
    assert engine_object_id(DESC, "vllm", "abc") != engine_object_id(DESC, "vllm", "abd")


def test_engine_ids_give_engine_object_ids():
    """The hot path's id function (constant parts hashed once) is engine_object_id, for any
    key and descriptor."""
    import random
    rng = random.Random(3)
    for desc in (StateDescriptor("ns", "m", "main", dtype="u8"),
                 StateDescriptor("n2", "org/model", "r2", kind="recurrent", dtype="fp32", shard="1/4",
                                 layout="paged(order=layer_first,layers=2,block=16,kv_heads=2,head_dim=8)")):
        for engine in ("lmcache-mp", "vllm"):
            ids = engine_ids(desc, engine)
            for size in (0, 1, 16, 40, 300):
                key = rng.randbytes(size)
                assert ids(key) == engine_object_id(desc, engine, key)
    assert engine_ids(StateDescriptor("ns", "m", "main"), "a")(b"k") != engine_ids(StateDescriptor("ns", "m", "main"), "b")(b"k")


def test_safe_store_round_trip_then_a_dead_daemon_is_a_counted_miss(daemon):
    store = SafeStore(StoreConfig(socket_path=daemon.socket, timeout_s=2, retry_after_s=0.05))
    ids = [engine_object_id(DESC, "test", i) for i in range(4)]
    data = [np.full(DESC.object_bytes, i, np.uint8) for i in range(4)]
    assert store.put_many(list(zip(ids[:3], data[:3])), DESC) == [True] * 3
    assert store.contains(ids) == [True, True, True, False]
    assert store.prefix_hits(ids) == 3
    out = np.zeros(DESC.object_bytes, np.uint8)
    assert store.get_into(ids[1], out) and np.array_equal(out, data[1])
    assert not store.get_into(ids[3], out)
    assert store.num_failures == 0
    daemon.stop(signal.SIGKILL)
    assert store.contains(ids) == [False] * 4
    assert not store.get_into(ids[0], out)
    assert store.put_many([(ids[3], data[3])], DESC) == [False]
    assert store.num_failures == 3
    daemon.start()
    # past retry_after_s the store reconnects by itself
    assert wait_for(lambda: store.put_many([(ids[3], data[3])], DESC) == [True], timeout=30), store.stats()
    assert store.contains(ids[3:]) == [True]


def test_a_request_the_store_refuses_is_a_miss_not_an_outage(daemon):
    store = SafeStore(StoreConfig(socket_path=daemon.socket, timeout_s=2, retry_after_s=60))
    oid = engine_object_id(DESC, "test", 1)
    assert store.put_many([(oid, np.zeros(DESC.object_bytes, np.uint8))], DESC) == [True]
    too_small = np.zeros(8, np.uint8)
    assert not store.get_into(oid, too_small)  # InvalidArgument: the buffer is too small
    assert store.num_refused == 1 and store.num_failures == 0
    out = np.empty(DESC.object_bytes, np.uint8)
    assert store.get_into(oid, out)  # the link stayed up (retry_after_s is a minute)


def test_get_many_into_copies_hits_and_answers_false_for_misses_and_a_dead_store(daemon):
    store = SafeStore(StoreConfig(socket_path=daemon.socket, timeout_s=2, retry_after_s=0.05))
    ids = [engine_object_id(DESC, "test", i) for i in range(3)]
    store.put_many([(ids[0], np.full(DESC.object_bytes, 7, np.uint8)), (ids[2], np.full(DESC.object_bytes, 9, np.uint8))],
                   DESC)
    outs = [np.zeros(DESC.object_bytes, np.uint8) for _ in ids]
    assert store.get_many_into(list(zip(ids, outs))) == [True, False, True]
    assert (outs[0] == 7).all() and (outs[1] == 0).all() and (outs[2] == 9).all()
    daemon.stop(signal.SIGKILL)
    assert store.get_many_into(list(zip(ids, outs))) == [False] * 3
    assert store.num_failures == 1
