"""Host arenas as pinned memory for CUDA, where the process already uses CUDA.

A GPU reader copies a lease's bytes to the device; from pageable memory the driver first
copies them into its own pinned bounce buffer, from registered (pinned) memory the copy
engine reads them directly (DMA). The client registers each arena it maps with
`cudaHostRegister` when torch is already imported and sees a CUDA device: an engine has
torch loaded long before it connects, and a client without torch never imports it here.

A registration lasts as long as the arena array: when the last lease view of it is gone, the
range is unregistered before the mapping is unmapped. Left registered, the pages stayed pinned
for the life of the process and the next arena mapped at the same address could not be
registered (CUDA error 712, seen on an H200 when one process used two daemons in turn).
A failed runtime call also leaves its error as the thread's last error, which torch's next
kernel launch check reports as its own; that error is read back (cleared) at once.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import weakref

log = logging.getLogger("kvstore.client")

CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process


def pin_for_cuda(mapping, arena) -> str:
    """Register `mapping` (a writable mmap) as pinned memory if CUDA is in use here, until
    `arena` (the array over it that every lease views) is collected; what happened, as one
    phrase ("pinned ..." or why not). Never raises: an unpinned arena still works, at the
    pageable copy's speed."""
    torch = sys.modules.get("torch")
    if torch is None:
        return "not pinned: torch is not imported in this process"
    try:
        if not torch.cuda.is_available():
            return "not pinned: torch sees no CUDA device"
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        err = torch.cuda.cudart().cudaHostRegister(address, len(mapping), CUDA_HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            clear_last_cuda_error()
            return f"not pinned: cudaHostRegister failed with CUDA error {int(err)}"
    except Exception as exc:  # a broken driver must not break the store
        return f"not pinned: {type(exc).__name__}: {exc}"
    # runs while the array is freed, before it lets go of the mapping; at exit the process's
    # end unpins everything anyway
    weakref.finalize(arena, _unpin, torch, address).atexit = False
    return f"pinned {len(mapping)} bytes for CUDA (DMA copies)"


def _unpin(torch, address: int) -> None:
    try:
        if int(torch.cuda.cudart().cudaHostUnregister(address)) != 0:
            clear_last_cuda_error()
    except Exception as exc:  # in a finalizer: say it, never raise
        log.debug("cudaHostUnregister(%#x) failed: %s", address, exc)


def clear_last_cuda_error() -> None:
    """Read (and so reset) the CUDA runtime's last error in this thread, in the runtime library
    the process has loaded (torch's libcudart); a no-op where none is loaded."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()  # dlopen of a loaded library: the same instance
    except Exception as exc:
        log.debug("could not clear the CUDA runtime's last error: %s", exc)
