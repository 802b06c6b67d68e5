"""The engine adapters' own overhead: blocks stored and loaded per second through each
adapter, against a plain copy of the same bytes in the same run.

    .venv/bin/python bench/engines.py [--engines vllm,sglang,lmcache] [--quick]

Each engine's part runs in that engine's own environment (scripts/engine_env.sh makes it
when missing) against a daemon it starts (host tier only, 1 GiB arena); the parts print
their rows as JSON and this driver reports them together (bench/results/engines.json).

Each part lives in bench/engines_<engine>.py (`bench(socket_path, quick, suite) ->
list[Row]`), whose docstring says what it times. vllm: the KV connector's save / load of
256-token chunks (6 MiB), plain and hybrid (attention chunks with Mamba states as store
groups), and the secondary tier's store / load of 2 MiB chunks. sglang: HiCache pages (24
layers, 64 tokens, 8x128 bf16: 6 MiB) through batch_set_v1 / batch_get_v1, page_first and
layer_first. lmcache: 24 MiB KV_2LTD chunks through batched_put / get.

Ratios are the adapter's rate / the baseline's rate (1.0 = as fast as the plain copy; lower
is slower); the absolute rates vary up to 3x between runs on this shared 2-core machine.
Every load is checked bit-exact before its row counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import Row, median, report  # noqa: E402

SUITE = "engines"
ENGINES = ("vllm", "sglang", "lmcache")


def _timed(fn, reps: int, after=None) -> float:
    """Median seconds of fn() over reps runs (one warm-up first); `after(fn's result)` runs
    untimed after each (e.g. deletes what fn stored)."""
    times = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        result = fn()
        if rep:  # rep 0 warms up
            times.append(time.perf_counter() - start)
        if after is not None:
            after(result)
    return median(times)


def run_part(engine: str, quick: bool) -> list[dict]:
    """In the engine's environment: start a daemon, measure, return rows as dicts."""
    from kvstore.commands.smoke import start_daemon

    with tempfile.TemporaryDirectory(prefix="kvs-bench-") as tmp:
        sock = os.path.join(tmp, "s.sock")
        proc = start_daemon(sock, "1GiB")
        try:
            module = __import__(f"bench.engines_{engine}", fromlist=["bench"])
            rows = module.bench(sock, quick, SUITE)
        finally:
            proc.terminate()
            proc.wait(30)
    return [r.to_json() for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one engine's part here
    args = parser.parse_args()
    if args.part:
        print("ROWS " + json.dumps(run_part(args.part, args.quick)))
        return
    rows, skipped = [], {}
    for engine in [e for e in args.engines.split(",") if e]:
        if not os.path.exists(os.path.join(ROOT, "bench", f"engines_{engine}.py")):
            skipped[engine] = f"no bench/engines_{engine}.py yet"
            continue
        print(f"engines: {engine} (its environment: scripts/engine_env.sh {engine})", flush=True)
        python = subprocess.run([os.path.join(ROOT, "scripts", "engine_env.sh"), engine], check=True,
                                capture_output=True, text=True).stdout.strip()
        env = {**os.environ, "PYTHONPATH": ROOT, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
        done = subprocess.run([python, os.path.abspath(__file__), "--part", engine] + (["--quick"] if args.quick else []),
                              capture_output=True, text=True, env=env)
        found = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
        if done.returncode != 0 or not found:
            skipped[engine] = f"its part failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
            continue
        rows += [Row(**{k: v for k, v in r.items() if k != "ratio"}) for r in json.loads(found[-1][5:])]
    report(SUITE, rows, [], skipped, {"quick": args.quick, "engines": args.engines})


if __name__ == "__main__":
    main()
