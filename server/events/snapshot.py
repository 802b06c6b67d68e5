"""A snapshot: what one namespace holds now, as batches a router applies with vLLM's own
classes (the replay socket's snapshot request, server/events/publisher.py).

    a router asks         DEALER sends [b"", b"snapshot", topic] to the replay endpoint
    the event loop        flushes the pending batches, so S, the number of the namespace's
                          last batch, is exact; copies the namespace's holdings in one call
                          (stream.py); queues this job for the publisher thread
    the publisher thread  sends [b"", topic, S, KVEventBatch] frames: AllBlocksCleared first,
                          then a BlockStored per held object and medium; then the replay's
                          end marker [b"", b"", END_SEQ, b""]

The router applies the frames in order, then live batches numbered after S (it drops those
numbered S or lower: the snapshot holds them). The thread reads each record's media when it
encodes it, which may be after the copy: a medium that changed since is one a batch numbered
after S changes as well, so applying those batches ends where the stream is either way.

Pure: no sockets, no threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.server.events.holdings import MEDIA
from kvstore.server.events.wire import CLEARED, STORED

# Events per snapshot frame: ~150 KB for objects named by their ids, ~1.5 MB with 256-token
# routes; a router decodes one frame at a time. A snapshot that would take more frames than
# the replay socket can queue for one reader gets fuller frames instead (Snapshot.batches).
SNAPSHOT_BATCH_EVENTS = 1000


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One router's request, taken on the event loop, sent by the publisher thread."""

    client: bytes  # the ROUTER socket's name for the DEALER that asked
    topic: bytes
    seq: int  # the namespace's last batch number when taken; -1: it has published none
    ts: float
    items: list  # Holdings.items(namespace): (digest, Held), copied on the loop

    def batches(self, max_frames: int) -> Iterator[list[tuple]]:
        """The snapshot's events (wire tuples) in at most `max_frames` batches of at least
        SNAPSHOT_BATCH_EVENTS: AllBlocksCleared, then STORED per held object and medium."""
        most = 1 + len(MEDIA) * len(self.items)
        per = max(SNAPSHOT_BATCH_EVENTS, -(-most // max(1, max_frames)))
        batch: list[tuple] = [(CLEARED,)]
        for digest, held in self.items:
            for medium in held.in_media():
                batch.append((STORED, digest, medium, held.route, held.block_size, held.session_id))
                if len(batch) == per:
                    yield batch
                    batch = []
        if batch:
            yield batch
