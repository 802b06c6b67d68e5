"""Admin route table and the node-level handlers: health, stats, cluster, metrics.

Object handlers (list, show, delete, pin, evict) are in server/admin/objects.py, lookups
for routers in server/admin/lookup.py and lookup_batch.py. Every
route here must be described in server/admin/openapi.py; a test holds the two together.
"""

from __future__ import annotations

import os
import socket

from aiohttp import web

from kvstore.server.admin import lookup, lookup_batch, objects
from kvstore.server.admin.http import ADMIN, json_response
from kvstore.server.admin.openapi import TIER_KEYS, openapi_document
from kvstore.server.admin.parts import REMOTE
from kvstore.tiers.nvme import ALIGN as NVME_ALIGN
from kvstore.tiers.slabs import SIZE_CLASSES


def _admin(request: web.Request):
    return request.app[ADMIN]


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    ready = _admin(request).ready()
    return json_response({"ready": ready}, status=200 if ready else 503)


def _tier_stats(ns: dict) -> dict:
    """One namespace's manager stats, as the host tier's numbers."""
    return {k: v for k, v in ns.items() if isinstance(v, int)}


def stats_document(admin) -> dict:
    stats = admin.node_stats()
    per_ns = {name: {"tiers": {"host": _tier_stats(ns)}, "pages": ns["pages"]}
              for name, ns in sorted(stats["namespaces"].items())}
    total = dict.fromkeys(TIER_KEYS, 0)
    for ns in per_ns.values():
        for key, value in ns["tiers"]["host"].items():
            total[key] = total.get(key, 0) + value
    # Objects up to 3.5 KiB take a slot of their size class (multiples of 64 B), larger ones whole 4 KiB pages.
    total["allocation_unit_bytes"] = SIZE_CLASSES[0]
    return {
        "version": stats["version"],
        "pid": stats["pid"],
        "uptime_s": stats["uptime_s"],
        "ready": admin.ready(),
        "clients": stats["clients"],
        "leases": stats["leases"],
        "ops_per_s": admin.ops_per_s(),
        "socket": stats["socket"],
        "host_bandwidth_bytes_s": stats["host_bandwidth_bytes_s"],
        "gpu": stats["gpu"],
        "tiers": {"host": total, **({"nvme": _nvme_tier(stats["tiers"]["nvme"])} if "nvme" in stats.get("tiers", {}) else {})},
        "namespaces": per_ns,
    }


# NVMe counters under the names the host tier uses, so one TierStats schema fits both.
_NVME_AS_TIER = {"num_puts": "writes", "num_gets": "reads", "num_hits": "hits", "num_misses": "misses",
                 "num_evictions": "num_nvme_evictions"}


def _nvme_tier(nvme: dict) -> dict:
    """The node-wide NVMe tier in TierStats shape, plus its own integer counters."""
    doc = dict.fromkeys(TIER_KEYS, 0)
    for key in TIER_KEYS:
        value = nvme.get(_NVME_AS_TIER.get(key, key), 0)
        doc[key] = value if isinstance(value, int) and not isinstance(value, bool) else 0
    doc.update({k: v for k, v in nvme.items()
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and k not in doc})
    doc["allocation_unit_bytes"] = NVME_ALIGN  # extents are O_DIRECT-aligned: whole 4 KiB blocks
    return doc


async def stats(request: web.Request) -> web.Response:
    return json_response(stats_document(_admin(request)))


async def cluster(request: web.Request) -> web.Response:
    admin = _admin(request)
    doc = stats_document(admin)
    node = {
        "node_id": f"{socket.gethostname()}:{os.getpid()}",
        "hostname": socket.gethostname(),
        "admin_url": admin.url,
        "version": doc["version"],
        "ready": doc["ready"],
        "uptime_s": doc["uptime_s"],
        "namespaces": sorted(doc["namespaces"]),
        "tiers": {name: {k: tier[k] for k in ("capacity_bytes", "used_bytes", "objects")}
                  for name, tier in doc["tiers"].items()},
        "host_bandwidth_bytes_s": doc["host_bandwidth_bytes_s"],
    }
    link = request.app[REMOTE]
    if link.remote is None:  # one node; its remote tier may be a shared pool (else "pool" is left out)
        pool = await link.pool_status()
        return json_response({"self": node["node_id"], "nodes": [node], **({"pool": pool} if pool else {})})
    # Clustered: this node's numbers, and every member as this node sees it.
    stats = link.stats()
    node["node_id"] = stats["node_id"]
    down = set(stats["remote"].get("peers_down", ()))
    members = [{"node_id": n, "peer_address": a, "self": n == stats["node_id"], "down": n in down}
               for n, a in sorted(stats["members"].items())]
    return json_response({"self": node["node_id"], "nodes": [node], "members": members,
                          "replicas": link.config.replicas, "remote_write": link.config.remote_write,
                          "rehome": stats.get("rehome"), "auth_failures": stats.get("auth_failures")})


async def metrics(request: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST
    from kvstore.server.admin.metrics import render
    return web.Response(body=render(_admin(request).registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document())


ROUTES = [
    ("GET", "/healthz", healthz),
    ("GET", "/readyz", readyz),
    ("GET", "/v1/stats", stats),
    ("GET", "/v1/objects", objects.list_objects),
    ("GET", "/v1/objects/{id}", objects.show_object),
    ("DELETE", "/v1/objects/{id}", objects.delete_object),
    ("POST", "/v1/objects/{id}/pin", objects.pin_object),
    ("DELETE", "/v1/objects/{id}/pin", objects.unpin_object),
    ("POST", "/v1/evict", objects.evict),
    ("POST", "/v1/lookup", lookup.lookup),
    ("POST", "/v1/lookup/batch", lookup_batch.lookup_batch),
    ("GET", "/v1/cluster", cluster),
    ("GET", "/metrics", metrics),
    ("GET", "/openapi.json", openapi),
]
