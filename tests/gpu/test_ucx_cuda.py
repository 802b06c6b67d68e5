"""CUDA buffers through the UCX peer transport, unchanged (GPUDirect where the hardware has
it): a device tensor is sent as a peer_put payload and a peer_get lands in a device tensor.
Runs on the lent GPU machine (scripts/gpu_check.sh runs `pytest -m gpu tests/gpu`)."""

import asyncio

import numpy as np
import pytest
import torch
import xxhash

from kvstore.identity import ObjectId, StateDescriptor
from kvstore.peer_messages import PeerGet, PeerPut, RemoteMeta
from kvstore.server.peer.client import connect_peer
from bench.peer_service import InMemoryBackend
from kvstore.server.peer.service import PeerService
from kvstore.server.peer.transports import make_transport

pytestmark = [pytest.mark.gpu, pytest.mark.ucx]
SECRET = b"gpu-ucx-secret-0123456789"
SIZE = 4 << 20


def test_cuda_tensors_travel_over_ucx_bit_exact():
    try:
        transport = make_transport("ucx")
    except ImportError as exc:
        pytest.skip(f"ucxx does not load here ({exc}); pip install ucxx-cu12")
    host = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
    meta = RemoteMeta(SIZE, xxhash.xxh3_128_digest(host), StateDescriptor("ns", "m", "r1"))
    oid = ObjectId(b"\x05" * 32)
    src = torch.from_numpy(host).cuda()
    out = torch.zeros(SIZE, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    backend = InMemoryBackend()

    async def scenario():
        service = PeerService(backend, transport, SECRET, "b", 5.0)
        address = await service.start("127.0.0.1:0")
        try:
            link = await connect_peer(transport, address, SECRET, "a", 5.0)
            put = PeerPut("ns", oid, SIZE, meta.checksum, meta.descriptor).to_args()
            stored = await link.call("peer_put", put, payload=src)  # device -> peer's host memory
            got = await link.call("peer_get", PeerGet("ns", oid).to_args(), into=lambda r: out)  # -> device
            await link.close()
            return stored, got
        finally:
            await service.stop()

    stored, got = asyncio.run(scenario())
    assert stored == {"stored": True}  # the peer verified the bytes against the checksum
    assert bytes(backend.objects[("ns", oid)][1]) == host.tobytes()
    assert got["payload_bytes"] == SIZE
    torch.cuda.synchronize()
    assert np.array_equal(out.cpu().numpy(), host)
