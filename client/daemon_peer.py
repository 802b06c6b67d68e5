"""Who serves at the socket: a client talks only to a daemon run by its own user or by root.

Whoever can write the socket's directory can put a server of their own at its path (the
daemon keeps its own directory private, server/socket_path.py, but a client cannot know how
the path it was given was made). So after connecting, and before sending anything, a client
asks the kernel who holds the other end (SO_PEERCRED) and refuses any other uid, unless
$KVSTORE_DAEMON_UID names it: a daemon run on purpose as a service user (a container's).
"""

from __future__ import annotations

import os
import socket
import struct

from kvstore.errors import InvalidArgument, PermissionDenied

_UCRED = struct.Struct("3i")  # pid, uid, gid


def trusted_uids() -> frozenset[int]:
    """This process's effective uid, root's, and those $KVSTORE_DAEMON_UID lists."""
    uids = {os.geteuid(), 0}
    raw = os.environ.get("KVSTORE_DAEMON_UID", "")
    for part in filter(None, (p.strip() for p in raw.split(","))):
        if not part.isdigit():
            raise InvalidArgument(f"KVSTORE_DAEMON_UID={raw!r}: expected uids (whole numbers) separated by commas")
        uids.add(int(part))
    return frozenset(uids)


def check_daemon_peer(sock: socket.socket, path: str) -> None:
    """Raise PermissionDenied unless the process serving `sock` runs as a trusted uid (and
    InvalidArgument for a bad $KVSTORE_DAEMON_UID); `sock` is closed when it raises."""
    try:
        _check(sock, path)
    except BaseException:
        sock.close()
        raise


def _check(sock: socket.socket, path: str) -> None:
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    if uid not in trusted_uids():
        raise PermissionDenied(
            f"the server at {path} runs as uid {uid} (pid {pid}), not as this user ({os.geteuid()}) or root, "
            f"so it may not be your kvstore daemon; nothing was sent. If it is the daemon you mean, "
            f"set KVSTORE_DAEMON_UID={uid}")
