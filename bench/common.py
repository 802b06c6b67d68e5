"""What every bench suite shares: result rows, targets, the table, the JSON file and worker
processes. The baseline servers (Redis, etcd, the Mooncake master) are in bench/baselines.py.

A suite measures in worker processes (`Worker`), turns the numbers into `Row`s,
checks them against `Target`s and hands both to `report`, which prints the table and
writes `bench/results/<suite>.json`. Baselines that cannot run here raise
`BaselineUnavailable`; the suite prints its reason on a skip line and goes on.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import tempfile
import traceback
from dataclasses import asdict, dataclass

import numpy as np

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class BaselineUnavailable(Exception):
    """A baseline cannot run on this machine; the message says why and how to get it."""


@dataclass(frozen=True, slots=True)
class Row:
    """One measurement of ours, against one baseline (or none). `ratio` is ours / baseline."""

    suite: str
    case: str  # what was measured, e.g. "get_into 4MiB"
    metric: str  # "throughput", "p50", "median", ...
    unit: str  # "GB/s" (1e9 bytes), "us", "ms"
    ours: float
    baseline_name: str | None = None
    baseline: float | None = None
    higher_is_better: bool = True

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.baseline == 0:
            return None
        return self.ours / self.baseline

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


_OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "<": lambda a, b: a < b}


@dataclass(frozen=True, slots=True)
class Target:
    """A goal on one row: its ratio against `baseline_name`, or `ours` itself when None."""

    case: str
    metric: str
    baseline_name: str | None
    op: str  # ">=", "<=" or "<"
    bound: float

    def __post_init__(self):
        if self.op not in _OPS:
            raise ValueError(f"target op must be one of {sorted(_OPS)}, not {self.op!r}")

    def describe(self, unit: str = "") -> str:
        if self.baseline_name is None:
            return f"{self.op} {self.bound:g} {unit}".strip()
        return f"{self.op} {self.bound:g}x {self.baseline_name}"

    def row(self, rows: list[Row]) -> Row | None:
        for row in rows:
            if (row.case, row.metric, row.baseline_name) == (self.case, self.metric, self.baseline_name):
                return row
        return None

    def verdict(self, rows: list[Row]) -> str:
        """"met", "missed", or "not run" when the row (or its baseline) is missing."""
        row = self.row(rows)
        value = None if row is None else (row.ours if self.baseline_name is None else row.ratio)
        if value is None:
            return "not run"
        return "met" if _OPS[self.op](value, self.bound) else "missed"


# --- statistics and timing ---------------------------------------------------------


def median(values) -> float:
    return float(np.median(np.asarray(values, dtype=float)))


def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q))


def gb_per_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9


def touched(num_bytes: int, seed: int = 0) -> np.ndarray:
    """A uint8 array whose pages are faulted in (random bytes, so nothing compresses)."""
    return np.random.default_rng(seed).integers(0, 256, size=num_bytes, dtype=np.uint8)


def page_aligned(num_bytes: int, seed: int = 0) -> np.ndarray:
    """As touched(), but starting on a page boundary, as an engine's pinned or page-allocated
    buffers do (numpy's own large arrays start 16 bytes past one)."""
    raw = touched(num_bytes + 4096, seed)
    skip = (-raw.ctypes.data) % 4096
    return raw[skip:skip + num_bytes]


def size_label(num_bytes: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if num_bytes >= unit and num_bytes % unit == 0:
            return f"{num_bytes // unit}{name}"
    return f"{num_bytes}B"


# --- processes --------------------------------------------------------------------


class WorkerError(RuntimeError):
    """A call failed inside a worker process; the message carries its traceback."""


class Worker:
    """An object built and driven in its own spawned process.

    `Worker(factory, *args)` runs `factory(*args)` in a fresh process (spawned, not forked:
    it starts with no sockets, maps or threads of ours); `call(method, *args)` runs
    `getattr(obj, method)(*args)` there and returns the result, which must pickle. Calls
    are serialised; an idle worker blocks on its pipe and uses no CPU. A
    `BaselineUnavailable` raised there is raised here as is; anything else as `WorkerError`.
    `close()` (or leaving the `with` block) calls the object's `close()` if it has one.
    """

    def __init__(self, name: str, factory, *args, timeout_s: float = 300.0):
        self.name = name
        self.timeout_s = timeout_s
        ctx = multiprocessing.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(theirs, factory, args), name=f"bench-{name}", daemon=True)
        self._proc.start()
        theirs.close()
        try:
            self._receive()
        except BaseException:
            self.close()
            raise

    def call(self, method: str, *args):
        self._conn.send((method, args))
        return self._receive()

    def _receive(self):
        try:
            if not self._conn.poll(self.timeout_s):
                raise WorkerError(f"{self.name}: no answer within {self.timeout_s:g} s")
            status, value, trace = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise WorkerError(f"{self.name}: worker process died (exit code {self._proc.exitcode})") from None
        if status == "ok":
            return value
        if isinstance(value, BaselineUnavailable):
            raise value
        raise WorkerError(f"{self.name}: {trace}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._proc.join(15)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(conn, factory, args) -> None:
    def answer(status, value, trace=None):
        try:
            conn.send((status, value, trace))
        except Exception:  # the value or the exception does not pickle
            conn.send(("err", None, f"{trace or ''}\n(unpicklable {type(value).__name__}: {value})"))

    try:
        obj = factory(*args)
    except BaseException as exc:
        answer("err", exc, traceback.format_exc())
        return
    answer("ok", None)
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                break
            if message is None:
                break
            method, call_args = message
            try:
                answer("ok", getattr(obj, method)(*call_args))
            except Exception as exc:
                answer("err", exc, traceback.format_exc())
    finally:
        close = getattr(obj, "close", None)
        if close is not None:
            close()


def scratch_dir(prefix: str) -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix=prefix)


def host_only_daemon(workdir: str, name: str, arena_bytes: int, extra_toml: str = "", prefault: bool = False):
    """A `kvstore serve` child (host tier only, no admin API, its arena prefaulted only with
    `prefault`, the default a user gets) with its socket at <workdir>/<name>.sock; returns
    (process, socket path). The caller terminates it. extra_toml: more tables for its config
    (a remote tier: `[remote]`, `[cluster]`; NVMe: `[nvme]`)."""
    from kvstore.commands.smoke import start_daemon
    socket_path = os.path.join(workdir, f"{name}.sock")
    config_path = os.path.join(workdir, f"{name}.toml")
    with open(config_path, "w") as f:
        f.write("[admin]\nenabled = false\n" + ("" if prefault else "[host]\nprefault = false\n") + extra_toml)
    daemon = start_daemon(socket_path, str(arena_bytes), extra=("--config", config_path,
                                                                "--data-dir", os.path.join(workdir, f"data-{name}")))
    return daemon, socket_path


# --- reporting ----------------------------------------------------------------------


def machine_info() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # Other users' load skews absolute numbers on a shared machine; ratios less so.
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
    }


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def print_table(rows: list[Row], targets: list[Target]) -> None:
    header = f"{'case':<22} {'metric':<10} {'unit':<5} {'ours':>8}  {'baseline':<16} {'value':>8} {'ratio':>7}  target"
    print(header)
    print("-" * len(header))
    for row in rows:
        goals = [t for t in targets if t.row([row]) is row]
        target = "; ".join(f"{t.describe(row.unit)}: {t.verdict([row]).upper()}" for t in goals)
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
        print(f"{row.case:<22} {row.metric:<10} {row.unit:<5} {_fmt(row.ours):>8}  {row.baseline_name or '-':<16} "
              f"{_fmt(row.baseline):>8} {ratio:>7}  {target}")


def report(suite: str, rows: list[Row], targets: list[Target], skipped: dict[str, str], settings: dict) -> str:
    """Print the table and the target summary; write results/<suite>.json. Returns its path."""
    print()
    print_table(rows, targets)
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    verdicts = [(t, t.verdict(rows)) for t in targets]
    print(f"\ntargets: {sum(v == 'met' for _, v in verdicts)} met, {sum(v == 'missed' for _, v in verdicts)} missed, "
          f"{sum(v == 'not run' for _, v in verdicts)} not run")
    for target, verdict in verdicts:
        row = target.row(rows)
        print(f"  {verdict.upper():<8} {target.case} {target.metric} {target.describe(row.unit if row else '')}")
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{suite}.json")
    doc = {
        "suite": suite,
        "machine": machine_info(),
        "settings": settings,
        "rows": [r.to_json() for r in rows],
        "targets": [{**asdict(t), "verdict": v} for t, v in verdicts],
        "skipped": skipped,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"\nwrote {path}")
    return path

