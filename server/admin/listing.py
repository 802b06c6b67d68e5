"""What the admin API sees of stored objects: every tier of this node, one view per id.

An object held in host memory is shown from its host entry (hits, readers, pins); one held
only on NVMe (after a restart, or demoted) from the NVMe index. Both list, show and delete
alike, and `tiers` names every tier of this node that holds a copy. NVMe metadata is read
in the NVMe tier's thread pool, only for the objects a page or a lookup needs.

Keys are (namespace, raw id) and listings are ordered by them (see server/admin/objects.py
for the cursor). Runs on the event loop, like every admin handler.
"""

from __future__ import annotations

import heapq
import itertools
import math

from kvstore.errors import InvalidArgument, NotFound
from kvstore.identity import ObjectId
from kvstore.server.admin.http import Conflict
from kvstore.server.admin.parts import NvmeCopies
from kvstore.server.tiering.host import HostTier
from kvstore.server.tiering.objects import ObjectEntry, live_in


def tiers_of(nvme: NvmeCopies) -> tuple[str, ...]:
    """The tiers this node keeps objects in (what ?tier= may name)."""
    return ("host", *nvme.listed_as)


def check_tier(nvme: NvmeCopies, tier: str | None) -> None:
    if tier is not None and tier not in tiers_of(nvme):
        raise InvalidArgument(f"unknown tier {tier!r}; this node has: {', '.join(tiers_of(nvme))}")


def object_doc(nvme: NvmeCopies, entry, now: float) -> dict:
    """A host entry (also on NVMe when a verified copy is there)."""
    pinned = entry.is_pinned(now)
    return {
        "object_id": entry.object_id.hex,
        "namespace": entry.namespace,
        "tier": "host",
        "tiers": ["host", "nvme"] if nvme.holds(entry.namespace, entry.object_id) else ["host"],
        "size": entry.size,
        "checksum": entry.checksum.hex(),
        "descriptor": entry.descriptor.to_wire(),
        "hints": entry.hints.to_json(),
        "created_at": entry.created_at,
        "expires_in_s": None if math.isinf(entry.expires_at) else max(0.0, entry.expires_at - now),
        "pinned": pinned,
        "pinned_for_s": max(0.0, entry.pinned_until - now) if pinned and math.isfinite(entry.pinned_until) else None,
        "num_hits": entry.num_hits,
        "readers": entry.readers,
    }


def nvme_doc(meta) -> dict:
    """An object only on NVMe (tiers.nvme.NvmeMeta). It has no hits, readers or pin
    here, and no expiry yet: a ttl counts from its promotion into host memory."""
    return {
        "object_id": meta.object_id.hex,
        "namespace": meta.namespace,
        "tier": "nvme",
        "tiers": ["nvme"],
        "size": meta.size,
        "checksum": meta.checksum.hex(),
        "descriptor": meta.descriptor.to_wire(),
        "hints": meta.hints.to_json(),
        "created_at": meta.created_at,
        "expires_in_s": None,
        "pinned": False,
        "pinned_for_s": None,
        "num_hits": 0,
        "readers": 0,
    }


def doc(nvme: NvmeCopies, view, now: float) -> dict:
    """The document of a view find_object or list_page returned."""
    return object_doc(nvme, view, now) if isinstance(view, ObjectEntry) else nvme_doc(view)


def _in_order(items: list):
    """The items in order, sorted lazily: a page takes a few of a million NVMe keys."""
    heapq.heapify(items)
    while items:
        yield heapq.heappop(items)


async def list_page(host: HostTier, nvme: NvmeCopies, namespace: str | None, flt, after, limit: int,
                    tier: str | None = None):
    """Up to `limit` live objects after key `after` (views: host entries or NVMe metas), and
    the key to continue from (None: done). tier: only objects with a copy in that tier."""
    now = host.clock()

    def wanted(name: str) -> bool:
        return (namespace is None or name == namespace) and (after is None or name >= after[0])

    def host_candidates():
        if tier not in (None, "host", "nvme"):
            return
        for name, ns in host.namespaces.items():
            if not wanted(name):
                continue
            for oid, entry in ns.objects.items():
                key = (name, oid.digest)
                if ((after is None or key > after) and entry.is_live(now) and flt.matches(entry)
                        and (tier != "nvme" or nvme.holds(name, oid))):
                    yield key, entry

    # Host entries win (they know hits and pins); at most limit + 1 of them can be on a page.
    in_host = heapq.nsmallest(limit + 1, host_candidates(), key=lambda item: item[0])
    nvme_only = []
    if tier in (None, "nvme"):
        nvme_only = [(key, None) for key in nvme.keys()
                     if wanted(key[0]) and (after is None or key > after)
                     and live_in(host.namespaces.get(key[0]), ObjectId(key[1]), now) is None]
    merged = heapq.merge(in_host, _in_order(nvme_only), key=lambda item: item[0])
    page: list = []
    while len(page) <= limit:
        batch = list(itertools.islice(merged, limit + 1 - len(page)))
        if not batch:
            break
        metas = iter(await nvme.metas([key for key, view in batch if view is None]))
        for key, view in batch:
            if view is None:
                view = next(metas)
                if view is None or not flt.matches(view):
                    continue  # deleted meanwhile, or not what the filter asks for
            page.append((key, view))
    more = len(page) > limit
    page = page[:limit]
    return [view for _, view in page], (page[-1][0] if more else None)


async def find_object(host: HostTier, nvme: NvmeCopies, oid: ObjectId, namespace: str | None):
    """The one object with this id on this node (in `namespace`, or in whichever namespace
    holds it): its live host entry, else its NVMe meta. NotFound, or Conflict when several
    namespaces hold the id and none was named."""
    now = host.clock()
    if namespace is not None:
        on_nvme = nvme.holds(namespace, oid)
        if namespace not in host.namespaces and not on_nvme:
            raise NotFound(f"no object {oid.hex} in namespace {namespace!r} on this node")
        names = [namespace]
    else:
        names = {name for name, ns in host.namespaces.items() if oid in ns.objects}
        names |= {name for name, digest in nvme.keys() if digest == oid.digest}
        names = sorted(names)
    found = []
    nvme_keys = []
    for name in names:
        entry = live_in(host.namespaces.get(name), oid, now)
        if entry is not None:
            found.append(entry)
        elif nvme.holds(name, oid):
            nvme_keys.append((name, oid.digest))
    found += [meta for meta in await nvme.metas(nvme_keys) if meta is not None]
    if not found:
        where = f"namespace {namespace!r}" if namespace is not None else "any namespace"
        raise NotFound(f"no object {oid.hex} in {where} on this node (host or NVMe)")
    if len(found) > 1:
        spaces = ", ".join(sorted(view.namespace for view in found))
        raise Conflict(f"object {oid.hex} is stored in several namespaces ({spaces}); add ?namespace=")
    return found[0]
