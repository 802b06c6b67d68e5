"""POST /v1/lookup: how much of one prompt's state this node holds, where, how fast it loads.

What a router asks of a node: the token ids and descriptor give kvstore's chunk ids
(`kvstore.identity.chunk_keys`), the tiers say which lead and where they are. The batched
form for many candidate prefixes, by token ids or by the engine's block hashes, is
server/admin/lookup_batch.py; it checks its inputs with the functions here.
"""

from __future__ import annotations

from aiohttp import web

from kvstore.errors import InvalidArgument
from kvstore.identity import StateDescriptor, chunk_keys
from kvstore.replies import LookupReply
from kvstore.server.admin.http import json_body, json_response
from kvstore.server.admin.parts import INDEX
from kvstore.server.later import resolve

# Router calls per lookup stay bounded: 1M tokens is 4096 chunks of 256.
MAX_LOOKUP_TOKENS = 1 << 20
MAX_EXTRA_KEYS = 64


def descriptor(data) -> StateDescriptor:
    if not isinstance(data, dict):
        raise InvalidArgument("descriptor must be an object with namespace, model and model_revision")
    for key, value in data.items():
        if key == "chunk_tokens":
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LOOKUP_TOKENS:
                raise InvalidArgument(f"descriptor.chunk_tokens must be an integer in 1..{MAX_LOOKUP_TOKENS}")
        elif not isinstance(value, str):
            raise InvalidArgument(f"descriptor.{key} must be a string")
    try:
        return StateDescriptor.from_wire(data)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad descriptor: {exc}") from None


def tokens(value) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_LOOKUP_TOKENS:
        raise InvalidArgument(f"tokens must be a list of at most {MAX_LOOKUP_TOKENS} token ids")
    if not all(type(t) is int and 0 <= t < 2**32 for t in value):
        raise InvalidArgument("token ids must be integers in 0..4294967295")
    return value


def extra_keys(value) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_EXTRA_KEYS or not all(isinstance(k, str) for k in value):
        raise InvalidArgument(f"extra_keys must be a list of at most {MAX_EXTRA_KEYS} strings")
    return value


async def lookup(request: web.Request) -> web.Response:
    """What a router asks: how much of this prompt's state is here, where, and how fast it loads."""
    body = await json_body(request, {"tokens", "descriptor", "extra_keys"})
    if "tokens" not in body or "descriptor" not in body:
        raise InvalidArgument("lookup needs tokens and descriptor")
    desc = descriptor(body["descriptor"])
    keys = chunk_keys(tokens(body["tokens"]), desc, extra_keys=extra_keys(body.get("extra_keys")))
    if keys:  # opens no namespace: one not opened since a restart still has its objects on NVMe
        # desc's only; misses are asked of peers
        found = await resolve(request.app[INDEX].lookup(desc.namespace, [k.object_id for k in keys], [desc] * len(keys)))
    else:
        found = LookupReply.nothing(0)
    per_tier: dict[str, int] = {}
    tiers = found.names()
    for tier in tiers[:found.hits]:
        per_tier[tier] = per_tier.get(tier, 0) + 1
    return json_response({
        "namespace": desc.namespace,
        "num_chunks": len(keys),
        "chunk_tokens": desc.chunk_tokens,
        "hits": found.hits,
        "hit_tokens": found.hits * desc.chunk_tokens,
        "hit_bytes": found.hit_bytes,
        "est_load_s": found.est_load_s,
        "hit_chunks_per_tier": per_tier,
        "tiers": list(tiers),
        "object_ids": [k.object_id.hex for k in keys],
    })
