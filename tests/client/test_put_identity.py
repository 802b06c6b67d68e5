"""A key and its descriptor agree, over a real daemon: a put under another descriptor is
refused, one id holds one state, and a reader states what it expects (host and NVMe, sync
and asyncio clients). put_many reports one item's failure in that item's result."""

import asyncio

import numpy as np
import pytest

from kvstore.client import AsyncClient
from kvstore import Layout, StateDescriptor, chunk_keys
from kvstore.errors import Conflict, InvalidArgument
from kvstore.identity import ObjectId
from kvs_testing import payload

TOKENS = list(range(512))
LAYOUT = Layout.make("paged", order="layer_first", layers=2, block=16, kv_heads=1, head_dim=64)
MODEL_A = StateDescriptor("default", "model-a", "r1", layout=LAYOUT, chunk_tokens=256)
MODEL_B = MODEL_A.with_(model="model-b")
SIZE = MODEL_A.object_bytes


def test_put_of_a_chunk_key_under_another_models_descriptor_is_refused(daemon):
    key_b = chunk_keys(TOKENS, MODEL_B)[0]
    with daemon.client() as c:
        with pytest.raises(InvalidArgument, match="model model-b != model-a"):
            c.put(key_b, payload(SIZE, 1), MODEL_A)
        assert c.lookup([key_b.object_id]).hits == 0  # nothing was stored
        c.put(key_b, payload(SIZE, 1))  # the key's own descriptor
        with c.get(key_b) as lease:
            assert lease.descriptor == MODEL_B


def test_same_id_with_another_size_or_descriptor_is_a_conflict(daemon):
    key = chunk_keys(TOKENS, MODEL_A)[0]
    raw = ObjectId(b"\x33" * 32)
    with daemon.client() as c:
        assert not c.put(key, payload(SIZE, 1)).existed
        with pytest.raises(Conflict, match="another descriptor .*model model-a != model-b"):
            c.put(key.object_id, payload(SIZE, 2), MODEL_B)
        assert c.put(key, payload(SIZE, 1)).existed  # the same state: deduplicated
        c.put(raw, payload(8192, 3))
        with pytest.raises(Conflict, match="already stored with 8192 bytes, not 4096"):
            c.put(raw, payload(4096, 4))
        with c.get(key) as lease, c.get(raw) as other:  # the stored objects stayed
            assert np.array_equal(lease.numpy(), payload(SIZE, 1)) and lease.descriptor == MODEL_A
            assert np.array_equal(other.numpy(), payload(8192, 3))
        c.check_integrity()


def test_reader_of_another_model_misses(daemon):
    key_b = chunk_keys(TOKENS, MODEL_B)[0]
    with daemon.client() as c:
        c.put(key_b.object_id, payload(SIZE, 1), MODEL_A)  # a plain id: the daemon cannot tell
        assert c.get(key_b) is None  # a ChunkKey expects the descriptor it was computed for
        assert c.get(key_b.object_id, expect=MODEL_B) is None
        assert c.get_into(key_b, np.empty(SIZE, np.uint8)) is None
        assert c.lookup([key_b]).hits == 0
        assert c.lookup([key_b.object_id], expect=MODEL_B).tiers == (None,)
        for other in (MODEL_A.with_(model_revision="r2"), MODEL_A.with_(kind="mla_latent"),
                      MODEL_A.with_(dtype="fp16"), MODEL_A.with_(shard="0/2"),
                      MODEL_A.with_(layout=Layout.make("raw"))):
            assert c.get(key_b.object_id, expect=other) is None
            assert c.lookup([key_b.object_id], expect=other).hits == 0
        with c.get(key_b.object_id, expect=MODEL_A) as lease:
            assert lease.descriptor == MODEL_A
        mixed = [chunk_keys(TOKENS, d)[0] for d in (MODEL_A, MODEL_B)]
        c.put(mixed[0], payload(SIZE, 2))
        assert c.lookup(mixed + [key_b.object_id]).tiers == ("host", None, "host")  # per key


def test_async_reader_of_another_model_misses(daemon):
    key_b = chunk_keys(TOKENS, MODEL_B)[0]

    async def main():
        c = await AsyncClient.connect(daemon.socket)
        try:
            await c.put(key_b.object_id, payload(SIZE, 1), MODEL_A)
            with pytest.raises(InvalidArgument, match="model model-b != model-a"):
                await c.put(key_b, payload(SIZE, 1), MODEL_A)
            assert await c.get(key_b) is None
            assert await c.get_into(key_b, np.empty(SIZE, np.uint8)) is None
            assert (await c.lookup([key_b])).hits == 0
            assert (await c.lookup([key_b.object_id], expect=MODEL_A)).hits == 1
        finally:
            await c.close()

    asyncio.run(main())


def test_nvme_held_objects_keep_their_identity(daemon_factory):
    d = daemon_factory("4MiB", config={"nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "32MiB",
                                                "admit_min_hits": 0}})
    big = MODEL_A.with_(layout=Layout.make("raw"))  # any size
    keys = chunk_keys(list(range(256 * 12)), big)
    with d.client() as c:
        for i, key in enumerate(keys):
            c.put(key, payload(1 << 20, i))
        found = c.lookup(keys)
        cold = [i for i, t in enumerate(found.tiers) if t == "nvme"][:2]
        assert len(cold) == 2
        first, second = (keys[i] for i in cold)
        assert c.lookup([first.object_id], expect=big.with_(model="model-b")).tiers == (None,)
        assert c.lookup([first]).tiers == ("nvme",)
        with pytest.raises(Conflict, match="another descriptor"):
            c.put(second.object_id, payload(1 << 20, 99), big.with_(model="model-b"))
        assert c.get(first.object_id, expect=big.with_(model_revision="r2")) is None
        got = np.empty(1 << 20, np.uint8)
        assert c.get_into(second, got) == 1 << 20 and np.array_equal(got, payload(1 << 20, cold[1]))
        c.check_integrity()


def test_a_re_put_of_an_nvme_held_id_is_existed_for_its_bytes_and_conflict_for_others(daemon_factory):
    """Held only on NVMe: the same bytes once answered existed=False (a second copy), other
    bytes of the same size were taken, and reads then flipped between the two as the host
    copy came and went."""
    d = daemon_factory("4MiB", config={"nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "32MiB",
                                                "admit_min_hits": 0}})
    big = MODEL_A.with_(layout=Layout.make("raw"))
    keys = chunk_keys(list(range(256 * 12)), big)
    with d.client() as c:
        for i, key in enumerate(keys):
            c.put(key, payload(1 << 20, i))
        cold = [i for i, t in enumerate(c.lookup(keys).tiers) if t == "nvme"]
        assert len(cold) >= 2
        same, other = cold[0], cold[1]
        assert c.put(keys[same], payload(1 << 20, same)).existed
        with pytest.raises(Conflict, match="other bytes"):
            c.put(keys[other], payload(1 << 20, 1000 + other))
        results = c.put_many([(keys[other], payload(1 << 20, 2000))], big)
        assert isinstance(results[0].error, Conflict)
        for _ in range(2):  # again after the host copies went: still the first bytes
            for i in (same, other):
                got = np.empty(1 << 20, np.uint8)
                assert c.get_into(keys[i], got) == 1 << 20 and np.array_equal(got, payload(1 << 20, i))
            for i, key in enumerate(keys):
                if i not in (same, other):
                    c.get_into(key, np.empty(1 << 20, np.uint8))  # push both out of the host tier
        c.check_integrity()


def test_put_many_reports_an_empty_item_and_stores_the_rest(daemon):
    keys = [ObjectId(bytes([0x40 + i]) * 32) for i in range(4)]
    with daemon.client() as c:
        c.put(keys[3], payload(8192, 3))
        results = c.put_many([(keys[0], payload(4096, 0)), (keys[1], b""), (keys[2], payload(4096, 2)),
                              (keys[3], payload(4096, 3)), ("not-a-key", b"x")])
        assert [r.error is None for r in results] == [True, False, True, False, False]
        assert isinstance(results[1].error, InvalidArgument) and "empty" in results[1].error.message
        assert results[1].object_id == keys[1]
        assert isinstance(results[3].error, Conflict)
        assert results[4].object_id is None and isinstance(results[4].error, InvalidArgument)
        assert c.lookup(keys[:3]).tiers == ("host", None, "host")
        with pytest.raises(InvalidArgument, match="empty"):
            c.put(keys[1], b"")


class RecordingCodec:
    """A StateCodec that only records what the connector hands it."""

    boundary_only = False

    def __init__(self, descriptor):
        self.descriptor = descriptor
        self.loaded = []

    def export(self, request_id, start_token, end_token):
        return None

    def load(self, request_id, start_token, end_token, data):
        self.loaded.append(data.copy())


def test_connector_never_loads_another_models_state(daemon):
    from kvstore.gpu.engine.connector import KVConnector
    keys_b = chunk_keys(TOKENS, MODEL_B)
    with daemon.client() as c:
        for i, key in enumerate(keys_b):  # model A's state under model B's ids
            c.put(key.object_id, payload(SIZE, i), MODEL_A)
    codec = RecordingCodec(MODEL_B)
    connector = KVConnector(daemon.socket, [codec], prefill_s=lambda tokens: tokens * 1.0)
    try:
        match = connector.get_num_new_matched_tokens("r1", TOKENS + [7])
        assert (match.num_tokens, match.reason) == (0, "miss")
        assert connector.start_load_kv("r1") == 0 and codec.loaded == []
        assert connector.read_segments("r1", TOKENS, {0: [(1, 1)]}) is None  # a sparse reader's pages too
        with daemon.client() as c:
            c.delete([k.object_id for k in keys_b])
            c.put_many([(key, payload(SIZE, i)) for i, key in enumerate(keys_b)])  # under their own descriptor
        assert connector.get_num_new_matched_tokens("r2", TOKENS + [7]).num_tokens == 512
        assert connector.start_load_kv("r2") == 512 and len(codec.loaded) == 2
        assert connector.read_segments("r2", TOKENS, {0: [(1, 1)]}) is not None
    finally:
        connector.close()


def test_keys_of_every_kind_resolve_as_each_alone_would():
    """resolve_keys (a batch's ids and expectations, with no call per key where it can) gives
    what to_object_id and expectation give key by key, for ObjectIds, ChunkKeys, raw digests
    and hex, with or without an `expect`; plain ObjectIds come back as the list itself."""
    from kvstore.client.core import expectation, resolve_keys, to_object_id
    chunk_a, chunk_b = chunk_keys(TOKENS, MODEL_A)[0], chunk_keys(TOKENS, MODEL_B)[1]
    plain = [ObjectId(bytes([i]) * 32) for i in range(3)]
    for keys in (plain, [chunk_a, plain[0], bytes(plain[1]), plain[2].hex, chunk_b], [chunk_a, chunk_b], []):
        for expect in (None, MODEL_B):
            ids, wanted = resolve_keys(keys, expect)
            assert ids == [to_object_id(k) for k in keys] and all(type(i) is ObjectId for i in ids)
            assert wanted == [expectation(k, expect) for k in keys]
            assert all(w is expectation(k, expect) for w, k in zip(wanted, keys))
    assert resolve_keys(plain, None)[0] is plain
    with pytest.raises(InvalidArgument, match="expect must be a StateDescriptor"):
        resolve_keys(plain, "model-a")
    with pytest.raises(InvalidArgument, match="a key is an ObjectId"):
        resolve_keys([plain[0], 7], None)
