"""Host arenas as pinned memory for CUDA, where the process already uses CUDA.

A GPU reader copies a lease's bytes to the device; from pageable memory the driver first
copies them into its own pinned bounce buffer, from registered (pinned) memory the copy
engine reads them directly (DMA). The client registers each arena it maps with
`cudaHostRegister` when torch is already imported and sees a CUDA device: an engine has
torch loaded long before it connects, and a client without torch never imports it here.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger("kvstore.client")

CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process


def pin_for_cuda(mapping) -> str:
    """Register `mapping` (a writable mmap) as pinned memory if CUDA is in use here; what
    happened, as one phrase ("pinned ..." or why not). Never raises: an unpinned arena still
    works, at the pageable copy's speed."""
    torch = sys.modules.get("torch")
    if torch is None:
        return "not pinned: torch is not imported in this process"
    try:
        if not torch.cuda.is_available():
            return "not pinned: torch sees no CUDA device"
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        err = torch.cuda.cudart().cudaHostRegister(address, len(mapping), CUDA_HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            return f"not pinned: cudaHostRegister failed with CUDA error {int(err)}"
    except Exception as exc:  # a broken driver must not break the store
        return f"not pinned: {type(exc).__name__}: {exc}"
    return f"pinned {len(mapping)} bytes for CUDA (DMA copies)"
