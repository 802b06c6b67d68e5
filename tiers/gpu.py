"""GPU tier: device memory owned by the daemon, shared with local engines by CUDA IPC.

On a machine without CUDA the tier is absent, not broken: `GpuTier.probe()` says why
(CPU-only torch build, no device visible, driver missing) and never raises; constructing a
`GpuTier` there raises `ServiceError` carrying that reason. torch is imported only inside
functions, so importing this module costs nothing on a CPU-only daemon.

With CUDA the daemon allocates one device buffer per tier at start and carves it into extents
with the host arena's `ExtentAllocator` (same alloc/free/view/check_integrity shape as
`HostArena`, so the same lease rules apply: the daemon never frees an extent under a lease).
Engines get a `GpuHandleReply` (torch's CUDA IPC export of the buffer, as op gpu_handle
sends it), map it once with `client.gpu.open_ipc_buffer` (client side: the client
never imports tiers) and read extents in place. `tiers.gpu_copies.GpuCopies` decides what the
buffer holds: device copies of host objects. (Clients pin the host arena for DMA
themselves: client/pinning.py.) Everything past `probe` runs only on a GPU machine (tests
marked `gpu`).
"""

from __future__ import annotations

import glob
from dataclasses import dataclass

from kvstore.config import GPU_ALIGNMENT_BYTES, GpuConfig
from kvstore.errors import InvalidArgument, ServiceError
from kvstore.replies import GpuHandleReply
from kvstore.tiers.allocator import Extent, ExtentAllocator


@dataclass(frozen=True, slots=True)
class Availability:
    available: bool
    reason: str  # what was found, or why the tier cannot run and what would fix it
    num_devices: int = 0


def _device_nodes() -> list[str]:
    """The device files a CUDA driver exposes (WSL 2: /dev/dxg)."""
    return glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/dxg")


def _driver_note() -> str:
    """What cuda-python (if installed) says about the driver; never raises."""
    try:
        try:
            from cuda.bindings import driver
        except ImportError:
            from cuda import cuda as driver  # cuda-python < 12.6 layout
    except Exception:
        return "cuda-python not installed"
    try:
        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return f"cuda-python: cuInit failed ({getattr(err, 'name', err)})"
        err, count = driver.cuDeviceGetCount()
        return f"cuda-python: driver sees {count} device(s)"
    except Exception as exc:  # no libcuda: the bindings raise instead of returning an error
        return f"cuda-python: no usable driver ({type(exc).__name__}: {exc})"


class GpuTier:
    """One device buffer of `capacity_bytes` on `device`. Not thread-safe: the daemon's tier
    manager calls it from its loop; engines touch the memory only through IPC mappings."""

    name = "gpu"

    @staticmethod
    def probe() -> Availability:
        """Can this machine run the tier? Cheap, idempotent, never raises. Without an NVIDIA
        device node it answers without importing torch (a daemon start stays fast and small)."""
        if not _device_nodes():
            return Availability(False, "no NVIDIA device on this machine (no /dev/nvidia<N>, no WSL /dev/dxg)")
        try:
            import torch
        except Exception as exc:
            return Availability(False, f"torch is not importable ({exc}); install torch with CUDA")
        try:
            if torch.version.cuda is None:
                cause = f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch"
            elif torch.cuda.is_available() and torch.cuda.device_count() > 0:
                count = torch.cuda.device_count()
                name = torch.cuda.get_device_name(0)
                return Availability(True, f"{count} CUDA device(s), first: {name}", count)
            else:
                cause = (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device: "
                         "no driver, or CUDA_VISIBLE_DEVICES hides every device")
        except Exception as exc:
            cause = f"torch.cuda failed ({type(exc).__name__}: {exc})"
        return Availability(False, f"{cause}; {_driver_note()}")

    def __init__(self, config: GpuConfig):
        availability = self.probe()
        if not availability.available:
            raise ServiceError(f"gpu tier unavailable: {availability.reason}")
        if config.device >= availability.num_devices:
            raise InvalidArgument(
                f"gpu.device = {config.device} but only {availability.num_devices} CUDA device(s) present"
            )
        import torch

        self.config = config
        self._allocator = ExtentAllocator(config.capacity_bytes, GPU_ALIGNMENT_BYTES)
        self._buffer = torch.empty(config.capacity_bytes, dtype=torch.uint8, device=f"cuda:{config.device}")

    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    @property
    def allocator(self) -> ExtentAllocator:
        """For stats; change it only through the tier."""
        return self._allocator

    @property
    def closed(self) -> bool:
        return self._buffer is None

    @property
    def device_uuid(self) -> str | None:
        """The device's uuid: names it for an engine whose CUDA_VISIBLE_DEVICES numbers
        devices differently (GpuHandleReply.device_uuid); None where torch does not say."""
        import torch

        uuid = getattr(torch.cuda.get_device_properties(self.config.device), "uuid", None)
        return None if uuid is None else str(uuid)

    def can_alloc(self, size_bytes: int) -> bool:
        return self._allocator.can_alloc(size_bytes)

    def alloc(self, size_bytes: int) -> Extent | None:
        """A 256-byte-aligned extent of at least size_bytes, or None; bytes not cleared."""
        self._check_open()
        return self._allocator.alloc(size_bytes)

    def free(self, extent: Extent) -> None:
        """Give an extent back; no lease and no engine write may be pending on it."""
        self._allocator.free(extent)

    def view(self, extent: Extent):
        """uint8 device tensor over the extent (no copy). The tier owns the memory; the view
        is valid until close()."""
        self._check_open()
        if not isinstance(extent, Extent) or extent.end > self.capacity_bytes:
            raise InvalidArgument(
                f"view({extent!r}): not an extent inside this {self.capacity_bytes}-byte gpu tier"
            )
        return self._buffer[extent.offset : extent.end]

    def copy_from_host(self, extent: Extent, src) -> None:
        """Copy a host uint8 array (an arena view; read only) to the front of `extent`. A
        blocking copy: the bytes are on the device when it returns, so a lease handed out next
        reads whole bytes from any process. The one place GpuCopies touches device memory."""
        import warnings

        import torch

        view = self.view(extent)
        if src.size > view.numel():
            raise InvalidArgument(f"copy_from_host: {src.size} bytes do not fit {extent!r}")
        with warnings.catch_warnings():  # the arena's read-only views: torch only reads them here
            warnings.filterwarnings("ignore", message=".*not writable.*")
            host = torch.from_numpy(src)
        view[: src.size].copy_(host)

    def ipc_handle(self) -> GpuHandleReply:
        """Export the whole buffer for a local engine, which addresses extents by offset; the
        reply op gpu_handle sends as it is. Call it once per gpu_handle request: each export
        carries its own consumer reference (torch's IPC ref counter), which that consumer
        gives back when it unmaps; torch frees the buffer only after every one is back."""
        self._check_open()
        fields = self._buffer.untyped_storage()._share_cuda_()
        return GpuHandleReply(int(fields[0]), bytes(fields[1]), int(fields[2]), int(fields[3]),
                              bytes(fields[4]), int(fields[5]), bytes(fields[6]), bool(fields[7]),
                              self.capacity_bytes, self.device_uuid)

    def check_integrity(self) -> None:
        """Raise RuntimeError if the allocator or the buffer is inconsistent."""
        self._check_open()
        self._allocator.check_integrity()
        if self._buffer.numel() != self.capacity_bytes:
            raise RuntimeError(
                f"gpu tier buffer is {self._buffer.numel()} bytes, expected {self.capacity_bytes}"
            )

    def close(self) -> None:
        """Drop the buffer (idempotent). Engines must have released their mappings first;
        torch keeps the memory alive while an exported handle is still mapped elsewhere."""
        self._buffer = None

    def _check_open(self) -> None:
        if self._buffer is None:
            raise RuntimeError("gpu tier is closed")

