"""POST /v1/lookup/batch over real HTTP against real daemons: objects put with routes on
host and NVMe are found by the engine's block hashes, per tier, as the tiers hold them."""

from __future__ import annotations

import hashlib
import os

import pytest

from kvs_testing import payload
from kvstore import Hints, ObjectId, StateDescriptor, chunk_keys
from kvstore.identity import Shard
from kvstore.route import Route, published_hash
from kvstore.server.admin import lookup_batch, openapi
from kvstore.server.admin.client import AdminClient, AdminRequestFailed
from test_admin_support import PAYLOAD, admin_daemon

MiB = 1 << 20
BATCH = "/v1/lookup/batch"
NUM_OBJECTS = 8  # of 1 MiB through a 4 MiB arena: the first ones go to NVMe


@pytest.fixture(scope="module")
def daemon(module_daemon_factory):
    d = module_daemon_factory("4MiB", {
        "events": {"enabled": True},
        "nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB", "admit_min_hits": 0}})
    d.api = AdminClient.from_data_dir(d.data_dir)
    return d


def block_hashes(tag: str, i: int) -> list:
    """An object's two engine blocks, named as vLLM does: a sha256 digest and a 64-bit int."""
    digest = hashlib.sha256(f"{tag}-{i}".encode()).digest()
    return [digest, int.from_bytes(digest[:8], "big")]


def route(tag: str, i: int) -> Route:
    return Route(block_hashes(tag, i), parent_block_hash=None if i == 0 else block_hashes(tag, i - 1)[1],
                 block_size=16, group_idx=0)


def as_json(hashes) -> list:
    return [h.hex() if isinstance(h, bytes) else h for h in hashes]


def prefix_of(tag: str, order) -> dict:
    return {"block_hashes": as_json(h for i in order for h in block_hashes(tag, i))}


def batch(d, namespace: str, *prefixes) -> list[dict]:
    answer = d.api.post(BATCH, {"namespace": namespace, "prefixes": list(prefixes)})
    assert answer["namespace"] == namespace and len(answer["results"]) == len(prefixes)
    return answer["results"]


def leading(tiers, allowed) -> int:
    return next((i for i, t in enumerate(tiers) if t not in allowed), len(tiers))


def fails(call, status: int, *words: str) -> AdminRequestFailed:
    with pytest.raises(AdminRequestFailed) as info:
        call()
    assert info.value.status == status, info.value.message
    assert all(w in info.value.message for w in words), info.value.message
    return info.value


@pytest.fixture(scope="module")
def stored(daemon):
    """NUM_OBJECTS objects of two blocks each put with routes (put_many's and a hint's):
    ids and their tiers once the puts are done."""
    with daemon.client(namespace="routes") as c:
        keys = [ObjectId(os.urandom(32)) for _ in range(NUM_OBJECTS)]
        half = NUM_OBJECTS // 2
        results = c.put_many([(k, payload(MiB, i)) for i, k in enumerate(keys[:half])],
                             routes=[route("r", i) for i in range(half)])
        assert all(r.error is None for r in results)
        for i, key in enumerate(keys[half:], half):
            c.put(key, payload(MiB, i), hints=Hints(route=route("r", i)))
        tiers = c.lookup(keys).tiers
    assert "host" in tiers and "nvme" in tiers, tiers
    return keys, tiers


def test_block_hashes_find_host_and_nvme_objects_with_per_tier_lengths(daemon, stored):
    keys, tiers = stored
    host = [i for i, t in enumerate(tiers) if t == "host"]
    nvme = [i for i, t in enumerate(tiers) if t == "nvme"]
    # Two candidates in one call: host objects first then NVMe ones; and NVMe ones alone.
    both, nvme_only, host_only = batch(daemon, "routes", prefix_of("r", host + nvme), prefix_of("r", nvme),
                                       prefix_of("r", host))
    assert both["unit"] == "block" and both["num_blocks"] == 2 * NUM_OBJECTS
    assert both["tiers"] == ["host"] * 2 * len(host) + ["nvme"] * 2 * len(nvme)
    assert both["hit_blocks"] == 2 * NUM_OBJECTS and both["hit_tokens"] == 16 * 2 * NUM_OBJECTS
    assert both["up_to_tier"] == {"host": {"blocks": 2 * len(host), "tokens": 32 * len(host)},
                                  "nvme": {"blocks": 2 * NUM_OBJECTS, "tokens": 32 * NUM_OBJECTS},
                                  "remote": {"blocks": 2 * NUM_OBJECTS, "tokens": 32 * NUM_OBJECTS}}
    assert both["hit_bytes"] == NUM_OBJECTS * MiB
    assert nvme_only["up_to_tier"]["host"] == {"blocks": 0, "tokens": 0}
    assert nvme_only["hit_blocks"] == 2 * len(nvme) and nvme_only != both
    # The estimate is /v1/lookup's over the same objects, and grows with the NVMe part.
    with daemon.client(namespace="routes") as c:
        assert both["est_load_s"] == pytest.approx(c.lookup([keys[i] for i in host + nvme]).est_load_s)
        assert host_only["est_load_s"] == pytest.approx(c.lookup([keys[i] for i in host]).est_load_s)
    assert 0 < host_only["est_load_s"] < both["est_load_s"]
    # One block of an object suffices to load it whole; hashes in upper-case hex match too.
    first = block_hashes("r", host[0])[0].hex().upper()
    (one,) = batch(daemon, "routes", {"block_hashes": [first]})
    assert (one["hit_blocks"], one["hit_tokens"], one["hit_bytes"]) == (1, 16, MiB)
    # A router asks with the hashes it read from the stream: sha256 digests in vLLM's int form.
    (as_read,) = batch(daemon, "routes", {"block_hashes": [published_hash(h, True) for i in host + nvme
                                                           for h in block_hashes("r", i)]})
    assert as_read == both


def test_a_prefix_is_held_up_to_the_block_that_left(daemon):
    with daemon.client(namespace="gap") as c:
        keys = [ObjectId(os.urandom(32)) for _ in range(4)]
        assert all(r.error is None for r in c.put_many([(k, PAYLOAD) for k in keys],
                                                       routes=[route("gap", i) for i in range(4)]))
        (before,) = batch(daemon, "gap", prefix_of("gap", range(4)))
        assert before["hit_blocks"] == 8
        assert c.delete([keys[1]]) == 1
    (after,) = batch(daemon, "gap", prefix_of("gap", range(4)))
    assert after["tiers"] == ["host", "host", None, None, "host", "host", "host", "host"]
    assert after["hit_blocks"] == 2 and after["hit_tokens"] == 32 and after["hit_bytes"] == len(PAYLOAD)
    assert all(v == {"blocks": 2, "tokens": 32} for v in after["up_to_tier"].values())
    assert 0 < after["est_load_s"] < before["est_load_s"]


def test_a_block_is_held_when_every_object_naming_it_is(daemon):
    """TP shards put under the same block hashes: objects_per_block asks for both."""
    shards = [StateDescriptor("tp", "m", "r1", shard=Shard(r, 2)) for r in range(2)]
    keys = [ObjectId(os.urandom(32)) for _ in range(2)]
    with daemon.client(namespace="tp") as c:
        for key, desc in zip(keys, shards):
            c.put(key, PAYLOAD, desc, Hints(route=route("tp", 0)))
        one, two, three = batch(daemon, "tp", prefix_of("tp", [0]), {**prefix_of("tp", [0]), "objects_per_block": 2},
                                {**prefix_of("tp", [0]), "objects_per_block": 3})
        assert one["hit_blocks"] == two["hit_blocks"] == 2 and three["hit_blocks"] == 0
        assert one["hit_bytes"] == 2 * len(PAYLOAD)  # the engine loads both shards
        assert c.delete(keys[1:]) == 1
    one, two = batch(daemon, "tp", prefix_of("tp", [0]), {**prefix_of("tp", [0]), "objects_per_block": 2})
    assert (one["hit_blocks"], one["hit_bytes"]) == (2, len(PAYLOAD)) and two["hit_blocks"] == 0


def test_an_object_put_without_a_route_is_found_by_its_id(daemon):
    with daemon.client(namespace="plain") as c:
        key = ObjectId(os.urandom(32))
        c.put(key, PAYLOAD)
    (found, as_read, missing) = batch(daemon, "plain", {"block_hashes": [key.hex]},
                                      {"block_hashes": [published_hash(key.digest, True)]},  # as the stream says
                                      {"block_hashes": ["ab" * 32]})
    assert found["hit_blocks"] == 1 and found["hit_tokens"] == 256 and found["tiers"] == ["host"]
    assert as_read == found
    assert missing["hit_blocks"] == 0 and missing["est_load_s"] == 0


def test_the_tokens_form_agrees_with_v1_lookup(daemon):
    desc = StateDescriptor("toks", "m", "r1", chunk_tokens=16)
    tokens = list(range(64))
    keys = chunk_keys(tokens, desc, extra_keys=["lora-a"])
    with daemon.client(namespace="toks") as c:
        for key in keys[:3]:
            c.put(key, PAYLOAD, desc)
        c.put(ObjectId(os.urandom(32)), PAYLOAD, desc, Hints(route=route("toks", 0)))
    body = {"tokens": tokens, "descriptor": desc.to_wire(), "extra_keys": ["lora-a"]}
    single = daemon.api.post("/v1/lookup", body)
    by_tokens, by_hashes, short = batch(daemon, "toks", body, prefix_of("toks", [0]),
                                        {**body, "tokens": tokens[:32]})
    assert by_tokens["unit"] == "chunk" and by_tokens["num_blocks"] == single["num_chunks"] == 4
    assert by_tokens["tiers"] == single["tiers"] == ["host", "host", "host", None]
    assert (by_tokens["hit_blocks"], by_tokens["hit_tokens"], by_tokens["hit_bytes"]) == \
        (single["hits"], single["hit_tokens"], single["hit_bytes"]) == (3, 48, 3 * len(PAYLOAD))
    assert by_tokens["up_to_tier"]["host"]["blocks"] == single["hit_chunks_per_tier"]["host"]
    assert by_tokens["est_load_s"] == pytest.approx(single["est_load_s"])
    assert by_hashes["unit"] == "block" and by_hashes["hit_blocks"] == 2  # both forms in one call
    assert short["hit_blocks"] == 2 and short["est_load_s"] < by_tokens["est_load_s"]


def test_another_namespaces_objects_are_never_counted(daemon):
    with daemon.client(namespace="ns-a") as a, daemon.client(namespace="ns-b") as b:
        a.put_many([(ObjectId(os.urandom(32)), PAYLOAD) for _ in range(2)], routes=[route("ns", i) for i in range(2)])
        b.put_many([(ObjectId(os.urandom(32)), PAYLOAD)], routes=[route("ns", 0)])  # the same block hashes
    in_a, in_b = batch(daemon, "ns-a", prefix_of("ns", range(2)))[0], batch(daemon, "ns-b", prefix_of("ns", range(2)))[0]
    assert (in_a["hit_blocks"], in_a["hit_bytes"]) == (4, 2 * len(PAYLOAD))
    assert (in_b["hit_blocks"], in_b["hit_bytes"]) == (2, len(PAYLOAD))
    (nowhere,) = batch(daemon, "never-opened", prefix_of("ns", range(2)))
    assert nowhere["hit_blocks"] == 0 and nowhere["tiers"] == [None] * 4
    assert "never-opened" not in daemon.api.get("/v1/stats")["namespaces"]  # a lookup opens no namespace


def test_without_events_the_block_hash_form_is_refused_by_name(tmp_path):
    desc = StateDescriptor("plain", "m", "r1", chunk_tokens=16)
    keys = chunk_keys(list(range(32)), desc)
    with admin_daemon(tmp_path) as d:
        with d.client("plain") as c:
            c.put(keys[0], PAYLOAD, desc)
        fails(lambda: d.api.post(BATCH, {"namespace": "plain", "prefixes": [{"block_hashes": [1]}]}),
              409, "block_hashes", "[events] enabled = true")
        body = {"tokens": list(range(32)), "descriptor": desc.to_wire()}
        (found,) = d.api.post(BATCH, {"namespace": "plain", "prefixes": [body]})["results"]
        assert found["hit_blocks"] == 1 and found["tiers"] == ["host", None]


def test_bad_input_is_refused_naming_the_field(daemon):
    desc = StateDescriptor("bad", "m", "r1", chunk_tokens=1).to_wire()
    ok = {"block_hashes": [1]}
    many = lookup_batch.MAX_BLOCKS_PER_PREFIX
    for body, words in [
        ({}, ["namespace"]), ({"namespace": "bad"}, ["prefixes"]), ({"namespace": 5, "prefixes": [ok]}, ["namespace"]),
        ({"namespace": "bad", "prefixes": []}, ["prefixes"]), ({"namespace": "bad", "prefixes": [ok], "x": 1}, ["x"]),
        ({"namespace": "bad", "prefixes": [ok] * (lookup_batch.MAX_PREFIXES + 1)}, ["prefixes", "64"]),
        ({"namespace": "bad", "prefixes": [7]}, ["prefixes[0]"]),
        ({"namespace": "bad", "prefixes": [ok, {"block_hashes": "ab"}]}, ["prefixes[1].block_hashes"]),
        ({"namespace": "bad", "prefixes": [{"block_hashes": [1, "zz"]}]}, ["prefixes[0].block_hashes[1]"]),
        ({"namespace": "bad", "prefixes": [{"block_hashes": ["abc"]}]}, ["prefixes[0].block_hashes[0]"]),
        ({"namespace": "bad", "prefixes": [{"block_hashes": ["ab cd"]}]}, ["prefixes[0].block_hashes[0]"]),
        ({"namespace": "bad", "prefixes": [{"block_hashes": [True]}]}, ["prefixes[0].block_hashes[0]"]),
        ({"namespace": "bad", "prefixes": [{"block_hashes": [1 << 64]}]}, ["prefixes[0].block_hashes[0]"]),
        ({"namespace": "bad", "prefixes": [{"block_hashes": ["ab" * 65]}]}, ["prefixes[0].block_hashes[0]"]),
        ({"namespace": "bad", "prefixes": [{**ok, "tokens": [1]}]}, ["prefixes[0]", "tokens"]),
        ({"namespace": "bad", "prefixes": [{**ok, "objects_per_block": 0}]}, ["prefixes[0].objects_per_block"]),
        ({"namespace": "bad", "prefixes": [{**ok, "objects_per_block": None}]}, ["prefixes[0]", "null"]),
        ({"namespace": "bad", "prefixes": [{"tokens": [1]}]}, ["prefixes[0]", "descriptor"]),
        ({"namespace": "bad", "prefixes": [{"tokens": [-1], "descriptor": desc}]}, ["prefixes[0].tokens", "token ids"]),
        ({"namespace": "bad", "prefixes": [{"tokens": [1], "descriptor": {**desc, "namespace": "other"}}]},
         ["prefixes[0].descriptor.namespace", "other"]),
        ({"namespace": "bad", "prefixes": [{"tokens": [1], "descriptor": {**desc, "layout": "what"}}]},
         ["prefixes[0].descriptor", "layout"]),
        ({"namespace": "bad", "prefixes": [{"tokens": [1] * (many + 1), "descriptor": desc}]}, ["prefixes[0]", "chunks"]),
        ({"namespace": "bad", "prefixes": [{"block_hashes": [1] * (many + 1)}]}, ["prefixes[0].block_hashes"]),
        ({"namespace": "bad", "prefixes": [{"block_hashes": [1] * many}] * 3}, ["split the call"]),
    ]:
        fails(lambda: daemon.api.post(BATCH, body), 400, *words)
    assert daemon.api.get("/healthz") == {"status": "ok"}
    assert "bad" not in daemon.api.get("/v1/stats")["namespaces"]


def test_the_openapi_document_states_the_limits():
    assert (openapi.MAX_PREFIXES, openapi.MAX_BLOCKS_PER_PREFIX, openapi.MAX_OBJECTS_PER_BLOCK) == \
        (lookup_batch.MAX_PREFIXES, lookup_batch.MAX_BLOCKS_PER_PREFIX, lookup_batch.MAX_OBJECTS_PER_BLOCK)
    assert str(lookup_batch.MAX_BLOCKS_PER_CALL) in str(openapi.SCHEMAS["LookupBatchRequest"])


def test_a_block_loads_from_the_slowest_tier_of_its_objects():
    """What no single daemon here holds: remote objects, and a block of objects on two tiers."""
    blocks = lookup_batch.Blocks("block", [(0,), (1,), (1, 2), (3,), (), (0,)], [16] * 6)
    ranks = lookup_batch.rank_of(["host", "nvme", "remote", "host"])
    found = lookup_batch.score(blocks, ranks, [1, 2, 4, 8], lambda *loaded: loaded)
    assert found["tiers"] == ["host", "nvme", "remote", "host", None, "host"]
    assert found["up_to_tier"] == {"host": {"blocks": 1, "tokens": 16}, "nvme": {"blocks": 2, "tokens": 32},
                                   "remote": {"blocks": 4, "tokens": 64}}
    assert (found["hit_blocks"], found["hit_bytes"]) == (4, 15)
    assert found["est_load_s"] == (4, 9, 2, 4)  # objects, then host, nvme and remote bytes: each object once
