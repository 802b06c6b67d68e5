"""Admin handlers over stored objects: paged listing, show, delete, pin and evict.

Listing pages are ordered by (namespace, object id) and the cursor is the last key a page
returned, so paging while puts go on never repeats an object and never skips one that
existed when paging began (an object put behind the cursor shows up in no later page).
Object ids are unique per namespace only: a call without ?namespace= searches them all.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from aiohttp import web

from kvstore.dtypes import DType
from kvstore.errors import InvalidArgument, NotFound
from kvstore.fields import pin_ttl
from kvstore.hints import MAX_LABEL_CHARS
from kvstore.identity import Kind, check_name
from kvstore.server.admin.http import (
    check_number,
    check_str,
    json_body,
    json_response,
    parse_object_id,
    query_int,
    query_namespace,
    query_str,
)
from kvstore.server.admin.listing import check_tier, doc, find_object, list_page
from kvstore.server.admin.parts import GROUPS, HOST, INDEX, NVME
from kvstore.server.later import resolve
from kvstore.server.tiering.objects import ObjectEntry

DEFAULT_PAGE = 100
MAX_PAGE = 1000
# An eviction answer lists at most this many objects (its counts are always complete).
MAX_EVICT_REPORT = 10_000
FILTER_FIELDS = ("model", "model_revision", "kind", "dtype", "session_id", "branch_id")


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
            if value is None:
                continue
            if name in ("model", "model_revision"):  # a descriptor's names: none can hold what the rule refuses
                check_name(f"filter field {name}", value)
            elif not isinstance(value, str) or not 0 < len(value) <= MAX_LABEL_CHARS:
                raise InvalidArgument(f"filter field {name} must be a string of 1..{MAX_LABEL_CHARS} characters")
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


async def list_objects(request: web.Request) -> web.Response:
    host, nvme = request.app[HOST], request.app[NVME]
    tier = query_str(request, "tier")
    check_tier(nvme, tier)
    flt = ObjectFilter.parse({"model": query_str(request, "model"), "kind": query_str(request, "kind")})
    limit = query_int(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    cursor = query_str(request, "cursor")
    views, last = await list_page(host, nvme, query_namespace(request), flt,
                                  decode_cursor(cursor) if cursor is not None else None, limit, tier)
    now = host.clock()
    return json_response({"objects": [doc(nvme, v, now) for v in views],
                          "next_cursor": encode_cursor(last) if last is not None else None})


async def _target(request: web.Request):
    """The object the path names: its host entry, else its NVMe meta (find_object)."""
    oid = parse_object_id(request.match_info["id"])
    return await find_object(request.app[HOST], request.app[NVME], oid, query_namespace(request))


def _doc(request: web.Request, view) -> dict:
    return doc(request.app[NVME], view, request.app[HOST].clock())


async def show_object(request: web.Request) -> web.Response:
    view = await _target(request)
    document = _doc(request, view)
    document.update(await _groups_doc(request.app[HOST], request.app[GROUPS], view.namespace, view.object_id))
    return json_response(document)


async def _groups_doc(host, groups, namespace: str, oid) -> dict:
    """The store groups naming the object (those whose manifest is in host memory here), each
    complete or not; for a manifest, its members too."""
    ns = host.namespaces.get(namespace)
    index = ns.groups if ns is not None else None
    gids = index.groups(oid) if index is not None else []
    out: dict = {}
    if index is not None and oid in index.members:
        out["members"] = [member.hex for member in index.members[oid]]
        gids = [oid, *gids]
    if gids:
        found = await resolve(groups.lookup_groups(namespace, [list(index.members[g]) for g in gids], None))
        complete = dict(zip(gids, found.complete))
        if "members" in out:
            out["complete"] = bool(complete.pop(oid))
        out["groups"] = [{"group": g.hex, "complete": bool(ok)} for g, ok in complete.items()]
    else:
        out["groups"] = []
    return out


async def delete_object(request: web.Request) -> web.Response:
    view = await _target(request)
    # this node's admin: its copies (NVMe ones are deleted in the I/O pool)
    await resolve(request.app[INDEX].delete(view.namespace, [view.object_id], scope="node"))
    return json_response({"deleted": True, "namespace": view.namespace, "object_id": view.object_id.hex})


async def pin_object(request: web.Request) -> web.Response:
    """Pin this node's host copy. An object only on NVMe is promoted into host memory first
    (a pin keeps an object resident, and only host copies are ever evicted)."""
    body = await json_body(request, {"ttl_s"}, optional=True, nullable=frozenset({"ttl_s"}))
    ttl_s = pin_ttl(body.get("ttl_s"))  # the wire's rule: (0, a century], or null
    view = await _target(request)
    if not isinstance(view, ObjectEntry):
        view = await request.app[NVME].promote(view.namespace, view.object_id)
        if view is None:  # deleted meanwhile, or its NVMe copy failed its checksum (dropped, counted)
            raise NotFound(f"object {request.match_info['id']} left NVMe before it could be pinned")
    request.app[INDEX].pin(view.namespace, [view.object_id], ttl_s, scope="node")  # like delete: this node's copy
    return json_response(_doc(request, view))


async def unpin_object(request: web.Request) -> web.Response:
    view = await _target(request)
    if isinstance(view, ObjectEntry):  # an NVMe-only copy is never pinned: nothing to undo
        request.app[INDEX].unpin(view.namespace, [view.object_id], scope="node")
    return json_response(_doc(request, view))


async def evict(request: web.Request) -> web.Response:
    """Free `bytes` in one namespace (policy order), or evict what `filter` matches, or both.

    Leased and pinned objects are never evicted; the answer lists what was."""
    body = await json_body(request, {"namespace", "tier", "bytes", "filter"})
    host, index = request.app[HOST], request.app[INDEX]
    namespace = body.get("namespace")
    if namespace is not None:
        check_name("namespace", namespace)
    tier = check_str(body, "tier") or "host"
    if tier == "nvme":
        raise InvalidArgument("evict frees host memory only; NVMe makes its own room (delete an NVMe copy "
                              "with DELETE /v1/objects/{id}, `kvstore objects rm`)")
    check_tier(request.app[NVME], tier)
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
    if namespace is not None and namespace not in host.namespaces:
        raise NotFound(f"no namespace {namespace!r} on this node")
    evicted = []
    for name in [namespace] if namespace is not None else sorted(host.namespaces):
        evicted += await resolve(index.evict(name, num_bytes, flt.matches))  # written down first
    return json_response({
        "tier": tier,
        "requested_bytes": num_bytes,
        "num_evicted": len(evicted),
        "evicted_bytes": sum(e.size for e in evicted),
        "evicted": [{"namespace": e.namespace, "object_id": e.object_id.hex, "size": e.size}
                    for e in evicted[:MAX_EVICT_REPORT]],
        "truncated": len(evicted) > MAX_EVICT_REPORT,
    })
