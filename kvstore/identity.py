"""State identity: namespace salts, the chunk hash chain, and object ids.

Scheme `kvstore-key-v1` (test vectors in kvstore/vectors/key-v1.json):

    field(b)  = u32_le(len(b)) || b
    H_salt(x) = BLAKE2b-256(x, key=salt)
    salt      = BLAKE2b-256(utf8(namespace), key=secret or empty, person="kvstore-ns-v1")
    h0        = H_salt(field("kvstore-key-v1") || field(model) || field(model_revision))
    h_i       = H_salt(h_{i-1} || field(tokens of chunk i as u32_le) || u32_le(n) || field(extra_1) ... field(extra_n))
    object id = BLAKE2b-256(h_i || field(kind) || field(shard) || field(dtype) || field(layout),
                            key=salt, person="kvstore-obj-v1")

A keyed cryptographic hash, never xxhash or Python's `hash`: ids must agree across
processes and hosts (no PYTHONHASHSEED), and a tenant must not be able to forge a
collision with another tenant's prefix.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import re
import struct
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

from kvstore.dtypes import DType
from kvstore.errors import InvalidArgument, parse_enum
from kvstore.layout import Layout

KEY_SCHEME = "kvstore-key-v1"
ID_BYTES = 32
DEFAULT_CHUNK_TOKENS = 256
# Names and revisions are labels; a bound keeps every frame small.
MAX_NAME_CHARS = 256
# What a name (namespace, model, model revision) may not hold: control characters (C0, DEL,
# C1: a newline in a namespace forged lines of the daemon's log and of `kvstore status`), the
# line and paragraph separators, and lone surrogates (not UTF-8: no wire or file carries them).
_NOT_IN_NAMES = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
NAME_RULE = (f"1..{MAX_NAME_CHARS} characters, none of them a control character (U+0000..U+001F, "
             "U+007F..U+009F), a line or paragraph separator (U+2028, U+2029) or a lone surrogate")
MAX_TOKEN_ID = 2**32 - 1


class Kind(str, enum.Enum):
    KV = "kv"
    MLA_LATENT = "mla_latent"
    RECURRENT = "recurrent"
    CONV = "conv"
    INDEXER = "indexer"
    GROUP = "group"  # a store group's manifest (kvstore/groups.py)

    @classmethod
    def parse(cls, value: str | Kind) -> Kind:
        return parse_enum(cls, value, "kind")


class ObjectId(bytes):
    """32-byte content id; prints as 64 hex characters.

    It is its digest: one bytes object, no wrapper around one (a daemon indexes tens of
    millions of ids; a wrapper costs ~48 B more each). So an id hashes and compares
    as its raw 32 bytes, and a batch of ids off the wire probes an index without building
    an object per id. `hex` is the 64-character text (a property, not bytes.hex)."""

    __slots__ = ()

    def __new__(cls, digest: bytes) -> ObjectId:
        if type(digest) is cls:
            return digest
        if not isinstance(digest, bytes) or len(digest) != ID_BYTES:
            raise InvalidArgument(f"an object id is {ID_BYTES} bytes (64 hex characters)")
        return super().__new__(cls, digest)

    @property
    def digest(self) -> bytes:
        """The 32 bytes as plain bytes (a copy: keys and wire fields built from it are bytes)."""
        return bytes(self)

    @classmethod
    def from_hex(cls, text: str) -> ObjectId:
        try:
            digest = bytes.fromhex(text)
        except (ValueError, TypeError):
            raise InvalidArgument(f"object id must be 64 hex characters, got {str(text)[:80]!r}") from None
        return cls(digest)

    @property
    def hex(self) -> str:  # type: ignore[override]
        return bytes.hex(self)

    def __str__(self) -> str:
        return self.hex

    def __repr__(self) -> str:
        return f"ObjectId({self.hex[:16]}…)"


@dataclass(frozen=True, slots=True, order=True)
class Shard:
    """Which slice of the model's state this is (tensor-parallel split of heads).

    It names the slice, not the rank that produced it, so any rank of any instance with
    the same split hits the same object.
    """

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.index, int) and isinstance(self.count, int)) or not 0 <= self.index < self.count:
            raise InvalidArgument(f"shard must satisfy 0 <= index < count, got {self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str | Shard) -> Shard:
        if isinstance(text, Shard):
            return text
        index, sep, count = str(text).partition("/")
        if not sep or not (index + count).isascii() or not index.isdigit() or not count.isdigit():
            raise InvalidArgument(f"shard must look like 'index/count', got {text!r}")
        return cls(int(index), int(count))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def check_name(what: str, value) -> str:
    """`value` when it is a name by NAME_RULE, else InvalidArgument saying the rule. The one
    rule for every name of a descriptor, and for a namespace wherever one enters: the client,
    the wire, the config's [auth] and [events] tables and the admin API."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS or _NOT_IN_NAMES.search(value):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise InvalidArgument(f"{what} must be {NAME_RULE}, got {shown}")
    return value


@dataclass(frozen=True, slots=True)
class StateDescriptor:
    """What a state object is. Every field is typed; none is a convention in a key string."""

    namespace: str
    model: str
    model_revision: str
    kind: Kind = Kind.KV
    dtype: DType = DType.BF16
    layout: Layout = field(default_factory=lambda: Layout.make("raw"))
    shard: Shard = Shard()
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # Hashed once: a descriptor is hashed per object on hot paths (the shared index's digest
    # cache), and hashing its nested fields each time cost ~0.7 us.
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_name("namespace", self.namespace)
        check_name("model", self.model)
        check_name("model_revision", self.model_revision)
        # Accept strings for convenience; store the typed values.
        object.__setattr__(self, "kind", Kind.parse(self.kind))
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        if isinstance(self.layout, str):
            object.__setattr__(self, "layout", Layout.parse(self.layout))
        elif not isinstance(self.layout, Layout):
            raise InvalidArgument(f"layout must be a Layout or a layout string, got {type(self.layout).__name__}")
        object.__setattr__(self, "shard", Shard.parse(self.shard))
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens <= 0:
            raise InvalidArgument(f"chunk_tokens must be a positive integer, got {self.chunk_tokens!r}")
        object.__setattr__(self, "_hash", hash(self.fields()))

    def fields(self) -> tuple:
        """The values that make the descriptor what it is, in field order (hashed, compared)."""
        return (self.namespace, self.model, self.model_revision, self.kind, self.dtype, self.layout, self.shard,
                self.chunk_tokens)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        """Field by field, after the shortcuts reads take per object: the same descriptor
        object (one decoding cache serves a connection), or another hash."""
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return hash(self) == hash(other) and self.fields() == other.fields()

    def __reduce__(self):
        """Pickled by its fields: the hash is this process's (str hashes are seeded per process)."""
        return (type(self), self.fields())

    def with_(self, **changes) -> StateDescriptor:
        """The same state seen as another kind, dtype, layout or shard."""
        return replace(self, **changes)

    @property
    def object_bytes(self) -> int:
        """Size of one object of this descriptor (every put checks it: computed once per
        layout, dtype and chunk size)."""
        return _object_bytes(self.layout, self.dtype, self.chunk_tokens)

    def to_wire(self) -> dict:
        return {
            "namespace": self.namespace,
            "model": self.model,
            "model_revision": self.model_revision,
            "kind": self.kind.value,
            "dtype": self.dtype.value,
            "layout": str(self.layout),
            "shard": str(self.shard),
            "chunk_tokens": self.chunk_tokens,
        }

    @classmethod
    def from_wire(cls, data) -> StateDescriptor:
        if not isinstance(data, dict):
            raise InvalidArgument("descriptor must be a map")
        unknown = set(data) - _DESCRIPTOR_FIELDS
        if unknown:
            raise InvalidArgument(f"unknown descriptor field(s) {sorted(map(str, unknown))}")
        try:
            return _descriptor_from_items(tuple(sorted(data.items())))
        except TypeError as exc:  # unhashable values or wrong arguments
            raise InvalidArgument(f"bad descriptor: {exc}") from None


_DESCRIPTOR_FIELDS = frozenset({"namespace", "model", "model_revision", "kind", "dtype", "layout", "shard", "chunk_tokens"})


@functools.lru_cache(maxsize=1024)
def _descriptor_from_items(items: tuple) -> StateDescriptor:
    # Engines send the same few descriptors millions of times; validating and parsing
    # the layout costs ~20 us, a cache hit well under 1 us. Pure, so safe to memoise.
    return StateDescriptor(**dict(items))


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def _as_bytes(value: str | bytes) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise InvalidArgument(f"extra keys must be str or bytes, got {type(value).__name__}")


def namespace_salt(namespace: str, secret: bytes | None = None) -> bytes:
    """The 32-byte salt of a namespace. A per-tenant `secret` makes ids unguessable."""
    check_name("namespace", namespace)
    return hashlib.blake2b(
        namespace.encode(), digest_size=ID_BYTES, key=secret or b"", person=b"kvstore-ns-v1"
    ).digest()


def root_hash(salt: bytes, model: str, model_revision: str) -> bytes:
    h = hashlib.blake2b(digest_size=ID_BYTES, key=salt)
    h.update(_field(KEY_SCHEME.encode()) + _field(model.encode()) + _field(model_revision.encode()))
    return h.digest()


def chain_hash(salt: bytes, parent: bytes, tokens: Sequence[int], extra_keys: Iterable[str | bytes] = ()) -> bytes:
    try:
        token_bytes = struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        raise InvalidArgument(f"token ids must be integers in 0..{MAX_TOKEN_ID}") from None
    extras = [_as_bytes(e) for e in extra_keys]
    return _chain_digest(salt, _chain_head(parent, token_bytes, len(extras)) + b"".join(map(_field, extras)))


def _chain_head(parent: bytes, token_bytes: bytes, num_extras: int) -> bytes:
    """What chain_hash hashes before its extra keys."""
    return parent + _field(token_bytes) + struct.pack("<I", num_extras)


def _chain_digest(salt: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=ID_BYTES, key=salt).digest()


def tokenless_ids(salt: bytes, parent: bytes, extra_keys: Sequence[str | bytes], desc: StateDescriptor):
    """f(key) = object_id(salt, chain_hash(salt, parent, (), [*extra_keys, key]), desc) for
    many keys: the constant parts are packed once (an adapter computes an id per engine key on
    its hot path: ~3 us instead of ~10)."""
    extras = [_as_bytes(e) for e in extra_keys]
    head = _chain_head(parent, b"", len(extras) + 1) + b"".join(map(_field, extras))
    suffix = _object_suffix(desc)

    def ids(key: bytes) -> ObjectId:
        return _object_digest(salt, _chain_digest(salt, head + _field(key)) + suffix)

    return ids


IDENTITY_FIELDS = ("namespace", "model", "model_revision", "kind", "dtype", "layout", "shard", "chunk_tokens")


def check_object_size(descriptor: StateDescriptor, size: int) -> None:
    """InvalidArgument when `size` is not the size the descriptor's layout gives one object
    (a layout without a fixed size, such as raw(bytes=0), takes any). The daemon checks
    every put; the client checks first, so a put's caller hears of it at the put."""
    expected = descriptor.object_bytes
    if expected and size != expected:
        raise InvalidArgument(
            f"object of {size} bytes does not match its layout {descriptor.layout} "
            f"in {descriptor.dtype.value} ({expected} bytes per {descriptor.chunk_tokens}-token chunk)")


def descriptor_differences(expected: StateDescriptor, actual: StateDescriptor) -> str:
    """The fields where two descriptors differ, as `field: expected != actual` ('' if none)."""
    def text(value) -> str:
        return value.value if isinstance(value, enum.Enum) else str(value)

    return ", ".join(f"{name} {text(getattr(expected, name))} != {text(getattr(actual, name))}"
                     for name in IDENTITY_FIELDS if getattr(expected, name) != getattr(actual, name))


def read_refusal(stored: StateDescriptor, accept=None, expect: StateDescriptor | None = None) -> str | None:
    """Why a reader gets a miss for an object stored as `stored`: its dtype is not in the
    reader's `accept` list, or the descriptor differs from the one it `expect`s; None when
    the reader can use it. Every tier that serves a read asks this one question."""
    if accept is not None and stored.dtype not in accept:
        return f"stored as {stored.dtype.value}, not in accept list"
    if expect is not None and stored != expect:
        return f"stored as {descriptor_differences(stored, expect)}"
    return None


def object_id(salt: bytes, logical: bytes, desc: StateDescriptor) -> ObjectId:
    return _object_digest(salt, logical + _object_suffix(desc))


def _object_digest(salt: bytes, data: bytes) -> ObjectId:
    return ObjectId(hashlib.blake2b(data, digest_size=ID_BYTES, key=salt, person=b"kvstore-obj-v1").digest())


def _object_suffix(desc: StateDescriptor) -> bytes:
    """What an object id hashes of its descriptor after the logical id."""
    return (_field(desc.kind.value.encode()) + _field(str(desc.shard).encode()) + _field(desc.dtype.value.encode())
            + _field(str(desc.layout).encode()))


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """The object holding the state after the prefix that ends at chunk `index`.

    It carries the descriptor its id was computed for: a put with a ChunkKey stores it under
    that descriptor (another one is refused), and a get or lookup with it expects it (an
    object stored under any other descriptor is a miss)."""

    index: int
    end_token: int  # tokens [0, end_token) are covered by this key's prefix
    logical: bytes
    object_id: ObjectId
    descriptor: StateDescriptor


def chunk_keys(
    tokens: Sequence[int],
    desc: StateDescriptor,
    extra_keys: Iterable[str | bytes] = (),
    chunk_extra_keys: Mapping[int, Iterable[str | bytes]] | None = None,
    secret: bytes | None = None,
) -> list[ChunkKey]:
    """Keys of every full chunk of `tokens` (a trailing partial chunk has no key).

    extra_keys apply to every chunk (a LoRA id); chunk_extra_keys[i] only to chunk i
    (content hashes of images whose tokens fall in chunk i). Token ids may be a list or
    any sequence of ints, numpy arrays included (`.tolist()` is used when present).
    """
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    salt = namespace_salt(desc.namespace, secret)
    size = desc.chunk_tokens
    common = [_as_bytes(e) for e in extra_keys]
    parent = root_hash(salt, desc.model, desc.model_revision)
    keys = []
    for index in range(len(tokens) // size):
        extras = common + [_as_bytes(e) for e in (chunk_extra_keys or {}).get(index, ())]
        parent = chain_hash(salt, parent, tokens[index * size:(index + 1) * size], extras)
        keys.append(ChunkKey(index, (index + 1) * size, parent, object_id(salt, parent, desc), desc))
    return keys


@functools.lru_cache(maxsize=1024)
def _object_bytes(layout: Layout, dtype: DType, chunk_tokens: int) -> int:
    return layout.total_bytes(dtype, chunk_tokens)
