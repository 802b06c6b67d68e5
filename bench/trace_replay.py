"""Replay real or generated prefix-cache traffic through kvstore and the stores users would
pick instead, each at the same capacity, in one run (issue 42, item 4).

Trace format: Mooncake's FAST'25 traces (JSON lines: `timestamp` ms, `input_length`,
`output_length`, `hash_ids`: one id per 512-token block, equal ids = equal prefix blocks).
The conversation, tool-agent and synthetic traces are in the Mooncake repository
(github.com/kvcache-ai/Mooncake, FAST25-release/traces/); fetch one and pass its path:

    .venv/bin/python bench/trace_replay.py --trace conversation_trace.jsonl --capacity-mb 512
    .venv/bin/python bench/trace_replay.py --generate agent --requests 2000     # no download
    .venv/bin/python bench/trace_replay.py --generate agent --write-trace agent.jsonl   # keep it

`--generate agent` makes an agent trace of its own (seeded): sessions that share a few system
prompts and tool preambles, turns that extend the session's context, branches that go back
to an earlier turn, and retries of the last request; sessions interleave.

Each request, in timestamp order, as an engine's prefix cache uses a store: look up its
blocks (the leading hits count), read the hits, write the misses. Block bytes are
`--block-kb` (a scaled-down KV block); each carries its id, and every block read is checked.
Stores, each holding at most `--capacity-mb` of blocks:

    kvstore   a daemon, host tier only, arena of the capacity: lookup, get_many_into, put_many;
              its default eviction policy, and with `--policies lru,s3fifo` also once per
              policy named (`[host] policy`), reported as kvstore/<policy>
    mooncake  Mooncake Store: its master and one holder lending a segment of the capacity,
              the embedded client (batch_is_exist, batch_get_into, batch_put_from); the master
              evicts at its high watermark
    lmcache   LMCache 0.5.6's storage manager (its MP server's core) with an L1 of the
              capacity and LRU eviction, no L2 (LMCache's environment, a process of its own)

Reported per store: block hit rate, token hit rate, bytes read per hit token, per-request
read and write p50/p99 (ms) and per-block read p50/p99 (us), effective GB/s over the bytes
read and written, and failed writes (a store that refused a block). CI runs this on a small
generated trace (tests/benchmarks/test_trace_replay.py); the figures in the README come from the
command beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import time
from contextlib import ExitStack

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

KiB, MiB = 1 << 10, 1 << 20
BLOCK_TOKENS = 512  # Mooncake's traces hash 512-token blocks
STORES = ("kvstore", "mooncake", "lmcache")


# --- traces -----------------------------------------------------------------------------------


def load_trace(path: str, limit: int | None = None) -> list[dict]:
    """Mooncake FAST'25 JSON lines; a line without hash_ids or with bad fields is an error
    that names the line."""
    requests = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids = [int(h) for h in rec["hash_ids"]]
                requests.append({"timestamp": float(rec.get("timestamp", number)), "input_length":
                                 int(rec.get("input_length", len(ids) * BLOCK_TOKENS)),
                                 "output_length": int(rec.get("output_length", 0)), "hash_ids": ids})
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(f"trace_replay: {path}:{number}: not a Mooncake trace line ({exc!r})") from None
            if limit and len(requests) >= limit:
                break
    if not requests:
        raise SystemExit(f"trace_replay: {path} holds no requests")
    return sorted(requests, key=lambda r: r["timestamp"])


def agent_trace(requests: int, seed: int = 42) -> list[dict]:
    """A generated agent trace in Mooncake's format (see the module docstring)."""
    rng = random.Random(seed)
    next_id = iter(range(1, 1 << 62))
    prompts = [[next(next_id) for _ in range(rng.randint(2, 6))] for _ in range(4)]  # system prompts
    tools = [[next(next_id) for _ in range(rng.randint(1, 4))] for _ in range(6)]  # tool preambles
    sessions: list[dict] = []
    out, clock = [], 0.0
    while len(out) < requests:
        clock += rng.expovariate(1 / 200.0)
        if not sessions or (len(sessions) < 64 and rng.random() < 0.08):
            base = list(rng.choice(prompts)) + list(rng.choice(tools))
            sessions.append({"history": [base], "last": None})
        session = rng.choice(sessions)
        roll = rng.random()
        if session["last"] is not None and roll < 0.08:
            blocks = session["last"]  # a retry of the last request
        else:
            if roll < 0.23 and len(session["history"]) > 1:  # a branch from an earlier turn
                session["history"].append(list(rng.choice(session["history"][:-1])))
            context = session["history"][-1] + [next(next_id) for _ in range(rng.randint(1, 3))]
            if len(context) > 96:  # a session that outgrew its window starts over
                context = session["history"][0] + [next(next_id)]
            session["history"].append(context)
            blocks = context
        session["last"] = blocks
        if len(sessions) > 48 and rng.random() < 0.03:
            sessions.remove(rng.choice(sessions))
        out.append({"timestamp": round(clock, 3), "input_length": len(blocks) * BLOCK_TOKENS - rng.randint(0, 400),
                    "output_length": rng.randint(20, 600), "hash_ids": list(blocks)})
    return out


def block_bytes_for(block_id: int, size: int) -> np.ndarray:
    """A block's bytes: its id first (checked on every read), then a pattern of it."""
    data = np.full(size, block_id % 251, dtype=np.uint8)
    data[:8] = np.frombuffer(struct.pack("<q", block_id), dtype=np.uint8)
    return data


# --- stores -----------------------------------------------------------------------------------


class KVStoreSide:
    def __init__(self, socket_path: str, block_size: int):
        from kvstore.client import Client
        from kvstore.identity import ObjectId, StateDescriptor
        import hashlib
        self.client = Client.connect(socket_path, namespace="trace", timeout_s=60)
        self.desc = StateDescriptor("trace", "trace-model", "main", dtype="u8")
        self.oid = lambda b: ObjectId(hashlib.blake2b(struct.pack("<q", b), digest_size=32).digest())
        self.size = block_size

    def lookup(self, ids: list[int]) -> int:
        return self.client.lookup([self.oid(b) for b in ids]).hits

    def read(self, ids: list[int], outs: list[np.ndarray]) -> list[bool]:
        return [n == self.size for n in self.client.get_many_into([(self.oid(b), o) for b, o in zip(ids, outs)])]

    def write(self, ids: list[int], datas: list[np.ndarray]) -> int:
        results = self.client.put_many([(self.oid(b), d) for b, d in zip(ids, datas)], self.desc)
        return sum(r.error is not None for r in results)

    def close(self) -> None:
        self.client.close()


class MooncakeStoreSide:
    def __init__(self, rpc: int, meta: int, block_size: int, log_path: str, max_blocks: int):
        from bench.baselines import mooncake_store
        self.store = mooncake_store(rpc, meta, 0, 64 * MiB, log_path)
        self.size = block_size
        self.buffer = np.zeros(block_size * max_blocks, dtype=np.uint8)
        if self.store.register_buffer(self.buffer.ctypes.data, self.buffer.nbytes) != 0:
            raise RuntimeError("mooncake register_buffer failed")

    def lookup(self, ids: list[int]) -> int:
        found = self.store.batch_is_exist([str(b) for b in ids])
        return next((i for i, ok in enumerate(found) if ok != 1), len(ids))

    def _views(self, n: int):
        return [self.buffer.ctypes.data + i * self.size for i in range(n)]

    def read(self, ids: list[int], outs: list[np.ndarray]) -> list[bool]:
        got = self.store.batch_get_into([str(b) for b in ids], self._views(len(ids)), [self.size] * len(ids))
        for i, out in enumerate(outs):
            out[:] = self.buffer[i * self.size:(i + 1) * self.size]
        return [n == self.size for n in got]

    def write(self, ids: list[int], datas: list[np.ndarray]) -> int:
        for i, d in enumerate(datas):
            self.buffer[i * self.size:(i + 1) * self.size] = d
        codes = self.store.batch_put_from([str(b) for b in ids], self._views(len(ids)), [self.size] * len(ids))
        return sum(c != 0 for c in codes)

    def close(self) -> None:
        self.store.close()


class LMCacheSide:
    """LMCache's StorageManager with an L1 only (run in LMCache's environment)."""

    def __init__(self, capacity: int, block_size: int):
        import torch
        from lmcache.v1.distributed.api import MemoryLayoutDesc
        from lmcache.v1.distributed.config import (EvictionConfig, L1ManagerConfig, L1MemoryManagerConfig,
                                                   StorageManagerConfig)
        from lmcache.v1.distributed.storage_manager import StorageManager
        memory = L1MemoryManagerConfig(size_in_bytes=capacity, use_lazy=False, init_size_in_bytes=capacity, shm_name="")
        self.sm = StorageManager(StorageManagerConfig(l1_manager_config=L1ManagerConfig(memory_config=memory),
                                                      eviction_config=EvictionConfig(eviction_policy="LRU")))
        self.layout = MemoryLayoutDesc(shapes=[torch.Size([block_size])], dtypes=[torch.uint8])
        self.size = block_size

    def _keys(self, ids):
        from lmcache.v1.distributed.api import ObjectKey
        return [ObjectKey(struct.pack("<q", b), "trace-model", 0) for b in ids]

    def lookup(self, ids: list[int]) -> int:
        from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec
        keys = self._keys(ids)
        handle = self.sm.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys(keys, 0, self.layout)]), skip_l2=True)
        result = self.sm.query_prefetch_status(handle)
        hits = result.hit_cells[0].count_leading_ones() if result is not None and result.hit_cells else 0
        self._locked = keys[:hits]
        return hits

    def read(self, ids: list[int], outs: list[np.ndarray]) -> list[bool]:
        keys = self._locked[:len(ids)]
        ok = [False] * len(ids)
        with self.sm.read_prefetched_results(keys) as objs:
            if objs is not None:
                for i, (obj, out) in enumerate(zip(objs, outs)):
                    out[:] = np.frombuffer(obj.byte_array, dtype=np.uint8)
                    ok[i] = True
        self.sm.finish_read_prefetched(keys)
        return ok

    def write(self, ids: list[int], datas: list[np.ndarray]) -> int:
        keys = self._keys(ids)
        objs = self.sm.reserve_write(keys, self.layout)
        written = []
        for key, data in zip(keys, datas):
            obj = objs.get(key)
            if obj is not None:
                np.frombuffer(obj.byte_array, dtype=np.uint8)[:] = data
                written.append(key)
        if written:
            self.sm.finish_write(written)
        return len(keys) - len(written)

    def close(self) -> None:
        self.sm.close()


# --- the replay -------------------------------------------------------------------------------


def replay(side, trace: list[dict], block_size: int, progress: str = "") -> dict:
    hit_blocks = total_blocks = hit_tokens = input_tokens = failed_writes = wrong = 0
    read_ms, write_ms, read_us_per_block = [], [], []
    read_bytes = written_bytes = 0
    busy = 0.0
    max_blocks = max(len(r["hash_ids"]) for r in trace)
    outs = [np.empty(block_size, dtype=np.uint8) for _ in range(max_blocks)]
    started = time.perf_counter()
    for number, request in enumerate(trace, 1):
        ids = request["hash_ids"]
        t0 = time.perf_counter()
        hits = side.lookup(ids) if ids else 0
        if hits:
            got = side.read(ids[:hits], outs[:hits])
            for i, ok in enumerate(got):  # a hit read back must be that block, whole
                if ok and (struct.unpack("<q", outs[i][:8].tobytes())[0] != ids[i] or outs[i][-1] != ids[i] % 251):
                    wrong += 1
            hits = next((i for i, ok in enumerate(got) if not ok), hits)
        t1 = time.perf_counter()
        if hits:
            read_ms.append((t1 - t0) * 1e3)
            read_us_per_block.append((t1 - t0) * 1e6 / hits)
            read_bytes += hits * block_size
        misses = ids[hits:]
        if misses:
            datas = [block_bytes_for(b, block_size) for b in misses]
            t2 = time.perf_counter()
            failed = side.write(misses, datas)
            t3 = time.perf_counter()
            write_ms.append((t3 - t2) * 1e3)
            failed_writes += failed
            written_bytes += (len(misses) - failed) * block_size
            busy += t3 - t2
        busy += t1 - t0
        hit_blocks += hits
        total_blocks += len(ids)
        hit_tokens += min(hits * BLOCK_TOKENS, request["input_length"])
        input_tokens += request["input_length"]
        if progress and number % max(1, len(trace) // 10) == 0:
            print(f"  {progress}: {number}/{len(trace)} requests, block hit rate {hit_blocks / total_blocks:.3f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)

    def pct(values, q):
        return round(float(np.percentile(values, q)), 3) if values else None

    return {"requests": len(trace), "blocks": total_blocks, "block_hit_rate": round(hit_blocks / max(1, total_blocks), 4),
            "token_hit_rate": round(hit_tokens / max(1, input_tokens), 4),
            "bytes_read_per_hit_token": round(read_bytes / hit_tokens, 1) if hit_tokens else None,
            "read_ms_p50": pct(read_ms, 50), "read_ms_p99": pct(read_ms, 99),
            "read_us_per_block_p50": pct(read_us_per_block, 50), "read_us_per_block_p99": pct(read_us_per_block, 99),
            "write_ms_p50": pct(write_ms, 50), "write_ms_p99": pct(write_ms, 99),
            "effective_gb_s": round((read_bytes + written_bytes) / busy / 1e9, 3) if busy else None,
            "failed_writes": failed_writes, "wrong_blocks": wrong}


def run_lmcache(trace_path: str, args) -> dict:
    """The lmcache side in LMCache's environment (this file, --side lmcache)."""
    py = subprocess.run([os.path.join(REPO, "scripts/engine_env.sh"), "lmcache"], check=True, capture_output=True,
                        text=True).stdout.strip().splitlines()[-1]
    out = trace_path + ".lmcache.json"
    env = {**os.environ, "PYTHONPATH": REPO, "LMCACHE_DISABLE_BANNER": "1", "PYTHONWARNINGS": "ignore",
           "LMCACHE_LOG_LEVEL": "WARNING"}
    done = subprocess.run([py, os.path.abspath(__file__), "--side", "lmcache", "--trace", trace_path,
                           "--capacity-mb", str(args.capacity_mb), "--block-kb", str(args.block_kb), "--json", out],
                          env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        tail = " | ".join([line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-4:])
        raise RuntimeError(f"the lmcache side failed (exit {done.returncode}): {tail}")
    return json.load(open(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="a Mooncake FAST'25 trace (JSON lines)")
    source.add_argument("--generate", choices=["agent"], help="generate a trace instead")
    parser.add_argument("--requests", type=int, default=2000, help="requests to generate, or the first N of --trace")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--write-trace", help="save the generated trace here (JSON lines)")
    parser.add_argument("--capacity-mb", type=int, default=0,
                        help="bytes each store may hold, MiB (default: a quarter of the trace's distinct blocks)")
    parser.add_argument("--block-kb", type=int, default=64, help="bytes per 512-token block, KiB (default 64)")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--policies", default="",
                        help="more kvstore runs, one per eviction policy named (comma-separated: cost_aware, lru, s3fifo)")
    parser.add_argument("--results", help="where the results go (default bench/results/trace_replay.json)")
    parser.add_argument("--side", choices=["lmcache"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.block_kb <= 0 or args.requests <= 0 or args.capacity_mb < 0:
        parser.error("--block-kb and --requests must be positive, --capacity-mb >= 0")
    block_size = args.block_kb * KiB
    if args.side == "lmcache":
        trace = load_trace(args.trace)
        side = LMCacheSide(args.capacity_mb * MiB, block_size)
        try:
            result = replay(side, trace, block_size)
        finally:
            side.close()
        with open(args.json, "w") as f:
            json.dump(result, f)
        return 0
    trace = load_trace(args.trace, args.requests) if args.trace else agent_trace(args.requests, args.seed)
    distinct = len({b for r in trace for b in r["hash_ids"]})
    if not args.capacity_mb:
        args.capacity_mb = max(16, distinct * block_size // 4 // MiB)  # Mooncake sets up no smaller segment
    stores = [s.strip() for s in args.stores.split(",")]
    if set(stores) - set(STORES):
        parser.error(f"--stores takes {', '.join(STORES)}")
    from kvstore.policy import POLICIES
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if set(policies) - set(POLICIES):
        parser.error(f"--policies takes {', '.join(sorted(POLICIES))}")
    stores[stores.index("kvstore") + 1 if "kvstore" in stores else 0:0] = [f"kvstore/{p}" for p in policies]
    print(f"trace: {len(trace)} requests, {sum(len(r['hash_ids']) for r in trace)} blocks, {distinct} distinct "
          f"({distinct * block_size / MiB:.0f} MiB at {args.block_kb} KiB a block); capacity {args.capacity_mb} MiB "
          "per store", flush=True)
    from bench.common import RESULTS_DIR, machine_info, scratch_dir
    results, skipped = {}, {}
    with scratch_dir("kvstore-trace-") as workdir, ExitStack() as stack:
        trace_path = args.write_trace or os.path.join(workdir, "trace.jsonl")
        with open(trace_path, "w") as f:
            for r in trace:
                f.write(json.dumps(r) + "\n")
        for name in stores:
            print(f"{name}: replaying", flush=True)
            try:
                if name.startswith("kvstore"):
                    from bench.common import host_only_daemon
                    policy = name.partition("/")[2]
                    proc, socket_path = host_only_daemon(workdir, name.replace("/", "-"), args.capacity_mb * MiB,
                                                         f'[host]\npolicy = "{policy}"\n' if policy else "",
                                                         prefault=True)
                    stack.callback(lambda p=proc: (p.terminate(), p.wait(60)))
                    side = KVStoreSide(socket_path, block_size)
                elif name == "mooncake":
                    from bench.baselines import BaselineUnavailable, mooncake_master
                    from bench.common import Worker
                    from bench.remote_pool import MooncakeHolder
                    log_path = os.path.join(workdir, "mooncake.log")
                    try:
                        rpc, meta = stack.enter_context(mooncake_master(workdir))
                        stack.enter_context(Worker("trace-holder", MooncakeHolder, rpc, meta, args.capacity_mb * MiB,
                                                   log_path))
                    except BaselineUnavailable as exc:  # (a holder of under 16 MiB does not set up)
                        skipped[name] = str(exc)
                        print(f"  {name}: skipped: {exc}", flush=True)
                        continue
                    side = MooncakeStoreSide(rpc, meta, block_size, log_path,
                                             max(len(r["hash_ids"]) for r in trace))
                else:
                    results[name] = run_lmcache(trace_path, args)
                    print(f"  {name}: {results[name]}", flush=True)
                    continue
                try:
                    results[name] = replay(side, trace, block_size, progress=name)
                finally:
                    side.close()
                print(f"  {name}: {results[name]}", flush=True)
            except RuntimeError as exc:
                skipped[name] = str(exc)
                print(f"  {name}: FAILED {exc}", flush=True)
    print_results(results, skipped)
    path = args.results or os.path.join(RESULTS_DIR, "trace_replay.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"suite": "trace_replay", "machine": machine_info(), "trace": args.trace or f"generated {args.generate}",
                   "settings": {k: v for k, v in vars(args).items() if k not in ("side", "json")},
                   "results": results, "skipped": skipped}, f, indent=2)
    print(f"results: {path}")
    wrong = sum(r["wrong_blocks"] for r in results.values())
    return 1 if wrong or skipped else 0


def print_results(results: dict, skipped: dict) -> None:
    fields = ("block_hit_rate", "token_hit_rate", "bytes_read_per_hit_token", "read_ms_p50", "read_ms_p99",
              "read_us_per_block_p50", "read_us_per_block_p99", "write_ms_p50", "write_ms_p99", "effective_gb_s",
              "failed_writes", "wrong_blocks")
    print()
    widths = [max(12, len(name) + 2) for name in results]
    print(f"{'':<26}" + "".join(f"{name:>{w}}" for name, w in zip(results, widths)))
    for field in fields:
        print(f"{field:<26}" + "".join(f"{str(r[field]):>{w}}" for r, w in zip(results.values(), widths)))
    best = {n: r["block_hit_rate"] for n, r in results.items() if not n.startswith("kvstore")}
    if best:
        other = max(best, key=best.get)
        for name in (n for n in results if n.startswith("kvstore")):
            print(f"{name}'s block hit rate / the best other ({other}): "
                  f"{results[name]['block_hit_rate'] / max(best[other], 1e-9):.3f}x")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")


if __name__ == "__main__":
    sys.exit(main())
