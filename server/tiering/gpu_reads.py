"""The GPU tier in the chain: device copies of host objects, leased to engines on this node.

    get(gpu=True) of a host hit -> the object's device copy (tiers/gpu_copies.py), made now if
                                   there is room: the host bytes are held while they are
                                   copied in the default executor, off the event loop
                                -> a read lease on the copy's extent of the GPU buffer, which
                                   the engine mapped once by CUDA IPC (op gpu_handle)
    no room, a copy underway,    -> the host lease, as a get without gpu
    or the copy failed (logged)
    the host object leaves       -> its copy is forgotten (freed after its last reader)

The host arena keeps every object; the GPU tier only caches copies for local readers, so an
object is never only on the GPU. Made at start, once the probe found CUDA (`[gpu] enabled`).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from kvstore.replies import GpuHandleReply
from kvstore.server.tiering.host import HostTier, Namespace
from kvstore.server.later import MaybeAwaitable
from kvstore.server.tiering.objects import ObjectEntry
from kvstore.tiers.allocator import Extent
from kvstore.tiers.gpu_copies import GpuCopies

log = logging.getLogger("kvstore.gpu")


class GpuReads:
    def __init__(self, device, host: HostTier):
        """device: a tiers.gpu.GpuTier (or anything with its surface)."""
        self.device = device
        self.copies = GpuCopies(device)
        self.host = host

    def lease_copy(self, ns: Namespace, entry: ObjectEntry) -> MaybeAwaitable[Extent | None]:
        """A reader of the entry's device copy (release it with `release`): its extent, or
        None when the host must serve it (no room, or a copy underway)."""
        digest = entry.object_id.digest
        extent = self.copies.acquire(ns.name, digest)
        if extent is not None:
            return extent
        extent = self.copies.begin_copy(ns.name, digest, entry.size)
        if extent is None:
            return None
        return self._copy_in(ns, entry, extent)

    async def _copy_in(self, ns: Namespace, entry: ObjectEntry, extent: Extent) -> Extent | None:
        digest = entry.object_id.digest
        self.host.hold(entry)  # its host extent stays put under the copy
        src = np.frombuffer(ns.arena.view(entry.extent)[:entry.size], dtype=np.uint8)
        copy = asyncio.get_running_loop().run_in_executor(None, self.device.copy_from_host, extent, src)

        def copied(done: asyncio.Future) -> None:
            """On the loop, once the copy thread stopped (even if the get that started it was
            cancelled meanwhile: the room and the hold are given back only then)."""
            self.host.release_hold(entry)
            error = None if done.cancelled() else done.exception()
            if error is not None:  # a CUDA error: the host copy serves readers instead
                log.warning("event=gpu_copy_failed namespace=%s object=%s error=%r", ns.name, entry.object_id.hex,
                            error)
            self.copies.finish_copy(ns.name, digest, not done.cancelled() and error is None)
        copy.add_done_callback(copied)
        try:
            await asyncio.shield(copy)
        except Exception:  # logged by copied()
            return None
        return self.copies.acquire(ns.name, digest)  # None if forgotten meanwhile

    def release(self, namespace: str, digest: bytes) -> None:
        self.copies.release(namespace, digest)

    def forget(self, namespace: str, digest: bytes) -> None:
        self.copies.forget(namespace, digest)

    def handle(self) -> GpuHandleReply:
        """The buffer exported for one engine process (each export its own reference)."""
        return self.device.ipc_handle()

    def stats(self) -> dict:
        return self.copies.stats()

    def check_integrity(self) -> None:
        self.copies.check_integrity()
