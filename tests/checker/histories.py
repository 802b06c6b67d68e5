"""The history checker: what every read, miss and lookup of a concurrent run must be explainable by.

A run (tests/checker/run.py) records every operation each worker made: what it asked, when it
started and ended (CLOCK_MONOTONIC, one clock for every process of the machine), and what it
got. Each put writes a version of a key that no other put writes (tests/checker/values.py),
and each read decodes which version it got, so a read names the one put it can come from.
The rules, each an anomaly when broken:

    foreign      a read returned bytes that are not a whole version of that key in that
                 namespace (another key's, another namespace's, torn, or garbage)
    phantom      a read returned a version no put of that key had begun by the read's end
    resurrected  every put of the version read was followed by an acknowledged delete that
                 ended before the read began (a deleted id never reappears unless put again)
    expired      every put of the version read had a TTL that ran out before the read began
    lost         (where the run's store promises it) an acknowledged put, not deleted since,
                 not given a TTL, was a miss: NVMe write_through (ample NVMe) promises it across
                 SIGKILL for puts acknowledged durable; NVMe write_back across clean stops only
    torn group   a group read returned members of different group puts

Puts whose outcome is unknown (the call was cancelled, interrupted, or its process killed or
its daemon lost mid-way) may or may not have been applied: they explain reads from their
start on and are never counted dead, but promise nothing. An operator's delete that was not
acknowledged likewise may have been applied (it excuses misses) but kills nothing.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field

# A TTL is judged from the put's end; the daemon starts it within the put (never later), and
# host and client read the same CLOCK_MONOTONIC. Kept for clocks read a little apart.
TTL_MARGIN_S = 0.05
UNKNOWN = "unknown"  # the outcome of a call that did not finish
# The outcome of a put that stored its version. "existed" does not: the id was held already
# (ids name one state: a put of the same id is not copied again, whatever its bytes), and a
# put of the same version again ("put_again") is explained by the put that stored it.
STORED = ("ok",)


@dataclass
class Put:
    worker: str
    ns: int
    key: int
    version: int
    t0: float
    t1: float = math.inf  # inf: not known to have ended (unknown outcome)
    outcome: str = UNKNOWN  # ok, existed, conflict, error:<code>, unknown
    durability: str | None = None  # the put's reply: sync, group, memory
    ttl_s: float | None = None
    # put(wait=False): stored at some point of [t0, t1] (before any later call of its worker),
    # t1 being the flush that reported it; not the moment it was stored
    deferred: bool = False

    def may_be_stored(self) -> bool:
        return self.outcome in STORED or self.outcome == UNKNOWN


@dataclass
class Delete:
    ns: int
    key: int
    t0: float
    t1: float = math.inf
    acknowledged: bool = False


@dataclass
class Anomaly:
    rule: str
    what: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.what}"


@dataclass
class Life:
    """One run of the daemon: from its start to its stop, `clean` (SIGTERM) or not (SIGKILL)."""
    start: float
    end: float = math.inf
    clean: bool = True


@dataclass
class History:
    """What one run recorded, and the store's promise for misses ("none", "write_back",
    "write_through")."""
    promise: str = "none"
    puts: dict = field(default_factory=lambda: defaultdict(list))  # (ns, key) -> [Put]
    deletes: dict = field(default_factory=lambda: defaultdict(list))  # (ns, key) -> [Delete]
    reads: list = field(default_factory=list)  # (worker, op, ns, key, t0, t1, version | None | "bad: ...")
    groups: list = field(default_factory=list)  # (worker, ns, t0, t1, [(key, version | "bad...")] | None)
    lives: list = field(default_factory=list)
    num_ops: int = 0
    faults: dict = field(default_factory=lambda: defaultdict(int))  # fault -> times injected

    # --- loading what the workers wrote ------------------------------------------------

    def load(self, lines) -> None:
        """Records of one worker, JSON lines in order: a "begin" line per call and an "end"
        line per call that returned (a worker SIGKILLed leaves calls begun, never ended)."""
        begun: dict[int, dict] = {}
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line a SIGKILL cut short
            if rec["e"] == "fault":
                self.faults[rec["kind"]] += 1
            elif rec["e"] == "begin":
                begun[rec["i"]] = rec
                self._begin(rec)
            else:
                self._end(begun.pop(rec["i"]), rec)
        for rec in begun.values():  # never ended
            self.num_ops += 1

    def _begin(self, rec: dict) -> None:
        if rec["op"] in ("put", "put_group"):
            for key in rec["keys"]:
                put = Put(rec["w"], rec["ns"], key, rec["v"], rec["t"], ttl_s=rec.get("ttl"),
                          deferred=bool(rec.get("deferred")))
                self.puts[(rec["ns"], key)].append(put)
                rec.setdefault("_puts", []).append(put)
        elif rec["op"] == "delete":
            for key in rec["keys"]:
                d = Delete(rec["ns"], key, rec["t"])
                self.deletes[(rec["ns"], key)].append(d)
                rec.setdefault("_deletes", []).append(d)

    def _end(self, begin: dict, rec: dict) -> None:
        self.num_ops += 1
        op, ns, t0, t1 = begin["op"], begin["ns"], begin["t"], rec["t"]
        out = rec.get("out")
        if op in ("put", "put_group"):
            outcomes = out if isinstance(out, list) else [out] * len(begin["_puts"])
            for put, outcome in zip(begin["_puts"], outcomes):
                put.outcome = outcome
                put.durability = rec.get("dur")
                if outcome != UNKNOWN:
                    put.t1 = t1
        elif op == "delete":
            for d in begin["_deletes"]:
                if out != UNKNOWN:
                    d.t1, d.acknowledged = t1, out == "ok"
        elif op in ("get", "get_into", "get_many", "get_many_into", "lookup"):
            if out == UNKNOWN or out is None:
                return
            for key, got in zip(begin["keys"], out):
                self.reads.append((begin["w"], op, ns, key, t0, t1, got))
        elif op == "get_group":
            if out != UNKNOWN:
                self.groups.append((begin["w"], ns, t0, t1, None if out is None else list(zip(begin["keys"], out))))

    # --- the rules ---------------------------------------------------------------------

    def check(self) -> list[Anomaly]:
        self._index()
        anomalies: list[Anomaly] = []
        for worker, op, ns, key, t0, t1, got in self.reads:
            anomalies += self._check_read(f"{worker} {op}", ns, key, t0, t1, got)
        for worker, ns, t0, t1, members in self.groups:
            if members is None:
                continue
            versions = set()
            for key, got in members:
                anomalies += self._check_read(f"{worker} get_group", ns, key, t0, t1, got)
                versions.add(got)
            if len(versions) > 1:
                anomalies.append(Anomaly("torn group", f"{worker} ns {ns} read members of puts {sorted(map(str, versions))}"))
        return anomalies

    def _index(self) -> None:
        """Per key, what the rules search, sorted so that each read costs a few bisections
        (a soak records millions of calls): puts by version and by start; acknowledged
        deletes by start, with the least end from each on; every delete by start, with the
        greatest end up to each; the puts a miss could break a promise of, by end."""
        self._by_version: dict = defaultdict(list)
        self._by_start: dict = {}
        self._kills: dict = {}
        self._excuses: dict = {}
        self._promised: dict = {}
        for k, puts in self.puts.items():
            for put in puts:
                self._by_version[(*k, put.version)].append(put)
            self._by_start[k] = sorted(puts, key=lambda p: p.t0)
            promised = sorted((p for p in puts if self._promises(p)), key=lambda p: p.t1)
            self._promised[k] = ([p.t1 for p in promised], promised)
        for k, deletes in self.deletes.items():
            acked = sorted((d for d in deletes if d.acknowledged), key=lambda d: d.t0)
            least_end, m = [], math.inf
            for d in reversed(acked):
                m = min(m, d.t1)
                least_end.append(m)
            self._kills[k] = ([d.t0 for d in acked], least_end[::-1])
            every = sorted(deletes, key=lambda d: d.t0)
            most_end, m = [], -math.inf
            for d in every:
                m = max(m, d.t1)
                most_end.append(m)
            self._excuses[k] = ([d.t0 for d in every], most_end)

    def _promises(self, put: Put) -> bool:
        """A put whose later miss the store's promise forbids (until a delete)."""
        if self.promise == "none" or put.outcome not in STORED or put.ttl_s is not None:
            return False
        return self.promise != "write_through" or put.durability in ("sync", "group")

    def _check_read(self, who: str, ns: int, key: int, t0: float, t1: float, got) -> list[Anomaly]:
        where = f"{who} ns {ns} key {key} [{t0:.4f}, {t1:.4f}]"
        if isinstance(got, str) and got.startswith("bad"):
            return [Anomaly("foreign", f"{where}: {got}")]
        if got is None or got == "miss":  # a miss, or a lookup's None
            lost = self._lost(ns, key, t0, t1)
            return [] if lost is None else [Anomaly("lost", f"{where}: missed {lost}")]
        if got == "held":  # a lookup's hit: some version is explained
            if self._any_alive(ns, key, t0, t1):
                return []
            return [Anomaly("resurrected", f"{where}: a lookup found it; no put of it explains that")]
        candidates = [p for p in self._by_version.get((ns, key, got), ()) if p.t0 < t1 and p.may_be_stored()]
        if not candidates:
            return [Anomaly("phantom", f"{where}: version {got:#x} was never put before this read ended")]
        if any(self._alive(p, t0, t1) for p in candidates):
            return []
        if any(p.ttl_s is not None and t0 > p.t1 + p.ttl_s + TTL_MARGIN_S for p in candidates):
            return [Anomaly("expired", f"{where}: version {got:#x} read past its TTL")]
        deletes = [(d.t0, d.t1) for d in self.deletes.get((ns, key), []) if d.acknowledged]
        return [Anomaly("resurrected", f"{where}: version {got:#x} (put {[(p.t0, p.t1) for p in candidates]}) "
                                       f"read after the deletes {deletes[:20]}")]

    def _alive(self, put: Put, t0: float, t1: float) -> bool:
        """Could `put`'s version still be stored when a read [t0, t1] ran?"""
        if not put.may_be_stored() or put.t0 >= t1:
            return False
        if put.ttl_s is not None and t0 > put.t1 + put.ttl_s + TTL_MARGIN_S:
            return False
        # killed: an acknowledged delete began after the put ended and ended before the read began
        starts, least_end = self._kills.get((put.ns, put.key), ((), ()))
        i = bisect.bisect_right(starts, put.t1)
        return not (i < len(starts) and least_end[i] < t0)

    def _any_alive(self, ns: int, key: int, t0: float, t1: float) -> bool:
        puts = self._by_start.get((ns, key), [])
        for put in reversed(puts[:bisect.bisect_left(puts, t1, key=lambda p: p.t0)]):  # latest first
            if self._alive(put, t0, t1):
                return True
        return False

    def _lost(self, ns: int, key: int, t0: float, t1: float) -> Put | None:
        """An acknowledged put this miss breaks the store's promise for, or None: of the
        promised puts ended before the miss began (after the last SIGKILL, for write_back),
        the one that began last, unless a delete (acknowledged or not) overlaps it up to the
        miss's end (one that excuses it excuses every earlier one too). A deferred put
        promises only if it began after that SIGKILL: it was stored before its flush reported it."""
        ends, promised = self._promised.get((ns, key), ((), ()))
        after = self._last_dirty_stop_before(t0) if self.promise == "write_back" else -math.inf
        best = None
        for i in range(bisect.bisect_left(ends, t0) - 1, bisect.bisect_right(ends, after) - 1, -1):
            put = promised[i]
            if best is not None and put.t1 < best.t0:
                break  # every earlier put began before this one ended, so before `best` began
            if put.deferred and put.t0 <= after:
                continue  # perhaps stored before that SIGKILL and lost with it, reported after
            if best is None or put.t0 > best.t0:
                best = put
        if best is None:
            return None
        starts, most_end = self._excuses.get((ns, key), ((), ()))
        i = bisect.bisect_left(starts, t1)  # the deletes that began before the miss ended
        if i and most_end[i - 1] > best.t0:
            return None  # one of them may have removed it
        return best

    def _last_dirty_stop_before(self, t: float) -> float:
        return max((life.end for life in self.lives if not life.clean and life.end <= t), default=-math.inf)
