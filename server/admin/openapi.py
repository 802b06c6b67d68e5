"""The OpenAPI 3.0 document served at /openapi.json.

Written by hand next to the handlers it describes; tests check that every route the
server registers is here and nothing else is, and a schemathesis run checks that the
server's answers conform to it.
"""

from __future__ import annotations

import functools

from kvstore.dtypes import DType
from kvstore.hints import MAX_LABEL_CHARS
from kvstore.identity import MAX_NAME_CHARS, Kind
from kvstore.units import MAX_DURATION_S

MAX_TOKENS = 1 << 20  # server.admin.lookup.MAX_LOOKUP_TOKENS
# server.admin.lookup_batch's limits
MAX_PREFIXES, MAX_BLOCKS_PER_PREFIX, MAX_OBJECTS_PER_BLOCK = 64, MAX_TOKENS // 16, 1024
INT, NUM, STR, BOOL = {"type": "integer"}, {"type": "number"}, {"type": "string"}, {"type": "boolean"}


def _nullable(schema: dict) -> dict:
    return {**schema, "nullable": True}


def _obj(properties: dict, required=None, extra=False, **more) -> dict:
    schema = {"type": "object", "properties": properties, "required": list(properties) if required is None else required}
    if not schema["required"]:
        del schema["required"]
    if extra is not True:
        schema["additionalProperties"] = extra
    return {**schema, **more}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


# kvstore.identity.NAME_RULE: no control characters, line or paragraph separators
NAME = {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS,
        "pattern": "^[^\\u0000-\\u001f\\u007f-\\u009f\\u2028\\u2029]*$"}
LABEL = {"type": "string", "minLength": 1, "maxLength": MAX_LABEL_CHARS}
KIND = {"type": "string", "enum": [k.value for k in Kind]}
DTYPE = {"type": "string", "enum": [d.value for d in DType]}
BLOCK_HASH = {"oneOf": [{"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 64) - 1},
                        {"type": "string", "pattern": "^([0-9a-fA-F]{2}){1,64}$"}],
              "description": "a 64-bit integer, or 1..64 bytes in hex (vLLM's sha256 digests: 32)"}
TIER_KEYS = ("capacity_bytes", "used_bytes", "objects", "pinned", "num_puts", "num_dedup_puts", "num_gets",
             "num_hits", "num_misses", "num_evictions", "num_expired", "num_deletes", "num_checksum_failures",
             "bytes_in", "bytes_out")

SCHEMAS = {
    "Error": _obj({"error": _obj({"code": STR, "message": STR}, extra=True)}, extra=True),
    "TierStats": _obj({k: {"type": "integer", "minimum": 0} for k in TIER_KEYS}, extra=INT,
                      description="num_gets are the reads, num_puts the writes; used_bytes counts whole "
                                  "allocation units (allocation_unit_bytes, in the node-wide tiers: NVMe "
                                  "objects take whole 4 KiB pages; host objects up to 3.5 KiB a slot of their "
                                  "size class, a multiple of 64 B, larger ones whole 4 KiB pages; "
                                  "slab_free_bytes: free slots, only for objects of their class)"),
    "Stats": _obj({
        "version": STR, "pid": INT, "uptime_s": NUM, "ready": BOOL, "clients": INT, "leases": INT,
        "ops_per_s": {"type": "number", "minimum": 0}, "socket": STR, "host_bandwidth_bytes_s": NUM,
        "gpu": _obj({"enabled": BOOL, "available": BOOL, "reason": STR, "device": INT}, extra=INT,
                    description="the GPU tier: what the start-up probe found (CUDA present, or why not); "
                                "capacity_bytes and used_bytes when [gpu] enabled"),
        "tiers": {"type": "object", "additionalProperties": _ref("TierStats")},
        "namespaces": {"type": "object", "additionalProperties": _obj(
            {"tiers": {"type": "object", "additionalProperties": _ref("TierStats")},
             "pages": {"type": "string", "enum": ["hugetlb", "thp", "off"],
                       "description": "what backs the namespace's arena: reserved huge pages, transparent "
                                      "huge pages, or 4 KiB pages ([host] huge_pages)"}})},
    }, extra=True),
    "Descriptor": _obj({"namespace": STR, "model": STR, "model_revision": STR, "kind": KIND, "dtype": DTYPE,
                        "layout": STR, "shard": STR, "chunk_tokens": INT}, extra=True),
    "Hints": _obj({"ttl_s": _nullable(NUM), "priority": INT, "session_id": _nullable(STR),
                   "branch_id": _nullable(STR), "next_access_s": _nullable(NUM),
                   "recompute_cost_ms": _nullable(NUM), "pin": BOOL,
                   "route": {"type": "object", "nullable": True, "additionalProperties": True,
                             "description": "the engine's names for the object's blocks (block_hashes, "
                                            "parent_block_hash, token_ids, ...; hashes as hex), as its "
                                            "KV events publish them"}}, extra=True),
    "Object": _obj({
        "object_id": STR, "namespace": STR, "tier": {**STR, "description": "the fastest tier holding it"},
        "tiers": {"type": "array", "items": {"type": "string", "enum": ["host", "nvme"]},
                  "description": "every tier of this node that holds a copy"},
        "size": INT, "checksum": STR,
        "descriptor": _ref("Descriptor"), "hints": _ref("Hints"), "created_at": NUM,
        "expires_in_s": _nullable(NUM), "pinned": BOOL, "pinned_for_s": _nullable(NUM),
        "num_hits": INT, "readers": INT,
    }, extra=True),
    "ObjectPage": _obj({"objects": {"type": "array", "items": _ref("Object")}, "next_cursor": _nullable(STR)},
                       extra=True),
    "Deleted": _obj({"deleted": BOOL, "namespace": STR, "object_id": STR}, extra=True),
    "PinRequest": _obj({"ttl_s": {"type": "number", "minimum": 0, "exclusiveMinimum": True,
                                  "maximum": MAX_DURATION_S, "nullable": True}},
                       required=[]),
    "Filter": _obj({"model": NAME, "model_revision": NAME, "kind": KIND, "dtype": DTYPE,
                    "session_id": LABEL, "branch_id": LABEL},
                   required=[]),
    "EvictRequest": _obj(
        {"namespace": NAME, "tier": {"type": "string", "enum": ["host"]},
         "bytes": {"type": "integer", "minimum": 1}, "filter": _ref("Filter")},
        required=[],
        description="bytes frees that much room in one namespace (so it needs namespace); filter evicts "
                    "every matching object; with both, at most bytes of matching objects",
        anyOf=[{"required": ["namespace", "bytes"]}, {"required": ["filter"], "not": {"required": ["bytes"]}}]),
    "EvictResult": _obj({
        "tier": STR, "requested_bytes": _nullable(INT), "num_evicted": INT, "evicted_bytes": INT,
        "evicted": {"type": "array", "items": _obj({"namespace": STR, "object_id": STR, "size": INT})},
        "truncated": BOOL,
    }, extra=True),
    "LookupRequest": _obj({
        "tokens": {"type": "array", "maxItems": MAX_TOKENS,
                   "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}},
        "descriptor": _obj({"namespace": NAME, "model": NAME, "model_revision": NAME, "kind": KIND,
                            "dtype": DTYPE, "layout": STR, "shard": {"type": "string", "pattern": r"^\d+/\d+$"},
                            "chunk_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS}},
                           required=["namespace", "model", "model_revision"]),
        "extra_keys": {"type": "array", "maxItems": 64, "items": STR},
    }, required=["tokens", "descriptor"]),
    "LookupResult": _obj({
        "namespace": STR, "num_chunks": INT, "chunk_tokens": INT, "hits": INT, "hit_tokens": INT,
        "hit_bytes": INT, "est_load_s": NUM,
        "hit_chunks_per_tier": {"type": "object", "additionalProperties": INT},
        "tiers": {"type": "array", "items": _nullable(STR)},
        "object_ids": {"type": "array", "items": STR},
    }, extra=True),
    "LookupBatchRequest": _obj({
        "namespace": NAME,
        "prefixes": {"type": "array", "minItems": 1, "maxItems": MAX_PREFIXES, "items": {"oneOf": [
            _obj({"block_hashes": {"type": "array", "maxItems": MAX_BLOCKS_PER_PREFIX, "items": BLOCK_HASH},
                  "objects_per_block": {"type": "integer", "minimum": 1, "maximum": MAX_OBJECTS_PER_BLOCK,
                                        "description": "a block is held only when at least this many objects "
                                                       "name it (TP ranks x KV cache groups; default 1)"}},
                 required=["block_hashes"]),
            _ref("LookupRequest"),
        ]}, "description": "block_hashes: the engine's hashes, as this node's KV events publish them "
                           "(needs [events] enabled); tokens + descriptor: as /v1/lookup, with the "
                           "descriptor's namespace the call's. At most 131072 blocks (hashes, or "
                           "chunks of tokens) in all"},
    }, description="a block is held when at least objects_per_block objects name it and every "
                   "object naming it is held in some tier; its tier is the slowest of theirs"),
    "LookupBatchResult": _obj({
        "namespace": STR,
        "results": {"type": "array", "description": "one per prefix, in the order asked", "items": _obj({
            "unit": {"type": "string", "enum": ["block", "chunk"],
                     "description": "block: an engine block (block_hashes); chunk: a kvstore chunk (tokens)"},
            "num_blocks": INT, "hit_blocks": {**INT, "description": "the longest held prefix"},
            "hit_tokens": INT, "hit_bytes": INT,
            "est_load_s": {**NUM, "description": "to load the held prefix's objects, as /v1/lookup estimates"},
            "up_to_tier": _obj({tier: _obj({"blocks": INT, "tokens": INT}) for tier in ("host", "nvme", "remote")},
                               description="per tier, the leading blocks and tokens that load from it or "
                                           "a faster one (host, then nvme, then remote)"),
            "tiers": {"type": "array", "items": {"type": "string", "enum": ["host", "nvme", "remote"],
                                                 "nullable": True},
                      "description": "per block the tier it loads from (null: not held)"},
        }, extra=True)},
    }, extra=True),
    "Node": _obj({
        "node_id": STR, "hostname": STR, "admin_url": _nullable(STR), "version": STR, "ready": BOOL,
        "uptime_s": NUM, "namespaces": {"type": "array", "items": STR},
        "tiers": {"type": "object", "additionalProperties": _obj(
            {"capacity_bytes": INT, "used_bytes": INT, "objects": INT}, extra=True)},
        "host_bandwidth_bytes_s": NUM,
    }, extra=True),
    "Pool": _obj({
        "backend": {"type": "string", "enum": ["mooncake"]},
        "master": {**STR, "description": "the mooncake_master RPC address"}, "metadata_server": STR,
        "protocol": STR, "tenant_id": STR, "key_prefix": STR, "replicas": INT, "remote_write": STR,
        "write_through_backlog": {**INT, "description": "commits whose write_through copy has not gone yet "
                                                        "(they wait while clients are busy: write_through_yield_ms)"},
        "up": {**BOOL, "description": "this daemon's client is set up and its last call reached the master"},
        "last_error": _nullable(STR),
        "held": _nullable(_obj({"allocated_bytes": INT, "capacity_bytes": INT, "keys": INT,
                                "soft_pinned_keys": INT, "clients": INT}, required=[], extra=True,
                               description="the whole pool as its master counts it (every client and "
                                           "tenant), from remote.mooncake.master_metrics_url")),
        "held_error": _nullable({**STR, "description": "why held is null"}),
        "counters": {"type": "object", "additionalProperties": INT,
                     "description": "this daemon's reads, writes and pool calls (as /v1/stats reports them)"},
    }, required=["backend", "master", "up", "counters"], extra=True),
    "Cluster": _obj({"self": STR, "nodes": {"type": "array", "items": _ref("Node")},
                     "members": {"type": "array", "items": _obj(
                         {"node_id": STR, "peer_address": STR, "self": BOOL, "down": BOOL}, extra=True)},
                     "replicas": INT, "remote_write": STR, "rehome": _nullable({"type": "object"}),
                     "auth_failures": _obj({"client": INT, "server": INT}, extra=True,
                                           description="peer handshakes that failed for a wrong cluster secret"),
                     "pool": _ref("Pool")},
                    required=["self", "nodes"], extra=True,
                    description="members, replicas, remote_write, rehome and auth_failures are there when "
                                "cluster.enabled; pool when remote.backend is mooncake"),
}

_ERRORS = {400: "invalid request", 401: "missing or wrong bearer token", 404: "no such object or namespace",
           409: "the id is stored in several namespaces; add ?namespace="}


def _json(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _op(op_id: str, summary: str, ok: str | dict, errors=(401,), params=(), body=None, body_required=True,
        extra=None, links=None) -> dict:
    responses = {"200": _json(_ref(ok)) if isinstance(ok, str) else ok}
    if links:
        responses["200"]["links"] = {target: {"operationId": target, "parameters": {"id": src, "namespace": ns}}
                                     for target, (src, ns) in links.items()}
    responses.update({str(code): _json(_ref("Error"), _ERRORS[code]) for code in errors})
    responses.update(extra or {})
    op = {"operationId": op_id, "summary": summary, "responses": responses}
    if params:
        op["parameters"] = list(params)
    if body:
        op["requestBody"] = {"required": body_required, "content": {"application/json": {"schema": _ref(body)}}}
    return op


def _query(name: str, schema: dict, description: str) -> dict:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


ID = {"name": "id", "in": "path", "required": True, "description": "object id, 64 hex characters",
      "schema": {"type": "string", "pattern": "^[0-9a-fA-F]{64}$"}}
NAMESPACE = _query("namespace", NAME,
                   "namespace holding the object (default: search every namespace)")
ONE = (ID, NAMESPACE)
ONE_ERRORS = (400, 401, 404, 409)
# Links let a client (and schemathesis' stateful phase) go from a listing to one object.
_FIRST = ("$response.body#/objects/0/object_id", "$response.body#/objects/0/namespace")
_SAME = ("$request.path.id", "$response.body#/namespace")
FROM_LIST = {op: _FIRST for op in ("getObject", "deleteObject", "pinObject", "unpinObject")}
FROM_ONE = {op: _SAME for op in ("getObject", "deleteObject", "pinObject", "unpinObject")}


@functools.cache
def openapi_document() -> dict:
    ready = {"type": "object", "properties": {"ready": BOOL}, "required": ["ready"]}
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvstore admin API", "version": "1",
                 "description": "Operate one kvstore node. Every route except /healthz needs "
                                "`Authorization: Bearer <token>` (the token is in <data_dir>/admin.token)."},
        "security": [{"bearer": []}],
        "paths": {
            "/healthz": {"get": {**_op("healthz", "liveness (no token needed)",
                                       _json({"type": "object", "properties": {"status": {"type": "string"}},
                                              "required": ["status"]}), errors=()), "security": []}},
            "/readyz": {"get": _op("readyz", "ready to serve (after recovery)", _json(ready),
                                   extra={"503": _json(ready, "not ready yet")})},
            "/v1/stats": {"get": _op("stats", "per tier usage and counters, ops/s, leases, clients, uptime", "Stats")},
            "/v1/objects": {"get": _op("listObjects", "paged listing, ordered by namespace then id", "ObjectPage",
                                       errors=(400, 401), links=FROM_LIST, params=(
                NAMESPACE | {"description": "only this namespace"},
                _query("model", NAME, "only this model"),
                _query("kind", KIND, "only this state kind"),
                _query("tier", {"type": "string", "enum": ["host", "nvme"]},
                       "only objects with a copy in this tier (nvme: where the NVMe tier is enabled)"),
                _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000}, "page size (default 100)"),
                _query("cursor", {"type": "string", "minLength": 1}, "next_cursor of the previous page"),
            ))},
            "/v1/objects/{id}": {
                "get": _op("getObject", "one object's metadata", "Object", ONE_ERRORS, ONE, links=FROM_ONE),
                "delete": _op("deleteObject", "delete an object (leased bytes stay until released)",
                              "Deleted", ONE_ERRORS, ONE),
            },
            "/v1/objects/{id}/pin": {
                "post": _op("pinObject", "keep this node's copy resident for ttl_s seconds, or until unpinned "
                            "(an object only on NVMe is promoted into host memory first)",
                            "Object", ONE_ERRORS, ONE, body="PinRequest", body_required=False, links=FROM_ONE),
                "delete": _op("unpinObject", "unpin this node's copy", "Object", ONE_ERRORS, ONE),
            },
            "/v1/evict": {"post": _op("evict", "evict by bytes or filter; leased and pinned objects stay",
                                      "EvictResult", (400, 401, 404), body="EvictRequest")},
            "/v1/lookup": {"post": _op("lookup", "hit chunks per tier and estimated load time for a prompt",
                                       "LookupResult", (400, 401), body="LookupRequest")},
            "/v1/lookup/batch": {"post": _op(
                "lookupBatch", "per candidate prefix (by block hashes or token ids): the leading blocks "
                "and tokens held per tier, the longest held prefix and its estimated load time",
                "LookupBatchResult", (400, 401), body="LookupBatchRequest",
                extra={"409": _json(_ref("Error"), "lookup by block_hashes needs [events] enabled = true")})},
            "/v1/cluster": {"get": _op("cluster", "this node, and the cluster members it sees when clustered", "Cluster")},
            "/metrics": {"get": _op("metrics", "Prometheus text format", {
                "description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}})},
            "/openapi.json": {"get": _op("openapi", "this document", _json({"type": "object"}))},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": SCHEMAS,
        },
    }
