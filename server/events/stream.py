"""The event loop's side of the KV event stream: what the tiers report, batched per namespace.

    a tier stores or drops an object -> stored() / removed() append to its namespace's batch
    FLUSH_INTERVAL_S after the first -> each namespace's batch gets its next sequence number,
                                        joins that namespace's replay ring (ring.py), and is
                                        offered to the publisher thread (publisher.py)
    the thread's queue is full       -> the batch is not sent live (counted in
                                        num_dropped_batches); the subscriber sees a gap in the
                                        sequence numbers at its next batch and replays it

Sequence numbers are per namespace (each namespace is one topic), gapless within a daemon's
life: every number is in the ring before it is offered. A life numbers from its first_seq,
past every number an earlier life of the data directory used (lives.py), so a restart is a
gap to any subscriber. The calls never block and do no I/O (a namespace's first batch ever
has its name written down by a worker thread); a tier calls them on the event loop thread
only. `NoEvents` stands in when `[events]` is off.

    the daemon starts                -> a life after the first records AllBlocksCleared in each
                                        namespace an earlier life published, and begins any
                                        other namespace's first batch with one
    every heartbeat_s                -> each namespace that published offers a heartbeat: its
                                        last number again, no events, not in the ring
    a subscription takes effect      -> each namespace it matches whose last batch has events
                                        (and none pending) gets an empty batch, numbered and
                                        kept: a seal (_seal says why)
    a router asks for a snapshot     -> the publisher thread hands it to the loop; the loop
                                        flushes, copies the namespace's holdings and offers
                                        the snapshot back (snapshot.py)
    at start, with NVMe              -> what NVMe kept joins the holdings unpublished (kept());
                                        snapshots asked meanwhile wait for restored()
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass

from kvstore.config_events import EventsConfig
from kvstore.identity import Kind
from kvstore.server.events.holdings import Holdings
from kvstore.server.events.lives import Lives, OneLife
from kvstore.server.events.ring import Ring
from kvstore.server.events.snapshot import Snapshot
from kvstore.server.events.wire import CLEARED, MEDIUM_PEER, REMOVED, STORED, namespace_of, topic_of

# Reports are gathered this long into one batch per namespace (vLLM sends one per engine
# step). What costs is a flush (it wakes the publisher thread), not a report: on a loaded
# 2-core machine (bench/events.py) puts ran 0.66x as fast with a batch per loop iteration,
# 0.82-0.87x with 2 ms, 1.0x with 50 ms, and within that run's noise (0.89-1.04x) with 10 ms,
# where the lag from a put's reply to its event is ~5 ms at the median.
FLUSH_INTERVAL_S = 0.01


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
class StreamCounters:
    num_batches: int = 0  # batches numbered and kept for replay
    num_events: int = 0
    num_dropped_batches: int = 0  # not sent live: the publisher thread's queue was full
    num_refused_snapshots: int = 0  # too many waiting for the thread: the router asks again
    num_kept_objects: int = 0  # what NVMe kept over the restart, in the holdings unpublished
    num_seals: int = 0  # empty batches after a subscription (EventStream._seal)


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
        # Which life of the data directory this is (config.data_dir, filled in by EventsConfig.under)
        self.lives = Lives(config.data_dir) if config.data_dir else OneLife()

    def start(self) -> None:
        """Begin this life (DataDirError if its record cannot be kept), bind the sockets and
        start the publisher thread (at the daemon's start, after it holds the data directory,
        on the event loop: heartbeats and snapshots run there; without a running loop there
        are none). Then, in a life after the first, each namespace an earlier life published
        gets AllBlocksCleared as its first batch: a router drops what that life told it."""
        self.lives.begin()
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        for publisher in self._publishers():
            if self._loop is None:
                publisher.start()
            else:
                publisher.start(functools.partial(self._snapshot_asked, publisher),
                                functools.partial(self._subscription_took_effect, publisher))
        if self._loop is not None and self.config.heartbeat_s > 0:
            self._heartbeat_timer = self._loop.call_later(self.config.heartbeat_s, self._heartbeat)
        for namespace in self.lives.previous:
            self._record(namespace, (CLEARED,))

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

    def _subscription_took_effect(self, publisher, prefix: bytes) -> None:
        """A subscriber of `publisher` now receives the topics that start with `prefix` (its
        thread): sealed on the loop."""
        try:
            self._loop.call_soon_threadsafe(self._seal, publisher, prefix)
        except RuntimeError:  # the loop is closed: the daemon is stopping
            pass

    def _seal(self, publisher, prefix: bytes) -> None:
        """After a subscription: each of `publisher`'s namespaces whose topic starts with
        `prefix`, whose last batch has events and that has none pending, gets an empty batch.

        A subscriber that follows vLLM's rules replays only when a frame's number skips, and
        takes a heartbeat for the batch whose number it repeats. One that subscribes (or
        reconnects: after a restart, at a moment nobody knows) after batch S went would take
        the heartbeats repeating S for S itself, and never see S. The seal is numbered S + 1
        and reaches it, so it replays S; later heartbeats repeat S + 1, which holds nothing.
        Event loop thread."""
        for name, ring in self._by_namespace.items():
            if (ring.topic.startswith(prefix) and name not in self._pending and ring.last_has_events()
                    and self._publisher_of(name) is publisher):
                batch = ring.append(time.time(), [])
                self.counters.num_batches += 1
                self.counters.num_seals += 1
                if not publisher.offer(ring, batch):
                    self.counters.num_dropped_batches += 1

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
        ring = self._by_namespace.get(namespace)
        if event == (CLEARED,) and (pending[-1:] == [event] if pending else ring is not None and ring.ends_cleared()):
            return  # nothing since the last AllBlocksCleared: another says nothing
        if pending is None:
            pending = self._pending[namespace] = []
            if ring is None and self.lives.life > 0 and event != (CLEARED,):
                pending.append((CLEARED,))  # a new life's first batch: forget the earlier ones
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
            ring = Ring(topic_of(self.config.topic, namespace), self.config.buffer_batches, self.lives.first_seq)
            self._by_namespace[namespace] = self.rings[ring.topic] = ring
            self._publisher_of(namespace).rings[ring.topic] = ring
            self.lives.named(namespace)
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
               "heartbeat_s": self.config.heartbeat_s, "restoring": self._waiting is not None, "life": self.lives.life,
               "pending_events": sum(map(len, self._pending.values())), "held_objects": self.holdings.count()}
        doc.update({k: getattr(self.counters, k) for k in self.counters.__slots__})
        for publisher in self._publishers():  # counts of every endpoint's publisher together
            for key, value in publisher.stats().items():
                doc[key] = doc.get(key, 0) + value
        if self._own:
            doc["own_endpoints"] = {name: {"endpoint": p.config.endpoint, "replay_endpoint": p.config.replay_endpoint,
                                           **p.stats()} for name, p in self._own.items()}
        return doc
