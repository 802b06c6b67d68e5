"""Layouts: how the bytes of one state object are arranged.

A layout is a canonical string such as
`paged(order=layer_first,layers=32,block=16,kv_heads=8,head_dim=128)` that parses back
to the same value. Together with the dtype and the chunk length it maps a
(layer, block) pair to one contiguous byte range of the object: the unit of a ranged
read, and what sparse prefetch asks for.

Each (layer, block) segment is contiguous and self-contained: for block-scaled dtypes
(mxfp8) the segment's scales follow its elements, so a ranged read never needs a
neighbour's bytes.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, NamedTuple

from kvstore.dtypes import DType
from kvstore.errors import InvalidArgument

# Longest layout string accepted; a layout travels in every put and get.
MAX_LAYOUT_CHARS = 256
_ORDERS = ("layer_first", "block_first")


class ByteRange(NamedTuple):
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class _Schema:
    params: tuple[str, ...]  # canonical order; every one is required unless in defaults
    defaults: dict
    # elements in one (layer, block) segment; blocked=False means one segment per layer
    segment_elements: Callable[[dict], int]
    blocked: bool
    # bytes of one segment where they do not follow from the descriptor's dtype (states of mixed dtypes)
    segment_bytes: Callable[[dict], int] | None = None


# A Mamba layer's states, each shape and dtype: "3x32:fp16+2x4x8:fp32" (conv state, then SSM state).
_STATES_RE = re.compile(r"^\d+(x\d+)*:[a-z0-9_]+(\+\d+(x\d+)*:[a-z0-9_]+)*$")
_STATE_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "uint8": 1}


def parse_states(text: str) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype name) of each state in a `mamba` layout's `states` parameter."""
    if not isinstance(text, str) or not _STATES_RE.match(text):
        raise InvalidArgument(f"layout parameter states must look like 3x32:fp16+2x4x8:fp32, got {text!r}")
    out = []
    for part in text.split("+"):
        shape, dtype = part.split(":")
        dims = tuple(int(d) for d in shape.split("x"))
        if dtype not in _STATE_DTYPE_BYTES or 0 in dims:
            raise InvalidArgument(f"state {part!r}: dimensions must be > 0 and the dtype one of "
                                  f"{sorted(_STATE_DTYPE_BYTES)}")
        out.append((dims, dtype))
    return out


def _states_bytes(params: dict) -> int:
    total = 0
    for dims, dtype in parse_states(params["states"]):
        size = _STATE_DTYPE_BYTES[dtype]
        for d in dims:
            size *= d
        total += size
    return total


_SCHEMAS: dict[str, _Schema] = {
    # K and V of `block` tokens for one layer
    "paged": _Schema(
        ("order", "layers", "block", "kv_heads", "head_dim"),
        {"order": "layer_first"},
        lambda p: 2 * p["block"] * p["kv_heads"] * p["head_dim"],
        True,
    ),
    # MLA: one compressed latent (plus the decoupled rope key) per token per layer
    "mla": _Schema(
        ("order", "layers", "block", "latent_dim", "rope_dim"),
        {"order": "layer_first", "rope_dim": 0},
        lambda p: p["block"] * (p["latent_dim"] + p["rope_dim"]),
        True,
    ),
    # sparse-attention indexer keys, one per token per layer
    "indexer": _Schema(
        ("order", "layers", "block", "head_dim"),
        {"order": "layer_first"},
        lambda p: p["block"] * p["head_dim"],
        True,
    ),
    # recurrent (linear attention / SSM) state: one matrix per head per layer
    "recurrent": _Schema(
        ("layers", "heads", "k_dim", "v_dim"),
        {},
        lambda p: p["heads"] * p["k_dim"] * p["v_dim"],
        False,
    ),
    # short convolution cache: `width` past inputs per channel per layer
    "conv": _Schema(
        ("layers", "channels", "width"),
        {},
        lambda p: p["channels"] * p["width"],
        False,
    ),
    # a Mamba / linear-attention layer's recurrent states at one token boundary, state after
    # state (typically the conv state, then the SSM state), each of its own shape and dtype
    "mamba": _Schema(("layers", "states"), {}, lambda p: 0, False, _states_bytes),
    # opaque bytes: bytes=0 means "any size" (the daemon checks nothing)
    "raw": _Schema(("bytes",), {"bytes": 0}, lambda p: p["bytes"], False),
}

_LAYOUT_RE = re.compile(r"^([a-z_]+)\((.*)\)$")


@dataclass(frozen=True, slots=True)
class Layout:
    """A parsed layout. Build it with `Layout.parse(text)` or `Layout.make(name, **params)`."""

    name: str
    params: tuple[tuple[str, int | str], ...]

    def __post_init__(self) -> None:
        schema = _SCHEMAS.get(self.name)
        if schema is None:
            raise InvalidArgument(
                f"unknown layout {self.name!r}; expected one of: {', '.join(_SCHEMAS)}"
            )
        names = tuple(k for k, _ in self.params)
        if names != schema.params:
            raise InvalidArgument(
                f"layout {self.name} needs parameters {schema.params} in that order, got {names}"
            )
        for key, value in self.params:
            if key == "order":
                if value not in _ORDERS:
                    raise InvalidArgument(f"layout order must be one of {_ORDERS}, got {value!r}")
            elif key == "states":
                parse_states(value)
            elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"layout parameter {key} must be an integer >= 0, got {value!r}")
            elif value == 0 and key not in schema.defaults:
                raise InvalidArgument(f"layout parameter {key} must be > 0")
        if len(str(self)) > MAX_LAYOUT_CHARS:
            raise InvalidArgument(f"layout string longer than {MAX_LAYOUT_CHARS} characters")

    @classmethod
    def make(cls, name: str, **params: int | str) -> Layout:
        schema = _SCHEMAS.get(name)
        if schema is None:
            raise InvalidArgument(f"unknown layout {name!r}; expected one of: {', '.join(_SCHEMAS)}")
        unknown = set(params) - set(schema.params)
        if unknown:
            raise InvalidArgument(f"layout {name} has no parameter(s) {sorted(unknown)}")
        merged = {**schema.defaults, **params}
        missing = [p for p in schema.params if p not in merged]
        if missing:
            raise InvalidArgument(f"layout {name} is missing parameter(s) {missing}")
        return cls(name, tuple((p, merged[p]) for p in schema.params))

    @classmethod
    def parse(cls, text: str) -> Layout:
        if not isinstance(text, str) or len(text) > MAX_LAYOUT_CHARS:
            raise InvalidArgument(f"layout must be a string of at most {MAX_LAYOUT_CHARS} characters")
        return _parse(text)

    @classmethod
    def _parse_uncached(cls, text: str) -> Layout:
        match = _LAYOUT_RE.match(text.replace(" ", ""))
        if match is None:
            raise InvalidArgument(f"cannot parse layout {text!r}; expected name(key=value,...)")
        params: dict[str, int | str] = {}
        body = match.group(2)
        for item in body.split(",") if body else []:
            key, sep, value = item.partition("=")
            if not sep or not key or key in params:
                raise InvalidArgument(f"bad or repeated layout parameter {item!r} in {text!r}")
            # isascii: str.isdigit() also accepts '²' and '٣', which int() refuses or rewrites
            params[key] = int(value) if value.isascii() and value.isdigit() else value
        return cls.make(match.group(1), **params)

    def __str__(self) -> str:
        return _render(self.name, self.params)

    def param(self, key: str) -> int | str:
        return dict(self.params)[key]

    @property
    def _schema(self) -> _Schema:
        return _SCHEMAS[self.name]

    @property
    def num_layers(self) -> int:
        return int(self.param("layers")) if "layers" in dict(self.params) else 1

    def num_blocks(self, chunk_tokens: int) -> int:
        """Blocks per object: chunk_tokens / block for blocked layouts, 1 otherwise."""
        if not self._schema.blocked:
            return 1
        block = int(self.param("block"))
        if chunk_tokens <= 0 or chunk_tokens % block:
            raise InvalidArgument(
                f"chunk of {chunk_tokens} tokens is not a multiple of the layout block {block}"
            )
        return chunk_tokens // block

    def segment_bytes(self, dtype: DType) -> int:
        schema = self._schema
        if schema.segment_bytes is not None:
            return schema.segment_bytes(dict(self.params))
        return dtype.segment_bytes(schema.segment_elements(dict(self.params)))

    def total_bytes(self, dtype: DType, chunk_tokens: int) -> int:
        """Size of one object with this layout (every segment, scales included)."""
        return self.segment_bytes(dtype) * self.num_layers * self.num_blocks(chunk_tokens)

    def segment(self, layer: int, block: int, dtype: DType, chunk_tokens: int) -> ByteRange:
        """Byte range of (layer, block) inside the object."""
        layers, blocks = self.num_layers, self.num_blocks(chunk_tokens)
        if not (0 <= layer < layers and 0 <= block < blocks):
            raise InvalidArgument(
                f"(layer={layer}, block={block}) outside {layers} layers x {blocks} blocks of {self}"
            )
        if dict(self.params).get("order", "layer_first") == "layer_first":
            index = layer * blocks + block
        else:
            index = block * layers + layer
        size = self.segment_bytes(dtype)
        return ByteRange(index * size, size)

    def ranges(self, pairs, dtype: DType, chunk_tokens: int) -> list[ByteRange]:
        """Byte ranges of many (layer, block) pairs, adjacent ranges merged, sorted."""
        spans = sorted({self.segment(l, b, dtype, chunk_tokens) for l, b in pairs})
        merged: list[ByteRange] = []
        for span in spans:
            if merged and merged[-1].offset + merged[-1].length == span.offset:
                last = merged.pop()
                span = ByteRange(last.offset, last.length + span.length)
            merged.append(span)
        return merged


@functools.lru_cache(maxsize=1024)
def _parse(text: str) -> Layout:
    return Layout._parse_uncached(text)


@functools.lru_cache(maxsize=1024)
def _render(name: str, params: tuple) -> str:
    return f"{name}({','.join(f'{k}={v}' for k, v in params)})"
