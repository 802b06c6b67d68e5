"""What the daemon's events lack for Dynamo, filled in on the way: a relay, and the prompts it knows.

Dynamo 1.6's listener drops a whole batch whose block_hashes are not 64-bit integers (the
daemon publishes its 32-byte object ids), stores no block whose token_ids fall short of
block_size tokens per hash (the daemon publishes []: it never sees tokens), files each block
under its parent_block_hash, so chunk i of a prompt is found only below chunk i-1 (the daemon
publishes null), and drops every event whose `ownership` is set (vLLM's name of a secondary
tier, which the daemon sets to "kvstore"). The relay reads the daemon's PUB socket
(tests/kvs_events.py's subscriber) and publishes each batch on a PUB socket of its own with
those four fields changed, from what the test put (`Prompts`: each chunk key's tokens and the
key before it):

    block_hashes        [id] -> [the id's last 8 bytes, big-endian, as an unsigned integer]:
                        vLLM's own conversion (maybe_convert_block_hash, its default)
    token_ids           []   -> the object's chunk_tokens token ids
    parent_block_hash   null -> the previous chunk's id, converted the same way (chunk 0: null)
    ownership           "kvstore" -> left out (vLLM's default, None)

Nothing else changes: the topic, ts, data_parallel_rank, and the events' order, types, media
and other fields pass through. The relay numbers its own batches from 0, as a publisher does.
Once the daemon's events carry these fields (the adapters handing tokens and parents in with
a put), Dynamo registers the daemon's endpoint itself and this relay goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import zmq

from kvstore.identity import ChunkKey, StateDescriptor, chunk_keys


def as_u64(object_id: bytes) -> int:
    """vLLM's integer form of a block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default)."""
    return int.from_bytes(object_id, "big") & ((1 << 64) - 1)


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: list[int]
    keys: list[ChunkKey]  # one object per chunk of desc.chunk_tokens tokens


class Prompts:
    """Prompts for the tests to put, none sharing a token with another (so no two share a
    block), and for each chunk key's object: its tokens and the key of the chunk before it."""

    def __init__(self, desc: StateDescriptor):
        self.desc = desc
        self._next_token = 1
        self._chunks: dict[bytes, tuple[list[int], bytes | None]] = {}

    def new(self, num_chunks: int) -> Prompt:
        size = self.desc.chunk_tokens
        tokens = list(range(self._next_token, self._next_token + num_chunks * size))
        self._next_token += len(tokens)
        keys = chunk_keys(tokens, self.desc)
        for i, key in enumerate(keys):
            self._chunks[key.object_id.digest] = (tokens[i * size:(i + 1) * size],
                                                  keys[i - 1].object_id.digest if i else None)
        return Prompt(tokens, keys)

    def chunk(self, object_id: bytes) -> tuple[list[int], bytes | None]:
        """(tokens, previous chunk's id or None) of an object these prompts put."""
        try:
            return self._chunks[bytes(object_id)]
        except KeyError:
            raise AssertionError(f"the daemon published {bytes(object_id).hex()}, which no prompt of "
                                 "the test holds") from None


class Relay:
    """Republishes what `subscriber` received, with the fields Dynamo needs, on `endpoint`."""

    def __init__(self, subscriber, prompts: Prompts, endpoint: str):
        self.subscriber = subscriber
        self.prompts = prompts
        self.endpoint = endpoint
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(endpoint)
        self._num_forwarded = 0  # of subscriber.received
        self._seq = 0
        self._last: tuple[bytes, bytes] | None = None

    def forward(self) -> None:
        """Publish every batch the subscriber received since the last call, in order."""
        for _, payload in self.subscriber.received[self._num_forwarded:]:
            self._last = (self.subscriber.topic, self.filled_in(payload))
            self._send(*self._last)
        self._num_forwarded = len(self.subscriber.received)

    def resend_last(self) -> None:
        """The last batch again, under the next number: a subscriber that joined after it
        was sent gets it (applying a batch twice leaves an index as once)."""
        if self._last is not None:
            self._send(*self._last)

    def _send(self, topic: bytes, payload: bytes) -> None:
        self._pub.send_multipart((topic, self._seq.to_bytes(8, "big"), payload))
        self._seq += 1

    def filled_in(self, payload: bytes) -> bytes:
        ts, events, rank = msgpack.unpackb(payload)
        return msgpack.packb([ts, [self._event(e) for e in events], rank], use_bin_type=True)

    def _event(self, event: dict) -> dict:
        if "block_hashes" not in event:  # AllBlocksCleared
            return event
        ids = event["block_hashes"]
        out = {k: v for k, v in event.items() if k != "ownership"}  # the other keys in their order
        out["block_hashes"] = [as_u64(i) for i in ids]
        if event["type"] == "BlockStored":
            (object_id,) = ids  # the daemon publishes one object per event
            tokens, parent = self.prompts.chunk(object_id)
            out["token_ids"] = tokens
            out["parent_block_hash"] = None if parent is None else as_u64(parent)
        return out

    def close(self) -> None:
        self._pub.close(linger=0)
        self._ctx.term()
