"""LMCache's own L2 adapter benchmark (`lmcache bench l2`, from LMCache 0.5.6 in its locked
environment), run with the same parameters against each store in one run, reps interleaved:

    kvstore        kvstore's L2 adapter (adapters/lmcache_mp.py) on a daemon, host tier only
    kvstore+nvme   the same daemon with NVMe on, as configured by default (write_back: objects
                   go to NVMe as the host tier evicts them, and at a clean stop)
    kvstore+nvme-wt  NVMe write_through: every store is on NVMe before it answers (group
                   commit every 5 ms), the durable comparison with fs
    kvstore+pool   a daemon whose remote tier is a Mooncake Store pool (its master and a
                   holder lending the pool its memory, started for each run): stores go to
                   the pool as well as the host tier (remote_write = "write_through", the
                   default: the daemon copies them in the background, while the bench goes on)
    kvstore+pool-wb  the same with remote_write = "write_back": only objects leaving the node
                   go to the pool
    fs             LMCache's fs adapter, files under the same scratch directory (same disk)
    resp           LMCache's resp adapter (its C++ Redis client) on a real redis-server over
                   loopback, no persistence
    mooncake_store LMCache's mooncake_store adapter: needs LMCache's C++ Mooncake extension
                   (`lmcache.lmcache_mooncake`), which LMCache's 0.5.6 wheel does not ship;
                   the run says so and goes on

Each run of `lmcache bench l2` stores `rounds` rounds of `in_flight` x `num_keys` keys, looks
them up (hit rate bound 1.0) and loads them, verifying the last round's bytes; it prints
per-round duration p50/p99 and throughput. A run whose keys did not all succeed is an error
here, not a figure (LMCache's bench reports a fast throughput for failed stores). Ratios are
kvstore's throughput over each other store's (higher is better) and kvstore's p99 over theirs.

    .venv/bin/python bench/lmcache_l2.py                   # 256 KiB (LMCache's default) and 2 MiB
    .venv/bin/python bench/lmcache_l2.py --quick           # fewer rounds
Needs the LMCache environment (scripts/engine_env.sh lmcache) and redis-server for resp.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.baselines import mooncake_master, redis_server  # noqa: E402
from bench.common import (RESULTS_DIR, BaselineUnavailable, Worker, host_only_daemon, machine_info,  # noqa: E402
                          median, scratch_dir)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB, MiB = 1 << 10, 1 << 20
OPS = ("Store", "Lookup", "Load")
OURS = ("kvstore", "kvstore+nvme", "kvstore+nvme-wt", "kvstore+pool", "kvstore+pool-wb")
STORES = (*OURS, "fs", "resp", "mooncake_store")


def lmcache_cli() -> str:
    out = subprocess.run([os.path.join(REPO, "scripts/engine_env.sh"), "lmcache"], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    cli = os.path.join(os.path.dirname(out), "lmcache")
    if not os.access(cli, os.X_OK):
        raise SystemExit(f"lmcache_l2: no lmcache command beside {out}")
    return cli


# write_through copies wait while clients are busy (remote.mooncake.write_through_yield_ms):
# per pool run, how many the pool held in the end and how long after the bench that was.
caught_up: list[dict] = []


def pool_caught_up(socket_path: str, settle_s: float = 5.0, limit_s: float = 120.0) -> tuple[int, float, int, int]:
    """(write_through copies the pool holds, seconds from now until the last of them went,
    objects put as they left the host tier instead, puts that failed): polls the daemon's
    count until it has not grown for `settle_s` (a batch of 64 x 2 MiB can take over a second)."""
    from kvstore.client import Client
    start = time.perf_counter()
    with Client(socket_path) as client:
        count, changed = -1, start
        while time.perf_counter() - changed < settle_s and time.perf_counter() - start < limit_s:
            remote = client.stats()["tiers"]["remote"]
            if remote["num_replicated"] != count:
                count, changed = remote["num_replicated"], time.perf_counter()
            time.sleep(0.05)
    return count, changed - start, remote["num_demoted_remote"], remote["num_put_failures"]


def run_bench(cli: str, spec: dict, args, size_kb: int, workdir: str, label: str) -> dict:
    """One `lmcache bench l2` run; {op: metrics} or raises RuntimeError naming what failed."""
    out = os.path.join(workdir, f"{label}-{size_kb}.json")
    argv = [cli, "bench", "l2", "--l2-adapter", json.dumps(spec), "--num-keys", str(args.num_keys),
            "--in-flight", str(args.in_flight), "--data-size-kb", str(size_kb), "--rounds", str(args.rounds),
            "--warmup-rounds", str(args.warmup), "--lookup-max-hit-rate", "1.0", "--no-skip-verify",
            "--format", "json", "--output", out]
    env = {**os.environ, "PYTHONPATH": REPO, "LMCACHE_DISABLE_BANNER": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    text = done.stdout + done.stderr
    if done.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"exit {done.returncode}: {_last_lines(text)}")
    if "MISMATCH" in text or "data mismatches" in text:
        raise RuntimeError(f"LMCache's round-trip check failed: {_last_lines(text)}")
    metrics = json.load(open(out))["metrics"]
    ops = {m["operation"]: m for m in metrics.values() if isinstance(m, dict) and "operation" in m}
    for op in OPS:
        m = ops.get(op)
        if m is None or m["rounds_timed_out"] or m["total_success"] != m["total_keys"]:
            raise RuntimeError(f"{op}: {m and m['total_success']} of {m and m['total_keys']} keys succeeded, "
                               f"{m and m['rounds_timed_out']} rounds timed out: {_last_lines(text)}")
    return ops


def _last_lines(text: str, n: int = 4) -> str:
    lines = [line for line in text.splitlines() if line.strip() and "Warning" not in line]
    return " | ".join(lines[-n:])


def stores(stack: ExitStack, workdir: str, args, skipped: dict[str, str]) -> dict:
    """store -> a context manager factory(size_kb, rep) that yields an adapter spec over a
    fresh, empty store (a daemon started for the run, a flushed Redis, an empty directory):
    LMCache's bench writes the same keys every run."""
    total = (args.rounds + args.warmup) * args.in_flight * args.num_keys * max(args.sizes_kb) * KiB
    out: dict = {}

    @contextlib.contextmanager
    def ours(name: str, toml: str = ""):
        run_dir = tempfile.mkdtemp(prefix=f"{name}-", dir=workdir)
        # the defaults a user gets (the arena prefaulted)
        proc, socket_path = host_only_daemon(run_dir, name, total + 256 * MiB, toml.replace("@DIR@", run_dir),
                                             prefault=True)
        try:
            yield {"type": "plugin", "module_path": "kvstore.adapters.lmcache_mp", "class_name": "KVStoreL2Adapter",
                   "adapter_params": {"socket_path": socket_path}}
        finally:
            proc.terminate()
            proc.wait(120)
            shutil.rmtree(run_dir, ignore_errors=True)

    if "kvstore" in args.stores:
        out["kvstore"] = lambda size_kb, rep: ours("host")
    capacity = max(2 * total, 1 << 30) // (64 * MiB) * (64 * MiB)
    nvme = f'[nvme]\nenabled = true\npath = "@DIR@/nvme"\ncapacity_bytes = {capacity}\nfile_bytes = {64 * MiB}\n'
    if "kvstore+nvme" in args.stores:
        out["kvstore+nvme"] = lambda size_kb, rep: ours("nvme", nvme)
    if "kvstore+nvme-wt" in args.stores:
        out["kvstore+nvme-wt"] = lambda size_kb, rep: ours("nvme-wt", nvme + 'write_policy = "write_through"\n'
                                                                     'durability = "group"\n')
    @contextlib.contextmanager
    def pool(remote_write: str):
        from bench.remote_pool import MooncakeHolder, _pool_toml
        with ExitStack() as run:  # a fresh pool each run: LMCache's bench writes the same keys
            run_dir = tempfile.mkdtemp(prefix="pool-", dir=workdir)
            rpc, meta = run.enter_context(mooncake_master(run_dir))
            run.enter_context(Worker("l2-pool-holder", MooncakeHolder, rpc, meta, total + 256 * MiB,
                                     os.path.join(run_dir, "mooncake.log")))
            spec = run.enter_context(ours("pool", _pool_toml(rpc, meta) + f'remote_write = "{remote_write}"\n'))
            yield spec
            if remote_write == "write_through":  # the copies yield to the bench's requests: when did they end?
                count, after_s, evicted, failed = pool_caught_up(spec["adapter_params"]["socket_path"])
                caught_up.append({"objects": count, "after_s": round(after_s, 3), "put_as_evicted": evicted,
                                  "failed": failed})
                print(f"  kvstore+pool: the pool held {count} write_through copies {after_s:.2f} s after the "
                      f"bench's last load ({evicted} more put as the host tier evicted them, {failed} puts failed)",
                      flush=True)

    if "kvstore+pool" in args.stores:
        out["kvstore+pool"] = lambda size_kb, rep: pool("write_through")
    if "kvstore+pool-wb" in args.stores:
        out["kvstore+pool-wb"] = lambda size_kb, rep: pool("write_back")
    if "fs" in args.stores:
        @contextlib.contextmanager
        def fs(size_kb, rep):
            path = tempfile.mkdtemp(prefix="fs-", dir=workdir)
            try:
                yield {"type": "fs", "base_path": path}
            finally:
                shutil.rmtree(path, ignore_errors=True)
        out["fs"] = fs
    if "resp" in args.stores:
        try:
            port = stack.enter_context(redis_server(workdir))
        except BaselineUnavailable as exc:
            skipped["resp"] = str(exc)
        else:
            @contextlib.contextmanager
            def resp(size_kb, rep):
                subprocess.run(["redis-cli", "-p", str(port), "FLUSHALL"], capture_output=True, check=True)
                yield {"type": "resp", "host": "127.0.0.1", "port": port}
            out["resp"] = resp
    if "mooncake_store" in args.stores:
        probe = subprocess.run([os.path.join(os.path.dirname(args.cli), "python"), "-c",
                                "import lmcache.lmcache_mooncake"], capture_output=True, text=True)
        if probe.returncode:
            skipped["mooncake_store"] = ("LMCache's mooncake_store adapter needs its C++ extension "
                                         "lmcache.lmcache_mooncake, which the LMCache 0.5.6 wheel does not ship "
                                         f"({_last_lines(probe.stderr, 1)}); building it needs LMCache's source and "
                                         "Mooncake's store headers (MOONCAKE_INCLUDE_DIR)")
        else:
            skipped["mooncake_store"] = "its extension imports, but this bench does not start a pool for it yet"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-kb", default="256,2048", help="data size per key, KiB, comma-separated")
    parser.add_argument("--num-keys", type=int, default=32, help="keys per submit (LMCache's default: 32)")
    parser.add_argument("--in-flight", type=int, default=4, help="submits per round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2, help="runs per store and size, interleaved")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--quick", action="store_true", help="--rounds 4 --reps 1")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.reps = 4, 1
    args.sizes_kb = [int(s) for s in args.sizes_kb.split(",")]
    args.stores = [s.strip() for s in args.stores.split(",")]
    unknown = set(args.stores) - set(STORES)
    if unknown or not args.stores or min(args.sizes_kb) <= 0:
        parser.error(f"--stores takes {', '.join(STORES)}; --sizes-kb positive numbers")
    args.cli = lmcache_cli()
    skipped: dict[str, str] = {}
    results: dict[tuple[str, int], list[dict]] = {}
    errors: dict[tuple[str, int], str] = {}
    with scratch_dir("kvstore-lmcache-l2-") as workdir, ExitStack() as stack:
        makers = stores(stack, workdir, args, skipped)
        names = list(makers)
        for size_kb in args.sizes_kb:
            for rep in range(args.reps):
                for k in range(len(names)):  # each rep starts one store further along
                    name = names[(rep + k) % len(names)]
                    if (name, size_kb) in errors:
                        continue
                    started = time.perf_counter()
                    try:
                        with makers[name](size_kb, rep) as spec:
                            ops = run_bench(args.cli, spec, args, size_kb, workdir, f"{name}-{rep}")
                    except (RuntimeError, subprocess.TimeoutExpired, subprocess.CalledProcessError) as exc:
                        errors[(name, size_kb)] = str(exc)
                        print(f"{name:>14} {size_kb:>5} KiB rep {rep}: FAILED {exc}", flush=True)
                        continue
                    results.setdefault((name, size_kb), []).append(ops)
                    print(f"{name:>14} {size_kb:>5} KiB rep {rep}: " + ", ".join(
                        f"{op} {ops[op]['throughput_avg_mbps'] or ops[op]['ops_per_sec_avg']:.0f}"
                        f"{' MB/s' if ops[op]['throughput_avg_mbps'] else ' keys/s'} p99 {ops[op]['duration_p99_ms']} ms"
                        for op in OPS) + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    rows = summarize(results, args)
    print_rows(rows, skipped, errors)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, "lmcache_l2.json")
    with open(path, "w") as f:
        json.dump({"suite": "lmcache_l2", "machine": machine_info(),
                   "settings": {k: v for k, v in vars(args).items() if k != "cli"}, "rows": rows,
                   "pool_write_through_caught_up": caught_up, "skipped": skipped, "errors": {f"{n} {s} KiB": e for (n, s), e in errors.items()}}, f, indent=2)
    print(f"results: {path}")
    return 1 if errors else 0


def summarize(results, args) -> list[dict]:
    """Per size, op and store: median throughput (MB/s, or keys/s for lookups) and p50/p99
    (ms, the median over reps), and kvstore's ratios against every other store."""
    rows = []
    for size_kb in args.sizes_kb:
        for op in OPS:
            per = {}
            for (name, size), runs in results.items():
                if size != size_kb:
                    continue
                unit = "keys/s" if op == "Lookup" else "MB/s"
                value = median([r[op]["ops_per_sec_avg" if op == "Lookup" else "throughput_avg_mbps"] for r in runs])
                per[name] = {"value": value, "unit": unit, "p50_ms": median([r[op]["duration_p50_ms"] for r in runs]),
                             "p99_ms": median([r[op]["duration_p99_ms"] for r in runs]), "reps": len(runs)}
            for ours in OURS:
                if ours not in per:
                    continue
                for name, theirs in per.items():
                    if name in OURS:
                        continue
                    per[ours].setdefault("vs", {})[name] = {
                        "throughput": round(per[ours]["value"] / theirs["value"], 2) if theirs["value"] else None,
                        "p99": round(per[ours]["p99_ms"] / theirs["p99_ms"], 2) if theirs["p99_ms"] else None}
            rows.append({"size_kb": size_kb, "op": op, "stores": per})
    return rows


def print_rows(rows, skipped, errors) -> None:
    print()
    print(f"{'size':>8} {'op':<7} {'store':<14} {'throughput':>14} {'p50 ms':>8} {'p99 ms':>8}  kvstore vs it")
    for row in rows:
        for name, r in row["stores"].items():
            vs = ""
            if name not in OURS:
                vs = "  ".join(f"{o}: {row['stores'][o]['vs'][name]['throughput']}x, p99 {row['stores'][o]['vs'][name]['p99']}x"
                               for o in OURS if o in row["stores"] and name in row["stores"][o].get("vs", {}))
            print(f"{row['size_kb']:>5}KiB {row['op']:<7} {name:<14} {r['value']:>8.0f} {r['unit']:<6}"
                  f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}  {vs}")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    for (name, size), why in errors.items():
        print(f"FAILED {name} {size} KiB: {why}")


if __name__ == "__main__":
    sys.exit(main())
