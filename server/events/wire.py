"""vLLM's KV event wire format (vllm/distributed/kv_events.py, vLLM 0.33), written with msgpack.

A frame on the PUB socket is three parts: the topic, the sequence number as 8 bytes
big-endian, and one msgpack `KVEventBatch`: an array [ts, events, data_parallel_rank]. Each
event is a map whose first key "type" names its class (msgspec's tagged structs), then the
class's fields in declaration order, fields at their default left out. This writes the same
document msgspec writes for the same values (only the map header may differ: msgspec gives a
struct of more than 15 fields a map16 header even when it writes fewer);
tests/adapters/vllm/test_kv_events.py checks that with vLLM's own classes. So a consumer of
vLLM's events needs no code of ours.

What the fields say here (docs/architecture.md, "Events for routers"):
- block_hashes, parent_block_hash, token_ids, block_size, lora_name, extra_keys, group_idx,
  kv_cache_spec_kind, kv_cache_spec_sliding_window: the object's route (kvstore/route.py),
  the engine's own names for its blocks, handed in by the adapter that put it. An object
  without a route is one block named by its object id (kvstore.identity.chunk_keys over the
  token ids: the documented hash), with token_ids [] and block_size its chunk_tokens. A
  route without block_size: chunk_tokens / the number of hashes. With `int_block_hashes`
  (the default, as vLLM's), a hash given as bytes is published as vLLM's int form: its
  last 8 bytes, big-endian.
- lora_id: None (deprecated in vLLM in favour of lora_name).
- medium: where the object is held now, vLLM's names: "CPU" (the host arena), "STORAGE"
  (NVMe); and "PEER" (ours: its home nodes hold it, as this node saw when it sent it there,
  locality "REMOTE"). An object on two tiers is held in two media: each has its own stored
  and removed events.
- locality "LOCAL" (this node) but for PEER; ownership: `[events] ownership`, left out when
  "" (the default, as vLLM's engine events: Dynamo drops events that have one); session_id:
  the put's hints.session_id when it had one.

Pure: no sockets, no threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from kvstore.route import route_fields

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
# Not vLLM's: the object's home nodes hold it (as seen from this node, which can fetch it).
MEDIUM_PEER = "PEER"
LOCALITY = "LOCAL"
LOCALITY_REMOTE = "REMOTE"  # of a PEER event: the bytes are on another node
# The replay socket's end-of-replay marker's sequence number (ZmqEventPublisher.END_SEQ).
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# BlockStored's fields after lora_name that have defaults (left out when unset, as msgspec does).
_OPTIONAL = ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")

# Events as the event loop records them (cheap tuples; turned into maps in the publisher thread).
STORED, REMOVED, CLEARED = 0, 1, 2


def topic_of(prefix: str, namespace: str) -> bytes:
    """A namespace's topic: `<prefix><length of the name in UTF-8 bytes>:<name>`.

    ZMQ subscriptions match topic prefixes. With the length before the name, one namespace's
    topic is never a prefix of another's ("kvstore.1:a" vs "kvstore.2:ab"), so a subscriber
    of one namespace's topic receives that namespace's frames and no other's."""
    name = namespace.encode()
    return prefix.encode() + str(len(name)).encode() + b":" + name


def namespace_of(prefix: str, topic: bytes) -> str | None:
    """The namespace whose topic (topic_of) is `topic`, or None when no name's is."""
    head = prefix.encode()
    length, colon, name = topic[len(head):].partition(b":")
    if not topic.startswith(head) or not colon or not length.isdigit() or int(length) != len(name):
        return None
    try:
        namespace = name.decode()
    except UnicodeDecodeError:
        return None
    return namespace if topic_of(prefix, namespace) == topic else None


def seq_bytes(seq: int) -> bytes:
    """A sequence number on the wire: 8 bytes big-endian. Signed, so that a snapshot of a
    namespace that published nothing says -1 (its first batch is 0); a batch's is >= 0 and
    reads the same either way."""
    return seq.to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class Wire:
    """How events are written (`[events]` int_block_hashes and ownership)."""

    int_block_hashes: bool = True
    ownership: str = ""  # "" = left out

    @classmethod
    def of(cls, config) -> Wire:
        return cls(config.int_block_hashes, config.ownership)

    def encode_batch(self, ts: float, events: list[tuple], data_parallel_rank: int = 0) -> bytes:
        """One KVEventBatch of recorded events (STORED / REMOVED / CLEARED tuples) as msgpack.
        data_parallel_rank 0: what a vLLM engine without data parallelism sends."""
        return msgpack.packb([float(ts), [self._event_map(e) for e in events], data_parallel_rank],
                             use_bin_type=True)

    def _hash(self, value):
        """A block hash as published: bytes become vLLM's int form when int_block_hashes
        (kv_cache_utils.maybe_convert_block_hash: the last 8 bytes, big-endian)."""
        if self.int_block_hashes and isinstance(value, bytes):
            return int.from_bytes(value[-8:], "big")
        return value

    def _event_map(self, event: tuple) -> dict:
        kind = event[0]
        if kind == STORED:
            _, digest, medium, route, block_size, session_id = event
            fields = None if route is None else route_fields(route)
            if fields is None:
                doc = {"type": "BlockStored", "block_hashes": [self._hash(digest)], "parent_block_hash": None,
                       "token_ids": [], "block_size": block_size, "lora_id": None, "medium": medium,
                       "lora_name": None}
            else:
                hashes = fields["block_hashes"]
                doc = {"type": "BlockStored", "block_hashes": [self._hash(h) for h in hashes],
                       "parent_block_hash": self._hash(fields.get("parent_block_hash")),
                       "token_ids": fields.get("token_ids", []),
                       "block_size": fields.get("block_size") or max(1, block_size // len(hashes)), "lora_id": None,
                       "medium": medium, "lora_name": fields.get("lora_name")}
                for name in _OPTIONAL:
                    if fields.get(name) is not None:
                        doc[name] = fields[name]
            self._where(doc, medium)
            if session_id is not None:
                doc["session_id"] = session_id
            if fields is not None and fields.get("lookahead_token_ids") is not None:  # vLLM's last field
                doc["lookahead_token_ids"] = fields["lookahead_token_ids"]
            return doc
        if kind == REMOVED:
            _, digest, medium, route = event
            if route is None:
                doc = {"type": "BlockRemoved", "block_hashes": [self._hash(digest)], "medium": medium}
            else:
                fields = route_fields(route)
                doc = {"type": "BlockRemoved", "block_hashes": [self._hash(h) for h in fields["block_hashes"]],
                       "medium": medium}
                if fields.get("group_idx") is not None:
                    doc["group_idx"] = fields["group_idx"]
            self._where(doc, medium)
            return doc
        return {"type": "AllBlocksCleared"}

    def _where(self, doc: dict, medium: str) -> None:
        doc["locality"] = LOCALITY_REMOTE if medium == MEDIUM_PEER else LOCALITY
        if self.ownership:
            doc["ownership"] = self.ownership


def encode_batch(ts: float, events: list[tuple], data_parallel_rank: int = 0) -> bytes:
    """encode_batch of the default Wire (int block hashes, no ownership)."""
    return DEFAULT_WIRE.encode_batch(ts, events, data_parallel_rank)


DEFAULT_WIRE = Wire()
