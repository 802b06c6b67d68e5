"""One conformance suite for every peer transport (tcp always; ucx with marker `ucx`)."""

import asyncio
import socket
import struct
import time

import numpy as np
import pytest
from peer_helpers import SECRET, TRANSPORTS, make_object, run, services, transport_or_skip

from kvstore.protocol import MAX_FRAME_BYTES, Request
from bench.peer_service import InMemoryBackend
from kvstore.server.peer.service import PeerRead
from kvstore.server.peer.client import connect_peer
from kvstore.server.peer.tcp import TcpTransport
from kvstore.peer_messages import PeerGet, PeerPut
from kvstore.tiers.remote import PeerUnavailable

MiB = 1 << 20


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return transport_or_skip(request.param)


def test_round_trip_4mib_bit_exact_into_caller_buffer(transport):
    oid, meta, data = make_object(4 * MiB, seed=1)
    backend = InMemoryBackend()

    async def scenario():
        async with services(transport, backends=[backend]) as started:
            _, address = started["b"]
            link = await connect_peer(transport, address, SECRET, "a", 2.0)
            put = PeerPut("ns", oid, meta.size, meta.checksum, meta.descriptor).to_args()
            assert await link.call("peer_put", put, payload=data) == {"stored": True}
            out = np.zeros(4 * MiB, dtype=np.uint8)
            result = await link.call("peer_get", PeerGet("ns", oid).to_args(), into=lambda r: out)
            await link.close()
            return result, out

    result, out = run(scenario())
    assert result["payload_bytes"] == 4 * MiB
    assert bytes(backend.objects[("ns", oid)][1]) == data.tobytes()
    assert np.array_equal(out, data)


def test_payloads_larger_than_a_frame_and_many_small_calls(transport):
    """Payloads never go through frames: an 8 MiB object passes a 4 MiB frame limit."""
    big = make_object(2 * MAX_FRAME_BYTES, seed=2)
    small = [make_object(100 + i, seed=10 + i) for i in range(20)]

    async def scenario():
        async with services(transport) as started:
            link = await connect_peer(transport, started["b"][1], SECRET, "a", 2.0)
            for oid, meta, data in [big, *small]:
                args = PeerPut("ns", oid, meta.size, meta.checksum, meta.descriptor).to_args()
                await link.call("peer_put", args, payload=data)
            outs = []
            for oid, meta, _ in [big, *small]:
                out = np.empty(meta.size, dtype=np.uint8)
                await link.call("peer_get", PeerGet("ns", oid).to_args(), into=lambda r, out=out: out)
                outs.append(out)
            await link.close()
            return outs

    outs = run(scenario())
    for (_, _, data), out in zip([big, *small], outs):
        assert np.array_equal(out, data)


def test_peer_that_accepts_but_never_answers_times_out(transport):
    async def silent(channel):
        await asyncio.sleep(3600)

    async def scenario():
        listener = await transport.listen("127.0.0.1:0", silent)
        start = time.monotonic()
        try:
            with pytest.raises(PeerUnavailable, match="did not answer in time"):
                await connect_peer(transport, listener.address, SECRET, "a", 0.3)
            return time.monotonic() - start
        finally:
            await listener.close()

    assert run(scenario()) < 10  # ended by the 0.3 s timeout, not the peer's hour-long stall


def test_peer_that_stalls_mid_call_times_out_and_link_closes(transport):
    oid, meta, data = make_object(1000, seed=3)

    class Stuck(InMemoryBackend):
        async def read(self, namespace, object_id):
            await asyncio.sleep(3600)

    async def scenario():
        async with services(transport, backends=[Stuck()]) as started:
            link = await connect_peer(transport, started["b"][1], SECRET, "a", 0.3)
            start = time.monotonic()
            with pytest.raises(PeerUnavailable, match="did not answer in time on peer_get"):
                await link.call("peer_get", PeerGet("ns", oid).to_args(), into=lambda r: None)
            elapsed = time.monotonic() - start
            assert link.closed
            with pytest.raises(PeerUnavailable, match="closed"):
                await link.call("peer_lookup", {"namespace": "ns", "ids": []})
            return elapsed

    assert run(scenario()) < 10  # ended by the 0.3 s timeout, not the peer's hour-long stall


def test_unwanted_payload_is_drained_and_link_stays_usable(transport):
    oid, meta, data = make_object(256 * 1024, seed=4)

    async def scenario():
        async with services(transport) as started:
            link = await connect_peer(transport, started["b"][1], SECRET, "a", 2.0)
            args = PeerPut("ns", oid, meta.size, meta.checksum, meta.descriptor).to_args()
            await link.call("peer_put", args, payload=data)
            again = await link.call("peer_put", args, payload=data)  # already held: drained
            skipped = await link.call("peer_get", PeerGet("ns", oid).to_args(), into=lambda r: None)
            out = np.empty(meta.size, dtype=np.uint8)
            await link.call("peer_get", PeerGet("ns", oid).to_args(), into=lambda r: out)
            return again, skipped, out, started["b"][0].stats()

    again, skipped, out, stats = run(scenario())
    assert again == {"stored": False} and skipped["payload_bytes"] == meta.size
    assert np.array_equal(out, data)
    assert stats["num_channels"] == 1 and stats["num_errors"] == 0


def test_oversized_frame_header_closes_the_channel_without_harm():
    async def scenario():
        transport = TcpTransport()
        async with services(transport) as started:
            service, address = started["b"]
            host, port = address.rsplit(":", 1)
            loop = asyncio.get_running_loop()
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, (host, int(port)))
            await loop.sock_sendall(sock, struct.pack("<I", MAX_FRAME_BYTES + 1))
            data = await asyncio.wait_for(loop.sock_recv(sock, 100), 2.0)
            sock.close()
            return data, service.stats()

    data, stats = run(scenario())
    assert data == b""  # closed, nothing answered
    assert stats["num_requests"] == 0


def test_payload_buffer_is_released_even_when_the_reader_vanishes():
    released = []
    oid, meta, data = make_object(8 * MiB, seed=5)

    class Leased(InMemoryBackend):
        def read(self, namespace, object_id):
            return PeerRead(meta, data, release=lambda: released.append(object_id))

    async def scenario():
        transport = TcpTransport()
        async with services(transport, backends=[Leased()], timeout_s=0.3) as started:
            link = await connect_peer(transport, started["b"][1], SECRET, "a", 0.3)
            args = PeerGet("ns", oid).to_args()
            await link.channel.send(Request(9, "peer_get", args))
            await asyncio.sleep(0.05)
            link.channel.close()  # never reads the 8 MiB
            for _ in range(40):
                if released:
                    break
                await asyncio.sleep(0.05)

    run(scenario())
    assert released == [oid]
