"""The peer transports by name (`ClusterConfig.transport`): "tcp", or "ucx", whose ucxx is
imported only when it is chosen. Apart from server.peer.transport (the interface) so that the
implementations import the interface and nothing imports back."""

from __future__ import annotations

from typing import Callable

from kvstore.errors import InvalidArgument
from kvstore.server.peer.transport import Transport


def _tcp_transport() -> Transport:
    from kvstore.server.peer.tcp import TcpTransport
    return TcpTransport()


def _ucx_transport() -> Transport:
    from kvstore.server.peer.ucx import UcxTransport  # ucxx is ~320 MiB: load it only when chosen
    return UcxTransport()


TRANSPORTS: dict[str, Callable[[], Transport]] = {"tcp": _tcp_transport, "ucx": _ucx_transport}


def make_transport(name: str) -> Transport:
    try:
        return TRANSPORTS[name]()
    except KeyError:
        raise InvalidArgument(f"unknown peer transport {name!r}; known: {sorted(TRANSPORTS)}") from None
