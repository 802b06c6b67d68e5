"""A subscriber of a daemon's KV event stream, as a router would be one (real ZMQ sockets).

Shared by tests/server/events/ (decoded with msgpack) and tests/adapters/vllm/test_kv_events.py
(decoded with vLLM's own classes): `decode` turns a payload into what the test compares.
The waits poll with a liveness bound; nothing here measures time.
"""

from __future__ import annotations

import os
import time

import msgpack
import zmq

from kvstore.server.events import topic_of

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_MS = 10_000  # a liveness bound: the daemon sends within it on any machine


def vllm_int_hash(value: bytes) -> int:
    """A bytes block hash in vLLM's default int form (maybe_convert_block_hash): the last 8
    bytes, big-endian, as the daemon publishes it with `[events] int_block_hashes`."""
    return int.from_bytes(bytes(value)[-8:], "big")


def endpoints(daemon) -> tuple[str, str]:
    """The default endpoints of a DaemonProcess started with `[events] enabled = true`."""
    return (f"ipc://{os.path.join(daemon.data_dir, 'events.pub')}",
            f"ipc://{os.path.join(daemon.data_dir, 'events.replay')}")


class EventSubscriber:
    """One namespace's topic on the PUB endpoint, and a DEALER on the replay endpoint.
    received: (seq, payload bytes) of the batches in arrival order; heartbeats: those of the
    heartbeats (empty batches repeating a number: `[events] heartbeat_s`), with the empty
    batches a subscription seals with (a subscriber cannot tell them apart); frames: both."""

    def __init__(self, daemon, namespace: str, prefix: str = "kvstore.", rcvhwm: int | None = None,
                 at: tuple[str, str] | None = None):
        """at: (PUB, replay) endpoints other than the daemon's default ones."""
        self.topic = topic_of(prefix, namespace)
        pub, replay = at or endpoints(daemon)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        if rcvhwm is not None:
            self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(pub)
        self.replay_socket = self.ctx.socket(zmq.DEALER)
        self.replay_socket.connect(replay)
        self.received: list[tuple[int, bytes]] = []
        self.heartbeats: list[tuple[int, bytes]] = []
        self.frames: list[tuple[int, bytes]] = []

    def receive(self, timeout_ms: int = POLL_MS) -> tuple[int, bytes] | None:
        """The next frame of this topic (checked), or None when none came within timeout_ms."""
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic, (topic, self.topic)
        self.frames.append((int.from_bytes(seq, "big"), payload))
        (self.received if msgpack.unpackb(payload)[1] else self.heartbeats).append(self.frames[-1])
        return self.frames[-1]

    def receive_until(self, done, what: str) -> None:
        """Receive until done(self) is true; AssertionError naming `what` if the stream dries up."""
        while not done(self):
            if self.receive() is None:
                raise AssertionError(f"{what}: no event within {POLL_MS} ms; received {len(self.received)}")

    def drain(self, timeout_ms: int = 200) -> None:
        """Receive what is already on its way (stops after timeout_ms without a frame)."""
        while self.receive(timeout_ms) is not None:
            pass

    def replay(self, start_seq: int, topic: bytes | None = None) -> list[tuple[int, bytes]]:
        """Ask for the kept batches from start_seq on (vLLM's request without `topic`)."""
        request = [b""] + ([topic] if topic is not None else []) + [start_seq.to_bytes(8, "big")]
        self.replay_socket.send_multipart(request)
        out = []
        while True:
            assert self.replay_socket.poll(POLL_MS), "the replay did not end with its marker"
            frames = self.replay_socket.recv_multipart()
            assert frames[0] == b"", frames
            if frames[2] == END_SEQ:
                assert frames[1] == b"" and frames[3] == b""
                return out
            out.append((int.from_bytes(frames[2], "big"), frames[3]))
            assert frames[1] == (self.topic if topic is None else topic)

    def snapshot(self, topic: bytes | None = None) -> tuple[int, list[bytes]]:
        """Ask for a namespace's snapshot ([b"", b"snapshot", topic]; this subscriber's topic
        by default): (the sequence number every frame carries, the payloads in order)."""
        topic = self.topic if topic is None else topic
        self.replay_socket.send_multipart([b"", b"snapshot", topic])
        seqs, out = set(), []
        while True:
            assert self.replay_socket.poll(POLL_MS), "the snapshot did not end with its marker"
            frames = self.replay_socket.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4, frames
            if frames[1] == b"":  # the end marker: no topic
                assert frames[2] == END_SEQ and frames[3] == b""
                assert len(seqs) == 1, seqs
                return seqs.pop(), out
            assert frames[1] == topic
            seqs.add(int.from_bytes(frames[2], "big", signed=True))
            out.append(frames[3])

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay_socket.close(linger=0)
        self.ctx.term()


def events_of(payload: bytes) -> list[dict]:
    """The event maps of one KVEventBatch payload (plain msgpack)."""
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank == 0
    return events


def all_events(received) -> list[dict]:
    return [e for _, payload in received for e in events_of(payload)]


def held_media(events, held: dict | None = None) -> dict[str, set]:
    """medium -> block hashes held, from event maps applied in order (onto `held`)."""
    held = {} if held is None else held
    for e in events:
        if e["type"] == "BlockStored":
            held.setdefault(e["medium"], set()).update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            held.setdefault(e["medium"], set()).difference_update(e["block_hashes"])
        else:
            held.clear()
    return held


def last_seq(client, namespace: str) -> int:
    """The number of the last batch of `namespace`, once no report waits for its batch."""
    for _ in range(1000):
        events = client.stats()["events"]
        if events["pending_events"] == 0:
            return events["namespaces"][namespace]["next_seq"] - 1
        time.sleep(0.01)
    raise AssertionError("reports still wait for their batch")


def wait_subscribed(subscriber: EventSubscriber, poke) -> None:
    """ZMQ subscriptions take effect a moment after connect: poke() (a put in the namespace)
    until a batch of events arrives (not a heartbeat, nor the seal of a poke that went before
    the subscription). The frames after it come gapless."""
    for _ in range(200):
        poke()
        while subscriber.receive(timeout_ms=100) is not None:
            if events_of(subscriber.frames[-1][1]):
                return
    raise AssertionError("the subscription never took effect")


class VllmRules:
    """A router that follows vLLM's subscriber rules and knows nothing of kvstore's
    (vLLM's examples/online_serving/kv_events_subscriber.py): every frame it receives is
    applied in arrival order, heartbeats too (an empty batch); a number past `last + 1` first
    asks for a replay from `last + 1` (vLLM's request, which names no topic: the namespace
    "default") and applies the replayed batches numbered before it. No snapshot, no
    AllBlocksCleared rule beyond applying it. held: medium -> block hashes."""

    def __init__(self, subscriber: EventSubscriber):
        self.subscriber = subscriber
        self.last = -1
        self.held: dict[str, set] = {}

    def step(self, timeout_ms: int = POLL_MS) -> bool:
        """Apply the next frame (and the replay it calls for); False when none came."""
        got = self.subscriber.receive(timeout_ms)
        if got is None:
            return False
        seq, payload = got
        if self.last >= 0 and seq > self.last + 1:
            for replayed, body in self.subscriber.replay(self.last + 1):
                if self.last < replayed < seq:
                    held_media(events_of(body), self.held)
        held_media(events_of(payload), self.held)
        self.last = seq
        return True

    def follow_until(self, last: int, what: str) -> None:
        """Apply frames until one numbered `last` or later came (AssertionError naming `what`
        if the stream dries up: a liveness bound, not a timing)."""
        while self.last < last:
            if not self.step():
                raise AssertionError(f"{what}: no frame within {POLL_MS} ms; last applied {self.last}, "
                                     f"waiting for {last}")
