"""Every admin endpoint over real HTTP against a real daemon process."""

from __future__ import annotations

import os
import stat

import pytest

from kvstore import ObjectId, StateDescriptor, chunk_keys
from kvstore.server.admin.client import AdminClient, AdminRequestFailed
from kvstore.server.admin.routes import ROUTES
from test_admin_support import PAYLOAD, admin_daemon, put_objects

SOME_ID = "ab" * 32


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with admin_daemon(tmp_path_factory.mktemp("admin-api")) as d:
        yield d


def fails(call, status: int, code: str | None = None) -> AdminRequestFailed:
    with pytest.raises(AdminRequestFailed) as info:
        call()
    assert info.value.status == status, info.value.message
    if code is not None:
        assert info.value.code == code
    return info.value


def test_healthz_needs_no_token(daemon):
    assert daemon.anonymous().get("/healthz") == {"status": "ok"}


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_every_other_route_needs_the_token(daemon, token):
    api = daemon.anonymous(token)
    for method, path, _ in ROUTES:
        if path == "/healthz":
            continue
        err = fails(lambda: api.request(method, path.replace("{id}", SOME_ID)), 401, "unauthorized")
        assert "admin.token" in err.message


def test_token_is_private_and_survives_a_restart(tmp_path):
    token_path = tmp_path / "admin.token"
    with admin_daemon(tmp_path) as d:
        first = token_path.read_text().strip()
        assert stat.S_IMODE(os.stat(token_path).st_mode) == 0o600
        assert d.api.get("/readyz") == {"ready": True}
    assert not (tmp_path / "admin.addr").exists()  # removed at clean shutdown
    with admin_daemon(tmp_path) as d:
        assert token_path.read_text().strip() == first
        assert d.api.get("/v1/cluster")["nodes"][0]["admin_url"] == d.api.url


def test_stats_counts_puts_gets_and_leases(daemon):
    with daemon.client("stats") as client:
        ids = put_objects(client, "stats", 4)
        lease = client.get(ids[0], namespace="stats")
        assert client.get(ObjectId(os.urandom(32)), namespace="stats") is None
        stats = daemon.api.get("/v1/stats")
        host = stats["namespaces"]["stats"]["tiers"]["host"]
        assert (host["objects"], host["num_puts"], host["bytes_in"]) == (4, 4, 4 * len(PAYLOAD))
        assert (host["num_hits"], host["num_misses"], host["bytes_out"]) == (1, 1, len(PAYLOAD))
        assert host["capacity_bytes"] == 16 << 20 and host["used_bytes"] >= 4 * len(PAYLOAD)
        assert stats["leases"] >= 1 and stats["clients"] >= 1 and stats["ready"] is True
        assert stats["tiers"]["host"]["objects"] >= 4
        assert stats["ops_per_s"] > 0 and stats["uptime_s"] > 0
        lease.release()


def test_objects_listing_filters(daemon):
    with daemon.client("ls") as client:
        llama = set(put_objects(client, "ls", 3, model="llama"))
        mla = set(put_objects(client, "ls", 2, model="deepseek", kind="mla_latent"))
    page = daemon.api.get("/v1/objects", namespace="ls")
    assert {o["object_id"] for o in page["objects"]} == {i.hex for i in llama | mla}
    assert page["next_cursor"] is None
    keys = [(o["namespace"], o["object_id"]) for o in page["objects"]]
    assert keys == sorted(keys)
    assert {o["object_id"] for o in daemon.api.get("/v1/objects", namespace="ls", model="llama")["objects"]} \
        == {i.hex for i in llama}
    one = daemon.api.get("/v1/objects", namespace="ls", kind="mla_latent", tier="host")["objects"]
    assert {o["object_id"] for o in one} == {i.hex for i in mla}
    assert one[0]["descriptor"]["model"] == "deepseek" and one[0]["size"] == len(PAYLOAD)
    assert daemon.api.get("/v1/objects", namespace="nowhere") == {"objects": [], "next_cursor": None}
    for bad in ({"tier": "tape"}, {"kind": "nope"}, {"limit": "0"}, {"limit": "x"}, {"cursor": "garbage!"}):
        fails(lambda: daemon.api.get("/v1/objects", **bad), 400, "invalid_argument")


def test_show_and_delete_an_object(daemon):
    with daemon.client("show") as client:
        (oid,) = put_objects(client, "show", 1)
        obj = daemon.api.get(f"/v1/objects/{oid.hex}")
        assert obj["namespace"] == "show" and obj["tier"] == "host" and obj["pinned"] is False
        assert obj["descriptor"]["namespace"] == "show" and obj["expires_in_s"] is None
        assert daemon.api.delete(f"/v1/objects/{oid.hex}") == {
            "deleted": True, "namespace": "show", "object_id": oid.hex}
        assert client.get(oid, namespace="show") is None
    fails(lambda: daemon.api.get(f"/v1/objects/{oid.hex}"), 404, "not_found")
    fails(lambda: daemon.api.delete(f"/v1/objects/{oid.hex}"), 404, "not_found")
    fails(lambda: daemon.api.get("/v1/objects/not-hex"), 400, "invalid_argument")
    fails(lambda: daemon.api.get(f"/v1/objects/{oid.hex}", namespace="nowhere"), 404)


def test_an_id_in_two_namespaces_needs_a_namespace(daemon):
    oid = ObjectId(os.urandom(32))
    for ns in ("twin-a", "twin-b"):
        with daemon.client(ns) as client:
            client.put(oid, PAYLOAD, StateDescriptor(ns, "m", "r1"))
    err = fails(lambda: daemon.api.get(f"/v1/objects/{oid.hex}"), 409, "conflict")
    assert "twin-a" in err.message and "twin-b" in err.message
    assert daemon.api.get(f"/v1/objects/{oid.hex}", namespace="twin-b")["namespace"] == "twin-b"
    daemon.api.delete(f"/v1/objects/{oid.hex}", namespace="twin-a")
    assert daemon.api.get(f"/v1/objects/{oid.hex}")["namespace"] == "twin-b"


def test_pin_and_unpin(daemon):
    with daemon.client("pin") as client:
        (oid,) = put_objects(client, "pin", 1)
    path = f"/v1/objects/{oid.hex}/pin"
    obj = daemon.api.post(path, {"ttl_s": 60})
    assert obj["pinned"] is True and 0 < obj["pinned_for_s"] <= 60
    obj = daemon.api.request("POST", path)  # no body: until unpinned
    assert obj["pinned"] is True and obj["pinned_for_s"] is None
    assert daemon.api.get("/v1/stats")["namespaces"]["pin"]["tiers"]["host"]["pinned"] == 1
    assert daemon.api.delete(path)["pinned"] is False
    for body in ({"ttl_s": 0}, {"ttl_s": -1}, {"ttl_s": "1"}, {"ttl": 5}, [1]):
        fails(lambda: daemon.api.post(path, body), 400, "invalid_argument")
    fails(lambda: daemon.api.post(f"/v1/objects/{SOME_ID}/pin", {}), 404)


def test_a_pin_ttl_past_a_century_is_a_400_naming_the_range_not_a_500(daemon):
    """Issue 41 item 14: {"ttl_s": 10**400} answered 500 (OverflowError); 2**64 was taken."""
    with daemon.client("pin-ttl") as client:
        (oid,) = put_objects(client, "pin-ttl", 1)
    path = f"/v1/objects/{oid.hex}/pin"
    for ttl_s in (10**400, 2**64, 1e300, 3_153_600_001):
        err = fails(lambda: daemon.api.post(path, {"ttl_s": ttl_s}), 400, "invalid_argument")
        assert "ttl_s must be a number of seconds in 0..3,153,600,000" in err.message
    assert daemon.api.get(f"/v1/objects/{oid.hex}")["pinned"] is False
    assert daemon.api.post(path, {"ttl_s": 3_153_600_000})["pinned"] is True


def test_a_namespace_with_a_control_character_is_a_400_wherever_the_admin_api_takes_one(daemon):
    """Issue 41 item 15: no namespace name that could forge a log line or a status row enters."""
    bad = "x\nts=1 level=error event=forged"
    desc = {"namespace": bad, "model": "m", "model_revision": "r", "chunk_tokens": 1}
    calls = [
        lambda: daemon.api.get("/v1/objects", namespace=bad),
        lambda: daemon.api.get(f"/v1/objects/{SOME_ID}", namespace=bad),
        lambda: daemon.api.delete(f"/v1/objects/{SOME_ID}", namespace=bad),
        lambda: daemon.api.post("/v1/evict", {"namespace": bad, "bytes": 1}),
        lambda: daemon.api.post("/v1/evict", {"filter": {"model": "m\x1b[2J"}}),
        lambda: daemon.api.post("/v1/lookup", {"tokens": [1], "descriptor": desc}),
        lambda: daemon.api.post("/v1/lookup/batch", {"namespace": bad, "prefixes": [{"tokens": [1], "descriptor": desc}]}),
    ]
    for call in calls:
        err = fails(call, 400, "invalid_argument")
        assert "must be 1..256 characters, none of them a control character" in err.message, err.message


def test_evict_spares_pinned_and_leased_objects(daemon):
    with daemon.client("ev") as client:
        ids = put_objects(client, "ev", 5)
        other = put_objects(client, "ev", 2, model="keep")
        daemon.api.post(f"/v1/objects/{ids[0].hex}/pin", {})
        lease = client.get(ids[1], namespace="ev")
        done = daemon.api.post("/v1/evict", {"namespace": "ev", "filter": {"model": "m"}})
        assert done["num_evicted"] == 3 and done["evicted_bytes"] == 3 * len(PAYLOAD)
        assert {e["object_id"] for e in done["evicted"]} == {i.hex for i in ids[2:]}
        assert done["tier"] == "host" and done["truncated"] is False
        left = {o["object_id"] for o in daemon.api.get("/v1/objects", namespace="ev")["objects"]}
        assert left == {i.hex for i in [ids[0], ids[1], *other]}
        with lease:
            assert lease.verify()
        one = daemon.api.post("/v1/evict", {"namespace": "ev", "bytes": 1})
        assert one["num_evicted"] == 1 and one["requested_bytes"] == 1
        assert one["evicted"][0]["object_id"] in {i.hex for i in [ids[1], *other]}
    stats = daemon.api.get("/v1/stats")["namespaces"]["ev"]["tiers"]["host"]
    assert stats["num_evictions"] == 4 and stats["objects"] == 3


@pytest.mark.parametrize("body, status", [
    ({}, 400), ({"namespace": "ev"}, 400), ({"bytes": 10}, 400), ({"namespace": "ev", "bytes": 0}, 400),
    ({"filter": {"kind": "nope"}}, 400), ({"filter": {"colour": "red"}}, 400), ({"tier": "tape", "filter": {}}, 400),
    ({"namespace": "ev", "bytes": 10, "filter": None}, 400), ({"filter": {"model": None}}, 400),
    ({"filter": {"model_revision": "r" * 300}}, 400), ({"namespace": "nowhere", "bytes": 10}, 404),
])
def test_evict_rejects_bad_requests(daemon, body, status):
    fails(lambda: daemon.api.post("/v1/evict", body), status)


def test_lookup_reports_leading_hits_per_tier(daemon):
    desc = StateDescriptor("look", "m", "r1", chunk_tokens=16)
    tokens = list(range(48))
    keys = chunk_keys(tokens, desc)
    with daemon.client("look") as client:
        for key in keys[:2]:
            client.put(key, PAYLOAD, desc)
    body = {"tokens": tokens, "descriptor": desc.to_wire()}
    found = daemon.api.post("/v1/lookup", body)
    assert found["object_ids"] == [k.object_id.hex for k in keys]
    assert (found["num_chunks"], found["hits"], found["hit_tokens"]) == (3, 2, 32)
    assert found["hit_chunks_per_tier"] == {"host": 2} and found["tiers"] == ["host", "host", None]
    assert found["hit_bytes"] == 2 * len(PAYLOAD) and found["est_load_s"] > 0
    missing = daemon.api.post("/v1/lookup", {**body, "descriptor": {**desc.to_wire(), "namespace": "cold"}})
    assert missing["hits"] == 0 and missing["est_load_s"] == 0
    assert "cold" not in daemon.api.get("/v1/stats")["namespaces"]  # a lookup opens no namespace
    for bad in ({"tokens": [-1], "descriptor": desc.to_wire()}, {"tokens": tokens},
                {"tokens": tokens, "descriptor": {**desc.to_wire(), "layout": "what"}},
                {"tokens": tokens, "descriptor": {"namespace": "x"}},
                {**body, "extra_keys": None}, {**body, "unknown": 1}):
        fails(lambda: daemon.api.post("/v1/lookup", bad), 400, "invalid_argument")


def test_cluster_lists_this_node(daemon):
    doc = daemon.api.get("/v1/cluster")
    assert len(doc["nodes"]) == 1 and doc["nodes"][0]["node_id"] == doc["self"]
    assert doc["nodes"][0]["ready"] is True and "host" in doc["nodes"][0]["tiers"]


def test_errors_are_json_with_status(daemon):
    err = fails(lambda: daemon.api.get("/v1/nothing"), 404, "not_found")
    assert err.message
    fails(lambda: daemon.api.request("PUT", "/v1/stats"), 405, "method_not_allowed")
    fails(lambda: daemon.api.request("POST", "/v1/lookup"), 400, "invalid_argument")


def test_lookup_counts_no_other_models_state(daemon):
    desc = StateDescriptor("look", "model-b", "r1", chunk_tokens=16)
    tokens = list(range(100, 132))
    keys = chunk_keys(tokens, desc)
    with daemon.client("look") as client:  # another model's state under model B's ids
        client.put_many([(k.object_id, PAYLOAD) for k in keys], desc.with_(model="model-a"))
    found = daemon.api.post("/v1/lookup", {"tokens": tokens, "descriptor": desc.to_wire()})
    assert found["hits"] == 0 and found["tiers"] == [None, None]


@pytest.mark.parametrize("where", ["query", "header"])
def test_a_request_over_aiohttps_line_limit_gets_a_json_400(daemon, where):
    """A query over 8190 bytes got aiohttp's plain-text 400 (and a traceback in the log)."""
    long = "a" * 9000
    if where == "query":
        call = lambda: daemon.api.get("/v1/objects", model=long)  # noqa: E731
    else:
        call = lambda: AdminClient(daemon.api.url, daemon.api.token + "x" * 9000).get("/v1/stats")  # noqa: E731
    err = fails(call, 400, "bad_request")
    assert "longer than 8190 bytes" in err.message
    assert daemon.api.get("/healthz") == {"status": "ok"}  # and the API still serves
