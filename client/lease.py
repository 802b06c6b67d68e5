"""ReadLease: a read lease on a committed object, viewed in place in the shared arena."""

from __future__ import annotations

import bisect
import math
import time

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument, LeaseEnded
from kvstore.identity import StateDescriptor
from kvstore.ranges import starts

# A read lease counts as ended (ReadLease.closed) after this share of the daemon's lease TTL.
LEASE_TTL_MARGIN = 0.8


class ReadLease:
    """A read lease on a committed object, viewed in place in the shared arena.

    The daemon neither moves nor evicts the object until `release()` (or the end of the
    `with` / `async with` block); release is idempotent. Views: `numpy()`, `buffer` and
    `read()` are zero-copy and read-only; `tensor()` is a copy (torch has no read-only
    tensors, and a writable view would change what every later reader of the object gets).
    After release each of them raises LeaseEnded. `buffer` memoryviews go dead at
    release; a numpy array taken earlier cannot be revoked: it then shows whatever the daemon
    puts in that memory later, so copy (`.copy()`, or `tensor()`) what you keep past the lease.

    A lease got with `ranges=` is read with `read(offset, length)` only: it holds the whole
    object when the object is on this node and just the packed ranges when a home node sent
    them (`ranges` set), so `numpy()`, `tensor()` and `buffer` refuse on it rather than mean
    two different things.
    """

    __slots__ = ("lease_id", "object_id", "size", "checksum", "_descriptor", "tier", "_array", "_release", "_done",
                 "ranges", "_starts", "_core", "_stale_at", "_asked_ranges", "_views", "device_offset")

    def __init__(self, release, lease_id, object_id, size, checksum, descriptor_wire, tier, array, ranges=None,
                 core=None, asked_ranges: bool = False, device_offset: int | None = None):
        self.lease_id = lease_id
        self.object_id = object_id
        self.size = size
        self.checksum = checksum
        self._descriptor = descriptor_wire
        self.tier = tier
        self._array = array
        self._release = release
        self._done = False
        # None: the lease covers the whole object. Else the (offset, length) ranges of the
        # object it holds, packed in order (`size` and `checksum` are then of the packed bytes).
        self.ranges = ranges
        self._starts = None if ranges is None else sorted(zip(ranges, starts(ranges)))  # by object offset
        self._core = core  # the connection it came from: the daemon ends the lease when that closes
        # The daemon also takes a lease back after limits.lease_ttl_s; treat it as gone at 80%.
        ttl = getattr(core, "lease_ttl_s", None)
        self._stale_at = math.inf if ttl is None else time.monotonic() + LEASE_TTL_MARGIN * ttl
        self._asked_ranges = asked_ranges  # got with ranges=: read() only
        self._views: list[memoryview] = []  # handed out by `buffer`, released with the lease
        # tier "gpu": the object's device copy at this offset of the daemon's GPU buffer
        # (client.gpu.GpuMapping reads it); the lease then has no host bytes.
        self.device_offset = device_offset if tier == "gpu" else None

    @property
    def closed(self) -> bool:
        """Released, its connection to the daemon closed, or near the daemon's lease TTL:
        the daemon takes such a lease back, and its bytes may then hold another object."""
        return self._ended_by() is not None

    def _ended_by(self) -> str | None:
        if self._done:
            return "it was released"
        if self._core is not None and self._core.closed:
            return "its connection to the daemon closed"
        if time.monotonic() >= self._stale_at:
            return "it reached the daemon's lease TTL (limits.lease_ttl_s); the daemon takes such leases back"
        return None

    def _refuse_if_ended(self, what: str) -> None:
        why = self._ended_by()
        if why is not None:
            raise LeaseEnded(f"the lease on {self.object_id.hex} has ended ({why}); {what} is no longer valid: "
                             "get the object again")

    @property
    def descriptor(self) -> StateDescriptor:
        """What the object is (parsed on first use: most readers already know)."""
        if isinstance(self._descriptor, dict):
            self._descriptor = StateDescriptor.from_wire(self._descriptor)
        return self._descriptor

    def _whole(self, what: str) -> np.ndarray:
        """The leased bytes, for a view of the whole object: refused once the lease has
        ended, and on a ranged lease."""
        self._refuse_if_ended(what)
        if self._array is None:
            raise InvalidArgument(f"{what} of a lease on the GPU tier: its bytes are in the daemon's GPU buffer; "
                                  "copy them with Client.get_into_device, or get without gpu")
        if self._asked_ranges:
            raise InvalidArgument(f"{what} of a lease got with ranges=: read its bytes with read(offset, length) "
                                  "(the lease holds the whole object or only the ranges, depending on where it was)")
        return self._array

    @property
    def buffer(self) -> memoryview:
        """A read-only memoryview of the object; it is released (unusable) with the lease."""
        view = memoryview(self._whole("buffer")).toreadonly()
        self._views.append(view)
        return view

    def numpy(self, dtype=np.uint8) -> np.ndarray:
        """A read-only zero-copy array of the object's bytes as `dtype`, valid until release."""
        view = self._whole("numpy()").view(dtype)
        view.flags.writeable = False
        return view

    def tensor(self, dtype=None):
        """A CPU torch tensor holding a copy of the object's bytes (torch.uint8 unless
        `dtype`). The copy is the caller's and outlives the lease; for zero copies, read
        through `numpy()` (read-only) within the lease."""
        import torch
        return torch.from_numpy(self._whole("tensor()").copy()).view(dtype or torch.uint8)

    def read(self, offset: int, length: int) -> np.ndarray:
        """A read-only uint8 view of the object's bytes [offset, offset + length). On a ranged
        lease they must lie inside one of its ranges."""
        self._refuse_if_ended("read()")
        if self.ranges is None:
            if offset < 0 or length < 0 or offset + length > self.size:
                raise InvalidArgument(f"bytes [{offset}, {offset + length}) are outside the object's {self.size}")
            at = offset
        else:
            i = bisect.bisect_right(self._starts, offset, key=lambda item: item[0][0]) - 1
            while i >= 0 and sum(self._starts[i][0]) < offset + length:
                i -= 1  # an earlier, longer range may still cover them
            if i < 0 or length < 0:
                raise InvalidArgument(f"bytes [{offset}, {offset + length}) are not in this lease's ranges")
            (start, _), packed_at = self._starts[i]
            at = packed_at + offset - start
        view = self._array[at:at + length]
        view.flags.writeable = False
        return view

    def verify(self) -> bool:
        """Recompute the xxh3-128 of the bytes and compare it with the put's checksum (on a
        ranged lease: the checksum the home computed over the ranges it sent)."""
        return xxhash.xxh3_128_digest(self._array) == self.checksum

    def release(self) -> None:
        lease_id = self.detach()
        if lease_id is not None and not (self._core is not None and self._core.closed):
            self._release(lease_id)  # (a closed connection's leases ended with it)

    def detach(self) -> int | None:
        """End the lease here without telling the daemon, and return its id for a caller
        that releases many in one frame (Client.release_many); None if it had ended, or if it
        never was the daemon's (lease_id 0: a copy read from the shared index)."""
        if self._done:
            return None
        self._done = True
        for view in self._views:
            try:
                view.release()
            except BufferError:
                pass  # something (a numpy array) still exports it: it stays readable
        self._views.clear()
        return self.lease_id or None

    def __enter__(self) -> ReadLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    async def __aenter__(self) -> ReadLease:
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"ReadLease({self.object_id!r}, {self.size} B, tier={self.tier})"
