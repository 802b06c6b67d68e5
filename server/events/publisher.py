"""The publisher thread: sends numbered batches on a ZMQ PUB socket and answers replays.

Compatible with vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py):

    PUB frames      [topic, seq (8 bytes big-endian), msgpack KVEventBatch]
    replay request  a DEALER sends [b"", start_seq (8 bytes)]           vLLM's own form
                    or             [b"", topic, start_seq (8 bytes)]     kvstore's: one namespace
    replay answer   [b"", topic, seq, payload] for each kept batch numbered start_seq or later,
                    then the end marker [b"", b"", END_SEQ (-1), b""]
    snapshot        a DEALER sends [b"", b"snapshot", topic]                    kvstore's
                    answer: [b"", topic, S, payload] frames, then the end marker; every
                    frame's S is the namespace's last batch number (server/events/snapshot.py)
    heartbeat       PUB [topic, S, KVEventBatch(ts, [])] every `heartbeat_s` per namespace that
                    published: an empty batch repeating its last number S, not kept for replay
    subscription    the PUB socket is an XPUB (the same frames for subscribers): each
                    subscription that takes effect reaches the thread, which hands it to the
                    loop (`subscribed`, given at start) to seal the namespaces it matches

Each namespace numbers its own batches, so a replay names the namespace by its topic; vLLM's
form, which names none, replays namespace VLLM_REPLAY_NAMESPACE. b"snapshot" is never a
topic (a topic has a ':' after its name's length). A request of any other shape is ignored
(counted), as vLLM does.

The event loop only calls `offer` and its heartbeat and snapshot forms (a non-blocking put
on a bounded queue, plus a wake-up frame on an inproc socket when the queue was empty: once
woken, the thread sends until it is empty). Everything else runs in the thread, which owns
the PUB, ROUTER and wake-up receiver sockets. A snapshot request crosses the other way: the
thread hands it to the loop (`ask_snapshot`, given at start), which owns the holdings, and
the loop queues the snapshot back. One queue, in order: a heartbeat or snapshot numbered S
leaves after batch S. A subscriber that does not read never blocks the thread: PUB
drops frames past the high-water mark `hwm` (ZMQ does not count those; the subscriber sees
the gap in the sequence numbers and replays).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import zmq

from kvstore.config_events import EventsConfig
from kvstore.errors import KVStoreError
from kvstore.server.data_dir import private_directory
from kvstore.server.events.snapshot import Snapshot
from kvstore.server.events.wire import END_SEQ, Wire, seq_bytes, topic_of

log = logging.getLogger("kvstore.events")
# Batches waiting for the thread. Past this the loop stops offering (counted): the batches
# stay in their rings for replay, and the daemon's memory does not grow with a stuck thread.
QUEUE_BATCHES = 10_000
# vLLM's replay request names no topic: it replays this namespace (the one a daemon opens
# by default, host.namespaces).
VLLM_REPLAY_NAMESPACE = "default"
# On close, frames still queued for subscribers get this long to leave (then dropped).
CLOSE_LINGER_MS = 500
# How long the daemon's stop waits for the thread to send what it was offered.
CLOSE_JOIN_S = 5.0
# The replay socket's snapshot request: [b"", SNAPSHOT_REQUEST, topic].
SNAPSHOT_REQUEST = b"snapshot"
# Snapshots asked and not yet sent. Past this a request is refused (counted): the router hears
# no end marker and asks again; what a flood of requests can make the daemon hold is bounded.
MAX_QUEUED_SNAPSHOTS = 64
IPC = "ipc://"


class Heartbeat(NamedTuple):
    """An empty batch repeating a namespace's last number: sent, never kept."""
    seq: int
    ts: float
    events: tuple = ()


class EventsError(KVStoreError):
    code = "events"


class ZmqPublisher:
    """Made by the daemon with its EventStream; `start()` binds at the daemon's start."""

    def __init__(self, config: EventsConfig, rings: dict, namespace: str | None = None):
        """rings: topic -> server.events.ring.Ring, the batches a replay may send (the
        stream adds rings while the thread reads them): those of this publisher's namespaces
        only. namespace: the one namespace of endpoints of its own (`[events.namespaces.<name>]`,
        config.own_endpoints), which vLLM's replay form replays; None: the shared endpoints."""
        self.config = config
        self.rings = rings
        self.namespace = namespace
        self._key = "events" if namespace is None else f"events.namespaces.{namespace}"
        self.wire = Wire.of(config)  # how events are written (int hashes, ownership)
        # (topic, batch), or None to stop. A deque: append and popleft are atomic, and the
        # put path takes no lock (queue.Queue takes one and notifies a condition per put).
        self._queue: deque = deque()
        self._ctx: zmq.Context | None = None
        self._wake: zmq.Socket | None = None  # the event loop's end of the wake-up pair
        self._thread: threading.Thread | None = None
        self._vllm_topic = topic_of(config.topic, namespace or VLLM_REPLAY_NAMESPACE)
        self._ask_snapshot: Callable[[bytes, bytes], None] | None = None
        self._subscribed: Callable[[bytes], None] | None = None
        self._snapshots_queued = self._snapshots_taken = 0  # written by the loop and the thread, one each
        self.num_sent_batches = 0  # written by the thread only
        self.num_replays = 0
        self.num_bad_replay_requests = 0
        self.num_snapshot_requests = 0
        self.num_snapshots = 0  # sent whole, end marker included
        self.num_heartbeats = 0
        self.num_subscriptions = 0

    def start(self, ask_snapshot: Callable[[bytes, bytes], None] | None = None,
              subscribed: Callable[[bytes], None] | None = None) -> None:
        """Bind both endpoints (EventsError naming the key if one cannot be bound) and start
        the thread. On the event loop thread, once. ask_snapshot(client, topic): called in
        the thread for each snapshot request, returns at once; the loop answers through
        offer_snapshot. None: snapshot requests go unanswered. subscribed(prefix): called in
        the thread for each subscription that took effect (a topic, or a prefix of topics:
        b"" for all), returns at once; frames sent after it reach that subscriber."""
        self._ask_snapshot = ask_snapshot
        self._subscribed = subscribed
        self._ctx = zmq.Context()
        pub = self._bind(zmq.XPUB, self.config.endpoint, f"{self._key}.endpoint", self.config.hwm)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only a topic's first
        # A full replay plus its end marker must fit in the ROUTER's queue for a slow reader
        # (vLLM's sizing: ZMQ acknowledges reads only every HWM/2 messages).
        router = self._bind(zmq.ROUTER, self.config.replay_endpoint, f"{self._key}.replay_endpoint",
                            2 * (self.config.buffer_batches + 1), close_first=pub)
        # A reader's full queue or a reader gone refuses the send (zmq.Again, EHOSTUNREACH)
        # instead of dropping it unseen: a snapshot's frames carry no number of their own, so
        # one dropped in the middle could not be told from the end.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        address = f"inproc://kvstore-events-wake-{id(self)}"
        wake_in = self._ctx.socket(zmq.PULL)
        wake_in.bind(address)
        self._wake = self._ctx.socket(zmq.PUSH)
        self._wake.setsockopt(zmq.SNDHWM, 1)  # one pending wake-up is as good as many
        self._wake.setsockopt(zmq.LINGER, 0)
        self._wake.connect(address)
        self._thread = threading.Thread(target=self._run, args=(pub, router, wake_in), daemon=True,
                                        name="kvstore-events")
        self._thread.start()
        log.info("event=events_ready endpoint=%s replay_endpoint=%s topic_prefix=%r",
                 self.config.endpoint, self.config.replay_endpoint, self.config.topic)

    def _bind(self, kind: int, endpoint: str, key: str, hwm: int, close_first=None) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        try:
            if endpoint.startswith(IPC):
                self._bind_ipc(sock, endpoint[len(IPC):], key)
            else:
                sock.bind(endpoint)
        except (zmq.ZMQError, OSError, EventsError) as exc:
            sock.close(linger=0)
            if close_first is not None:
                close_first.close(linger=0)
            self._ctx.term()
            if isinstance(exc, EventsError):
                raise
            raise EventsError(f"{key} = {endpoint!r} cannot be bound: {exc}. Name a free address "
                              f"(tcp://127.0.0.1:<port> or ipc://<path>)") from None
        return sock

    def _bind_ipc(self, sock: zmq.Socket, path: str, key: str) -> None:
        """Bind a Unix socket as the client socket is made (server/socket_path.py): in a
        directory only this user can write (made 0700 if missing), created under umask 077 so
        no other user can connect before its mode is set, then given `socket_mode`. Whoever
        connects reads every snapshot, routes' token ids (prompts) included. libzmq creates
        the file in the calling thread, within bind()."""
        private_directory(os.path.dirname(os.path.abspath(path)), EventsError, f"{key}'s directory",
                          "could put another publisher at its path",
                          f"Name an ipc:// path in a directory only this user can write, or in one that does not "
                          f"exist yet (the daemon makes it 0700): {key}")
        umask = os.umask(0o077)
        try:
            sock.bind(f"{IPC}{path}")
        finally:
            os.umask(umask)
        os.chmod(path, self.config.socket_mode)

    def offer(self, ring, batch) -> bool:
        """Queue a numbered batch for sending, without blocking: False when the queue is full
        (the batch stays in its ring for replays). Event loop thread only."""
        return self._put((ring.topic, batch))

    def offer_heartbeat(self, topic: bytes, seq: int, ts: float) -> bool:
        """Queue a heartbeat of the namespace whose last batch is `seq` (after that batch, which
        the queue holds or sent); False when the queue is full. Event loop thread only."""
        return self._put((topic, Heartbeat(seq, ts)))

    def offer_snapshot(self, snapshot: Snapshot) -> bool:
        """Queue a snapshot taken on the loop for sending; False when too many wait (the router
        hears no end marker and asks again). Event loop thread only."""
        if self._snapshots_queued - self._snapshots_taken >= MAX_QUEUED_SNAPSHOTS or \
                not self._put(snapshot, bounded=False):
            return False
        self._snapshots_queued += 1
        return True

    def _put(self, item, bounded: bool = True) -> bool:
        if self._thread is None or (bounded and len(self._queue) >= QUEUE_BATCHES):  # not running, or full
            return False
        self._queue.append(item)
        if len(self._queue) == 1:  # it was empty: the thread sleeps, or drains what is queued anyway
            try:
                self._wake.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # a wake-up is pending already
                pass
        return True

    def close(self) -> None:
        """Send what was offered, then stop the thread and close the sockets (waits at most
        about CLOSE_JOIN_S). Event loop thread; idempotent."""
        if self._thread is None:
            return
        self._queue.append(None)
        try:
            self._wake.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # a wake-up is pending already
            pass
        self._thread.join(CLOSE_JOIN_S)
        self._wake.close(linger=0)
        if self._thread.is_alive():  # stuck: its sockets stay open, so the context is left as is
            log.warning("event=events_close_timeout queued=%d", len(self._queue))
        else:
            self._ctx.term()  # waits for the thread's sockets to linger out (CLOSE_LINGER_MS)
        self._thread = None

    def stats(self) -> dict:
        return {"num_sent_batches": self.num_sent_batches, "num_replays": self.num_replays,
                "num_bad_replay_requests": self.num_bad_replay_requests, "queued_batches": len(self._queue),
                "num_snapshot_requests": self.num_snapshot_requests, "num_snapshots": self.num_snapshots,
                "num_heartbeats": self.num_heartbeats, "num_subscriptions": self.num_subscriptions}

    # --- the thread -------------------------------------------------------------------

    def _run(self, pub: zmq.Socket, router: zmq.Socket, wake_in: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(wake_in, zmq.POLLIN)
        poller.register(router, zmq.POLLIN)
        poller.register(pub, zmq.POLLIN)  # subscriptions
        try:
            running = True
            while running:
                ready = dict(poller.poll())
                if pub in ready:
                    self._take_subscriptions(pub)
                if router in ready:
                    self._serve_replays(router)
                if wake_in in ready:
                    while _drain_one(wake_in):
                        pass
                    running = self._send_queued(pub, router)
        except Exception:
            log.exception("event=events_thread_failed")
        finally:
            for sock in (pub, router, wake_in):
                sock.close()

    def _send_queued(self, pub: zmq.Socket, router: zmq.Socket) -> bool:
        """Send every queued batch, heartbeat and snapshot; False once the close sentinel came."""
        while True:
            try:
                item = self._queue.popleft()
            except IndexError:
                return True
            if item is None:
                return False
            if isinstance(item, Snapshot):
                self._snapshots_taken += 1
                self._send_snapshot(router, item)
                continue
            topic, batch = item
            try:
                pub.send_multipart((topic, seq_bytes(batch.seq), self.wire.encode_batch(batch.ts, batch.events)),
                                   zmq.NOBLOCK)
            except zmq.Again:  # PUB drops rather than blocks; kept for replay either way
                continue
            if isinstance(batch, Heartbeat):
                self.num_heartbeats += 1
            else:
                self.num_sent_batches += 1

    def _send_snapshot(self, router: zmq.Socket, snapshot: Snapshot) -> None:
        # At most as many frames as a replay of the whole ring: what the ROUTER queues for one reader.
        seq = seq_bytes(snapshot.seq)
        try:
            for events in snapshot.batches(self.config.buffer_batches):
                router.send_multipart((snapshot.client, b"", snapshot.topic, seq,
                                       self.wire.encode_batch(snapshot.ts, events)), zmq.NOBLOCK)
            router.send_multipart((snapshot.client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
        except zmq.ZMQError:  # its queue is full (the reader is slow, or replaying), or it left
            return  # no end marker: the router asks again
        self.num_snapshots += 1

    def _take_subscriptions(self, pub: zmq.Socket) -> None:
        """XPUB hands each subscription over as a byte 1 then the prefix (0: an unsubscription),
        once it applies to what the socket sends next."""
        while True:
            try:
                message = pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == b"\x01":
                self.num_subscriptions += 1
                if self._subscribed is not None:
                    self._subscribed(message[1:])

    def _serve_replays(self, router: zmq.Socket) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 4 and frames[1] == b"" and frames[2] == SNAPSHOT_REQUEST:
                self.num_snapshot_requests += 1
                if self._ask_snapshot is not None:
                    self._ask_snapshot(frames[0], frames[3])
                continue
            if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8:
                client, topic, start = frames[0], self._vllm_topic, frames[2]
            elif len(frames) == 4 and frames[1] == b"" and len(frames[3]) == 8:
                client, topic, start = frames[0], frames[2], frames[3]
            else:
                self.num_bad_replay_requests += 1
                continue
            self.num_replays += 1
            ring = self.rings.get(topic)
            batches = ring.since(int.from_bytes(start, "big")) if ring is not None else []
            try:
                for batch in batches:
                    router.send_multipart((client, b"", topic, seq_bytes(batch.seq),
                                           self.wire.encode_batch(batch.ts, batch.events)), zmq.NOBLOCK)
                router.send_multipart((client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
            except zmq.ZMQError:  # that subscriber's queue is full (it asks again), or it left
                continue


def _drain_one(sock: zmq.Socket) -> bool:
    try:
        sock.recv(zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False
