"""Prompts for the Dynamo tests to put, each chunk with the route an engine adapter hands in.

Dynamo 1.6's listener hashes each block's token_ids itself (xxh3 over block_size tokens) and
matches prompts by those hashes, files each block under its parent_block_hash (chunk i of a
prompt is found only below chunk i-1), takes block hashes as 64-bit integers only, and drops
every event that names an `ownership`. A put's route (kvstore/route.py) carries the tokens
and the parent; the daemon writes bytes hashes in vLLM's int form and no ownership by default
(`[events] int_block_hashes`, `ownership`). Here a chunk's "engine hash" is its object id,
which is what an engine adapter would replace with its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.identity import ChunkKey, StateDescriptor, chunk_keys
from kvstore.route import Route


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: list[int]
    keys: list[ChunkKey]  # one object per chunk of desc.chunk_tokens tokens
    routes: list[Route]  # per key: its block (one per chunk), tokens and parent


class Prompts:
    """Prompts none of which shares a token with another (so no two share a block)."""

    def __init__(self, desc: StateDescriptor):
        self.desc = desc
        self._next_token = 1

    def new(self, num_chunks: int) -> Prompt:
        size = self.desc.chunk_tokens
        tokens = list(range(self._next_token, self._next_token + num_chunks * size))
        self._next_token += len(tokens)
        keys = chunk_keys(tokens, self.desc)
        routes = [Route([key.object_id.digest], parent_block_hash=keys[i - 1].object_id.digest if i else None,
                        token_ids=tokens[i * size:(i + 1) * size], block_size=size)
                  for i, key in enumerate(keys)]
        return Prompt(tokens, keys, routes)
