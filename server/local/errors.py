"""An exception as the error map a reply carries: the one rule for every local op."""

from __future__ import annotations

import logging

from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.local")


def error_wire(exc: Exception, conn_id: int, op: str, quiet: bool = False) -> dict:
    """A KVStoreError's own map (logged at info unless `quiet`: the client's mistake or a
    refusal); any other exception is a bug, logged with its traceback and answered as code
    "internal"."""
    if isinstance(exc, KVStoreError):
        if not quiet:
            log.info("event=request_error conn=%d op=%s code=%s error=%r", conn_id, op[:32], exc.code, exc.message)
        return exc.to_wire()
    log.error("event=internal_error conn=%d op=%s", conn_id, op[:32], exc_info=exc)
    return {"code": "internal", "message": f"internal error: {type(exc).__name__}: {exc}"}
