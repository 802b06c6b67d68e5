"""Huge pages for host arenas: put and get_into through two daemons alike but for their pages.

    .venv/bin/python bench/huge_pages.py [--quick] [--reserve]   # bench/results/huge_pages.json

Two `kvstore serve` daemons with a prefaulted 512 MiB arena each: "4 KiB pages" (`[host]
huge_pages = "off"`) and "huge pages" (`huge_pages = "auto"`: the host's reserved huge
pages where enough are free, else transparent huge pages where shared memory allows them),
and numpy memcpy in a process of its own as the baseline. Each store's client runs in its own
process; repetitions are interleaved across the three (bench/local.py: interleave), so a
shared machine's load hits all alike. Measured: put and get_into of 64 KiB, 4 MiB and 32 MiB
objects (as bench/local.py takes them), huge pages against 4 KiB pages, and each against memcpy.

--reserve: as root, reserve the huge pages the second daemon needs (`vm.nr_hugepages`) for the
run and put the setting back after. Which pages each daemon got is read from its stats and
printed; a run where the second got none says so, and its ratios compare 4 KiB with 4 KiB.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import asdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import KiB, MiB, Row, Worker, gb_per_s, report, scratch_dir, size_label  # noqa: E402
from bench.local import Plan, interleave, prepare_all, progress  # noqa: E402
from bench.local_sides import KVStoreSide, MemcpySide  # noqa: E402

SUITE = "huge_pages"
SIZES = (64 * KiB, 4 * MiB, 32 * MiB)
ARENA_BYTES = 512 * MiB
FULL = Plan(reps=11, rep_bytes=128 * MiB, latency_iters=0, lookup_iters=0)
QUICK = Plan(reps=5, rep_bytes=32 * MiB, latency_iters=0, lookup_iters=0)
SIDES = {"4 KiB pages": "off", "huge pages": "auto"}
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


@contextlib.contextmanager
def reserved(pages: int):
    """`pages` more huge pages reserved for the run (root), the setting put back after."""
    with open(NR_HUGEPAGES) as f:
        before = int(f.read())
    with open(NR_HUGEPAGES, "w") as f:
        f.write(str(before + pages))
    try:
        yield
    finally:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(before))


def start(stack: contextlib.ExitStack, plan: Plan, workdir: str, name: str, huge_pages: str) -> Worker:
    from kvstore.commands.smoke import start_daemon
    tag = name.split()[0]
    socket_path, config_path = os.path.join(workdir, f"{tag}.sock"), os.path.join(workdir, f"{tag}.toml")
    with open(config_path, "w") as f:
        # Its one arena is the bench's, made at start (not "default", which would take the pages).
        f.write(f'[admin]\nenabled = false\n[host]\nhuge_pages = "{huge_pages}"\nnamespaces = ["bench"]\n')
    daemon = start_daemon(socket_path, str(ARENA_BYTES),
                          extra=("--config", config_path, "--data-dir", os.path.join(workdir, f"data-{tag}")))
    stack.callback(lambda: (daemon.terminate(), daemon.wait(10)))
    side = stack.enter_context(Worker(name, KVStoreSide, socket_path, plan.reps))
    progress(name, f"daemon up, arena on {side.call('info')['pages']} pages")
    return side


def measure(plan: Plan, workdir: str) -> dict:
    out: dict = {"put": {}, "get": {}, "pages": {}}
    with contextlib.ExitStack() as stack:
        sides = {name: start(stack, plan, workdir, name, value) for name, value in SIDES.items()}
        out["pages"] = {name: side.call("info")["pages"] for name, side in sides.items()}
        sides["memcpy"] = stack.enter_context(Worker("memcpy", MemcpySide))
        for size in SIZES:
            count = plan.count(size)
            prepare_all(sides, size, count, {})
            out["put"][size] = {n: gb_per_s(count * size, s)
                                for n, s in interleave(sides, "put", plan.reps, after="drop").items()}
            out["get"][size] = {n: gb_per_s(count * size, s) for n, s in interleave(sides, "get", plan.reps).items()}
            for worker in sides.values():
                worker.call("finish")
            progress("bench", f"{size_label(size)} x{count}: " + "; ".join(
                f"{op} " + ", ".join(f"{n} {v:.2f}" for n, v in out[op][size].items()) for op in ("put", "get")))
    return out


def build_rows(out: dict) -> list[Row]:
    rows = []
    for op, case in (("put", "put"), ("get", "get_into")):
        for size in SIZES:
            got = out[op][size]
            label = f"{case} {size_label(size)}"
            rows.append(Row(SUITE, label, "throughput", "GB/s", got["huge pages"], "4 KiB pages", got["4 KiB pages"]))
            rows.append(Row(SUITE, label, "throughput", "GB/s", got["huge pages"], "memcpy", got["memcpy"]))
            rows.append(Row(SUITE, f"{label} (4 KiB pages)", "throughput", "GB/s", got["4 KiB pages"], "memcpy",
                            got["memcpy"]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer and smaller repetitions (< 1 min)")
    parser.add_argument("--reserve", action="store_true",
                        help="reserve the huge pages the run needs (root: vm.nr_hugepages), put back after")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.reserve:
            stack.enter_context(reserved(ARENA_BYTES // (2 * MiB)))
        with scratch_dir("kvstore-bench-") as workdir:
            out = measure(plan, workdir)
    skipped = {}
    if out["pages"]["huge pages"] == "off":
        skipped["huge pages"] = ("the host offers none (no reserved huge pages free, and transparent huge pages "
                                 "are off for shared memory): both daemons ran on 4 KiB pages; try --reserve as root")
    settings = {**asdict(plan), "mode": "quick" if args.quick else "full", "arena_bytes": ARENA_BYTES,
                "pages": out["pages"], "reserved": args.reserve, "elapsed_s": round(time.perf_counter() - started, 1)}
    report(SUITE, build_rows(out), [], skipped, settings)
    progress("bench", f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
