"""One run of the history checker: a real daemon, clients doing random operations from
threads, an asyncio loop and processes, faults injected throughout, then every recorded call
judged (tests/checker/histories.py). docs/hardening.md says what it covers.

    python tests/checker/run.py --store write_through --seconds 60 --seed 7

Faults: the daemon widens its race windows ([testing] delay_points = ["all"]: a delete, a
cancel or a restart lands inside an NVMe write, a promotion, a demotion); asyncio calls are
cancelled at random points; process workers get SIGINT (KeyboardInterrupt inside their calls)
and are SIGKILLed; the daemon is SIGKILLed or stopped (SIGTERM) and started again. A run
ends with every client gone: the daemon must hold no lease and pass check_integrity, and the
store's promise (histories.py: "lost") is checked once more across a last restart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]  # the checkout (its kvstore), then tests/ (for `checker`)

from checker.histories import History, Life  # noqa: E402
from checker.values import NAMESPACES, NUM_KEYS, object_id, size_of  # noqa: E402
from checker.workers import Recorder, async_worker, sync_worker  # noqa: E402
from kvstore.client import Client  # noqa: E402
from kvstore.errors import DaemonUnavailable  # noqa: E402

# Lines of the daemon's log that are anomalies: a traceback, an error-level event, an
# exception or a coroutine nobody awaited.
ERRORS = re.compile(r"Traceback|level=error|never retrieved|never awaited|Exception in callback")
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers.py")
ARENA = "8MiB"  # per namespace: every namespace holds more than this, so objects move all the time
STORES = {  # what each store configuration promises of a miss (histories.py "lost")
    "host": ("none", {}),
    "write_back": ("write_back", {"nvme": {"enabled": True, "capacity_bytes": "1GiB", "file_bytes": "256MiB",
                                           "admit_min_hits": 0, "write_policy": "write_back"}}),
    "write_through": ("write_through", {"nvme": {"enabled": True, "capacity_bytes": "1GiB",
                                                 "file_bytes": "256MiB", "admit_min_hits": 0,
                                                 "write_policy": "write_through"}}),
}


@dataclass
class Plan:
    store: str
    seed: int
    seconds: float
    threads: int = 2  # sync clients on threads of this process: one reads from the shared index, one not
    asyncs: int = 1  # AsyncClients whose calls are cancelled at random
    processes: int = 2  # sync clients in processes of their own, interrupted and SIGKILLed
    restart_every_s: tuple = (4.0, 9.0)  # the daemon is SIGKILLed (2 in 3) or stopped, then started again
    interrupt_every_s: tuple = (0.05, 0.4)
    kill_worker_every_s: tuple = (3.0, 8.0)
    delay_max_ms: float = 5.0


@dataclass
class Outcome:
    plan: Plan
    anomalies: list
    num_ops: int
    num_reads: int
    faults: dict = field(default_factory=dict)
    leases_at_end: int = 0

    def summary(self) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        return (f"store={self.plan.store} seed={self.plan.seed} seconds={self.plan.seconds:g}: {self.num_ops} ops, "
                f"{self.num_reads} reads judged, faults: {faults}; {len(self.anomalies)} anomalies")


def _toml(config: dict, prefix: str = "") -> str:
    lines = [f"{k} = {json.dumps(v)}" for k, v in config.items() if not isinstance(v, dict)]
    for name, table in config.items():
        if isinstance(table, dict):
            lines += [f"[{prefix}{name}]", _toml(table, f"{prefix}{name}.").rstrip("\n")]
    return "\n".join(line for line in lines if line) + "\n"


class Daemon:
    """The daemon under test, its restarts recorded as lives."""

    def __init__(self, root: str, plan: Plan):
        self.socket = os.path.join(root, "kvstore.sock")
        self.data_dir = os.path.join(root, "data")
        self.config_path = os.path.join(root, "kvstore.toml")
        self.log = os.path.join(root, "daemon.log")
        _, store_config = STORES[plan.store]
        config = {"data_dir": self.data_dir, "admin": {"port": 0}, **store_config}
        if plan.delay_max_ms:  # 0: no [testing] table (a daemon from before it existed, say)
            config["testing"] = {"delay_points": ["all"], "delay_max_ms": plan.delay_max_ms, "delay_seed": plan.seed}
        with open(self.config_path, "w") as f:
            f.write(_toml(config))
        self.proc = None
        self.lives: list[Life] = []

    def start(self) -> None:
        """Start it (its log appended to `log`, which the run reads for errors) and wait for
        its socket to answer."""
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore.commands.cli", "serve", "--socket", self.socket, "--arena-bytes",
                 ARENA, "--log-level", "warning", "--config", self.config_path],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the daemon exited {self.proc.returncode} at start; its log: {self.log}")
            try:
                Client.connect(self.socket, timeout_s=5).close()
                break
            except DaemonUnavailable:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the daemon did not answer within 60 s; its log: {self.log}") from None
                time.sleep(0.02)
        self.lives.append(Life(time.monotonic()))

    def errors(self) -> list[str]:
        """What in its log says something went wrong inside it (never a client's mistake)."""
        with open(self.log) as f:
            return [line.rstrip() for line in f if ERRORS.search(line)]

    def stop(self, sig: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        self.proc.wait(60)
        if sig == signal.SIGTERM and self.proc.returncode != 0:
            with open(self.log) as f:
                tail = f.readlines()[-40:]
            raise AssertionError(f"the daemon's clean stop exited {self.proc.returncode}; its log ends:\n"
                                 + "".join(line[:4000] for line in tail))
        self.lives[-1].end, self.lives[-1].clean = time.monotonic(), sig == signal.SIGTERM

    def client(self) -> Client:
        return Client.connect(self.socket, namespace=NAMESPACES[0], timeout_s=30)


class Chaos:
    """Signals at random moments from one thread: SIGINT to process workers, SIGKILL to one
    now and then (a new one takes its place), the daemon restarted."""

    def __init__(self, plan: Plan, daemon: Daemon, rng: random.Random, spawn):
        self.plan, self.daemon, self.rng, self.spawn = plan, daemon, rng, spawn
        self.procs: list[subprocess.Popen] = []
        self.faults = {"sigint": 0, "worker_sigkill": 0, "daemon_sigkill": 0, "daemon_sigterm": 0}
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # raised in the test's thread after the run
            self.error = exc

    def _run(self) -> None:
        now = time.monotonic()
        nxt = {"int": now + self.rng.uniform(*self.plan.interrupt_every_s),
               "kill": now + self.rng.uniform(*self.plan.kill_worker_every_s),
               "restart": now + self.rng.uniform(*self.plan.restart_every_s)}
        while not self.stop.wait(0.01):
            now = time.monotonic()
            live = [p for p in self.procs if p.poll() is None and os.path.exists(p.records)]  # started up
            if now >= nxt["int"] and live:
                self.rng.choice(live).send_signal(signal.SIGINT)
                self.faults["sigint"] += 1
                nxt["int"] = now + self.rng.uniform(*self.plan.interrupt_every_s)
            if now >= nxt["kill"] and live:
                victim = self.rng.choice(live)
                victim.kill()
                victim.wait()
                self.faults["worker_sigkill"] += 1
                self.procs.remove(victim)
                self.procs.append(self.spawn())
                nxt["kill"] = now + self.rng.uniform(*self.plan.kill_worker_every_s)
            if now >= nxt["restart"]:
                sig = signal.SIGKILL if self.rng.random() < 2 / 3 else signal.SIGTERM
                self.daemon.stop(sig)
                self.faults["daemon_sigkill" if sig == signal.SIGKILL else "daemon_sigterm"] += 1
                time.sleep(self.rng.uniform(0, 0.3))
                self.daemon.start()
                nxt["restart"] = time.monotonic() + self.rng.uniform(*self.plan.restart_every_s)


def _read_everything(daemon: Daemon, records: str) -> None:
    """One get_into of every key of every namespace, recorded (the last word on what is held)."""
    rec = Recorder(records, "final")
    import numpy as np
    from checker.values import decode
    with daemon.client() as c:
        for ns, name in enumerate(NAMESPACES):
            for key in range(NUM_KEYS):
                out = np.empty(size_of(key), np.uint8)
                seq = rec.begin("get_into", ns, [key])
                got = c.get_into(object_id(key), out, namespace=name)
                rec.end(seq, ["miss" if got is None else decode(ns, key, out[:got])])
    rec.close()


def _wait_no_leases(daemon: Daemon, timeout_s: float = 15.0) -> int:
    deadline = time.monotonic() + timeout_s
    with daemon.client() as c:
        while True:
            leases = c.stats()["leases"]
            if leases == 0 or time.monotonic() > deadline:
                return leases
            time.sleep(0.05)


def run(plan: Plan, keep: str | None = None, keep_if_anomalous: str | None = None) -> Outcome:
    """Run `plan` and judge it. keep: a directory to leave the records and logs in;
    keep_if_anomalous: the same, only when an anomaly was found. Whatever happens, the daemon
    and the worker processes are killed and the run's files removed."""
    root = tempfile.mkdtemp(prefix="kvs-check-")
    daemon = Daemon(root, plan)
    chaos = None
    outcome = None
    try:
        chaos, leases, crashes = _exercise(plan, root, daemon)
        history = History(promise=STORES[plan.store][0], lives=daemon.lives)
        records = os.path.join(root, "records")
        for name in sorted(os.listdir(records)):
            with open(os.path.join(records, name)) as f:
                history.load(f)
        anomalies = history.check()
        anomalies += [f"daemon log: {line}" for line in daemon.errors()]
        anomalies += crashes + _worker_tracebacks(root)
        if leases:
            anomalies.append(f"leases: the daemon held {leases} leases after every client had gone")
        outcome = Outcome(plan, anomalies, history.num_ops, len(history.reads),
                          dict(chaos.faults, **history.faults), leases)
        return outcome
    finally:
        if keep is None and outcome is not None and outcome.anomalies:
            keep = keep_if_anomalous
        if chaos is not None:
            chaos.stop.set()
            for p in chaos.procs:
                p.kill()
        daemon.stop(signal.SIGKILL)
        if keep:
            shutil.copytree(root, keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("data", "*.sock*"))
            with open(os.path.join(keep, "lives.json"), "w") as f:
                json.dump([(life.start, life.end, life.clean) for life in daemon.lives], f)
        shutil.rmtree(root, ignore_errors=True)


def _worker_tracebacks(root: str) -> list[str]:
    """A process worker that printed a traceback (a call raised something that is no error of
    the store, or a destructor failed): its stderr's last lines. SIGKILL prints nothing, and
    its SIGINT lands inside calls only, where the worker catches it."""
    found = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".err"):
            with open(os.path.join(root, name), errors="replace") as f:
                text = f.read()
            if re.search(r"^Traceback|^Exception ignored", text, re.M):
                tail = " | ".join(line.strip() for line in text.strip().splitlines()[-3:])
                found.append(f"worker {name[:-4]} crashed: {tail}")
    return found


def _crash_recorded(crashes: list, name: str, target):
    """`target` for a worker thread: what it raises is a crash of that worker (an anomaly)."""
    def run(*args):
        try:
            target(*args)
        except BaseException as exc:  # noqa: BLE001 (judged with the history)
            where = traceback.extract_tb(exc.__traceback__)[-1]
            crashes.append(f"worker {name} crashed: {exc!r} at {where.filename}:{where.lineno} ({where.name})")
            raise
    return run


def _exercise(plan: Plan, root: str, daemon: Daemon) -> tuple[Chaos, int, list]:
    """The run itself: workers and faults for plan.seconds, then the checks made with every
    client gone. Returns (the chaos, with its fault counts; leases the daemon still held;
    the worker threads that crashed)."""
    rng = random.Random(plan.seed)
    daemon.start()
    records = os.path.join(root, "records")
    os.makedirs(records)
    numbers = iter(range(1, 1 << 20))
    stop_at = time.monotonic() + plan.seconds

    def path(name: str) -> str:
        return os.path.join(records, name + ".jsonl")

    def spawn() -> subprocess.Popen:
        number = next(numbers)
        name = f"p{number}"
        left = max(0.5, stop_at - time.monotonic())
        with open(os.path.join(root, name + ".err"), "w") as err:  # read when a run goes wrong
            proc = subprocess.Popen(
                [sys.executable, WORKER_SCRIPT, daemon.socket, daemon.data_dir, name, str(number),
                 str(rng.randrange(1 << 30)), f"{left:.2f}", path(name), rng.choice(("shared", "daemon"))],
                stdin=subprocess.DEVNULL, stderr=err)
        proc.records = path(name)  # made once the worker has set up: signals wait for it
        return proc

    chaos = Chaos(plan, daemon, rng, spawn)
    chaos.procs = [spawn() for _ in range(plan.processes)]
    threads, crashes = [], []
    for i in range(plan.threads):
        number = next(numbers)
        threads.append(threading.Thread(target=_crash_recorded(crashes, f"t{number}", sync_worker), args=(
            daemon.socket, daemon.data_dir, f"t{number}", number, rng.randrange(1 << 30), plan.seconds,
            path(f"t{number}"), i % 2 == 0)))
    for _ in range(plan.asyncs):
        number = next(numbers)
        threads.append(threading.Thread(target=_crash_recorded(crashes, f"a{number}", asyncio.run), args=(
            async_worker(daemon.socket, daemon.data_dir, f"a{number}", number, rng.randrange(1 << 30),
                         plan.seconds, path(f"a{number}")),)))
    chaos_thread = threading.Thread(target=chaos.run)
    for t in threads + [chaos_thread]:
        t.start()
    for t in threads:
        t.join()
    chaos.stop.set()
    chaos_thread.join()
    if chaos.error is not None:
        raise chaos.error
    for p in chaos.procs:
        p.wait(60)
    leases = _wait_no_leases(daemon)
    with daemon.client() as c:
        c.check_integrity()
    _read_everything(daemon, path("final-1"))
    # The promise once more across a stop: SIGKILL for write_through (durable puts stay),
    # a clean stop otherwise (write_back's flush keeps what memory held).
    daemon.stop(signal.SIGKILL if plan.store == "write_through" else signal.SIGTERM)
    daemon.start()
    _read_everything(daemon, path("final-2"))
    with daemon.client() as c:
        c.check_integrity()
    return chaos, leases, crashes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run the history checker against a real daemon.")
    parser.add_argument("--store", choices=sorted(STORES), default="write_through")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--keep", help="copy the recorded histories here")
    parser.add_argument("--delay-max-ms", type=float, default=Plan.delay_max_ms,
                        help="the widest delay at the daemon's race windows; 0 leaves them as they are")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    outcome = run(Plan(args.store, seed, args.seconds, delay_max_ms=args.delay_max_ms), keep=args.keep)
    print(outcome.summary())
    for anomaly in outcome.anomalies[:50]:
        print("  ", anomaly)
    return 1 if outcome.anomalies else 0


if __name__ == "__main__":
    sys.exit(main())
