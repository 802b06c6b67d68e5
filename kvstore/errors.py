"""The error hierarchy shared by daemon, client and tools.

Two branches, as in h11: `RequestError` means the caller sent something wrong (fix the
request), `ServiceError` means the daemon, a disk or a peer failed (retry, or recompute).
Every error has a stable wire `code`; `from_wire` turns a reply back into the same class.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""

    code = "internal"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_wire(self) -> dict:
        return {"code": self.code, "message": self.message}


class RequestError(KVStoreError):
    """The caller sent something wrong; retrying the same request fails the same way."""

    code = "bad_request"


class ProtocolError(RequestError):
    """A frame could not be decoded or broke the protocol's limits."""

    code = "protocol"


class InvalidArgument(RequestError):
    """A field had the wrong type, range or format (descriptor, id, dtype, layout...)."""

    code = "invalid_argument"


class RangeError(InvalidArgument):
    """Byte ranges do not fit the object (past its end, or more bytes than it has)."""

    code = "invalid_range"


class NotFound(RequestError):
    """The object, lease or namespace does not exist (or is not visible to this caller)."""

    code = "not_found"


class Conflict(RequestError):
    """The id is already stored with another size or descriptor. Ids are content
    addresses: one id is one state, so the stored object stays and this put is refused."""

    code = "conflict"


class PermissionDenied(RequestError):
    """The caller may not use this namespace or operation."""

    code = "permission_denied"


class LimitExceeded(RequestError):
    """A per-client limit (leases, in-flight bytes, batch length) was reached."""

    code = "limit_exceeded"


class ServiceError(KVStoreError):
    """The daemon, a disk or a peer failed; the engine should fall back to recompute."""

    code = "service"


class CapacityError(ServiceError):
    """No room: every byte of the tier is pinned, leased or reserved."""

    code = "capacity"


class ChecksumError(ServiceError):
    """Bytes did not match the checksum taken at put; they were dropped, never served."""

    code = "checksum"


class DaemonUnavailable(ServiceError):
    """The client cannot reach the daemon (not started, crashed, or socket gone).

    Every client call raises this when the connection is lost; call `reconnect()` or
    construct a new client once the daemon is back.
    """

    code = "unavailable"


class LeaseEnded(ServiceError):
    """A read lease was used after it ended: released, its connection closed, or past the
    daemon's limits.lease_ttl_s. The daemon is fine; get the object again."""

    code = "lease_ended"


_BY_CODE = {
    cls.code: cls
    for cls in (
        KVStoreError,
        RequestError,
        ProtocolError,
        InvalidArgument,
        RangeError,
        NotFound,
        Conflict,
        PermissionDenied,
        LimitExceeded,
        ServiceError,
        CapacityError,
        ChecksumError,
        DaemonUnavailable,
        LeaseEnded,
    )
}


def parse_enum(cls, value, what: str):
    """`cls(value)` for a str Enum, or InvalidArgument listing what is accepted."""
    try:
        return cls(value)
    except ValueError:
        known = ", ".join(member.value for member in cls)
        raise InvalidArgument(f"unknown {what} {value!r}; expected one of: {known}") from None


def from_wire(error: dict) -> KVStoreError:
    """Rebuild an error from a `{"code", "message"}` reply; unknown codes stay generic."""
    cls = _BY_CODE.get(str(error.get("code")), KVStoreError)
    return cls(str(error.get("message", "no message")))
