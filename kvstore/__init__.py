"""kvstore: identity, metadata, layouts, dtypes, policies and the wire codec.

This package is pure: it does no I/O and imports nothing heavy at import time, so
engines, routers and tools can compute ids and speak the protocol without a daemon.
"""

from kvstore.dtypes import DType
from kvstore.errors import KVStoreError
from kvstore.hints import Hints
from kvstore.identity import (
    KEY_SCHEME,
    ChunkKey,
    Kind,
    ObjectId,
    Shard,
    StateDescriptor,
    chunk_keys,
    namespace_salt,
)
from kvstore.layout import Layout

__all__ = [
    "KEY_SCHEME",
    "ChunkKey",
    "DType",
    "Hints",
    "KVStoreError",
    "Kind",
    "Layout",
    "ObjectId",
    "Shard",
    "StateDescriptor",
    "chunk_keys",
    "namespace_salt",
]
