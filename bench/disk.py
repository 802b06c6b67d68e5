"""NVMe tier against fio on the same directory, and restart time with many objects indexed.

    .venv/bin/python bench/disk.py [--quick] [--dir PARENT] [--reps N]   # bench/results/disk.json

1. fio --direct=1 --bs=4M --ioengine=io_uring --iodepth=8, a sequential write then a read of
   one file (libaio, then psync, when io_uring is unavailable; the result says which ran).
   Also the write with --fdatasync=1: the baseline with the durability of a "sync" put.
2. NvmeTier put and get_into of 4 MiB objects, `depth` of them in flight from the tier's
   executor, for both durabilities; sources and destinations are page-aligned buffers (what
   the daemon passes: host-arena extents), plus one unaligned run (bounce-buffer path).
   A put includes its fdatasync and, in sync durability, a synced index write: fio does
   neither, so the sync ratio is a lower bound.
3. QD1 get of one 4 MiB object against fio's read time per 4 MiB.
4. Restart: the index holds N small objects (1,000,000; --quick: 50,000) and the tier is
   reopened; time to ready is what NvmeTier.open takes. The index is written in bulk with the
   tier's own record encoding (1 M real puts of 4 KiB would write 4 GiB), and the data files
   are sparse, so the files cost no disk space. Ids are hashes, as content-addressed ids are
   (index order is not write order), and created_at grows in write order, so recovery sorts
   them by age as it would on a real node. `--restart-only` runs only this case;
   `--restart-daemon` starts a whole daemon over such an index instead (and over an empty
   one): seconds until it takes clients, and its RssAnon per NVMe-indexed object.

Reaches inside: it times the NVMe tier (tiers/nvme) alone against fio on the same file, which a
daemon's socket round trips would blur.

Disk use stays under 2 GiB (one 1 GiB data set at a time) and everything is removed at the
end. Numbers on these machines vary by +-30% between runs: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MiB, Row, Target, median, report  # noqa: E402
from kvstore.config import NvmeTierConfig  # noqa: E402
from kvstore.identity import ObjectId, StateDescriptor  # noqa: E402
from kvstore.tiers.nvme import NvmeTier  # noqa: E402
from kvstore.tiers.nvme.index import NvmeIndex, NvmeRecord, object_key  # noqa: E402

SUITE = "disk"
OBJECT_BYTES = 4 * MiB
NS = "bench"
DESC = StateDescriptor(NS, "model", "rev")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB data set, one rep, 50k objects at restart")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="parent directory of the scratch directory")
    parser.add_argument("--depth", type=int, default=8, help="objects in flight (fio iodepth)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved fio/tier repetitions (3; --quick: 1)")
    parser.add_argument("--restart-objects", type=int, default=None)
    parser.add_argument("--restart-only", action="store_true",
                        help="only the restart case (issue 15: --restart-objects 10000000, ready in <= 15 s)")
    parser.add_argument("--restart-daemon", action="store_true",
                        help="only a whole daemon's restart over such an index: time until it takes clients, "
                             "and its memory per NVMe-indexed object")
    args = parser.parse_args()
    if args.restart_objects is not None and args.restart_objects < 1:
        parser.error(f"--restart-objects takes a positive number of objects; got {args.restart_objects}")
    if args.restart_daemon:
        return restart_daemon(args.restart_objects or 1_000_000, args.dir)
    if args.restart_only:
        return restart_only(args.restart_objects or 1_000_000, args.dir)
    data_bytes = (256 if args.quick else 1024) * MiB
    restart_n = args.restart_objects or (50_000 if args.quick else 1_000_000)
    reps = args.reps or (1 if args.quick else 3)
    runs: dict[str, list[float]] = {}
    scratch = tempfile.mkdtemp(prefix="kvstore-bench-disk-", dir=args.dir)
    try:
        engine = fio_engine(scratch)
        for _ in range(reps):  # interleaved, so drift on a shared host hits both sides alike
            runs.setdefault("fio_write", []).append(fio(scratch, "write", engine, data_bytes, args.depth))
            runs.setdefault("fio_write_sync", []).append(
                fio(scratch, "write", engine, data_bytes, args.depth, "--fdatasync=1"))
            runs.setdefault("fio_read", []).append(fio(scratch, "read", engine, data_bytes, args.depth))
            for name in os.listdir(scratch):
                os.unlink(os.path.join(scratch, name))
            for durability in ("sync", "group"):
                put, get, qd1 = tier_throughput(os.path.join(scratch, durability), data_bytes, args.depth, durability)
                runs.setdefault(f"put_{durability}", []).append(put)
                runs.setdefault("get", []).append(get)
                runs.setdefault("get_qd1_ms", []).append(qd1 * 1e3)
        put, get, _ = tier_throughput(os.path.join(scratch, "unaligned"), data_bytes // 2, args.depth, "group", aligned=False)
        ready_s, wall_s, rss = restart(os.path.join(scratch, "restart"), restart_n)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    m = {name: median(values) for name, values in runs.items()}
    fio_read_ms = OBJECT_BYTES / 1e9 / m["fio_read"] * 1e3  # fio's read time per 4 MiB
    restart_case = f"restart {restart_n // 1000}k objects"
    rows = [
        Row(SUITE, "put 4MiB sync", "throughput", "GB/s", m["put_sync"], "fio write", m["fio_write"]),
        Row(SUITE, "put 4MiB sync", "throughput", "GB/s", m["put_sync"], "fio write+fdsync", m["fio_write_sync"]),
        Row(SUITE, "put 4MiB group", "throughput", "GB/s", m["put_group"], "fio write", m["fio_write"]),
        Row(SUITE, "get_into 4MiB", "throughput", "GB/s", m["get"], "fio read", m["fio_read"]),
        Row(SUITE, "get_into 4MiB qd1", "p50", "ms", m["get_qd1_ms"], "fio read/object", fio_read_ms, False),
        Row(SUITE, "put 4MiB unaligned", "throughput", "GB/s", put, "fio write", m["fio_write"]),
        Row(SUITE, "get_into 4MiB unal.", "throughput", "GB/s", get, "fio read", m["fio_read"]),
        Row(SUITE, restart_case, "ready", "s", ready_s, None, None, False),
    ]
    targets = [  # issue 3
        Target("put 4MiB sync", "throughput", "fio write", ">=", 0.85),
        Target("put 4MiB group", "throughput", "fio write", ">=", 0.85),
        Target("get_into 4MiB", "throughput", "fio read", ">=", 0.85),
        Target("get_into 4MiB qd1", "p50", "fio read/object", "<=", 1 / 0.8),  # >= 0.8x fio per object
        Target(restart_case, "ready", None, "<", 10.0),
    ]
    settings = {
        "mode": "quick" if args.quick else "full", "reps": reps, "data_bytes": data_bytes, "depth": args.depth,
        "dir": args.dir, "kernel": platform.release(), "restart_objects": restart_n,
        "fio": f"fio --direct=1 --bs=4M --ioengine={engine} --iodepth={args.depth} --size={data_bytes}",
        "fio_engine_note": None if engine == "io_uring" else f"io_uring unavailable here; fio used {engine}",
        "restart_open_wall_s": round(wall_s, 3), "max_rss_bytes_after_restart": rss,
        "runs": {name: [round(v, 4) for v in values] for name, values in runs.items()},
    }
    report(SUITE, rows, targets, {}, settings)


# -- fio ------------------------------------------------------------------------------------


def ensure_fio() -> None:
    if shutil.which("fio"):
        return
    print("fio not found; installing it from Debian (apt-get install -y fio)")
    subprocess.run(["apt-get", "install", "-y", "fio"], check=True, stdout=subprocess.DEVNULL)


def fio_engine(directory: str) -> str:
    ensure_fio()
    for engine in ("io_uring", "libaio", "psync"):
        probe = subprocess.run(
            ["fio", "--name=probe", f"--directory={directory}", "--rw=write", "--bs=4k", "--size=1M",
             "--direct=1", f"--ioengine={engine}", "--output-format=json"],
            capture_output=True, text=True,
        )
        if probe.returncode == 0 and json.loads(probe.stdout[probe.stdout.index("{"):])["jobs"][0]["error"] == 0:
            os.unlink(os.path.join(directory, "probe.0.0"))
            return engine
    raise SystemExit("fio runs with none of io_uring, libaio, psync here")


def fio(directory: str, rw: str, engine: str, size: int, depth: int, *extra: str) -> float:
    """GB/s of a sequential 4 MiB O_DIRECT job over one file of `size` bytes."""
    out = subprocess.run(
        ["fio", "--name=seq", f"--directory={directory}", f"--rw={rw}", "--bs=4M", "--direct=1",
         f"--ioengine={engine}", f"--iodepth={depth}", f"--size={size}", "--output-format=json", *extra],
        capture_output=True, text=True, check=True,
    ).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job[rw]["bw_bytes"] / 1e9


# -- the tier -------------------------------------------------------------------------------


def tier_throughput(path: str, data_bytes: int, depth: int, durability: str, aligned: bool = True):
    """(put GB/s, get GB/s, QD1 get p50 in s) for data_bytes of 4 MiB objects."""
    n = data_bytes // OBJECT_BYTES
    config = NvmeTierConfig(path=path, capacity_bytes=data_bytes + (depth + 16) * OBJECT_BYTES, file_bytes=256 * MiB, durability=durability, io_threads=depth)
    sources = [buffer(aligned) for _ in range(depth)]
    for seed, s in enumerate(sources):
        s[:] = np.random.default_rng(seed).integers(0, 256, OBJECT_BYTES, dtype=np.uint8)
    checksums = [xxhash.xxh3_128_digest(s) for s in sources]
    local = threading.local()

    def get(oid):  # each I/O thread reads into its own destination, kept across calls
        if not hasattr(local, "out"):
            local.out = buffer(aligned)
        return tier.get_into(NS, oid, local.out)

    with NvmeTier(config) as tier:
        # warm-up, untimed: every I/O thread makes its bounce buffers once, on first use
        warm = [ObjectId((n + 1 + i).to_bytes(32, "big")) for i in range(depth)]
        for f in [tier.executor.submit(tier.put, NS, oid, sources[i], checksums[i], DESC) for i, oid in enumerate(warm)]:
            f.result()
        for f in [tier.executor.submit(get, oid) for oid in warm]:
            f.result()
        ids = [ObjectId(i.to_bytes(32, "big")) for i in range(1, n + 1)]
        start = time.perf_counter()
        futures = [tier.executor.submit(tier.put, NS, oid, sources[i % depth], checksums[i % depth], DESC)
                   for i, oid in enumerate(ids)]
        for f in futures:
            assert f.result().durability == durability
        tier.flush()
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        for f in [tier.executor.submit(get, oid) for oid in ids]:  # `depth` in flight throughout
            assert f.result() == OBJECT_BYTES
        get_s = time.perf_counter() - start
        qd1, out = [], buffer(aligned)
        for oid in ids[: min(n, 32)]:
            t = time.perf_counter()
            assert tier.get_into(NS, oid, out) == OBJECT_BYTES
            qd1.append(time.perf_counter() - t)
        assert tier.stats()["num_checksum_failures"] == 0
    shutil.rmtree(path)
    gb = n * OBJECT_BYTES / 1e9
    return gb / put_s, gb / get_s, median(qd1)


def buffer(aligned: bool) -> np.ndarray:
    if aligned:
        return np.frombuffer(mmap.mmap(-1, OBJECT_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE), np.uint8)
    return np.empty(OBJECT_BYTES + 8, np.uint8)[8:]  # page offset 8: never aligned


# -- restart --------------------------------------------------------------------------------


def restart_only(n: int, parent: str) -> None:
    scratch = tempfile.mkdtemp(prefix="kvstore-bench-disk-", dir=parent)
    try:
        print(f"disk: indexing {n:,} objects, then reopening the tier", flush=True)
        ready_s, wall_s, rss = restart(os.path.join(scratch, "restart"), n)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    case = f"restart {n // 1000}k objects"
    report(SUITE, [Row(SUITE, case, "ready", "s", ready_s, None, None, False)],
           [Target(case, "ready", None, "<=", 15.0 if n >= 10_000_000 else 10.0)], {},
           {"mode": "restart only", "restart_objects": n, "restart_open_wall_s": round(wall_s, 3),
            "max_rss_bytes_after_restart": rss})


def restart(path: str, n: int) -> tuple[float, float, int]:
    """Index n objects of 1000 bytes (one 4 KiB extent each), reopen, time it."""
    config, size = indexed_tier(path, n)
    start = time.perf_counter()
    tier = NvmeTier.open(config)
    wall = time.perf_counter() - start
    try:
        report = tier.recovery
        assert (report.recovered, report.dropped) == (n, 0), report
        out = np.empty(size, np.uint8)
        for i in range(0, n, max(1, n // 100)):
            assert tier.get_into(NS, restart_id(i), out) == size
        if n <= 100_000:  # reads the whole index under the lock: seconds at 1 M
            tier.check_integrity()
    finally:
        tier.close()
    return report.time_to_ready_s, wall, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def restart_id(i: int) -> ObjectId:
    """The restart cases' i-th id: a hash, like a real content-addressed id."""
    return ObjectId(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest())


def indexed_tier(path: str, n: int, capacity_objects: int | None = None) -> tuple[NvmeTierConfig, int]:
    """An NVMe tier at `path` whose index holds n objects of 1000 bytes (one 4 KiB extent
    each; sparse data files), room for capacity_objects (default n). (config, object size)"""
    file_bytes = 1 << 30
    capacity = -(-max(1, capacity_objects or n) * 4096 // file_bytes) * file_bytes
    config = NvmeTierConfig(path=path, capacity_bytes=capacity, file_bytes=file_bytes, durability="group")
    os.makedirs(path)
    for i in range(capacity // file_bytes):  # sparse: the tier only grows files that are short
        with open(os.path.join(path, f"data-{i:05d}.kvs"), "wb") as f:
            f.truncate(file_bytes)
    NvmeTier(config).close()  # writes the format record
    size = 1000
    checksum = xxhash.xxh3_128_digest(bytes(size))  # the sparse files read back zeros
    index = NvmeIndex(os.path.join(path, "index"))
    now, desc, per_file = time.time(), DESC.to_wire(), file_bytes // 4096
    batch = []
    for i in range(n):
        record = NvmeRecord(i // per_file, (i % per_file) * 4096, size, checksum, None, desc, {}, now + i * 1e-6)
        batch.append((object_key(NS, restart_id(i)), record.encode()))
        if len(batch) == 100_000:
            index.write(batch, [], sync=False)
            batch = []
    index.write(batch, [], sync=True)
    index.close()
    return config, size


def restart_daemon(n: int, parent: str) -> None:
    """A daemon started over an NVMe index of n objects: seconds until its socket takes a
    client (it indexes what NVMe holds first), and RssAnon then, against a daemon over an
    empty tier of the same size: the daemon's memory per NVMe-indexed object."""
    from bench.scale import rss_anon
    from kvstore.client import Client, DaemonUnavailable
    scratch = tempfile.mkdtemp(prefix="kvstore-bench-disk-", dir=parent)
    results = {}
    try:
        for name, count in (("empty", 0), ("full", n)):
            print(f"disk: indexing {count:,} objects, then starting a daemon over them", flush=True)
            config, _ = indexed_tier(os.path.join(scratch, name, "nvme"), count, capacity_objects=n)
            toml = os.path.join(scratch, name, "kvstore.toml")
            with open(toml, "w") as f:
                f.write(f'data_dir = "{os.path.join(scratch, name, "data")}"\n[admin]\nenabled = false\n'
                        f'[host]\narena_bytes = "64MiB"\nprefault = false\n'
                        f'[nvme]\nenabled = true\npath = "{config.path}"\ncapacity_bytes = {config.capacity_bytes}\n'
                        f'file_bytes = {config.file_bytes}\ndurability = "group"\n')
            sock = os.path.join(scratch, name, "kvstore.sock")
            start = time.perf_counter()
            daemon = subprocess.Popen([sys.executable, "-m", "kvstore.commands.cli", "serve", "--config", toml, "--socket", sock,
                                       "--log-level", "warning"], stdin=subprocess.DEVNULL)
            try:
                while True:
                    if daemon.poll() is not None:
                        raise RuntimeError(f"daemon exited with {daemon.returncode} while starting")
                    try:
                        Client.connect(sock, timeout_s=5).close()
                        break
                    except DaemonUnavailable:
                        time.sleep(0.05)
                results[name] = (time.perf_counter() - start, rss_anon(daemon.pid))
                if count:
                    with Client.connect(sock, timeout_s=60) as c:
                        found = c.lookup([restart_id(i) for i in range(0, count, max(1, count // 100))],
                                         namespace=NS)
                        assert found.hits == len(found.tiers), found
            finally:
                daemon.terminate()
                daemon.wait(60)
            shutil.rmtree(os.path.join(scratch, name), ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    (empty_s, empty_rss), (full_s, full_rss) = results["empty"], results["full"]
    case = f"daemon restart {n // 1000}k objects on NVMe"
    per_object = (full_rss - empty_rss) / n
    print(f"disk: a daemon over the empty tier took clients after {empty_s:.2f} s", flush=True)
    report(SUITE, [Row(SUITE, case, "ready", "s", full_s, None, None, False),
                   Row(SUITE, case, "bytes/object", "B", per_object, None, None, False)],
           [Target(case, "ready", None, "<=", 15.0 if n >= 10_000_000 else 10.0),
            Target(case, "bytes/object", None, "<=", 200.0)], {},
           {"mode": "daemon restart", "restart_objects": n, "ready_s_empty_tier": round(empty_s, 3),
            "rss_anon_empty": empty_rss, "rss_anon_full": full_rss})


if __name__ == "__main__":
    main()
