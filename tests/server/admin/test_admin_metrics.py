"""GET /metrics follows traffic; /openapi.json describes exactly the routes the server has."""

from __future__ import annotations

import os
import types

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import ObjectId
from kvstore.config import ServerConfig
from kvstore.server.admin.server import AdminServer, make_app
from kvstore.server.admin.parts import AdminParts
from kvstore.server.admin.client import AdminRequestFailed
from kvstore.server.admin.openapi import openapi_document
from test_admin_support import PAYLOAD, admin_daemon, put_objects


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with admin_daemon(tmp_path_factory.mktemp("admin-metrics")) as d:
        yield d


def scrape(api) -> dict:
    """{(sample name, frozenset of labels): value}"""
    text = api.request("GET", "/metrics", raw=True)
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def ns_value(samples: dict, name: str, namespace: str) -> float:
    return samples.get((name, frozenset({("namespace", namespace), ("tier", "host")})), 0.0)


def test_metrics_move_with_traffic(daemon):
    before = scrape(daemon.api)
    assert before[("kvstore_ready", frozenset())] == 1
    with daemon.client("met") as client:
        ids = put_objects(client, "met", 3)
        for oid in ids[:2]:
            assert client.get_into(oid, bytearray(len(PAYLOAD)), namespace="met") == len(PAYLOAD)
        assert client.get(ObjectId(os.urandom(32)), namespace="met") is None
        lease = client.get(ids[0], namespace="met")
        during = scrape(daemon.api)
        assert during[("kvstore_leases", frozenset())] >= 1
        assert during[("kvstore_clients", frozenset())] >= 1
        lease.release()
    assert ns_value(during, "kvstore_puts_total", "met") == 3
    assert ns_value(during, "kvstore_objects", "met") == 3
    assert ns_value(during, "kvstore_bytes_in_total", "met") == 3 * len(PAYLOAD)
    assert ns_value(during, "kvstore_hits_total", "met") == 3
    assert ns_value(during, "kvstore_misses_total", "met") == 1
    assert ns_value(during, "kvstore_bytes_out_total", "met") == 3 * len(PAYLOAD)
    assert ns_value(during, "kvstore_capacity_bytes", "met") == 16 << 20

    daemon.api.delete(f"/v1/objects/{ids[0].hex}")
    daemon.api.post("/v1/evict", {"namespace": "met", "bytes": 1})
    with pytest.raises(AdminRequestFailed):
        daemon.anonymous("wrong").get("/v1/stats")
    after = scrape(daemon.api)
    assert ns_value(after, "kvstore_objects", "met") == 1
    assert ns_value(after, "kvstore_deletes_total", "met") == 1
    assert ns_value(after, "kvstore_evictions_total", "met") == 1
    unauthorized = ("kvstore_admin_errors_total", frozenset({("code", "unauthorized")}))
    assert after[unauthorized] == before.get(unauthorized, 0) + 1
    assert ("kvstore_uptime_seconds", frozenset()) in after  # exported on every scrape


def test_metrics_content_type(daemon):
    import urllib.request
    req = urllib.request.Request(daemon.api.url + "/metrics",
                                 headers={"Authorization": f"Bearer {daemon.api.token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")


def _documented() -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, ops in openapi_document()["paths"].items() for method in ops}


def test_every_route_is_documented_and_nothing_else(tmp_path):
    config = ServerConfig(data_dir=str(tmp_path))  # the routes only: no part is called
    app = make_app(AdminServer(AdminParts(config.admin, config.data_dir, *[types.SimpleNamespace()] * 7)))
    registered = {(route.method, route.resource.canonical) for route in app.router.routes()}
    assert registered == _documented()


def test_served_document_is_the_openapi_document(daemon):
    doc = daemon.api.get("/openapi.json")
    assert doc == openapi_document()
    assert doc["openapi"].startswith("3.0")
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "200" in op["responses"], (method, path)
            if path != "/healthz":
                assert "401" in op["responses"], (method, path)
