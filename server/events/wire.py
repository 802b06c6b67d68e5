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
- block_hashes: one 32-byte object id (the engine's own block hashes come later, from the
  adapters); parent_block_hash, lora_id, lora_name: None; token_ids: [] (the daemon never
  sees tokens); block_size: the object's chunk_tokens.
- medium: where the object is held now, vLLM's names: "GPU", "CPU" (the host arena),
  "STORAGE" (NVMe). An object on two tiers is held in two media: each has its own
  stored and removed events.
- locality "LOCAL" (this node), ownership "kvstore" (vLLM's secondary tiers name themselves
  there), session_id: the put's hints.session_id when it had one.

Pure: no sockets, no threads.
"""

from __future__ import annotations

import msgpack

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCALITY = "LOCAL"
OWNERSHIP = "kvstore"
# The replay socket's end-of-replay marker's sequence number (ZmqEventPublisher.END_SEQ).
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# Events as the event loop records them (cheap tuples; turned into maps in the publisher thread).
STORED, REMOVED, CLEARED = 0, 1, 2


def topic_of(prefix: str, namespace: str) -> bytes:
    """A namespace's topic: `<prefix><length of the name in UTF-8 bytes>:<name>`.

    ZMQ subscriptions match topic prefixes. With the length before the name, one namespace's
    topic is never a prefix of another's ("kvstore.1:a" vs "kvstore.2:ab"), so a subscriber
    of one namespace's topic receives that namespace's frames and no other's."""
    name = namespace.encode()
    return prefix.encode() + str(len(name)).encode() + b":" + name


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _event_map(event: tuple) -> dict:
    kind = event[0]
    if kind == STORED:
        _, digest, medium, block_size, session_id = event
        doc = {"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": None, "token_ids": [],
               "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None,
               "locality": LOCALITY, "ownership": OWNERSHIP}
        if session_id is not None:
            doc["session_id"] = session_id
        return doc
    if kind == REMOVED:
        _, digest, medium = event
        return {"type": "BlockRemoved", "block_hashes": [digest], "medium": medium,
                "locality": LOCALITY, "ownership": OWNERSHIP}
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[tuple], data_parallel_rank: int = 0) -> bytes:
    """One KVEventBatch of recorded events (STORED / REMOVED / CLEARED tuples) as msgpack.
    data_parallel_rank 0: what a vLLM engine without data parallelism sends."""
    return msgpack.packb([float(ts), [_event_map(e) for e in events], data_parallel_rank], use_bin_type=True)
