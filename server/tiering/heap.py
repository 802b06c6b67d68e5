"""The daemon's C heap: how big allocations are made, and giving free pages back.

The host index's columns (server/tiering/object_table.py) grow by doubling, up to hundreds
of MiB at 10 M objects. glibc serves an allocation from its heap once a freed mmap chunk of
that size raised its dynamic mmap threshold (up to 32 MiB), and a doubled column then lands
in the heap among the holes the last ones left: at 3 M objects the daemon's RssAnon grew
~197 B per object that way against ~163 B with every allocation of 1 MiB or more its own
mapping (measured in process, issue 43's note). A fixed threshold also stops the dynamic one.
"""

from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_FROM = 1 << 20  # allocations of this size or more: a mapping each, unmapped when freed


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def map_large_allocations() -> bool:
    """Make every allocation of MMAP_FROM bytes or more a mapping of its own (glibc), so
    that a freed column goes back to the OS at once. False where there is no glibc."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, MMAP_FROM))


def give_back_heap() -> None:
    """Return the C heap's free pages to the OS (glibc's malloc_trim); a no-op elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
