"""HostArena: one namespace's host memory, a memfd mapped by the daemon, carved into extents.

Objects of up to 3.5 KiB take a slot of their size class (tiers/slabs.py: at most 1.25x their
size from 512 B up); larger ones take whole 4 KiB pages, page-aligned.

The arena is an anonymous memfd (no name under /dev/shm, so nothing leaks when the daemon
dies: the memory goes when the last fd and mapping go). The daemon maps it once; local clients
receive `arena.fd` over the Unix socket (SCM_RIGHTS) and map it themselves, so object bytes
never travel through the socket.

With `prefault=True` the memory is allocated (fallocate) and the page tables populated
(MADV_POPULATE_WRITE) at construction: first-touch faults cost about 10x a copy into warm memory,
and that price belongs to startup, not to the put path. Allocating up front also means a host short
of memory fails here with CapacityError instead of a SIGBUS on some later write. Both run in steps
of PREFAULT_STEP_BYTES and check `cancel` between them: a daemon told to stop while it prefaults
a large arena (about 2 s per GiB here) stops within a step instead of finishing the arena first.

With `pages` "hugetlb" the memfd is made of the host's reserved huge pages, with "thp" its
mapping is madvised for transparent huge pages (tiers/huge_pages.py says which a host offers).

The file is sealed against shrinking and growing, so a client holding the fd cannot ftruncate
it and make the daemon's own accesses fault.

Not thread-safe: the daemon's event loop thread is the only caller.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading

from kvstore.errors import CapacityError, InvalidArgument, ServiceError
from kvstore.tiers.allocator import Extent, ExtentAllocator
from kvstore.tiers.slabs import SlabAllocator

_log = logging.getLogger(__name__)

PAGE_BYTES = 4096
# Linux caps memfd names at 249 bytes (not characters: a namespace of 100 CJK characters is
# 300); the name only shows in /proc/<pid>/fd (as "memfd:...") to help whoever debugs, so a
# long namespace is cut rather than refused.
MAX_MEMFD_NAME_BYTES = 240


def memfd_name(name: str) -> str:
    """`name` cut to MAX_MEMFD_NAME_BYTES of UTF-8 at a character boundary: a name
    os.memfd_create takes for any namespace (the arena's and its shared index's)."""
    return name.encode()[:MAX_MEMFD_NAME_BYTES].decode(errors="ignore")  # drops a character cut in two
# Prefault granularity: how long a stop waits for the step in progress (~0.5 s here).
PREFAULT_STEP_BYTES = 256 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+


class HostArena:
    """Host memory of one namespace: a memfd, its mapping, and a SlabAllocator over it.

    Buffers: `view()` returns a memoryview into the mapping; the arena owns the memory, and the
    caller must drop (or `release()`) every view before `close()`, see there.
    """

    def __init__(self, namespace: str, capacity_bytes: int, prefault: bool = True,
                 cancel: threading.Event | None = None, pages: str = "off"):
        """pages: "hugetlb", "thp" or "off" (tiers/huge_pages.py: choose). Reserved huge
        pages that cannot be had after all (taken meanwhile) fall back to 4 KiB pages, logged;
        `pages` then says what the arena got."""
        if not isinstance(namespace, str) or not namespace or "\0" in namespace:
            raise InvalidArgument(f"namespace must be a non-empty string, got {namespace!r}")
        if type(capacity_bytes) is not int or capacity_bytes <= 0 or capacity_bytes % PAGE_BYTES:
            raise InvalidArgument(
                f"arena capacity_bytes must be a positive multiple of {PAGE_BYTES} "
                f"(the page size), got {capacity_bytes!r}; round it up to whole pages"
            )
        self._namespace = namespace
        self._capacity = capacity_bytes
        self.prefaulted = prefault  # all of it allocated at once; else where objects land
        self._allocator = SlabAllocator(ExtentAllocator(capacity_bytes, PAGE_BYTES))
        self._mmap: mmap.mmap | None = None
        self._fd = -1
        self.pages = pages
        if pages == "hugetlb":
            try:
                self._make(prefault, cancel, os.MFD_HUGETLB)
                return
            except (OSError, CapacityError) as exc:  # the reserved pages went to another mapping meanwhile
                _log.warning("event=huge_pages_fallback namespace=%s arena_bytes=%d error=%r pages=4KiB",
                             namespace, capacity_bytes, exc)
                self.pages = "off"
        self._make(prefault, cancel, 0)

    def _make(self, prefault: bool, cancel: threading.Event | None, huge_flag: int) -> None:
        capacity_bytes = self._capacity
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | huge_flag
        self._fd = os.memfd_create(memfd_name(f"kvstore-{self._namespace}"), flags)
        try:
            os.ftruncate(self._fd, capacity_bytes)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            steps = range(0, capacity_bytes, PREFAULT_STEP_BYTES) if prefault else ()
            for offset in steps:
                self._reserve(offset, min(PREFAULT_STEP_BYTES, capacity_bytes - offset), cancel)
            self._mmap = mmap.mmap(self._fd, capacity_bytes, flags=mmap.MAP_SHARED)
            if self.pages == "thp":
                self._advise_huge()
            for offset in steps:
                self._populate(offset, min(PREFAULT_STEP_BYTES, capacity_bytes - offset), cancel)
        except BaseException:
            if self._mmap is not None:
                self._mmap.close()
                self._mmap = None
            os.close(self._fd)
            self._fd = -1
            raise

    def _advise_huge(self) -> None:
        """Let the kernel back the mapping with transparent huge pages (before it is faulted)."""
        try:
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, AttributeError) as exc:
            _log.info("event=huge_pages_unavailable namespace=%s error=%r pages=4KiB", self._namespace, exc)
            self.pages = "off"

    def _populate(self, offset: int, length: int, cancel: threading.Event | None) -> None:
        self._check_cancel(cancel)
        try:
            self._mmap.madvise(MADV_POPULATE_WRITE, offset, length)
        except OSError as e:
            if e.errno != errno.EINVAL:  # an older kernel: touch each page (the arena is all zeros)
                raise
            self._mmap[offset:offset + length:PAGE_BYTES] = bytes(-(-length // PAGE_BYTES))

    def _check_cancel(self, cancel: threading.Event | None) -> None:
        if cancel is not None and cancel.is_set():
            raise ServiceError(f"host arena for namespace {self._namespace!r}: prefault interrupted (stopping)")

    def _reserve(self, offset: int, length: int, cancel: threading.Event | None) -> None:
        self._check_cancel(cancel)
        try:
            os.posix_fallocate(self._fd, offset, length)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            raise CapacityError(
                f"host arena for namespace {self._namespace!r}: cannot allocate "
                f"{self._capacity} bytes of memory ({e.strerror}); lower the host tier capacity"
            ) from None

    # -- identity and stats -------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def fd(self) -> int:
        """The memfd, for the server to pass to clients over SCM_RIGHTS. The arena owns it:
        send it (the kernel duplicates it), never close it. -1 after close()."""
        return self._fd

    @property
    def allocator(self) -> SlabAllocator:
        """The allocator, for stats (used_bytes, slab_free_bytes, largest_free_bytes...);
        change it only through the arena."""
        return self._allocator

    @property
    def closed(self) -> bool:
        return self._fd < 0

    # -- extents ------------------------------------------------------------------------------

    def can_alloc(self, size_bytes: int) -> bool:
        """True when alloc(size_bytes) would succeed now."""
        return self._allocator.can_alloc(size_bytes)

    def footprint(self, size_bytes: int) -> int:
        """The arena bytes an object of size_bytes takes: its size class, or whole pages."""
        return self._allocator.footprint(size_bytes)

    def alloc(self, size_bytes: int) -> Extent | None:
        """An extent of at least size_bytes, or None when there is no room: up to 3.5 KiB a slot
        of its size class (64-byte aligned), else whole pages (page-aligned). The bytes are
        not cleared: they hold whatever the extent held before."""
        self._check_open()
        return self._allocator.alloc(size_bytes)

    def alloc_many(self, size_bytes: int, count: int) -> list[Extent]:
        """Up to `count` extents of size_bytes, as `count` allocs would give them; fewer (maybe
        none) when there is no more room."""
        self._check_open()
        return self._allocator.alloc_many(size_bytes, count)

    def free(self, extent: Extent) -> None:
        """Give an extent back. The caller must hold no view of it and no lease on it."""
        self._allocator.free(extent)

    def trim_front(self, extent: Extent, nbytes: int) -> Extent:
        """Give back the first `nbytes` (whole pages) of an extent of more than a page and keep
        the rest, which is returned. The same rule as free for the part given back."""
        self._check_open()
        return self._allocator.trim_front(extent, nbytes)

    def compact(self) -> bool:
        """Housekeeping: the allocator's maps rebuilt once frees left them mostly empty."""
        return not self.closed and self._allocator.compact()

    def view(self, extent: Extent) -> memoryview:
        """A writable zero-copy memoryview of the extent's bytes (or any range inside the
        arena). The arena owns the memory; the view is valid until close(), and the caller
        must release it before close() (a live view keeps the whole mapping alive)."""
        self._check_open()
        if not isinstance(extent, Extent) or extent.end > self._capacity:
            raise InvalidArgument(
                f"view({extent!r}): not an extent inside this arena of {self._capacity} bytes"
            )
        return memoryview(self._mmap)[extent.offset : extent.end]

    def check_integrity(self) -> None:
        """Raise RuntimeError if the allocator or the memfd is inconsistent."""
        self._check_open()
        self._allocator.check_integrity()
        size = os.fstat(self._fd).st_size
        if size != self._capacity or len(self._mmap) != self._capacity:
            raise RuntimeError(
                f"arena {self._namespace!r}: memfd is {size} bytes and the mapping "
                f"{len(self._mmap)}, expected {self._capacity}"
            )

    # -- life ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the fd and unmap. Idempotent.

        Callers must drop every memoryview from view() first. If some are still alive, close()
        does not raise: it logs a warning and leaves the unmapping to the last of those views
        (the mapping stays valid, and its memory held, until they are gone). Clients that
        mapped the fd keep their own mapping either way.
        """
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._mmap is not None:
            mapping, self._mmap = self._mmap, None
            try:
                mapping.close()
            except BufferError:
                _log.warning(
                    "event=arena_close_deferred namespace=%s bytes=%d reason=live_memoryviews "
                    "hint=release_views_before_close",
                    self._namespace,
                    self._capacity,
                )

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._mmap is None:
            raise RuntimeError(f"host arena {self._namespace!r} is closed")
