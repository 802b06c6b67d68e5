"""One namespace's replay ring: its last batches, numbered, for replays and snapshots.

The event loop appends (server/events/stream.py); the publisher thread reads the batches a
replay asks for (server/events/publisher.py). Numbers are gapless from the ring's first_seq,
the life's (server/events/lives.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvstore.server.events.wire import CLEARED

# A namespace's replay ring keeps at most this many events (~150 B each: ~150 MB), whatever
# buffer_batches says: batches of 10 ms under a put_many stream hold hundreds of events, and
# 10,000 of them would be gigabytes. A replay from further back gets what is kept (as vLLM's).
MAX_RING_EVENTS = 1_000_000


@dataclass(slots=True)
class Batch:
    seq: int
    ts: float  # wall-clock seconds, like vLLM's
    events: list[tuple]  # wire.STORED / REMOVED / CLEARED tuples


class Ring:
    """One namespace's last batches, for replays: at most `size` batches and MAX_RING_EVENTS
    events, numbered from `first_seq`. Appended (and trimmed) on the event loop only; read by
    the publisher thread through `since`, which copies the deque in one C call (list() holds
    the GIL throughout, so no change lands in the middle of it): no lock on the put path."""

    def __init__(self, topic: bytes, size: int, first_seq: int = 0):
        self.topic = topic
        self.next_seq = first_seq
        self.size = size
        self.num_events = 0
        self._batches: deque[Batch] = deque()

    def append(self, ts: float, events: list[tuple]) -> Batch:
        batch = Batch(self.next_seq, ts, events)
        self._batches.append(batch)
        self.next_seq += 1
        self.num_events += len(events)
        while len(self._batches) > self.size or (self.num_events > MAX_RING_EVENTS and len(self._batches) > 1):
            self.num_events -= len(self._batches.popleft().events)
        return batch

    def since(self, seq: int) -> list[Batch]:
        """The kept batches numbered `seq` and later, oldest first (a copy). Any thread."""
        return [b for b in list(self._batches) if b.seq >= seq]

    def last_has_events(self) -> bool:
        return bool(self._batches) and bool(self._batches[-1].events)

    def ends_cleared(self) -> bool:
        """The last batch ends with AllBlocksCleared (nothing happened since). Event loop."""
        return bool(self._batches) and self._batches[-1].events[-1:] == [(CLEARED,)]
