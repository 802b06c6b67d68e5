"""Device copies of host objects: the GPU tier's index, above the host arena.

An object is content-addressed and immutable once committed, so a device copy checked at copy
time stays right; the host arena keeps the object, and the GPU tier only caches copies of it
for local engines to read over CUDA IPC (docs/architecture.md, "Design choices").

    copy_in(key, host bytes):  held already -> touch it, return its extent.
                               larger than the tier, or no room even with every idle copy
                               gone -> None (nothing evicted in vain).
                               else evict idle copies, least recently used first, until an
                               extent fits; copy the bytes in; the copy is most recently used.
    acquire(key):              a reader: count it, touch it, return its extent (None: no copy).
    release(key):              the reader leaves; a forgotten copy goes with its last reader.
    forget(key):               the host object is gone: drop its copy now, or when its last
                               reader leaves (until then no new reader gets it).
    begin_copy / finish_copy:  copy_in in two phases, for a copy made off the event loop: room
                               is taken and held (no reader sees it, nothing evicts it) until
                               finish_copy publishes the copy or gives the room back.

A busy copy (one with a reader, or being written) is never evicted or freed: an engine may
be reading its extent. The index owns every extent of its device (check_integrity holds it
to that).

`device` is anything with the GpuTier surface: can_alloc, alloc, free, copy_from_host,
capacity_bytes, allocator, check_integrity. Not thread-safe: the daemon's event loop thread
is the only caller, as for the tier itself (only device.copy_from_host, between begin_copy
and finish_copy, may run elsewhere).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.tiers.allocator import Extent

_log = logging.getLogger(__name__)

Key = tuple[str, bytes]  # (namespace, object id digest)


@dataclass(slots=True)
class _Copy:
    extent: Extent
    size: int  # the object's bytes at the front of the extent
    readers: int = 0
    forgotten: bool = False  # its host object is gone; freed when the last reader leaves
    copying: bool = False  # between begin_copy and finish_copy: room held, bytes not there yet

    @property
    def busy(self) -> bool:
        """Neither evicted nor freed now: someone reads it, or is writing it."""
        return self.readers > 0 or self.copying


class GpuCopies:
    """Index of the device copies in one GPU tier, in least-recently-used order."""

    def __init__(self, device):
        self._device = device
        self._copies: OrderedDict[Key, _Copy] = OrderedDict()  # oldest use first
        self.num_copies_in = 0
        self.num_gpu_hits = 0
        self.num_gpu_evictions = 0

    # -- queries ------------------------------------------------------------------------------

    def holds(self, namespace: str, digest: bytes) -> bool:
        """True when a reader could acquire a copy of the object now (no LRU touch)."""
        copy = self._copies.get((namespace, digest))
        return copy is not None and not copy.forgotten and not copy.copying

    def stats(self) -> dict:
        """A snapshot for the daemon's stats document ("gpu" table)."""
        return {
            "objects": sum(not c.forgotten and not c.copying for c in self._copies.values()),
            "copying": sum(c.copying for c in self._copies.values()),
            "readers": sum(c.readers for c in self._copies.values()),
            "used_bytes": self._device.allocator.used_bytes,
            "capacity_bytes": self._device.capacity_bytes,
            "num_copies_in": self.num_copies_in,
            "num_gpu_hits": self.num_gpu_hits,
            "num_gpu_evictions": self.num_gpu_evictions,
        }

    # -- changes ------------------------------------------------------------------------------

    def copy_in(self, namespace: str, digest: bytes, host_bytes, size: int) -> Extent | None:
        """Copy `size` bytes of a committed host object to the device; its extent, or None when
        it cannot be placed (larger than the tier, every copy in the way is busy, or another
        copy of the same id is being written or still read after a forget). The caller keeps
        host_bytes (a memoryview or uint8 array over the arena) valid for the call only; the
        copy is on the device when this returns. Idempotent: a held copy is touched and
        returned as it is. Blocks for the copy: begin_copy / finish_copy make it elsewhere."""
        key = (namespace, digest)
        copy = self._copies.get(key)
        if copy is not None:
            if copy.forgotten or copy.copying:
                return None  # the host serves the object meanwhile
            self._copies.move_to_end(key)
            return copy.extent
        src = _host_u8(host_bytes, size)
        extent = self.begin_copy(namespace, digest, size)
        if extent is None:
            return None
        try:
            self._device.copy_from_host(extent, src)
        except BaseException:
            self.finish_copy(namespace, digest, copied=False)
            raise
        self.finish_copy(namespace, digest, copied=True)
        return extent

    def begin_copy(self, namespace: str, digest: bytes, size: int) -> Extent | None:
        """Room for a copy of `size` bytes, made as copy_in makes it (evicting idle copies),
        and held for the caller, who copies the object's bytes to the front of the extent (any
        thread: device.copy_from_host touches no index) and then calls finish_copy on this
        thread. None when there is no room, or when the id has a copy already (holds says
        whether it is readable)."""
        if type(size) is not int or size <= 0:
            raise InvalidArgument(f"gpu copies: size must be a positive int, got {size!r}")
        key = (namespace, digest)
        if key in self._copies or not self._make_room(size):
            return None
        extent = self._device.alloc(size)
        if extent is None:  # _make_room said it fits: the allocator disagrees with the index
            raise RuntimeError(f"gpu tier: alloc({size}) failed after making room; run check_integrity")
        self._copies[key] = _Copy(extent, size, copying=True)
        return extent

    def finish_copy(self, namespace: str, digest: bytes, copied: bool) -> bool:
        """End a begin_copy: publish the copy (copied True: its bytes are on the device), or
        give its room back (copied False, or the object was forgotten meanwhile). True when
        the copy is now readable."""
        key = (namespace, digest)
        copy = self._copies.get(key)
        if copy is None or not copy.copying:
            raise InvalidArgument(f"gpu copies: finish_copy of {namespace}/{digest.hex()} without begin_copy")
        copy.copying = False
        if not copied or copy.forgotten:
            self._drop(key)
            return False
        self._copies.move_to_end(key)
        self.num_copies_in += 1
        return True

    def acquire(self, namespace: str, digest: bytes) -> Extent | None:
        """A reader of the object's copy: its extent (bytes [offset, offset + size) hold the
        object), or None when there is none. Each acquire needs one release."""
        key = (namespace, digest)
        copy = self._copies.get(key)
        if copy is None or copy.forgotten or copy.copying:
            return None
        copy.readers += 1
        self._copies.move_to_end(key)
        self.num_gpu_hits += 1
        return copy.extent

    def release(self, namespace: str, digest: bytes) -> None:
        """One reader leaves (its lease ended: release, disconnect or timeout). A release
        without an acquire raises InvalidArgument and changes nothing."""
        key = (namespace, digest)
        copy = self._copies.get(key)
        if copy is None or copy.readers == 0:
            raise InvalidArgument(
                f"gpu copies: release of {namespace}/{digest.hex()} without a reader "
                "(released twice, or never acquired)")
        copy.readers -= 1
        if copy.forgotten and copy.readers == 0:
            self._drop(key)

    def forget(self, namespace: str, digest: bytes) -> bool:
        """The host object was deleted or expired: drop its copy (after its last reader, or at
        finish_copy if it is being written). True when there was a copy. Idempotent."""
        key = (namespace, digest)
        copy = self._copies.get(key)
        if copy is None or copy.forgotten:
            return False
        if copy.busy:
            copy.forgotten = True
        else:
            self._drop(key)
        return True

    def forget_namespace(self, namespace: str) -> int:
        """forget() every copy of one namespace (it was dropped); how many there were."""
        return sum(self.forget(ns, digest) for ns, digest in list(self._copies) if ns == namespace)

    # -- integrity ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError if the index, its readers and the device's allocator disagree."""
        self._device.check_integrity()
        allocator = self._device.allocator
        for (namespace, digest), copy in self._copies.items():
            name = f"gpu copy {namespace}/{digest.hex()}"
            if not allocator.is_allocated(copy.extent):
                raise RuntimeError(f"{name}: its extent {copy.extent} is not allocated")
            if not 0 < copy.size <= copy.extent.length:
                raise RuntimeError(f"{name}: size {copy.size} does not fit its extent {copy.extent}")
            if copy.readers < 0 or (copy.forgotten and not copy.busy) or (copy.copying and copy.readers):
                raise RuntimeError(f"{name}: {copy.readers} readers, forgotten={copy.forgotten}, "
                                   f"copying={copy.copying}")
        if allocator.num_allocated != len(self._copies):
            raise RuntimeError(f"gpu tier has {allocator.num_allocated} extents allocated but "
                               f"{len(self._copies)} copies indexed (an extent leaked or is shared)")
        indexed = sum(c.extent.length for c in self._copies.values())
        if indexed != allocator.used_bytes:
            raise RuntimeError(f"gpu copies hold {indexed} bytes, the allocator {allocator.used_bytes}")

    # -- internals ----------------------------------------------------------------------------

    def _make_room(self, size: int) -> bool:
        """Evict idle copies, least recently used first, until `size` bytes fit; False
        (having evicted nothing) when they would not fit even with every idle copy gone."""
        if size > self._device.capacity_bytes or not self._fits_around_busy(size):
            return False
        victims = (key for key, copy in list(self._copies.items()) if not copy.busy)
        while not self._device.can_alloc(size):
            key = next(victims, None)
            if key is None:  # unreachable while _fits_around_busy is right; say so if not
                raise RuntimeError(f"gpu tier: no room for {size} bytes after evicting every idle copy")
            self._drop(key)
            self.num_gpu_evictions += 1
            _log.debug("event=gpu_copy_evicted namespace=%s id=%s", key[0], key[1].hex())
        return True

    def _fits_around_busy(self, size: int) -> bool:
        """Would `size` bytes fit in one gap between the busy copies' extents?"""
        alignment = self._device.allocator.alignment
        needed = -(-size // alignment) * alignment
        position = 0
        for extent in sorted((c.extent for c in self._copies.values() if c.busy), key=lambda e: e.offset):
            if extent.offset - position >= needed:
                return True
            position = extent.end
        return self._device.capacity_bytes - position >= needed

    def _drop(self, key: Key) -> None:
        self._device.free(self._copies.pop(key).extent)


def _host_u8(host_bytes, size: int) -> np.ndarray:
    """The object's first `size` bytes as a flat uint8 array (no copy)."""
    if type(size) is not int or size <= 0:
        raise InvalidArgument(f"gpu copies: size must be a positive int, got {size!r}")
    array = np.frombuffer(host_bytes, dtype=np.uint8) if not isinstance(host_bytes, np.ndarray) \
        else host_bytes.reshape(-1).view(np.uint8)
    if array.size < size:
        raise InvalidArgument(f"gpu copies: {size} bytes asked for, the host buffer holds {array.size}")
    return array[:size]
