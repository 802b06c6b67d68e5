"""HTTP plumbing shared by the admin handlers: JSON replies, errors, request parsing.

Errors travel as `{"error": {"code", "message"}}`; the status comes from the error class,
so a handler only raises the kvstore error that says what went wrong.
"""

from __future__ import annotations

import json
import math
import re

from aiohttp import web

from kvstore.errors import (
    CapacityError,
    InvalidArgument,
    KVStoreError,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    RequestError,
    ServiceError,
)
from kvstore.identity import ObjectId, check_name

# A lookup of 1M token ids is about 8 MB of JSON; nothing else comes close.
MAX_BODY_BYTES = 16 << 20
ADMIN = web.AppKey("admin", object)  # the app's AdminServer, for handlers
_HEX_ID = re.compile(r"[0-9a-fA-F]{64}")


class Unauthorized(RequestError):
    """Missing or wrong bearer token."""

    code = "unauthorized"


class Conflict(RequestError):
    """The request names more than one thing (an id stored in several namespaces)."""

    code = "conflict"


class NotEnabled(RequestError):
    """The request needs a part of the daemon its configuration leaves off."""

    code = "not_enabled"


# First match wins: subclasses before their bases.
_STATUS_BY_ERROR = (
    (Unauthorized, 401),
    (PermissionDenied, 403),
    (NotFound, 404),
    (Conflict, 409),
    (NotEnabled, 409),
    (LimitExceeded, 429),
    (RequestError, 400),
    (CapacityError, 507),
    (ServiceError, 503),
)

# Codes for errors aiohttp raises itself (no route, wrong method, body too large).
HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}


def http_status(exc: KVStoreError) -> int:
    for cls, status in _STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return status
    return 500


def json_response(data, status: int = 200, headers=None) -> web.Response:
    # allow_nan=False: an inf or nan in a reply is a bug to see, not invalid JSON to ship.
    return web.json_response(data, status=status, headers=headers,
                             dumps=lambda d: json.dumps(d, allow_nan=False))


def error_response(status: int, code: str, message: str, headers=None) -> web.Response:
    return json_response({"error": {"code": code, "message": message}}, status, headers)


async def json_body(request: web.Request, allowed: set[str], optional: bool = False,
                    nullable: frozenset[str] = frozenset()) -> dict:
    """The request's JSON object; unknown fields are refused so a typo never goes unnoticed,
    and so is null for a field that is not `nullable` (leave the field out instead)."""
    raw = await request.read()
    if not raw.strip():
        if optional:
            return {}
        raise InvalidArgument("this endpoint needs a JSON object body")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        raise InvalidArgument("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    unknown = set(body) - allowed
    if unknown:
        raise InvalidArgument(f"unknown field(s) {sorted(unknown)}; known: {sorted(allowed)}")
    nulls = sorted(k for k, v in body.items() if v is None and k not in nullable)
    if nulls:
        raise InvalidArgument(f"field(s) {nulls} must not be null; leave them out instead")
    return body


def _refuse_constant(name: str):
    raise InvalidArgument(f"{name} is not a JSON number")


def query_int(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= 18) or not lo <= int(text) <= hi:
        raise InvalidArgument(f"query parameter {name} must be an integer in {lo}..{hi}, got {text[:40]!r}")
    return int(text)


def query_str(request: web.Request, name: str) -> str | None:
    value = request.query.get(name)
    if value is not None and not value:
        raise InvalidArgument(f"query parameter {name} must not be empty")
    return value


def query_namespace(request: web.Request) -> str | None:
    """?namespace=: a name by kvstore.identity's rule (no control characters), or None."""
    value = request.query.get("namespace")
    return None if value is None else check_name("query parameter namespace", value)


def parse_object_id(text: str) -> ObjectId:
    if not _HEX_ID.fullmatch(text):
        raise InvalidArgument(f"object id must be 64 hex characters, got {text[:80]!r}")
    return ObjectId.from_hex(text)


def check_number(body: dict, name: str, integer: bool = False, minimum: float = 0):
    """body[name] as a finite number >= minimum (an integer if asked), or None when absent/null."""
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if (isinstance(value, bool) or not isinstance(value, kinds)
            or (isinstance(value, float) and not math.isfinite(value)) or value < minimum):
        kind = "an integer" if integer else "a number"
        raise InvalidArgument(f"{name} must be {kind} >= {minimum}, got {value!r}")
    return value


def check_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidArgument(f"{name} must be a non-empty string, got {value!r}")
    return value
