"""The event loop's side of the KV event stream: what the tiers report, batched per namespace.

    a tier stores or drops an object -> stored() / removed() append to its namespace's batch
    FLUSH_INTERVAL_S after the first -> each namespace's batch gets its next sequence number,
                                        joins that namespace's replay ring, and is offered to
                                        the publisher thread (server/events/publisher.py)
    the thread's queue is full       -> the batch is not sent live (counted in
                                        num_dropped_batches); the subscriber sees a gap in the
                                        sequence numbers at its next batch and replays it

Sequence numbers are per namespace (each namespace is one topic), from 0 at start, gapless:
every number is in the ring before it is offered. The calls never block and do no I/O; a tier
calls them on the event loop thread only. `NoEvents` stands in when `[events]` is off.

    every heartbeat_s                -> each namespace that published offers a heartbeat: its
                                        last number again, no events, not in the ring
    a router asks for a snapshot     -> the publisher thread hands it to the loop; the loop
                                        flushes, copies the namespace's holdings and offers
                                        the snapshot back (server/events/snapshot.py)
    at start, with NVMe              -> what NVMe kept joins the holdings unpublished (kept());
                                        snapshots asked meanwhile wait for restored()
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from dataclasses import dataclass

from kvstore.config_events import EventsConfig
from kvstore.identity import Kind
from kvstore.server.events.holdings import Holdings
from kvstore.server.events.snapshot import Snapshot
from kvstore.server.events.wire import CLEARED, MEDIUM_PEER, REMOVED, STORED, namespace_of, topic_of

# Reports are gathered this long into one batch per namespace (vLLM sends one per engine
# step). What costs is a flush (it wakes the publisher thread), not a report: on a loaded
# 2-core machine (bench/events.py) puts ran 0.66x as fast with a batch per loop iteration,
# 0.82-0.87x with 2 ms, 1.0x with 50 ms, and within that run's noise (0.89-1.04x) with 10 ms,
# where the lag from a put's reply to its event is ~5 ms at the median.
FLUSH_INTERVAL_S = 0.01
# A namespace's replay ring keeps at most this many events (~150 B each: ~150 MB), whatever
# buffer_batches says: batches of 10 ms under a put_many stream hold hundreds of events, and
# 10,000 of them would be gigabytes. A replay from further back gets what is kept (as vLLM's).
MAX_RING_EVENTS = 1_000_000


class NoEvents:
    """The event stream of a daemon with `[events] enabled = false`: every report is dropped."""

    enabled = False

    def stored(self, namespace: str, digest: bytes, medium: str, descriptor, hints) -> None:
        pass

    def removed(self, namespace: str, digest: bytes, medium: str) -> None:
        pass

    def cleared(self, namespace: str) -> None:
        pass

    def restoring(self) -> None:
        pass

    def kept(self, namespace: str, digest: bytes, medium: str, route: bytes | None, block_size: int,
             session_id: str | None) -> None:
        pass

    def restored(self) -> None:
        pass

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def namespaces(self) -> list[str]:
        return []

    def stats(self) -> None:
        return None


@dataclass(slots=True)
class Batch:
    seq: int
    ts: float  # wall-clock seconds, like vLLM's
    events: list[tuple]  # wire.STORED / REMOVED / CLEARED tuples


class Ring:
    """One namespace's last batches, for replays: at most `size` batches and MAX_RING_EVENTS
    events. Appended (and trimmed) on the event loop only; read by the publisher thread
    through `since`, which copies the deque in one C call (list() holds the GIL throughout,
    so no change lands in the middle of it): no lock on the put path."""

    def __init__(self, topic: bytes, size: int):
        self.topic = topic
        self.next_seq = 0
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


@dataclass(slots=True)
class StreamCounters:
    num_batches: int = 0  # batches numbered and kept for replay
    num_events: int = 0
    num_dropped_batches: int = 0  # not sent live: the publisher thread's queue was full
    num_refused_snapshots: int = 0  # too many waiting for the thread: the router asks again
    num_kept_objects: int = 0  # what NVMe kept over the restart, in the holdings unpublished


class EventStream:
    """Per-namespace batches of holdings changes for the publisher (`[events] enabled`)."""

    enabled = True

    def __init__(self, config: EventsConfig, make_publisher):
        """config: the `[events]` table with its endpoints filled in (EventsConfig.under).
        make_publisher(config, rings[, namespace=name]): a sender (server.events.publisher.
        ZmqPublisher), which replays from `rings` (topic -> Ring); it has `start()`,
        `offer(ring, batch) -> bool`, its heartbeat and snapshot forms, `close()` and
        `stats()`. One for the shared endpoints, and one per namespace with endpoints of its
        own (`[events.namespaces.<name>]`), made with that namespace's name: each sees only
        its own namespaces' rings, so neither its replays nor its snapshots show another's."""
        self.config = config
        self.rings: dict[bytes, Ring] = {}  # every namespace's (the publishers' rings are parts of it)
        self._by_namespace: dict[str, Ring] = {}
        self._pending: dict[str, list[tuple]] = {}
        self._flush_scheduled = False
        self.counters = StreamCounters()
        self.holdings = Holdings()  # what was published as held: removals and snapshots name it
        self.publisher = make_publisher(config, {})  # the shared endpoints
        self._own = {name: make_publisher(config.own_endpoints(name), {}, namespace=name)
                     for name in config.namespaces}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._heartbeat_timer: asyncio.TimerHandle | None = None
        self._waiting: list[tuple[bytes, bytes]] | None = None  # snapshots asked while restoring

    def start(self) -> None:
        """Bind the sockets and start the publisher thread (at the daemon's start, on the event
        loop: heartbeats and snapshots run there; without a running loop there are none)."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        for publisher in self._publishers():
            publisher.start(functools.partial(self._snapshot_asked, publisher) if self._loop is not None else None)
        if self._loop is not None and self.config.heartbeat_s > 0:
            self._heartbeat_timer = self._loop.call_later(self.config.heartbeat_s, self._heartbeat)

    # --- what the tiers report (event loop thread) -------------------------------------

    def stored(self, namespace: str, digest: bytes, medium: str, descriptor, hints) -> None:
        """An object is now held in `medium` (its descriptor and hints: kvstore.identity,
        kvstore.hints). A store group's manifest is no engine block: not published."""
        if descriptor.kind is Kind.GROUP:
            return
        digest = bytes(digest)
        held = self.holdings.add(namespace, digest, medium, hints.route, descriptor.chunk_tokens, hints.session_id)
        if held is not None:
            self._record(namespace, (STORED, digest, medium, held.route, held.block_size, held.session_id))
            if medium == MEDIUM_PEER:
                for name, oldest in self.holdings.over_peer_cap():
                    self.removed(name, oldest, MEDIUM_PEER)

    def removed(self, namespace: str, digest: bytes, medium: str) -> None:
        """An object left `medium` (published only if its storing was)."""
        digest = bytes(digest)
        held = self.holdings.remove(namespace, digest, medium)
        if held is not None:
            self._record(namespace, (REMOVED, digest, medium, held.route))

    def cleared(self, namespace: str) -> None:
        """Everything of the namespace is gone from this node's view (the daemon stops), or
        what routers knew of it before this start is (the daemon starts with NVMe)."""
        self.holdings.clear(namespace)
        self._record(namespace, (CLEARED,))

    # --- what NVMe kept over a restart (event loop thread) --------------------------------

    def restoring(self) -> None:
        """What NVMe kept is being read into the holdings: snapshots asked meanwhile wait."""
        if self._waiting is None:
            self._waiting = []

    def kept(self, namespace: str, digest: bytes, medium: str, route: bytes | None, block_size: int,
             session_id: str | None) -> None:
        """An object held since before this start: in the holdings, so snapshots list it and
        its removal is published, but no BlockStored now (server/tiering/nvme_kept.py)."""
        if self.holdings.add(namespace, bytes(digest), medium, route, block_size, session_id) is not None:
            self.counters.num_kept_objects += 1

    def restored(self) -> None:
        """The holdings are whole: the snapshots that waited are taken now."""
        waiting, self._waiting = self._waiting or [], None
        for publisher, client, topic in waiting:
            self._snapshot(publisher, client, topic)

    # --- snapshots and heartbeats ---------------------------------------------------------

    def _snapshot_asked(self, publisher, client: bytes, topic: bytes) -> None:
        """A router asked `publisher` for a snapshot (its thread): taken on the loop."""
        try:
            self._loop.call_soon_threadsafe(self._snapshot, publisher, client, topic)
        except RuntimeError:  # the loop is closed: the daemon is stopping
            pass

    def _snapshot(self, publisher, client: bytes, topic: bytes) -> None:
        """Take the namespace's snapshot at a batch boundary and offer it to the thread, which
        builds and encodes its batches. A namespace another publisher serves is answered as
        one that holds nothing. Event loop thread."""
        if self._waiting is not None:
            self._waiting.append((publisher, client, topic))
            return
        self.flush()  # what was reported is numbered now: the snapshot's number is exact
        namespace = namespace_of(self.config.topic, topic)
        if namespace is not None and self._publisher_of(namespace) is not publisher:
            namespace = None
        ring = self._by_namespace.get(namespace) if namespace is not None else None
        items = self.holdings.items(namespace) if namespace is not None else []
        snapshot = Snapshot(client, topic, ring.next_seq - 1 if ring is not None else -1, time.time(), items)
        if not publisher.offer_snapshot(snapshot):
            self.counters.num_refused_snapshots += 1

    def _publisher_of(self, namespace: str):
        return self._own.get(namespace, self.publisher)

    def _publishers(self) -> list:
        return [self.publisher, *self._own.values()]

    def _heartbeat(self) -> None:
        """Every heartbeat_s: each namespace that published repeats its last number. Queued
        behind that batch, so a heartbeat never names a number before its batch went."""
        ts = time.time()
        for name, ring in self._by_namespace.items():
            self._publisher_of(name).offer_heartbeat(ring.topic, ring.next_seq - 1, ts)
        self._heartbeat_timer = self._loop.call_later(self.config.heartbeat_s, self._heartbeat)

    def _record(self, namespace: str, event: tuple) -> None:
        pending = self._pending.get(namespace)
        if pending is None:
            pending = self._pending[namespace] = []
        pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_later(FLUSH_INTERVAL_S, self.flush)
            except RuntimeError:  # no loop (a synchronous caller): now
                self.flush()

    def flush(self) -> None:
        """Number, keep and offer every namespace's pending batch (FLUSH_INTERVAL_S after the
        first report, or now)."""
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        ts = time.time()
        for namespace, events in pending.items():
            ring = self._ring(namespace)
            batch = ring.append(ts, events)
            self.counters.num_batches += 1
            self.counters.num_events += len(events)
            if not self._publisher_of(namespace).offer(ring, batch):
                self.counters.num_dropped_batches += 1

    def _ring(self, namespace: str) -> Ring:
        ring = self._by_namespace.get(namespace)
        if ring is None:
            ring = Ring(topic_of(self.config.topic, namespace), self.config.buffer_batches)
            self._by_namespace[namespace] = self.rings[ring.topic] = ring
            self._publisher_of(namespace).rings[ring.topic] = ring
        return ring

    def namespaces(self) -> list[str]:
        """Namespaces that published at least one batch."""
        return list(self._by_namespace)

    def close(self) -> None:
        """Send what is pending, then stop the publisher (it sends what it was offered first)."""
        if self._heartbeat_timer is not None:
            self._heartbeat_timer.cancel()
            self._heartbeat_timer = None
        self.flush()
        for publisher in self._publishers():
            publisher.close()

    def stats(self) -> dict:
        doc = {"namespaces": {name: {"topic": ring.topic.decode(errors="replace"), "next_seq": ring.next_seq}
                              for name, ring in self._by_namespace.items()},
               "endpoint": self.config.endpoint, "replay_endpoint": self.config.replay_endpoint,
               "heartbeat_s": self.config.heartbeat_s, "restoring": self._waiting is not None,
               "pending_events": sum(map(len, self._pending.values())), "held_objects": self.holdings.count()}
        doc.update({k: getattr(self.counters, k) for k in self.counters.__slots__})
        for publisher in self._publishers():  # counts of every endpoint's publisher together
            for key, value in publisher.stats().items():
                doc[key] = doc.get(key, 0) + value
        if self._own:
            doc["own_endpoints"] = {name: {"endpoint": p.config.endpoint, "replay_endpoint": p.config.replay_endpoint,
                                           **p.stats()} for name, p in self._own.items()}
        return doc
