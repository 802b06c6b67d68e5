"""The peer service alone, over a dict of objects instead of a daemon's tiers: what
bench/remote.py measures the peer protocol with, and the backend the peer tests use.

    python bench/peer_service.py --listen 127.0.0.1:8471 --secret-file s.txt [--transport ucx]

Reaches inside: a peer service with no tiers behind it isolates the peer protocol's cost.

It prints "listening HOST:PORT" once it serves, and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kvstore.identity import ObjectId  # noqa: E402
from kvstore.peer_messages import RemoteMeta  # noqa: E402
from kvstore.server.peer.service import RANGED_RECHECK_S, PeerRead, PeerService, PeerWrite  # noqa: E402
from kvstore.server.peer.transports import make_transport  # noqa: E402


class InMemoryBackend:
    """A dict of objects, as a PeerBackend (server/peer/service.py)."""

    def __init__(self):
        self.objects: dict[tuple[str, ObjectId], tuple[RemoteMeta, bytearray]] = {}

    def read(self, namespace, object_id):
        held = self.objects.get((namespace, object_id))
        return None if held is None else PeerRead(held[0], memoryview(held[1]))

    def reserve(self, namespace, object_id, meta):
        if (namespace, object_id) in self.objects:
            return None
        buffer = bytearray(meta.size)
        return PeerWrite(buffer, lambda: self.objects.__setitem__((namespace, object_id), (meta, buffer)))

    def lookup(self, namespace, ids):
        return [self.objects[(namespace, oid)][0] if (namespace, oid) in self.objects else None for oid in ids]

    def delete(self, namespace, ids):
        return [self.objects.pop((namespace, oid), None) is not None for oid in ids]

    def pin(self, namespace, ids, ttl_s, unpin):
        return [(namespace, oid) in self.objects for oid in ids]  # held in memory: always resident


def _read_secret(args) -> bytes:
    if args.secret_file:
        with open(args.secret_file, "rb") as f:
            return f.read().strip()
    if args.secret:
        return args.secret.encode()
    sys.exit("a cluster secret is required: --secret-file PATH (or --secret S)")


async def _main(args) -> None:
    service = PeerService(InMemoryBackend(), make_transport(args.transport), _read_secret(args),
                          args.node_id, args.timeout_s, recheck_s=args.recheck_s)
    address = await service.start(args.listen)
    print(f"listening {address}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python bench/peer_service.py", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", required=True, help="host:port (port 0: any free port)")
    parser.add_argument("--secret", help="cluster secret (visible in ps; prefer --secret-file)")
    parser.add_argument("--secret-file")
    parser.add_argument("--node-id", default=os.uname().nodename)
    parser.add_argument("--transport", choices=("tcp", "ucx"), default="tcp")
    parser.add_argument("--timeout-s", type=float, default=1.0)
    parser.add_argument("--recheck-s", type=float, default=RANGED_RECHECK_S,
                        help="how long a copy that passed its checksum is trusted before ranges of it are sent "
                             "(0: hash the whole copy before every ranged read)")
    args = parser.parse_args(argv)
    from kvstore.server.logs import configure
    configure("info")
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(_main(args))


if __name__ == "__main__":
    main()
