"""Peer authentication: the right secret connects; anything else gets nothing."""

import logging
import secrets

import pytest
from peer_helpers import SECRET, TRANSPORTS, make_object, run, services, transport_or_skip

from kvstore.errors import PermissionDenied
from kvstore.protocol import Reply, Request
from kvstore.server.peer.auth import NONCE_BYTES, authenticate_client, proof
from bench.peer_service import InMemoryBackend
from kvstore.server.peer.client import connect_peer
from kvstore.server.peer.tcp import TcpTransport
from kvstore.server.peer.transport import PeerClosed
from kvstore.peer_messages import PeerGet


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return transport_or_skip(request.param)


def _backend_with_object():
    oid, meta, data = make_object(4096, seed=1)
    backend = InMemoryBackend()
    backend.objects[("ns", oid)] = (meta, bytearray(data.tobytes()))
    return backend, oid


def test_right_secret_connects_and_names_the_peer(transport):
    async def scenario():
        async with services(transport, names=("node-b",)) as started:
            link = await connect_peer(transport, started["node-b"][1], SECRET, "node-a", 2.0)
            await link.close()
            return link.peer_node

    assert run(scenario()) == "node-b"


def test_wrong_secret_refused_with_a_clear_error(transport, caplog):
    backend, oid = _backend_with_object()

    async def scenario():
        async with services(transport, backends=[backend]) as started:
            service, address = started["b"]
            with pytest.raises(PermissionDenied, match="wrong cluster secret"):
                await connect_peer(transport, address, b"another-secret-000000", "a", 2.0)
            return service.stats()

    with caplog.at_level(logging.WARNING, logger="kvstore"):
        stats = run(scenario())
    assert stats["num_requests"] == 0  # nothing was served
    assert any("event=peer_auth_failed" in r.getMessage() and "wrong_secret" in r.getMessage()
               for r in caplog.records)


async def _raw_channel(address):
    return await TcpTransport().connect(address)


def test_server_refuses_a_client_whose_proof_is_wrong(caplog):
    """A client that ignores the server's proof and guesses its own is refused and logged."""
    backend, oid = _backend_with_object()

    async def scenario():
        async with services(TcpTransport(), backends=[backend]) as started:
            service, address = started["b"]
            channel = await _raw_channel(address)
            await channel.send(Request(0, "peer_hello", {"node": "mallory", "nonce": secrets.token_bytes(NONCE_BYTES)}))
            await channel.recv()
            await channel.send(Request(1, "peer_auth", {"proof": b"\0" * 32}))
            refused = await channel.recv()
            await channel.send(Request(2, "peer_get", PeerGet("ns", oid).to_args()))
            with pytest.raises((PeerClosed, ConnectionError)):
                await channel.recv()
            channel.close()
            return refused, service.stats()

    with caplog.at_level(logging.WARNING, logger="kvstore"):
        refused, stats = run(scenario())
    assert isinstance(refused, Reply) and refused.error["code"] == "permission_denied"
    assert "wrong cluster secret" in refused.error["message"]
    assert stats["num_auth_failures"] == 1 and stats["num_requests"] == 0
    assert any("side=server" in r.getMessage() for r in caplog.records)


def test_request_before_handshake_gets_nothing():
    backend, oid = _backend_with_object()

    async def scenario():
        async with services(TcpTransport(), backends=[backend]) as started:
            channel = await _raw_channel(started["b"][1])
            await channel.send(Request(5, "peer_get", PeerGet("ns", oid).to_args()))
            reply = await channel.recv()
            with pytest.raises((PeerClosed, ConnectionError)):
                await channel.recv()
            channel.close()
            return reply

    reply = run(scenario())
    assert reply.error["code"] == "permission_denied" and reply.result is None


def test_client_refuses_an_impostor_server():
    """A server without the secret cannot make a client talk to it."""
    async def impostor(channel):
        hello = await channel.recv()
        await channel.send(Reply(hello.id, {"node": "evil", "nonce": b"\1" * NONCE_BYTES, "proof": b"\2" * 32}))
        await channel.recv()

    async def scenario():
        transport = TcpTransport()
        listener = await transport.listen("127.0.0.1:0", impostor)
        try:
            channel = await transport.connect(listener.address)
            with pytest.raises(PermissionDenied, match="wrong cluster secret"):
                await authenticate_client(channel, SECRET, "a")
            channel.close()
        finally:
            await listener.close()

    run(scenario())


def test_proofs_are_bound_to_role_nonces_and_nodes():
    n1, n2 = b"\1" * NONCE_BYTES, b"\2" * NONCE_BYTES
    base = proof(SECRET, "client", n1, n2, "a", "b")
    assert base != proof(SECRET, "server", n1, n2, "a", "b")
    assert base != proof(SECRET, "client", n2, n1, "a", "b")
    assert base != proof(SECRET, "client", n1, n2, "b", "a")
    assert base != proof(b"x" + SECRET, "client", n1, n2, "a", "b")
