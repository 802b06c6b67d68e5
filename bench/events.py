"""Events bench: what the KV event stream for routers (`[events]`) costs puts and gets.

    .venv/bin/python bench/events.py [--quick] [--no-subscriber]

Reaches inside for one name only: `server.events.topic_of`, the ZMQ topic a router subscribes
to (docs/routers.md); everything else runs through `kvstore serve` and the client.

Three daemons, host tier only, alike but for `[events] enabled` (off, on, on); the first
with events has a subscriber in its own process reading its namespace's stream as a router
would (decoding every batch); the second gets its puts with routes (kvstore/route.py: 16
block hashes, 256 token ids and a parent, as the vLLM connector names a chunk). Put and get_into of small objects, where the per-object cost shows, are
interleaved between them (rep 1 of each, then rep 2, starting with the other each time),
so load from other users of a shared machine hits both alike. Then, on the daemon with
events: the lag from a put's reply to its BlockStored event at the subscriber (one put at
a time), and the events per second a put_many stream sustains. Writes bench/results/events.json.

How each number is taken (median over the reps; one warm-up rep first):
  put, get_into   as bench/local.py: distinct keys every rep, deleted after the rep (untimed);
                  a put makes one BlockStored event, its delete one BlockRemoved
  lag             time.monotonic() at the subscriber's receipt minus at the put's reply
                  (CLOCK_MONOTONIC is one clock for every process of the machine)
  events/s        BlockStored events received during a put_many of small objects, over
                  the time from the first to the last one
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import KiB, Row, Target, Worker, median, percentile, report, scratch_dir, size_label  # noqa: E402
from bench.local import interleave, progress  # noqa: E402
from bench.local_sides import KVStoreSide, keys_for, timed  # noqa: E402

SUITE = "events"
# A routed put names a 256-token chunk as vLLM does: 16 blocks of 16 tokens.
ROUTE_BLOCKS, ROUTE_BLOCK_TOKENS = 16, 16
SIZES = (4 * KiB, 64 * KiB)
ARENA = "512MiB"


@dataclass(frozen=True, slots=True)
class Plan:
    reps: int
    count: int  # objects per rep
    lag_puts: int
    stream_objects: int  # put_many for events/s


FULL = Plan(reps=11, count=2000, lag_puts=2000, stream_objects=20000)
QUICK = Plan(reps=5, count=500, lag_puts=500, stream_objects=5000)
TARGETS = [Target(f"put {size_label(s)}", "throughput", "events off", ">=", 0.95) for s in SIZES] + \
          [Target(f"get_into {size_label(s)}", "throughput", "events off", ">=", 0.95) for s in SIZES]


class EventsSide(KVStoreSide):
    """A KVStoreSide that also times single puts (their reply's monotonic time)."""

    def put_replies(self, tag: str, count: int) -> list[tuple[bytes, float]]:
        src, out = self.src, []
        for key in keys_for(tag, count):
            self.client.put(key, src)
            out.append((bytes(key), time.monotonic()))
        return out

    def put_many_objects(self, tag: str, count: int) -> int:
        results = self.client.put_many([(key, self.src) for key in keys_for(tag, count)])
        return sum(1 for r in results if not r.error)


class RoutedSide(EventsSide):
    """Puts as the vLLM connector makes them: each with its route (ROUTE_BLOCKS 32-byte block
    hashes, their tokens and the parent hash), built and packed inside the timed loop as the
    adapter builds it at each put."""

    def prepare(self, size: int, count: int) -> None:
        super().prepare(size, count)
        self.hashes = {bytes(key): [bytes(key)[:28] + i.to_bytes(4, "little") for i in range(ROUTE_BLOCKS)]
                       for keys in self.rep_keys for key in keys}
        self.tokens = list(range(ROUTE_BLOCKS * ROUTE_BLOCK_TOKENS))

    def put(self, rep: int) -> float:
        from kvstore.hints import Hints
        from kvstore.route import Route
        put, src, hashes, tokens = self.client.put, self.src, self.hashes, self.tokens

        def run():
            for key in self.rep_keys[rep]:
                blocks = hashes[bytes(key)]
                put(key, src, hints=Hints(route=Route(blocks, parent_block_hash=blocks[0], token_ids=tokens,
                                                      block_size=ROUTE_BLOCK_TOKENS, group_idx=0)))
        return timed(run)


class Subscriber:
    """Reads one namespace's stream in a thread: BlockStored receipts by object id."""

    def __init__(self, endpoint: str, topic: bytes):
        import msgpack
        import zmq
        self._unpack = msgpack.unpackb
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.RCVTIMEO, 200)
        self.sub.connect(endpoint)
        self.stored: dict[bytes, float] = {}
        self.num_events = 0
        self._running = True
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        import zmq
        while self._running:
            try:
                _, _, payload = self.sub.recv_multipart()
            except zmq.Again:
                continue
            now = time.monotonic()
            _, events, _ = self._unpack(payload)
            self.num_events += len(events)
            for e in events:
                if e["type"] == "BlockStored":
                    self.stored[e["block_hashes"][0]] = now

    def arrivals(self, ids: list[bytes]) -> list[float | None]:
        """By object id: an object put without a route is one block named by its id, which the
        stream publishes in vLLM's int form by default (the daemons here keep that default)."""
        from kvstore.route import published_hash
        return [self.stored.get(published_hash(i, True)) for i in ids]

    def close(self) -> None:
        self._running = False
        self._thread.join()
        self.sub.close(linger=0)
        self.ctx.term()


def start(stack: contextlib.ExitStack, workdir: str, name: str, events: bool, reps: int,
          side=EventsSide) -> Worker:
    from kvstore.commands.smoke import start_daemon
    socket_path = os.path.join(workdir, f"{name}.sock")
    config = os.path.join(workdir, f"{name}.toml")
    with open(config, "w") as f:
        f.write(f"[admin]\nenabled = false\n[events]\nenabled = {'true' if events else 'false'}\n")
    data_dir = os.path.join(workdir, f"data-{name}")
    daemon = start_daemon(socket_path, ARENA, extra=("--config", config, "--data-dir", data_dir))
    stack.callback(lambda: (daemon.terminate(), daemon.wait(10)))
    return stack.enter_context(Worker(name, side, socket_path, reps))


def wait_for_events(subscriber: Worker, side: Worker) -> None:
    """Put probes until the subscriber has seen one (a ZMQ subscription takes a moment)."""
    for i in range(200):
        probe = side.call("put_replies", f"probe/{i}", 1)
        time.sleep(0.05)
        if subscriber.call("arrivals", [probe[0][0]])[0] is not None:
            return
    raise RuntimeError("the subscriber never received an event")


def settled(subscriber: Worker, ids: list[bytes], timeout_s: float = 10.0) -> list[float | None]:
    """The receipts of `ids` once all came (or timeout_s passed: None for the missing)."""
    deadline = time.monotonic() + timeout_s
    while None in (arrived := subscriber.call("arrivals", ids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return arrived


def measure(plan: Plan, workdir: str, subscribe: bool = True) -> dict:
    from kvstore.server.events import topic_of
    out: dict = {"put": {}, "get": {}}
    with contextlib.ExitStack() as stack:
        sides = {"events off": start(stack, workdir, "off", False, plan.reps),
                 "events on": start(stack, workdir, "on", True, plan.reps),
                 "events on, routes": start(stack, workdir, "routes", True, plan.reps, RoutedSide)}
        if subscribe:
            subscriber = stack.enter_context(Worker("subscriber", Subscriber, f"ipc://{workdir}/data-on/events.pub",
                                                    topic_of("kvstore.", "bench")))
            sides["events on"].call("prepare", SIZES[0], 1)
            wait_for_events(subscriber, sides["events on"])
        for size in SIZES:
            for worker in sides.values():
                worker.call("prepare", size, plan.count)
            progress("bench", f"{size_label(size)}: {plan.reps} reps of {plan.count} objects, events off / on")
            seconds = interleave(sides, "put", plan.reps, after="drop")
            out["put"][size] = {n: plan.count / s / 1e3 for n, s in seconds.items()}
            seconds = interleave(sides, "get", plan.reps)
            out["get"][size] = {n: plan.count / s / 1e3 for n, s in seconds.items()}
            for worker in sides.values():
                worker.call("finish")
            rates = {op: ", ".join(f"{n} {v:.1f}" for n, v in out[op][size].items()) for op in ("put", "get")}
            progress("bench", f"{size_label(size)} kops/s put {rates['put']} | get {rates['get']}")
        if not subscribe:
            return out
        on = sides["events on"]
        on.call("prepare", SIZES[0], 1)  # put_replies and put_many_objects put 4 KiB objects
        replies = on.call("put_replies", "lag", plan.lag_puts)
        arrived = settled(subscriber, [i for i, _ in replies])
        lags = [(a - t) * 1e6 for (_, t), a in zip(replies, arrived) if a is not None]
        out["lag_us"] = (percentile(lags, 50), percentile(lags, 99))
        out["lag_missing"] = sum(a is None for a in arrived)
        progress("bench", f"lag us p50 {out['lag_us'][0]:.0f} p99 {out['lag_us'][1]:.0f}, missing {out['lag_missing']}")
        ids = [bytes(k) for k in keys_for("stream", plan.stream_objects)]
        stored = on.call("put_many_objects", "stream", plan.stream_objects)
        times = [t for t in settled(subscriber, ids) if t is not None]
        out["events_per_s"] = (len(times) - 1) / (max(times) - min(times)) if len(times) > 1 else 0.0
        out["stream_received"], out["stream_stored"] = len(times), stored
        progress("bench", f"events/s {out['events_per_s']:.0f} ({len(times)} of {stored} received)")
    return out


def rows_of(out: dict) -> list[Row]:
    rows = []
    for op, case in (("put", "put"), ("get", "get_into")):
        for size, by_side in out[op].items():
            rows.append(Row(SUITE, f"{case} {size_label(size)}", "throughput", "kops/s", by_side["events on"],
                            "events off", by_side["events off"]))
            if op == "put":
                rows.append(Row(SUITE, f"{case} {size_label(size)} with routes", "throughput", "kops/s",
                                by_side["events on, routes"], "events off", by_side["events off"]))
    if "lag_us" not in out:
        return rows
    rows.append(Row(SUITE, "put reply -> event", "p50", "us", out["lag_us"][0], higher_is_better=False))
    rows.append(Row(SUITE, "put reply -> event", "p99", "us", out["lag_us"][1], higher_is_better=False))
    rows.append(Row(SUITE, f"put_many {size_label(SIZES[0])}", "events/s", "events/s", out["events_per_s"]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    parser.add_argument("--no-subscriber", action="store_true",
                        help="nobody reads the stream: the daemon's own cost, without a reader's on this machine")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    started = time.perf_counter()
    with scratch_dir("kvs-ev-") as workdir:
        out = measure(plan, workdir, subscribe=not args.no_subscriber)
    settings = {**asdict(plan), "mode": "quick" if args.quick else "full", "arena": ARENA,
                "subscriber": not args.no_subscriber, "elapsed_s": round(time.perf_counter() - started, 1),
                **{k: out[k] for k in ("lag_missing", "stream_received", "stream_stored") if k in out}}
    report(SUITE + ("-no-subscriber" if args.no_subscriber else ""), rows_of(out), TARGETS, {}, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
