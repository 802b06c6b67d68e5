"""Admin handlers over stored objects: paged listing, show, delete, pin and evict.

Listing pages are ordered by (namespace, object id) and the cursor is the last key a page
returned, so paging while puts go on never repeats an object and never skips one that
existed when paging began (an object put behind the cursor shows up in no later page).
Object ids are unique per namespace only: a call without ?namespace= searches them all.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import heapq
import inspect
import json
import math
from dataclasses import dataclass

from aiohttp import web

from kvstore.dtypes import DType
from kvstore.errors import InvalidArgument, NotFound
from kvstore.hints import MAX_LABEL_CHARS
from kvstore.identity import MAX_NAME_CHARS, Kind
from server.admin_http import (
    ADMIN,
    Conflict,
    check_number,
    check_str,
    json_body,
    json_response,
    parse_object_id,
    query_int,
    query_str,
)

KNOWN_TIERS = ("host",)
DEFAULT_PAGE = 100
MAX_PAGE = 1000
# An eviction answer lists at most this many objects (its counts are always complete).
MAX_EVICT_REPORT = 10_000
FILTER_FIELDS = ("model", "model_revision", "kind", "dtype", "session_id", "branch_id")


def _manager(request: web.Request):
    return request.app[ADMIN].daemon.manager


def object_doc(entry, now: float) -> dict:
    pinned = entry.is_pinned(now)
    return {
        "object_id": entry.object_id.hex,
        "namespace": entry.namespace,
        "tier": "host",
        "size": entry.size,
        "checksum": entry.checksum.hex(),
        "descriptor": entry.descriptor.to_wire(),
        "hints": dataclasses.asdict(entry.hints),
        "created_at": entry.created_at,
        "expires_in_s": None if math.isinf(entry.expires_at) else max(0.0, entry.expires_at - now),
        "pinned": pinned,
        "pinned_for_s": max(0.0, entry.pinned_until - now) if pinned and math.isfinite(entry.pinned_until) else None,
        "num_hits": entry.num_hits,
        "readers": entry.readers,
    }


@dataclass(frozen=True, slots=True)
class ObjectFilter:
    """Which objects a listing or an eviction covers; None matches anything."""

    model: str | None = None
    model_revision: str | None = None
    kind: Kind | None = None
    dtype: DType | None = None
    session_id: str | None = None
    branch_id: str | None = None

    @classmethod
    def parse(cls, data: dict) -> ObjectFilter:
        values = {name: data.get(name) for name in FILTER_FIELDS}
        for name, value in values.items():
            longest = MAX_LABEL_CHARS if name in ("session_id", "branch_id") else MAX_NAME_CHARS
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= longest):
                raise InvalidArgument(f"filter field {name} must be a string of 1..{longest} characters")
        if values["kind"] is not None:
            values["kind"] = Kind.parse(values["kind"])
        if values["dtype"] is not None:
            values["dtype"] = DType.parse(values["dtype"])
        return cls(**values)

    def matches(self, entry) -> bool:
        d, h = entry.descriptor, entry.hints
        return ((self.model is None or d.model == self.model)
                and (self.model_revision is None or d.model_revision == self.model_revision)
                and (self.kind is None or d.kind == self.kind)
                and (self.dtype is None or d.dtype == self.dtype)
                and (self.session_id is None or h.session_id == self.session_id)
                and (self.branch_id is None or h.branch_id == self.branch_id))


def encode_cursor(key: tuple[str, bytes]) -> str:
    raw = json.dumps([key[0], key[1].hex()]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(text: str) -> tuple[str, bytes]:
    try:
        name, hex_id = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        if not isinstance(name, str) or not isinstance(hex_id, str):
            raise ValueError
        return name, parse_object_id(hex_id).digest
    except (ValueError, TypeError, binascii.Error, InvalidArgument, RecursionError):
        raise InvalidArgument("cursor is not one this server handed out; list again without it") from None


def list_page(manager, namespace: str | None, flt: ObjectFilter, after, limit: int):
    """Up to `limit` live entries after key `after`, and the key to continue from (None: done)."""
    now = manager.clock()

    def candidates():
        for name, ns in manager.namespaces.items():
            if (namespace is not None and name != namespace) or (after is not None and name < after[0]):
                continue
            for oid, entry in ns.objects.items():
                key = (name, oid.digest)
                if (after is None or key > after) and entry.expires_at > now and flt.matches(entry):
                    yield key, entry

    page = heapq.nsmallest(limit + 1, candidates(), key=lambda item: item[0])
    more = len(page) > limit
    page = page[:limit]
    return [entry for _, entry in page], (page[-1][0] if more else None)


async def list_objects(request: web.Request) -> web.Response:
    tier = query_str(request, "tier")
    if tier is not None and tier not in KNOWN_TIERS:
        raise InvalidArgument(f"unknown tier {tier!r}; this node has: {', '.join(KNOWN_TIERS)}")
    flt = ObjectFilter.parse({"model": query_str(request, "model"), "kind": query_str(request, "kind")})
    limit = query_int(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    cursor = query_str(request, "cursor")
    manager = _manager(request)
    entries, last = list_page(manager, query_str(request, "namespace"), flt,
                              decode_cursor(cursor) if cursor is not None else None, limit)
    now = manager.clock()
    return json_response({"objects": [object_doc(e, now) for e in entries],
                          "next_cursor": encode_cursor(last) if last is not None else None})


def find_object(manager, oid, namespace: str | None):
    """The one live entry with this id (in `namespace`, or in whichever namespace holds it)."""
    now = manager.clock()
    if namespace is not None:
        if namespace not in manager.namespaces:
            raise NotFound(f"no namespace {namespace!r} on this node")
        spaces = [manager.namespaces[namespace]]
    else:
        spaces = list(manager.namespaces.values())
    found = [ns.objects[oid] for ns in spaces if oid in ns.objects and ns.objects[oid].expires_at > now]
    if not found:
        where = f"namespace {namespace!r}" if namespace is not None else "any namespace"
        raise NotFound(f"no object {oid.hex} in {where}")
    if len(found) > 1:
        names = ", ".join(sorted(e.namespace for e in found))
        raise Conflict(f"object {oid.hex} is stored in several namespaces ({names}); add ?namespace=")
    return found[0]


def _target(request: web.Request):
    manager = _manager(request)
    oid = parse_object_id(request.match_info["id"])
    return manager, find_object(manager, oid, query_str(request, "namespace"))


async def show_object(request: web.Request) -> web.Response:
    manager, entry = _target(request)
    return json_response(object_doc(entry, manager.clock()))


async def delete_object(request: web.Request) -> web.Response:
    manager, entry = _target(request)
    deleted = manager.delete(entry.namespace, [entry.object_id], scope="node")  # this node's admin: its copies
    if inspect.isawaitable(deleted):  # NVMe copies are deleted in the I/O pool
        await deleted
    return json_response({"deleted": True, "namespace": entry.namespace, "object_id": entry.object_id.hex})


async def pin_object(request: web.Request) -> web.Response:
    body = await json_body(request, {"ttl_s"}, optional=True, nullable=frozenset({"ttl_s"}))
    ttl_s = check_number(body, "ttl_s")
    if ttl_s == 0:
        raise InvalidArgument("ttl_s must be > 0, or null to pin until unpinned")
    manager, entry = _target(request)
    manager.pin(entry.namespace, [entry.object_id], ttl_s, scope="node")  # like delete: this node's copy
    return json_response(object_doc(entry, manager.clock()))


async def unpin_object(request: web.Request) -> web.Response:
    manager, entry = _target(request)
    manager.unpin(entry.namespace, [entry.object_id], scope="node")
    return json_response(object_doc(entry, manager.clock()))


async def evict(request: web.Request) -> web.Response:
    """Free `bytes` in one namespace (policy order), or evict what `filter` matches, or both.

    Leased and pinned objects are never evicted; the answer lists what was."""
    body = await json_body(request, {"namespace", "tier", "bytes", "filter"})
    namespace = check_str(body, "namespace")
    tier = check_str(body, "tier") or "host"
    if tier not in KNOWN_TIERS:
        raise InvalidArgument(f"unknown tier {tier!r}; this node has: {', '.join(KNOWN_TIERS)}")
    num_bytes = check_number(body, "bytes", integer=True, minimum=1)
    raw_filter = body.get("filter")
    if num_bytes is None and raw_filter is None:
        raise InvalidArgument("give bytes (how much to free), a filter (what to evict), or both")
    if raw_filter is not None and not isinstance(raw_filter, dict):
        raise InvalidArgument("filter must be an object")
    if raw_filter is not None and (set(raw_filter) - set(FILTER_FIELDS) or None in raw_filter.values()):
        raise InvalidArgument(f"filter fields are {', '.join(FILTER_FIELDS)}, each a non-empty string")
    flt = ObjectFilter.parse(raw_filter or {})
    if num_bytes is not None and namespace is None:
        raise InvalidArgument("bytes frees room in one namespace's arena; give namespace too")
    manager = _manager(request)
    if namespace is not None and namespace not in manager.namespaces:
        raise NotFound(f"no namespace {namespace!r} on this node")
    evicted = []
    for name in [namespace] if namespace is not None else sorted(manager.namespaces):
        evicted += manager.evict(name, num_bytes, flt.matches)
    return json_response({
        "tier": tier,
        "requested_bytes": num_bytes,
        "num_evicted": len(evicted),
        "evicted_bytes": sum(e.size for e in evicted),
        "evicted": [{"namespace": e.namespace, "object_id": e.object_id.hex, "size": e.size}
                    for e in evicted[:MAX_EVICT_REPORT]],
        "truncated": len(evicted) > MAX_EVICT_REPORT,
    })
