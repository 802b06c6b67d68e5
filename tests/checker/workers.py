"""The checker's workers: clients doing random operations against one daemon, each recording
every call it makes (tests/checker/histories.py reads the records).

A worker is a `Client` driven from a thread, a `Client` in a process of its own that is sent
SIGINT at random moments (KeyboardInterrupt inside its calls) and sometimes SIGKILLed, or an
`AsyncClient` whose calls are cancelled at random points. The operations are written once as
coroutines over the asyncio client's calls; a sync client runs them through `SyncCalls`,
whose awaits never suspend.

    python tests/checker/workers.py SOCKET DATA_DIR NAME SEED SECONDS RECORDS [shared|daemon]
        a process worker (the orchestrator, tests/checker/run.py, starts and signals it)
"""

from __future__ import annotations

import signal

if __name__ == "__main__":  # a process worker: SIGINT is for its calls, not its start (handled below)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import asyncio
import json
import os
import random
import sys
import time

import numpy as np

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]  # the checkout (its kvstore), then tests/ (for `checker`)

from checker.histories import UNKNOWN  # noqa: E402
from checker.values import NAMESPACES, NUM_KEYS, decode, descriptor, encode, object_id, size_of  # noqa: E402
from kvstore import Hints  # noqa: E402
from kvstore.client import AsyncClient, Client  # noqa: E402
from kvstore.errors import Conflict, DaemonUnavailable, KVStoreError  # noqa: E402
from kvstore.groups import Member  # noqa: E402

GROUP_SIZE = 3
NUM_GROUPS = 6  # groups use keys NUM_KEYS.. (NUM_KEYS + NUM_GROUPS * GROUP_SIZE), apart from single puts
TTLS_S = (0.3, 1.0)
OPS = (  # (operation, weight)
    ("put", 20), ("put_ttl", 3), ("put_again", 3), ("put_deferred", 6), ("flush", 3),
    ("get_into", 22), ("get", 8), ("get_many_into", 4), ("get_many", 3), ("lookup", 6), ("delete", 10),
    ("pin", 3), ("unpin", 2), ("put_group", 4), ("get_group", 4), ("delete_group", 1), ("evict", 1),
)
_NAMES, _WEIGHTS = zip(*OPS)


class Recorder:
    """JSON lines, one write(2) each, so a SIGKILL loses at most the line being written: a
    "begin" line before a call and an "end" line after it returned (or raised)."""

    def __init__(self, path: str, worker: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.worker = worker
        self.seq = 0

    def begin(self, op: str, ns: int, keys: list, **extra) -> int:
        self.seq += 1
        self._write({"e": "begin", "w": self.worker, "i": self.seq, "op": op, "ns": ns, "keys": keys,
                     "t": time.monotonic(), **extra})
        return self.seq

    def fault(self, kind: str) -> None:
        self._write({"e": "fault", "kind": kind})

    def end(self, seq: int, out, **extra) -> None:
        self._write({"e": "end", "i": seq, "t": time.monotonic(), "out": out, **extra})

    def _write(self, rec: dict) -> None:
        os.write(self.fd, (json.dumps(rec) + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)


class SyncCalls:
    """A sync Client's calls as coroutines that complete without suspending (run_now drives them)."""

    def __init__(self, client: Client):
        self.client = client

    def __getattr__(self, name):
        call = getattr(self.client, name)

        async def awaited(*args, **kwargs):
            return call(*args, **kwargs)
        return awaited


def run_now(coro):
    """Run a coroutine that never suspends (an op over SyncCalls) to its result."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("an op over a sync client suspended")


def _outcome(result) -> str:
    if result.error is None:
        return "existed" if result.existed else "ok"
    if isinstance(result.error, Conflict):
        return "conflict"
    if isinstance(result.error, DaemonUnavailable) or "may not be stored" in str(result.error):
        return UNKNOWN
    return f"error:{result.error.code}"


class Workload:
    """One worker's operations over a client (AsyncClient, or SyncCalls over a Client)."""

    def __init__(self, calls, rec: Recorder, rng: random.Random, number: int, data_dir: str):
        self.calls, self.rec, self.rng = calls, rec, rng
        self.number = number  # versions of this worker: (number << 40) | counter
        self.counter = 0
        self.data_dir = data_dir
        self.deferred: list[tuple[int, object]] = []  # (record seq, object id) not yet reported by a flush
        self.last_version: dict = {}  # (ns, key) -> the last version this worker put

    def version(self) -> int:
        self.counter += 1
        return (self.number << 40) | self.counter

    def pick(self) -> str:
        return self.rng.choices(_NAMES, _WEIGHTS)[0]

    async def step(self, name: str) -> None:
        await getattr(self, "op_" + name)(self.rng.randrange(len(NAMESPACES)), self.rng.randrange(NUM_KEYS))

    # --- writes ---------------------------------------------------------------------------

    async def _put(self, ns: int, key: int, version: int, **hints) -> None:
        seq = self.rec.begin("put", ns, [key], v=version, ttl=hints.get("ttl_s"))
        result = await self.calls.put(object_id(key), encode(ns, key, version), descriptor(ns),
                                      Hints(**hints) if hints else None)
        self.last_version[(ns, key)] = version
        self.rec.end(seq, "existed" if result.existed else "ok", dur=result.durability)

    async def op_put(self, ns, key):
        await self._put(ns, key, self.version())

    async def op_put_ttl(self, ns, key):
        await self._put(ns, key, self.version(), ttl_s=self.rng.choice(TTLS_S))

    async def op_put_again(self, ns, key):  # the same version again: dedup, or stored anew
        await self._put(ns, key, self.last_version.get((ns, key)) or self.version())

    async def op_put_deferred(self, ns, key):
        version = self.version()
        seq = self.rec.begin("put", ns, [key], v=version, deferred=True)
        await self.calls.put(object_id(key), encode(ns, key, version), descriptor(ns), None, wait=False)
        self.deferred.append((seq, object_id(key)))

    async def op_flush(self, ns=None, key=None):
        pending, self.deferred = self.deferred, []
        results = await self.calls.flush()
        if len(results) != len(pending) or any(r.object_id != oid for r, (_, oid) in zip(results, pending)):
            return  # an earlier flush was interrupted: which result is whose is not known (unknown outcomes)
        for (seq, _), result in zip(pending, results):
            self.rec.end(seq, _outcome(result), dur=result.durability)

    async def op_delete(self, ns, key):
        keys = sorted({key, self.rng.randrange(NUM_KEYS)})
        seq = self.rec.begin("delete", ns, keys)
        await self.calls.delete([object_id(k) for k in keys], namespace=NAMESPACES[ns])
        self.rec.end(seq, "ok")

    async def op_pin(self, ns, key):
        await self.calls.pin([object_id(key)], ttl_s=self.rng.choice((0.2, 1.0)), namespace=NAMESPACES[ns])

    async def op_unpin(self, ns, key):
        await self.calls.unpin([object_id(key)], namespace=NAMESPACES[ns])

    def _group(self) -> list[int]:
        g = self.rng.randrange(NUM_GROUPS)
        return [NUM_KEYS + g * GROUP_SIZE + m for m in range(GROUP_SIZE)]

    async def op_put_group(self, ns, key):
        keys, version = self._group(), self.version()
        seq = self.rec.begin("put_group", ns, keys, v=version)
        try:
            await self.calls.put_group([(object_id(k), encode(ns, k, version), descriptor(ns)) for k in keys])
        except Conflict:
            return self.rec.end(seq, "conflict")
        self.rec.end(seq, "ok")

    async def op_delete_group(self, ns, key):
        keys = self._group()
        seq = self.rec.begin("delete", ns, keys)
        await self.calls.delete([object_id(k) for k in keys], namespace=NAMESPACES[ns])
        self.rec.end(seq, "ok")

    async def op_evict(self, ns, key):
        from kvstore.server.admin.client import AdminClient
        try:
            api = AdminClient.from_data_dir(self.data_dir)
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: api.post("/v1/evict", {"namespace": NAMESPACES[ns], "bytes": 2 << 20}))
        except Exception:
            pass  # no such namespace yet, or the daemon is restarting

    # --- reads ----------------------------------------------------------------------------

    async def op_get_into(self, ns, key):
        seq = self.rec.begin("get_into", ns, [key])
        out = np.empty(size_of(key), np.uint8)
        got = await self.calls.get_into(object_id(key), out, namespace=NAMESPACES[ns])
        self.rec.end(seq, ["miss" if got is None else decode(ns, key, out[:got])])

    async def op_get(self, ns, key):
        seq = self.rec.begin("get", ns, [key])
        lease = await self.calls.get(object_id(key), namespace=NAMESPACES[ns])
        if lease is None:
            return self.rec.end(seq, ["miss"])
        try:
            got = decode(ns, key, lease.numpy().copy())
        finally:
            lease.release()
        self.rec.end(seq, [got])

    async def op_get_many_into(self, ns, key):
        keys = sorted({key, *(self.rng.randrange(NUM_KEYS) for _ in range(3))})
        outs = [np.empty(size_of(k), np.uint8) for k in keys]
        seq = self.rec.begin("get_many_into", ns, keys)
        sizes = await self.calls.get_many_into([(object_id(k), out) for k, out in zip(keys, outs)],
                                               namespace=NAMESPACES[ns])
        self.rec.end(seq, ["miss" if s is None else decode(ns, k, out[:s]) for k, out, s in zip(keys, outs, sizes)])

    async def op_get_many(self, ns, key):
        keys = sorted({key, *(self.rng.randrange(NUM_KEYS) for _ in range(3))})
        seq = self.rec.begin("get_many", ns, keys)
        leases = await self.calls.get_many([object_id(k) for k in keys], namespace=NAMESPACES[ns])
        try:
            got = ["miss" if lease is None else decode(ns, k, lease.numpy().copy()) for k, lease in zip(keys, leases)]
        finally:
            await self.calls.release_many(leases)
        self.rec.end(seq, got)

    async def op_lookup(self, ns, key):
        keys = sorted({key, self.rng.randrange(NUM_KEYS)})
        seq = self.rec.begin("lookup", ns, keys)
        found = await self.calls.lookup([object_id(k) for k in keys], namespace=NAMESPACES[ns])
        self.rec.end(seq, ["miss" if tier is None else "held" for tier in found.tiers])

    async def op_get_group(self, ns, key):
        keys = self._group()
        seq = self.rec.begin("get_group", ns, keys)
        group = await self.calls.get_group([Member.of(object_id(k), descriptor(ns)) for k in keys],
                                           namespace=NAMESPACES[ns])
        if group is None:
            return self.rec.end(seq, None)
        try:
            got = [decode(ns, k, lease.numpy().copy()) for k, lease in zip(keys, group.leases)]
        finally:
            group.release()
        self.rec.end(seq, got)


def _reconnect(client, stop_at: float) -> bool:
    while time.monotonic() < stop_at:
        try:
            client.reconnect()
            return True
        except DaemonUnavailable:
            time.sleep(0.05)
    return False


def sync_worker(socket_path: str, data_dir: str, name: str, number: int, seed: int, seconds: float,
                records: str, shared_index: bool, interruptible: bool = False) -> None:
    """A sync Client's loop. interruptible: SIGINT raises KeyboardInterrupt during calls (a
    process worker's main thread); it is then recorded as the call's unknown end."""
    rng = random.Random(seed)
    rec = Recorder(records, name)
    stop_at = time.monotonic() + seconds
    armed = [False]
    if interruptible:
        def interrupt(signum, frame):
            if armed[0]:
                raise KeyboardInterrupt
        signal.signal(signal.SIGINT, interrupt)
    client = None
    while client is None and time.monotonic() < stop_at:
        try:
            client = Client.connect(socket_path, namespace=NAMESPACES[0], shared_index=shared_index, timeout_s=10)
        except DaemonUnavailable:
            time.sleep(0.05)
    if client is None:
        return
    work = Workload(SyncCalls(client), rec, rng, number, data_dir)
    while time.monotonic() < stop_at:
        name_ = work.pick()
        try:
            armed[0] = True
            try:
                run_now(work.step(name_))
            finally:
                armed[0] = False
        except KeyboardInterrupt:
            rec.fault("interrupt")  # the call's begin has no end: an unknown outcome
            continue
        except DaemonUnavailable:
            if not _reconnect(client, stop_at):
                break
        except KVStoreError:
            pass  # a refusal (no room, a limit): the begin stays without an end, as unknown
    try:
        run_now(work.op_flush())
        client.close()
    except (KVStoreError, KeyboardInterrupt):
        pass
    rec.close()


async def async_worker(socket_path: str, data_dir: str, name: str, number: int, seed: int, seconds: float,
                       records: str, cancel_share: float = 0.3) -> None:
    """An AsyncClient's loop: `cancel_share` of its calls are cancelled at a random point."""
    rng = random.Random(seed)
    rec = Recorder(records, name)
    stop_at = time.monotonic() + seconds
    client = None
    while client is None and time.monotonic() < stop_at:
        try:
            client = await AsyncClient.connect(socket_path, namespace=NAMESPACES[0], timeout_s=10)
        except DaemonUnavailable:
            await asyncio.sleep(0.05)
    if client is None:
        return
    work = Workload(client, rec, rng, number, data_dir)
    while time.monotonic() < stop_at:
        task = asyncio.ensure_future(work.step(work.pick()))
        if rng.random() < cancel_share:
            await asyncio.sleep(rng.choice((0, 0, 0.0002, 0.001, 0.003)))
            if not task.done():
                task.cancel()
                rec.fault("cancel")
        try:
            await task
        except asyncio.CancelledError:
            continue
        except DaemonUnavailable:
            while time.monotonic() < stop_at:
                try:
                    await client.reconnect()
                    break
                except DaemonUnavailable:
                    await asyncio.sleep(0.05)
        except KVStoreError:
            pass
    try:
        await work.op_flush()
        await client.close()
    except KVStoreError:
        pass
    rec.close()


if __name__ == "__main__":
    socket_path, data_dir, name, number, seed, seconds, records, mode = sys.argv[1:9]
    sync_worker(socket_path, data_dir, name, int(number), int(seed), float(seconds), records,
                shared_index=mode == "shared", interruptible=True)
