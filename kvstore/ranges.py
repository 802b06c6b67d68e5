"""Byte ranges of one object: what a sparse reader asks for instead of the whole object.

A range list is a tuple of (offset, length) pairs in the object's bytes, in the order the
reader wants them. A ranged transfer packs the ranges back to back in that order (overlaps
are sent twice), so range i starts at `starts(ranges)[i]` in the packed buffer.
Shared by the local protocol (`Get.ranges`), the peer protocol (`PeerGet.ranges`), the
peer service that packs them and the client that unpacks them.
"""

from __future__ import annotations

import itertools
import operator

from kvstore.errors import InvalidArgument, RangeError
from kvstore.protocol import MAX_BATCH

MAX_RANGES = MAX_BATCH  # one request's ranges; adjacent ones should be merged by the reader
MAX_OFFSET = 1 << 40


def decode(v) -> tuple | None:
    """Wire [[offset, length], ...] (or None) -> a tuple of (offset, length) pairs."""
    if v is None:
        return None
    if not isinstance(v, list) or not 0 < len(v) <= MAX_RANGES:
        raise InvalidArgument(f"ranges must be a list of 1..{MAX_RANGES} [offset, length] pairs")
    out = []
    for pair in v:
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or not all(type(x) is int for x in pair) or pair[0] < 0 or pair[1] < 1
                or pair[0] + pair[1] > MAX_OFFSET):
            raise InvalidArgument(f"each range must be [offset >= 0, length >= 1] within {MAX_OFFSET} bytes, "
                                  f"got {pair!r}"[:200])
        out.append((pair[0], pair[1]))
    return tuple(out)


def encode(ranges) -> list | None:
    return None if ranges is None else [[o, n] for o, n in ranges]


def normalize(ranges) -> tuple:
    """What a caller passed (pairs of ints, numpy ints included) -> validated ranges, or
    InvalidArgument naming the problem (floats are refused, never truncated)."""
    try:
        pairs = [[operator.index(o), operator.index(n)] for o, n in ranges]
    except (TypeError, ValueError):
        raise InvalidArgument("ranges must be (offset, length) pairs of integers") from None
    return decode(pairs)


CODEC = (decode, encode)


def total(ranges) -> int:
    return sum(n for _, n in ranges)


def starts(ranges) -> list[int]:
    """Where each range begins in the packed buffer."""
    return [0, *itertools.accumulate(n for _, n in ranges)][:-1]


def check_within(ranges, size: int) -> None:
    """RangeError naming the first range that reaches past an object of `size` bytes, or
    when the ranges add up to more bytes than the object has (overlaps read twice)."""
    for offset, length in ranges:
        if offset + length > size:
            raise RangeError(f"range [{offset}, {offset + length}) reaches past the object's {size} bytes")
    if total(ranges) > size:
        raise RangeError(f"the ranges add up to {total(ranges)} bytes, more than the object's {size}; "
                         "merge overlapping ranges or read the whole object")


def pack(buffer, ranges):
    """A new contiguous uint8 numpy array with the ranges of host `buffer` back to back."""
    import numpy as np  # kvstore/ stays light at import time

    src = np.frombuffer(buffer, dtype=np.uint8)
    out = np.empty(total(ranges), dtype=np.uint8)
    for at, (offset, length) in zip(starts(ranges), ranges):
        out[at:at + length] = src[offset:offset + length]
    return out
