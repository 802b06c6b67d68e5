"""Sans-I/O framing for the local socket and peer control messages.

A frame is `u32_le(length) || msgpack(body)`; the body is a map:

    request: {"v": 1, "id": <u64>, "op": <str>, "a": {args}}      ("nr": true: no reply wanted)
    reply:   {"v": 1, "id": <u64>, "r": {result}}  or  {"v": 1, "id": <u64>, "e": {"code", "message"}}

Request ids let a client pipeline: replies carry the id of their request and may come
back in any order. Like h11, `FrameCodec` never touches a socket: feed bytes with
`receive_data`, pull events with `next_event`, and turn messages into bytes with `send_*`.

A frame whose header announces more than the limit cannot be skipped safely, so it is
fatal (`Fatal` event, then the connection is dead). A frame that is complete but whose
body is bad is answered and skipped (`BadFrame`), and the connection goes on.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from kvstore.errors import ProtocolError

PROTOCOL_VERSION = 1
HEADER = struct.Struct("<I")
# Payloads travel through shared memory, not frames; the biggest legitimate frame is a
# batch of MAX_BATCH 32-byte ids with per-key results (~300 KiB). 4 MiB leaves room and
# still bounds what one hostile peer can make the daemon buffer.
MAX_FRAME_BYTES = 4 * 1024 * 1024
# Largest batch (ids per lookup, delete, pin, prefetch): 4096 chunks of 256 tokens is a
# 1M-token context, more than any engine asks about in one call.
MAX_BATCH = 4096
# Strings in control messages are names and labels, never payload.
MAX_STR_CHARS = 1024
# Top-level argument fields of one request; the widest op uses fewer than 16.
MAX_FIELDS = 32
MAX_REQUEST_ID = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Request:
    id: int
    op: str
    args: dict
    no_reply: bool = False


@dataclass(frozen=True, slots=True)
class Reply:
    id: int
    result: Any = None
    error: dict | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class BadFrame:
    """A complete frame that could not be understood; `id` is its request id if readable."""

    id: int
    error: ProtocolError


@dataclass(frozen=True, slots=True)
class Fatal:
    """The stream cannot continue (for example an oversized length header)."""

    error: ProtocolError


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()
Event = Request | Reply | BadFrame | Fatal | _NeedData


def _unpack(body: bytes) -> Any:
    # Limits inside one body: msgpack itself refuses containers and strings past these.
    return msgpack.unpackb(
        body,
        raw=False,
        strict_map_key=True,
        max_str_len=MAX_STR_CHARS * 4,
        max_bin_len=MAX_FRAME_BYTES,
        max_array_len=MAX_BATCH * 2,
        max_map_len=max(MAX_FIELDS, MAX_BATCH),
        max_ext_len=0,
    )


class FrameCodec:
    """One side of a connection: bytes in, events out; messages in, bytes out.

    Not thread-safe; one codec per connection. `receive_data(b"")` is ignored; the caller
    handles EOF itself (there is nothing half-decoded that matters after EOF).
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._pos = 0
        self._dead: Fatal | None = None

    def receive_data(self, data: bytes) -> None:
        if self._dead is None:
            self._buf += data

    def next_event(self) -> Event:
        if self._dead is not None:
            return self._dead
        avail = len(self._buf) - self._pos
        if avail < HEADER.size:
            self._compact()
            return NEED_DATA
        (length,) = HEADER.unpack_from(self._buf, self._pos)
        if length > self.max_frame_bytes:
            self._dead = Fatal(ProtocolError(
                f"frame of {length} bytes exceeds the limit of {self.max_frame_bytes} bytes"
            ))
            self._buf = bytearray()
            return self._dead
        if avail < HEADER.size + length:
            self._compact()
            return NEED_DATA
        start = self._pos + HEADER.size
        body = bytes(self._buf[start:start + length])
        self._pos = start + length
        return self._decode(body)

    def _compact(self) -> None:
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0

    def _decode(self, body: bytes) -> Event:
        try:
            msg = _unpack(body)
        except Exception as exc:  # msgpack raises many types for hostile input
            return BadFrame(0, ProtocolError(f"undecodable frame body: {type(exc).__name__}: {exc}"))
        if not isinstance(msg, dict):
            return BadFrame(0, ProtocolError("frame body must be a map"))
        rid = msg.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid <= MAX_REQUEST_ID:
            return BadFrame(0, ProtocolError("frame has no valid request id (an integer in 0..2^64-1)"))
        if msg.get("v") != PROTOCOL_VERSION:
            return BadFrame(rid, ProtocolError(
                f"protocol version {msg.get('v')!r} not supported; this side speaks {PROTOCOL_VERSION}"
            ))
        if "op" in msg:
            op, args = msg["op"], msg.get("a", {})
            if not isinstance(op, str) or not op:
                return BadFrame(rid, ProtocolError("op must be a non-empty string"))
            if not isinstance(args, dict) or len(args) > MAX_FIELDS:
                return BadFrame(rid, ProtocolError(f"args must be a map of at most {MAX_FIELDS} fields"))
            return Request(rid, op, args, bool(msg.get("nr", False)))
        if "e" in msg:
            err = msg["e"]
            if not isinstance(err, dict):
                return BadFrame(rid, ProtocolError("error reply must carry a map"))
            return Reply(rid, None, err)
        if "r" in msg:
            return Reply(rid, msg["r"])
        return BadFrame(rid, ProtocolError("frame is neither a request (op) nor a reply (r or e)"))

    # --- outgoing ---------------------------------------------------------------

    @staticmethod
    def _frame(body: dict) -> bytes:
        data = msgpack.packb(body, use_bin_type=True)
        if len(data) > MAX_FRAME_BYTES:
            raise ProtocolError(f"message of {len(data)} bytes exceeds the frame limit {MAX_FRAME_BYTES}")
        return HEADER.pack(len(data)) + data

    def send_request(self, request: Request) -> bytes:
        body = {"v": PROTOCOL_VERSION, "id": request.id, "op": request.op, "a": request.args}
        if request.no_reply:
            body["nr"] = True
        return self._frame(body)

    def send_reply(self, reply: Reply) -> bytes:
        if reply.error is not None:
            return self._frame({"v": PROTOCOL_VERSION, "id": reply.id, "e": reply.error})
        return self._frame({"v": PROTOCOL_VERSION, "id": reply.id, "r": reply.result})
