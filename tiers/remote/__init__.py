"""The remote tier, client side: objects kept by their home nodes, reached over peer links.

An object's home nodes come from rendezvous hashing over the live members
(`kvstore.ownership`). This tier asks them: `get_into` fetches into a buffer the caller
provides (tier memory; a CUDA buffer through UCX), `put` sends to every home but this node,
`get_ranges_into` fetches only some byte ranges (a sparse reader), `lookup` asks each home
node once for a whole batch, `pin` asks every home of each id (an unpin, every member),
`delete` asks every member.
Bytes from a peer are checked against the xxh3-128 taken at put before `get_into` returns
(ranges: against the checksum of the packed ranges, taken by the home after it checked its
whole copy); a mismatch is a miss.

Failure is a miss, never a hang: every call is bounded by `timeout_s` (plus transfer time at
MIN_PEER_BANDWIDTH_BYTES_S), is counted, and logged once per peer going down. A peer that just
failed is skipped for `timeout_s`, so reads of its objects fail at once instead of each waiting.
It counts as down (`down_nodes`, `on_state`) until an exchange with it succeeds: a call after
that pause, a `probe`, or `mark_up` from whoever saw it answer. A pooled link found closed
(the peer restarted since it was opened) is not a failure: the call is tried once more on a
fresh link.

Links come from `connect(address)` (server.peer.client.connect_peer with the transport
and secret bound), so this package imports no transport. Runs on one event loop.

    tier.py    RemoteTier: the calls (get, ranged get, put, lookup, pin, delete), the
               checks on what comes back, the counters, which peers are down
    links.py   PeerLink (what a link must do), the per-peer link pools, the link errors
"""

from kvstore.tiers.remote.links import MAX_LINKS_PER_PEER, MIN_PEER_BANDWIDTH_BYTES_S, LinkBroken, PeerLink, PeerUnavailable
from kvstore.tiers.remote.tier import RemoteCounters, RemoteTier, host_digest

__all__ = [
    "MAX_LINKS_PER_PEER", "MIN_PEER_BANDWIDTH_BYTES_S", "LinkBroken", "PeerLink", "PeerUnavailable",
    "RemoteCounters", "RemoteTier", "host_digest",
]
