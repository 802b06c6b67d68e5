"""Peer authentication: a mutual HMAC-SHA256 challenge-response over the cluster secret.

The first exchange on every peer channel, before any request is served:

    client -> server  request peer_hello {node, nonce}                       nonce_c: 32 random bytes
    server -> client  reply  {node, nonce, proof}                            proof_s = MAC("server")
    client -> server  request peer_auth  {proof}                             proof_c = MAC("client")
    server -> client  reply  {ok: true}, or a permission_denied error and the channel closes

    (client -> server request peer_auth {refused: true} instead, when proof_s is wrong: the
     client sends no proof of its own, and the server learns why the channel ends)

    MAC(role) = HMAC-SHA256(secret, "kvstore-peer-v1" | role | nonce_c | nonce_s | node_c | node_s)

Each side proves it holds the secret over a nonce the other side just chose, so a recorded
handshake cannot be replayed, and the role in the MAC keeps one side's proof from being
reflected back as the other's. The client checks the server's proof before it sends anything
else: a node with the wrong secret is refused in both directions. The secret never travels.
A wrong secret is logged at warning level on both sides, as "wrong secret from <address>".
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct

from kvstore.errors import PermissionDenied, ProtocolError
from kvstore.protocol import Reply, Request

log = logging.getLogger("kvstore.peer")

SCHEME = b"kvstore-peer-v1"
NONCE_BYTES = 32
PROOF_BYTES = 32  # SHA-256
WRONG_SECRET = "peer authentication failed: wrong cluster secret (cluster.secret must be the same on every node)"


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def proof(secret: bytes, role: str, nonce_c: bytes, nonce_s: bytes, node_c: str, node_s: str) -> bytes:
    msg = b"".join(_field(x) for x in (SCHEME, role.encode(), nonce_c, nonce_s, node_c.encode(), node_s.encode()))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _bytes(value, size: int, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != size:
        raise ProtocolError(f"peer handshake: {what} must be {size} bytes")
    return value


def _node(value) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 64:
        raise ProtocolError("peer handshake: node id must be a string of 1..64 characters")
    return value


async def authenticate_client(channel, secret: bytes, node_id: str) -> str:
    """Run the client half on a fresh channel; returns the server's node id.

    Raises PermissionDenied when either side holds a different secret. The caller applies
    the timeout and closes the channel on any error.
    """
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    await channel.send(Request(0, "peer_hello", {"node": node_id, "nonce": nonce_c}))
    reply = await _reply(channel, 0)
    node_s = _node(reply.get("node"))
    nonce_s = _bytes(reply.get("nonce"), NONCE_BYTES, "nonce")
    expected = proof(secret, "server", nonce_c, nonce_s, node_id, node_s)
    if not hmac.compare_digest(expected, _bytes(reply.get("proof"), PROOF_BYTES, "proof")):
        _log_wrong_secret("client", channel.peer, node_s, "its proof does not match our secret")
        try:  # tell the server why the channel ends; it may be gone already
            await channel.send(Request(1, "peer_auth", {"refused": True}))
        except Exception:
            pass
        raise PermissionDenied(f"{WRONG_SECRET}; peer {node_s} at {channel.peer}")
    mine = proof(secret, "client", nonce_c, nonce_s, node_id, node_s)
    await channel.send(Request(1, "peer_auth", {"proof": mine}))
    await _reply(channel, 1)
    return node_s


async def authenticate_server(channel, secret: bytes, node_id: str) -> str:
    """Run the server half; returns the client's node id, or answers with an error and raises.

    Nothing but this handshake is answered before it succeeds.
    """
    hello = await channel.recv()
    if not isinstance(hello, Request) or hello.op != "peer_hello":
        await _refuse(channel, hello, "peer channel must start with peer_hello (the handshake)")
    node_c = _node(hello.args.get("node"))
    nonce_c = _bytes(hello.args.get("nonce"), NONCE_BYTES, "nonce")
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    mine = proof(secret, "server", nonce_c, nonce_s, node_c, node_id)
    await channel.send(Reply(hello.id, {"node": node_id, "nonce": nonce_s, "proof": mine}))
    auth = await channel.recv()
    if not isinstance(auth, Request) or auth.op != "peer_auth":
        await _refuse(channel, auth, "peer_auth must follow peer_hello")
    if auth.args.get("refused") is True:  # our proof did not match the client's secret
        _log_wrong_secret("server", channel.peer, node_c, "it refused our proof")
        raise PermissionDenied(f"{WRONG_SECRET}; peer {node_c} at {channel.peer} refused this node's proof")
    expected = proof(secret, "client", nonce_c, nonce_s, node_c, node_id)
    if not hmac.compare_digest(expected, _bytes(auth.args.get("proof"), PROOF_BYTES, "proof")):
        _log_wrong_secret("server", channel.peer, node_c, "its proof does not match our secret")
        await channel.send(Reply(auth.id, error=PermissionDenied(WRONG_SECRET).to_wire()))
        raise PermissionDenied(f"{WRONG_SECRET}; peer {node_c} at {channel.peer}")
    await channel.send(Reply(auth.id, {"ok": True}))
    return node_c


def _log_wrong_secret(side: str, address: str, node: str, why: str) -> None:
    log.warning("event=peer_auth_failed side=%s peer=%s node=%s reason=wrong_secret wrong secret from %s "
                "(node %s: %s; cluster.secret must be the same on every node)", side, address, node, address, node, why)


async def _refuse(channel, event, message: str):
    rid = getattr(event, "id", 0)
    await channel.send(Reply(rid, error=PermissionDenied(message).to_wire()))
    raise PermissionDenied(message)


async def _reply(channel, rid: int) -> dict:
    event = await channel.recv()
    if not isinstance(event, Reply) or event.id != rid:
        raise ProtocolError("peer handshake: unexpected message")
    if event.error is not None:
        if event.error.get("code") == PermissionDenied.code:
            log.warning("event=peer_auth_refused peer=%s message=%r wrong secret from %s",
                        channel.peer, event.error.get("message"), channel.peer)
            raise PermissionDenied(f"{event.error.get('message')}; refused by {channel.peer}")
        raise ProtocolError(f"peer handshake failed: {event.error.get('message')}")
    if not isinstance(event.result, dict):
        raise ProtocolError("peer handshake: reply must be a map")
    return event.result
