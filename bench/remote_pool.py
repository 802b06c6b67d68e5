"""The remote benchmark's pool part (`bench/remote.py --parts pool`): put and get_into of
4 MiB and 64 KiB objects through a daemon whose remote tier is a Mooncake Store pool
(`[remote] backend = "mooncake"`), against Mooncake's own client doing the same copies and
against kvstore's own peer tier, all in the same run, reps interleaved.

    pool      daemons W and R, each `[remote] backend = "mooncake"` (clients only: a holder
              process lends the pool its memory). put: `Client.put` of the rep's objects on
              W, timed until W's pool link has put every one into the pool (write_through,
              counted in num_replicated). get_into: on R, every object a local miss read
              from the pool (header, then payload straight into R's arena, xxh3-128
              checked), then copied out to the caller; R's copies are dropped after each
              rep (delete scope "node", untimed), so the next rep reads the pool again.
    peers     daemons A and B in a static cluster on loopback (TCP, replicas = 2: both are
              homes). put: on A, timed until A has copied every one to B; get_into: on B
              after B dropped its copies, so each is fetched from A and verified.
    mooncake  Mooncake's own client (MooncakeDistributedStore, TCP): put_from a registered
              buffer under fresh keys, get_into a registered buffer, one call per object.
    real      Mooncake's real client: a `mooncake_client` process per node that owns the
              pool link (as LMCache's MP server or llm-d's DaemonSet run it), and the
              engine's process as its dummy client (`setup_dummy`), its buffers in shared
              memory it registered with the real client: the same process boundary as
              kvstore's client -> daemon -> pool. Same calls as `mooncake`.
    put_many  as put, but BATCH objects a call: `put_many` on the daemons, `batch_put_from`
              on Mooncake's client (every key from the same registered buffer).
    get_many  as get_into, but BATCH objects a call, as an engine loads a prefix's chunks:
              `get_many_into` on the daemons (the pool reader reads a batch's misses ahead
              together), `batch_get_into` into registered buffers on Mooncake's client.

Every store is the same pool (one master, one holder segment) or the same loopback; the
objects a rep moves are distinct keys, deleted after the rep (untimed).
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from dataclasses import dataclass

from bench.baselines import free_port, mooncake_master, mooncake_store, native_log_to
from bench.common import (
    KiB, MiB, BaselineUnavailable, Row, Target, Worker, gb_per_s, host_only_daemon, median, size_label, touched,
)
from bench.local_sides import keys_for, timed

SUITE = "remote"
SIZES = (4 * MiB, 64 * KiB)
SECRET = "bench-remote-pool-secret-0123456789"
REPLICATION_TIMEOUT_S = 120.0  # a put rep the remote tier never finishes is an error, not a hang
POLL_S = 0.001  # how often a put rep asks the writer how many objects reached the remote tier
BATCH = 64  # objects per get_many call (fewer when a rep has fewer)


@dataclass(frozen=True, slots=True)
class PoolPlan:
    reps: int
    rep_bytes: int  # bytes one rep moves (the objects of one size)

    def count(self, size: int) -> int:
        return max(1, self.rep_bytes // size)


POOL_FULL = PoolPlan(reps=11, rep_bytes=128 * MiB)
POOL_QUICK = PoolPlan(reps=5, rep_bytes=32 * MiB)

# Batches against Mooncake's client in the engine's own process; single calls against it are
# reported, not a goal (a round trip to a daemon is the price of sharing a node).
TARGETS = [Target(f"pool {op} {size_label(s)}", "throughput", f"mooncake {base}", ">=", 0.9)
           for s in SIZES for op, base in (("get_many_into", "batch_get_into"), ("put_many", "batch_put_from"))]
# the same process boundary as Mooncake's real client (engine -> the node's store process -> pool)
TARGETS += [Target(f"pool {op} {size_label(s)}", "throughput", f"mooncake-real {base}", ">=", 1.0)
            for s in SIZES for op, base in (("get_into", "get_into"), ("put", "put_from"),
                                            ("get_many_into", "batch_get_into"), ("put_many", "batch_put_from"))]


class DaemonPairSide:
    """A client of a writer daemon and of a reader daemon whose remote tier holds what the
    writer puts (a pool, or the writer itself as a peer home)."""

    def __init__(self, writer_socket: str, reader_socket: str, reps: int):
        from kvstore.client import Client
        self.reps = reps
        self.writer = Client.connect(writer_socket, namespace="bench", timeout_s=60)
        self.reader = Client.connect(reader_socket, namespace="bench", timeout_s=60)

    def _replicated(self) -> int:
        return self.writer.stats()["tiers"]["remote"]["num_replicated"]

    def wait_remote_up(self, timeout_s: float) -> bool:
        """The pool's client sets up in the background; a commit made before then stays local."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            remote = self.writer.stats()["tiers"]["remote"], self.reader.stats()["tiers"]["remote"]
            if all(r.get("pool", {"up": True})["up"] for r in remote):
                return True
            time.sleep(0.1)
        return False

    def _put_all(self, keys, batch: int = 1) -> None:
        """Put `keys`' objects on the writer, one call each or `batch` a put_many call; return
        once the remote tier holds each."""
        before, src = self._replicated(), self.src
        if batch == 1:
            put = self.writer.put
            for key in keys:
                put(key, src)
        else:
            put_many = self.writer.put_many
            for first in range(0, len(keys), batch):
                failed = [r.error for r in put_many([(key, src) for key in keys[first:first + batch]]) if r.error]
                if failed:
                    raise RuntimeError(f"put_many refused {len(failed)} objects: {failed[0]}")
        deadline = time.monotonic() + REPLICATION_TIMEOUT_S
        while self._replicated() - before < len(keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the remote tier took {self._replicated() - before} of {len(keys)} puts: "
                                   f"{self.writer.stats()['tiers']['remote']}")
            time.sleep(POLL_S)

    def prepare(self, size: int, count: int) -> None:
        self.size, self.src, self.out = size, touched(size), touched(size, seed=1)
        self.outs = [touched(size, seed=2 + i) for i in range(min(BATCH, count))]
        self.rep_keys = [keys_for(f"put/{size}/{i}", count) for i in range(self.reps + 1)]
        self.get_keys = keys_for(f"get/{size}", count)
        self._put_all(self.get_keys)
        self.reader.delete(self.get_keys, scope="node")  # a home's own copy (peers): read it from the other

    def put(self, rep: int) -> float:
        return timed(lambda: self._put_all(self.rep_keys[rep]))

    def put_many(self, rep: int) -> float:
        return timed(lambda: self._put_all(self.rep_keys[rep], len(self.outs)))

    def drop(self, rep: int) -> None:
        self.writer.delete(self.rep_keys[rep])  # this node's copies and the remote tier's

    def get(self, rep: int) -> float:
        hits = self.reader.stats()["tiers"]["remote"]["remote"]["num_hits"]
        get_into, out = self.reader.get_into, self.out
        sizes = []
        elapsed = timed(lambda: sizes.extend(get_into(key, out) for key in self.get_keys))
        if any(n != self.size for n in sizes):
            raise RuntimeError(f"a {size_label(self.size)} get_into missed: {self.reader.stats()['tiers']['remote']}")
        fetched = self.reader.stats()["tiers"]["remote"]["remote"]["num_hits"] - hits
        if fetched != len(self.get_keys):
            raise RuntimeError(f"{fetched} of {len(self.get_keys)} gets came from the remote tier")
        return elapsed

    def get_many(self, rep: int) -> float:
        hits = self.reader.stats()["tiers"]["remote"]["remote"]["num_hits"]
        get_many_into, outs, keys, sizes = self.reader.get_many_into, self.outs, self.get_keys, []

        def run() -> None:
            for first in range(0, len(keys), len(outs)):
                sizes.extend(get_many_into(list(zip(keys[first:first + len(outs)], outs))))
        elapsed = timed(run)
        if any(n != self.size for n in sizes):
            raise RuntimeError(f"a {size_label(self.size)} get_many_into missed: {self.reader.stats()['tiers']['remote']}")
        fetched = self.reader.stats()["tiers"]["remote"]["remote"]["num_hits"] - hits
        if fetched != len(keys):
            raise RuntimeError(f"{fetched} of {len(keys)} gets came from the remote tier")
        return elapsed

    def forget(self, rep: int) -> None:
        self.reader.delete(self.get_keys, scope="node")

    def finish(self) -> None:
        self.writer.delete(self.get_keys)
        self.outs = []

    def counters(self) -> dict:
        return self.reader.stats()["tiers"]["remote"]["remote"]

    def close(self) -> None:
        self.writer.close()
        self.reader.close()


class MooncakeHolder:
    """The pool's only memory: a Mooncake client lending a segment, in its own process."""

    def __init__(self, rpc_port: int, meta_port: int, segment_bytes: int, log_path: str):
        self.store = mooncake_store(rpc_port, meta_port, segment_bytes, 16 * MiB, log_path)

    def close(self) -> None:
        self.store.close()


class MooncakeSide:
    """Mooncake's own client: the same copies, one call per object."""

    def __init__(self, rpc_port: int, meta_port: int, log_path: str):
        self.store = mooncake_store(rpc_port, meta_port, 0, 16 * MiB, log_path)
        self.registered: list[int] = []

    PREFIX = ""  # of its keys

    def _buffer(self, nbytes: int, seed: int):
        array = touched(nbytes, seed=seed)
        if self.store.register_buffer(array.ctypes.data, nbytes) != 0:
            raise BaselineUnavailable("mooncake register_buffer failed")
        return array

    def prepare(self, size: int, count: int) -> None:
        for address in self.registered:
            self.store.unregister_buffer(address)
        self.size, self.count = size, count
        self.batch = min(BATCH, count)
        self.src, self.out, self.outs = self._buffer(size, 0), self._buffer(size, 1), self._buffer(size * self.batch, 2)
        self.registered = [self.src.ctypes.data, self.out.ctypes.data, self.outs.ctypes.data]
        self.get_keys = [f"{self.PREFIX}get/{size}/{i}" for i in range(count)]
        for key in self.get_keys:
            if self.store.put_from(key, self.src.ctypes.data, size) != 0:
                raise BaselineUnavailable("mooncake put_from failed")

    def _put_keys(self, rep: int) -> list[str]:
        return [f"{self.PREFIX}put/{self.size}/{rep}/{i}" for i in range(self.count)]

    def put(self, rep: int) -> float:
        put_from, address, size, codes = self.store.put_from, self.src.ctypes.data, self.size, []
        elapsed = timed(lambda: codes.extend(put_from(key, address, size) for key in self._put_keys(rep)))
        if any(codes):
            raise RuntimeError(f"mooncake put_from failed: {sorted(set(codes))}")
        return elapsed

    def put_many(self, rep: int) -> float:
        """batch_put_from, `batch` keys a call, every one from the same registered buffer."""
        batch_put_from, keys, codes = self.store.batch_put_from, self._put_keys(rep), []
        addresses, sizes = [self.src.ctypes.data] * self.batch, [self.size] * self.batch

        def run() -> None:
            for first in range(0, len(keys), self.batch):
                part = keys[first:first + self.batch]
                codes.extend(batch_put_from(part, addresses[:len(part)], sizes[:len(part)]))
        elapsed = timed(run)
        if any(codes):
            raise RuntimeError(f"mooncake batch_put_from failed: {sorted(set(codes))}")
        return elapsed

    def drop(self, rep: int) -> None:
        for key in self._put_keys(rep):
            self.store.remove(key, True)

    def get(self, rep: int) -> float:
        get_into, address, size, got = self.store.get_into, self.out.ctypes.data, self.size, []
        elapsed = timed(lambda: got.extend(get_into(key, address, size) for key in self.get_keys))
        if any(n != size for n in got):
            raise RuntimeError(f"mooncake get_into returned {sorted(set(got))}")
        return elapsed

    def get_many(self, rep: int) -> float:
        batch_get_into, size, keys, got = self.store.batch_get_into, self.size, self.get_keys, []
        addresses = [self.outs.ctypes.data + i * size for i in range(self.batch)]

        def run() -> None:
            for first in range(0, len(keys), self.batch):
                part = keys[first:first + self.batch]
                got.extend(batch_get_into(part, addresses[:len(part)], [size] * len(part)))
        elapsed = timed(run)
        if any(n != size for n in got):
            raise RuntimeError(f"mooncake batch_get_into returned {sorted(set(got))}")
        return elapsed

    def forget(self, rep: int) -> None:
        pass

    def finish(self) -> None:
        for key in self.get_keys:
            self.store.remove(key, True)  # force: a get's lease would hold it for seconds

    def close(self) -> None:
        self.store.close()


class MooncakeRealSide(MooncakeSide):
    """Mooncake's dummy client, in the engine's process, of a real client on this node."""

    PREFIX = "real-"

    def __init__(self, real_port: int, log_path: str):
        native_log_to(log_path)
        from mooncake.store import MooncakeDistributedStore
        self.store = MooncakeDistributedStore()
        if self.store.setup_dummy(0, 16 * MiB, f"127.0.0.1:{real_port}") != 0:
            raise BaselineUnavailable(f"setup_dummy to the real client at 127.0.0.1:{real_port} failed (log: {log_path})")
        self.registered: list[int] = []

    def _buffer(self, nbytes: int, seed: int):
        """A buffer in shared memory the real client maps (the only kind a dummy client's
        calls take), filled as `touched` fills one."""
        import ctypes
        import numpy as np
        address = self.store.alloc_from_mem_pool(nbytes)
        if not address or self.store.register_buffer(address, nbytes) != 0:
            raise BaselineUnavailable("mooncake dummy client: alloc_from_mem_pool / register_buffer failed")
        array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
        array[:] = touched(nbytes, seed=seed)
        return array


def real_client(stack: ExitStack, workdir: str, rpc: int, meta: int, segment_bytes: int) -> int:
    """Start Mooncake's real client (`mooncake_client`, from the same wheel) lending
    `segment_bytes` to the pool (0: none); returns its service port."""
    import shutil
    import sys
    from bench.baselines import _serving
    exe = shutil.which("mooncake_client", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        raise BaselineUnavailable("mooncake_client (the real client) is not in this mooncake wheel")
    port = free_port()
    stack.enter_context(_serving("mooncake_client", [
        exe, f"--master_server_address=127.0.0.1:{rpc}", f"--metadata_server=http://127.0.0.1:{meta}/metadata",
        "--host=127.0.0.1", f"--port={port}", f"--global_segment_size={segment_bytes}", "--local_buffer_size=16MB",
        "--protocol=tcp", "--threads=4"], workdir, [port]))
    return port


def _pool_toml(rpc: int, meta: int) -> str:
    return (f'[remote]\nbackend = "mooncake"\n[remote.mooncake]\nmaster = "127.0.0.1:{rpc}"\n'
            f'metadata_server = "http://127.0.0.1:{meta}/metadata"\nlocal_buffer_bytes = "16MiB"\n'
            f'retry_interval_s = 0.5\n')


def _peer_toml(name: str, ports: dict[str, int]) -> str:
    peers = ", ".join(f'"{n}=127.0.0.1:{p}"' for n, p in ports.items())
    return (f'[cluster]\nenabled = true\nnode_id = "{name}"\nlisten = "127.0.0.1:{ports[name]}"\n'
            f'peers = [{peers}]\nsecret = "{SECRET}"\nreplicas = 2\nrehome = false\n')


def start_sides(plan: PoolPlan, workdir: str, skipped: dict[str, str], stack: ExitStack) -> dict[str, Worker]:
    def daemon(name: str, toml: str) -> str:
        proc, socket_path = host_only_daemon(workdir, name, 3 * plan.rep_bytes + 64 * MiB, toml)
        stack.callback(lambda: (proc.terminate(), proc.wait(30)))
        return socket_path

    sides: dict[str, Worker] = {}
    try:
        rpc, meta = stack.enter_context(mooncake_master(workdir))
        log_path = os.path.join(workdir, "mooncake-pool.log")
        # Both the daemons' and Mooncake's own objects, a rep's puts and the gets' set, twice over.
        stack.enter_context(Worker("pool-holder", MooncakeHolder, rpc, meta, 8 * plan.rep_bytes + 64 * MiB, log_path))
        sides["mooncake"] = stack.enter_context(Worker("mooncake-client", MooncakeSide, rpc, meta, log_path))
    except BaselineUnavailable as exc:
        skipped["pool"] = str(exc)
        return sides
    try:  # a client only, like the daemons here: every object lives in the holder's segment
        port = real_client(stack, workdir, rpc, meta, 0)
        sides["real"] = stack.enter_context(Worker("mooncake-dummy", MooncakeRealSide, port, log_path))
    except BaselineUnavailable as exc:
        skipped["mooncake-real"] = str(exc)
    os.environ.setdefault("GLOG_minloglevel", "2")  # the daemons' Mooncake clients: errors only on the console
    pool = [daemon(f"pool-{n}", _pool_toml(rpc, meta)) for n in ("w", "r")]
    sides["pool"] = stack.enter_context(Worker("pool-client", DaemonPairSide, *pool, plan.reps))
    if not sides["pool"].call("wait_remote_up", 60.0):
        raise RuntimeError(f"the daemons' Mooncake clients did not set up; see {workdir}")
    ports = {"a": free_port(), "b": free_port()}
    peers = [daemon(f"peer-{n}", _peer_toml(n, ports)) for n in ports]
    sides["peers"] = stack.enter_context(Worker("peers-client", DaemonPairSide, *peers, plan.reps))
    return sides


def _interleave(sides: dict[str, Worker], method: str, after: str, reps: int) -> dict[str, float]:
    """Median seconds of `method(rep)` per side; rep 0 warms up; each rep starts one side further along."""
    names, times = list(sides), {name: [] for name in sides}
    for rep in range(reps + 1):
        for k in range(len(names)):
            name = names[(rep + k) % len(names)]
            elapsed = sides[name].call(method, rep)
            sides[name].call(after, rep)
            if rep:
                times[name].append(elapsed)
    return {name: median(t) for name, t in times.items()}


def run(plan: PoolPlan, workdir: str, skipped: dict[str, str]) -> list[Row]:
    rows: list[Row] = []
    with ExitStack() as stack:
        sides = start_sides(plan, workdir, skipped, stack)
        if "pool" not in sides:
            return rows
        for size in SIZES:
            count = plan.count(size)
            print(f"[{time.strftime('%H:%M:%S')}] pool {size_label(size)}: {plan.reps} reps of {count} objects "
                  f"on {', '.join(sides)}", flush=True)
            for worker in sides.values():
                worker.call("prepare", size, count)
            speed = {}
            for op, after in (("put", "drop"), ("put_many", "drop"), ("get", "forget"), ("get_many", "forget")):
                seconds = _interleave(sides, op, after, plan.reps)
                speed[op] = {name: gb_per_s(count * size, s) for name, s in seconds.items()}
                print(f"[{time.strftime('%H:%M:%S')}] pool {size_label(size)} {op} GB/s "
                      + ", ".join(f"{n} {v:.3f}" for n, v in speed[op].items()), flush=True)
            for worker in sides.values():
                worker.call("finish")
            label = size_label(size)
            for op, ours, mooncake in (("put", "put", "put_from"), ("put_many", "put_many", "batch_put_from"),
                                       ("get", "get_into", "get_into"), ("get_many", "get_many_into", "batch_get_into")):
                for base, name in (("mooncake", f"mooncake {mooncake}"), ("real", f"mooncake-real {mooncake}"),
                                   ("peers", f"peers {ours}")):
                    if base in speed[op]:
                        rows.append(Row(SUITE, f"pool {ours} {label}", "throughput", "GB/s", speed[op]["pool"],
                                        name, speed[op][base]))
        checks = sides["pool"].call("counters")
        if checks["num_checksum_failures"] or checks["num_header_failures"]:
            raise RuntimeError(f"the pool reader counted failed checks: {checks}")
    return rows
