"""What a kvstore read or write of the Mooncake pool would cost if the client called Mooncake in
its own process (issue 28's open decision), against Mooncake's own client in the same run.

Not a path kvstore has: today every pool call goes through the daemon (docs/architecture.md,
"What keeps the pool rows under Mooncake's own client"). This probe does, in the bench's one
process, the work a client-side path could not skip and nothing else:

- get: `get_into` of the whole pool value (kvstore's 4 KiB header, then the payload) into a
  registered staging buffer, the header decoded and checked (kvstore.pool_header), the payload
  hashed (xxh3-128) against it, then copied into the caller's buffer; and the same with
  `get_into_ranges` reading header and payload into two buffers (no copy out).
- put: the payload hashed, the header encoded, one `batch_put_from_multi_buffers` of
  [header, payload], against `put_from` of the payload alone.

The segment holding the values lives in another process, as in bench/remote.py. Ratios are
Mooncake's own time over ours, reps alternated.

    .venv/bin/python bench/pool_inprocess.py [--reps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import xxhash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from baselines import BaselineUnavailable, mooncake_master, mooncake_store  # noqa: E402

from kvstore.identity import ObjectId, StateDescriptor  # noqa: E402
from kvstore.peer_messages import RemoteMeta  # noqa: E402
from kvstore.pool_header import HEADER_BYTES, decode_header, encode_header, pool_key  # noqa: E402

MiB = 1 << 20
NAMESPACE = "bench"
HOLDER = """
import sys, time
sys.path.insert(0, {bench!r})
from baselines import mooncake_store
store = mooncake_store({rpc}, {meta}, 256 << 20, 16 << 20, {log!r})
print("ready", flush=True)
sys.stdin.read()
store.close()
"""


class Client:
    def __init__(self, store, size: int):
        self.store, self.size = store, size
        rng = np.random.default_rng(size)
        self.src = rng.integers(0, 256, size, dtype=np.uint8)
        self.out = np.zeros(size, dtype=np.uint8)
        self.staging = np.zeros(HEADER_BYTES + size, dtype=np.uint8)
        self.header = np.zeros(HEADER_BYTES, dtype=np.uint8)
        for buf in (self.src, self.out, self.staging, self.header):
            if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                raise BaselineUnavailable("mooncake register_buffer failed")
        self.desc = StateDescriptor(NAMESPACE, "bench", "r1")
        self.oid = ObjectId(xxhash.xxh3_128_digest(self.src) * 2)
        self.plain_key = f"plain-{size}"
        self.kv_key = pool_key("kvstore/", NAMESPACE, self.oid)
        self.puts = 0
        if store.put_from(self.plain_key, self.src.ctypes.data, size) != 0:
            raise BaselineUnavailable("mooncake put_from failed")
        self._put_kv(self.kv_key)

    def _put_kv(self, key: str) -> None:
        meta = RemoteMeta(size=self.size, checksum=xxhash.xxh3_128_digest(self.src), descriptor=self.desc,
                          created_at=time.time())
        self.header[:] = np.frombuffer(encode_header(self.oid, meta), dtype=np.uint8)
        codes = self.store.batch_put_from_multi_buffers([key], [[self.header.ctypes.data, self.src.ctypes.data]],
                                                        [[HEADER_BYTES, self.size]])
        if list(codes) != [0]:
            raise RuntimeError(f"batch_put_from_multi_buffers returned {list(codes)}")

    def _verify(self, header, payload) -> None:
        meta = decode_header(header, NAMESPACE, self.oid)
        if meta.size != self.size or xxhash.xxh3_128_digest(payload) != meta.checksum:
            raise RuntimeError("pool value fails its checks")

    # --- the cases: each returns seconds ---------------------------------------------------

    def get_mooncake(self) -> float:
        start = time.perf_counter()
        n = self.store.get_into(self.plain_key, self.out.ctypes.data, self.size)
        elapsed = time.perf_counter() - start
        assert n == self.size, n
        return elapsed

    def get_staged(self) -> float:
        start = time.perf_counter()
        n = self.store.get_into(self.kv_key, self.staging.ctypes.data, HEADER_BYTES + self.size)
        payload = self.staging[HEADER_BYTES:]
        self._verify(self.staging[:HEADER_BYTES], payload)
        np.copyto(self.out, payload)
        elapsed = time.perf_counter() - start
        assert n == HEADER_BYTES + self.size, n
        return elapsed

    def get_ranges(self) -> float:
        start = time.perf_counter()
        got = self.store.get_into_ranges([self.header.ctypes.data, self.out.ctypes.data], [[self.kv_key], [self.kv_key]],
                                         [[[0]], [[0]]], [[[0]], [[HEADER_BYTES]]], [[[HEADER_BYTES]], [[self.size]]])
        self._verify(self.header, self.out)
        elapsed = time.perf_counter() - start
        assert got[0][0][0] == HEADER_BYTES and got[1][0][0] == self.size, got
        return elapsed

    def put_mooncake(self) -> float:
        key = f"plain-put-{self.size}-{self.puts}"
        self.puts += 1
        start = time.perf_counter()
        rc = self.store.put_from(key, self.src.ctypes.data, self.size)
        elapsed = time.perf_counter() - start
        assert rc == 0, rc
        self.store.remove(key, True)
        return elapsed

    def put_verified(self) -> float:
        key = f"kv-put-{self.size}-{self.puts}"
        self.puts += 1
        start = time.perf_counter()
        self._put_kv(key)
        elapsed = time.perf_counter() - start
        self.store.remove(key, True)
        return elapsed


def alternate(cases: dict, reps: int) -> dict[str, float]:
    times = {name: [] for name in cases}
    for _ in range(reps):
        for name, case in cases.items():
            times[name].append(case())
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200, help="reps of each case, alternated (default 200)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvs-pool-inprocess-") as workdir:
        log = os.path.join(workdir, "mooncake.log")
        print(f"Mooncake's native log: {log}", flush=True)
        try:
            with mooncake_master(workdir) as (rpc, meta):
                holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(bench=os.path.join(ROOT, "bench"), rpc=rpc,
                                                                                meta=meta, log=log + ".holder")],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                try:
                    if holder.stdout.readline().strip() != "ready":
                        raise BaselineUnavailable(f"the Mooncake holder did not start (log: {log}.holder)")
                    store = mooncake_store(rpc, meta, 0, 64 * MiB, log)
                    print("| size | case | median us | Mooncake's own | ratio |\n|---|---|---|---|---|")
                    for size in (64 * 1024, 4 * MiB):
                        client = Client(store, size)
                        got = alternate({"mooncake": client.get_mooncake, "staged": client.get_staged,
                                         "ranges": client.get_ranges}, args.reps)
                        for case in ("staged", "ranges"):
                            print(f"| {size // 1024} KiB | get, {case} + verified | {got[case] * 1e6:.0f} | "
                                  f"{got['mooncake'] * 1e6:.0f} | {got['mooncake'] / got[case]:.2f}x |", flush=True)
                        put = alternate({"mooncake": client.put_mooncake, "verified": client.put_verified}, args.reps)
                        print(f"| {size // 1024} KiB | put, header + hash | {put['verified'] * 1e6:.0f} | "
                              f"{put['mooncake'] * 1e6:.0f} | {put['mooncake'] / put['verified']:.2f}x |", flush=True)
                    store.close()
                finally:
                    holder.stdin.close()
                    holder.wait(timeout=30)
        except BaselineUnavailable as exc:
            print(f"skipped: {exc}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
