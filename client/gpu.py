"""Engine side of the GPU tier: map the daemon's device buffer, copy device copies out of it.

The daemon exports its GPU tier buffer once (op gpu_handle -> GpuHandleReply). An engine
process maps it once (`GpuMapping(handle)`; a second mapping of the same export in the same
process shares the first's) and then reads the extents that gets with `gpu=True` lease to it:
a gpu-tier GetReply's `offset`/`size` address this buffer. The daemon never frees or rewrites
an extent while the engine holds its lease, so the engine copies out (or reads in place)
before it releases.

torch is imported inside functions only: `import client` stays light (no torch) for engines
that never touch the GPU tier. CUDA refuses to open an IPC handle in the process that exported
it, so the daemon's own process cannot map its buffer this way.
"""

from __future__ import annotations

import threading
import weakref

from kvstore import messages as m
from kvstore.errors import InvalidArgument, ServiceError
from kvstore.replies import GpuHandleReply

# (memory handle, offset) -> the mapped uint8 tensor, while any GpuMapping holds it. One mapping
# per buffer and process: every export of the daemon's buffer has the same memory handle (its
# own ref counter slot only), and torch maps a handle once per process anyway.
_MAPPED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# Exports (ref counter name, slot) whose reference this process holds or gave back already: a
# second GpuMapping of the same reply must not give it back twice.
_EXPORTS_SEEN: set[tuple[bytes, int]] = set()
_MAPPED_LOCK = threading.Lock()


def local_device_index(handle: GpuHandleReply) -> int:
    """This process's index of the daemon's GPU: by uuid when the daemon sent one (indexes
    differ under another CUDA_VISIBLE_DEVICES), else the daemon's index as it is."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ServiceError("this process sees no CUDA device, so it cannot map the daemon's GPU tier; "
                           "run the engine with CUDA torch on the daemon's node, or read from the host tier")
    if handle.device_uuid is not None:
        for index in range(count):
            if _uuid(torch.cuda.get_device_properties(index).uuid) == _uuid(handle.device_uuid):
                return index
        raise ServiceError(f"the daemon's GPU (uuid {handle.device_uuid}) is not visible in this process: "
                           "CUDA_VISIBLE_DEVICES hides it; make it visible to the engine")
    if handle.device >= count:
        raise ServiceError(f"the daemon's GPU tier is on its cuda:{handle.device}, but this process sees "
                           f"{count} device(s): run the engine with the daemon's CUDA_VISIBLE_DEVICES")
    return handle.device


def open_ipc_buffer(handle: GpuHandleReply, device: int | None = None):
    """Map the daemon's buffer as a uint8 device tensor of handle.storage_bytes (another
    process only). Prefer GpuMapping, which maps each export once per process."""
    import torch

    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        handle.device if device is None else device, handle.handle, handle.storage_bytes,
        handle.storage_offset_bytes, handle.ref_counter_handle, handle.ref_counter_offset,
        handle.event_handle, handle.event_sync_required,
    )
    # the same rebuild torch.multiprocessing uses for CUDA tensors
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
    return torch._utils._rebuild_tensor(typed, 0, (handle.storage_bytes,), (1,))


class GpuMapping:
    """The daemon's GPU tier buffer mapped into this process. Any thread may copy out of it;
    the mapping lives while this object (or another mapping of the same export) does."""

    def __init__(self, handle: GpuHandleReply | None = None, *, buffer=None):
        """Map the export `handle`; or (`buffer`, see `over`) wrap a tensor, no IPC."""
        if buffer is not None:
            self._mapped = self._buffer = buffer
            self.capacity_bytes = buffer.numel()
            return
        if not isinstance(handle, GpuHandleReply):
            raise InvalidArgument(f"GpuMapping needs the GpuHandleReply of op gpu_handle, not {type(handle).__name__}")
        if handle.capacity_bytes > handle.storage_bytes:
            raise InvalidArgument(f"gpu handle: capacity_bytes {handle.capacity_bytes} exceeds the exported "
                                  f"{handle.storage_bytes} bytes; the reply is corrupt")
        key = (handle.handle, handle.storage_offset_bytes)
        export = (handle.ref_counter_handle, handle.ref_counter_offset)
        with _MAPPED_LOCK:
            mapped = _MAPPED.get(key)
            if mapped is None:
                mapped = open_ipc_buffer(handle, local_device_index(handle))  # holds this export's reference
                _MAPPED[key] = mapped
            elif export not in _EXPORTS_SEEN:  # mapped already: give it back now, as torch.multiprocessing does
                import torch

                torch.UntypedStorage._release_ipc_counter_cuda(*export)
            _EXPORTS_SEEN.add(export)
        self._mapped = mapped  # the cache entry lives while a mapping holds it
        self._buffer = mapped[: handle.capacity_bytes]
        self.capacity_bytes = handle.capacity_bytes

    @classmethod
    def over(cls, buffer) -> GpuMapping:
        """A mapping over a uint8 tensor this process already has (tests on CPU, or a
        buffer the caller mapped itself); no IPC."""
        return cls(buffer=buffer)

    @property
    def device(self):
        """The torch.device the buffer lives on (in this process's numbering)."""
        return self._buffer.device

    def view(self, offset: int, size: int):
        """uint8 tensor over [offset, offset + size) of the buffer, no copy. Valid to read
        only while the lease that handed out this extent is held."""
        self._check_range(offset, size)
        return self._buffer[offset : offset + size]

    def copy_to(self, out, offset: int, size: int, synchronize: bool = True) -> int:
        """Copy the leased extent's `size` bytes at `offset` into the front of `out` (a
        contiguous tensor of any dtype on the buffer's device); returns size.

        synchronize (default): wait for the copy on the current stream, so the lease may be
        released as soon as this returns. False: the copy is only queued on the current
        stream; keep the lease until that stream has passed it, or the daemon may reuse the
        extent under the copy."""
        import torch

        self._check_range(offset, size)
        _front_bytes(out, size, self.device).copy_(self._buffer[offset : offset + size])
        if synchronize and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return size

    def close(self) -> None:
        """Let go of the mapping (idempotent); the export is unmapped when the last
        GpuMapping of it goes."""
        self._mapped = self._buffer = None

    def _check_range(self, offset: int, size: int) -> None:
        if self._buffer is None:
            raise InvalidArgument("this GpuMapping is closed; map the gpu handle again")
        if type(offset) is not int or type(size) is not int or offset < 0 or size <= 0 \
                or offset + size > self.capacity_bytes:
            raise InvalidArgument(f"extent ({offset!r}, {size!r}) is not inside the "
                                  f"{self.capacity_bytes}-byte GPU tier: pass a gpu-tier GetReply's offset and size")


def op_get_into_device(core, key, out, namespace: str | None, expect=None):
    """Client.get_into_device: the object's bytes into the front of `out` (a contiguous torch
    tensor); its size, or None on a miss. With the daemon's GPU tier mapped (once per client),
    a device copy is copied device to device; else (no GPU tier, no room on it) the host
    lease is copied in, by DMA where the client pinned its arena (client/pinning.py)."""
    if core.gpu_mapping is None:
        try:
            core.gpu_mapping = GpuMapping((yield from core.op_simple(m.GpuHandle())))
        except (InvalidArgument, ServiceError):  # the daemon runs no GPU tier, or this process
            core.gpu_mapping = False               # cannot map it (no CUDA): host reads
    mapping = core.gpu_mapping or None
    lease = yield from core.op_get(key, namespace, None, None, expect, gpu=mapping is not None)
    if lease is None:
        return None
    with lease:
        if lease.device_offset is not None:
            return mapping.copy_to(out, lease.device_offset, lease.size)
        return _host_to_tensor(lease.numpy(), out)


def host_tensor(array):
    """A zero-copy torch tensor over a read-only numpy array (a lease's view). torch warns
    that it cannot protect such memory; the callers only read it, before the lease ends."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(array)


def _host_to_tensor(src, out) -> int:
    _front_bytes(out, src.size).copy_(host_tensor(src))
    return src.size


def _front_bytes(out, size: int, device=None):
    """The first `size` bytes of `out` as a uint8 tensor to copy into; InvalidArgument when
    `out` is no contiguous torch tensor (on `device`, if given) of at least that many bytes."""
    import torch

    if not isinstance(out, torch.Tensor):
        where = "" if device is None else f" on {device}"
        raise InvalidArgument(f"out must be a torch.Tensor{where}, not {type(out).__name__}")
    if device is not None and out.device != device:
        raise InvalidArgument(f"out is on {out.device}, but the daemon's GPU tier is on {device} "
                              f"in this process: allocate out on {device}")
    if not out.is_contiguous():
        raise InvalidArgument("out is not contiguous: pass a contiguous tensor (copy into a contiguous "
                              "one, then into your strided view)")
    out_bytes = out.numel() * out.element_size()
    if out_bytes < size:
        raise InvalidArgument(f"the object is {size} bytes, out only {out_bytes} "
                              f"({tuple(out.shape)} {out.dtype}): pass a larger tensor")
    return out.reshape(-1).view(torch.uint8)[:size]


def _uuid(value) -> str:
    """A device uuid as torch and nvidia-smi print it, compared without the "GPU-" prefix."""
    text = str(value).strip().lower()
    return text[4:] if text.startswith("gpu-") else text
